"""``simulate`` gives, to the last bit, the results stored in ``simulate_expected.json``.

The stored cases are profiles (two hand-built chains and a profiled 2-layer GPT, each also with
the memory flipped between unified and device, a remote pool, a throttle on bytes in flight and a
small prefetch window) and plans (every per-unit action the policies consider, codecs, partial
swaps, selective recompute, and the plans of the policies), with the results the simulator gave
before it was split into named steps (issue 26): peak, step time, exposed and added seconds, and
a digest of every span and timeline point. A change to the simulator's model changes them on
purpose: regenerate the file then (``python -m tests.planner.test_simulate_expected``) and say
why in the commit.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import pathlib
import random

from tensortier.planner.profile import Profile
from tensortier.planner.simulator import Plan, SimResult, simulate

DATA = pathlib.Path(__file__).with_name("simulate_expected.json")


def _variant(profile: Profile, overrides: dict) -> Profile:
    p = copy.deepcopy(profile)
    for name, value in overrides.items():
        if name == "bandwidth":
            for channel, v in value.items():
                setattr(p.bandwidth, channel, v)
        else:
            setattr(p, name, value)
    return p


def _observed(r: SimResult) -> dict:
    """The main numbers of a result and a digest of every field (spans and timeline included;
    JSON writes a float's shortest exact form, so the digest sees every bit)."""
    every = dataclasses.asdict(r)
    digest = hashlib.sha256(json.dumps(every, sort_keys=True).encode()).hexdigest()[:16]
    return {"peak_bytes": r.peak_bytes, "step_s": r.step_s, "exposed_s": r.exposed_s, "all": digest}


def test_simulate_gives_the_stored_results_exactly():
    data = json.loads(DATA.read_text())
    profiles = {name: Profile.from_dict(d) for name, d in data["profiles"].items()}
    wrong, runs = [], 0
    for case in data["cases"]:
        profile = _variant(profiles[case["profile"]], case["variant"])
        for plan, expected in case["runs"]:
            runs += 1
            got = _observed(simulate(profile, Plan.from_dict(plan)))
            if got != expected:
                wrong.append((case["profile"], case["variant"], plan["policy"], got, expected))
    assert runs > 250
    assert not wrong, f"{len(wrong)} of {runs} differ, e.g. {wrong[0]}"


# ------------------------------------------------------------------ regenerating the file
def _variants(profile: Profile) -> list[dict]:
    big = max((t.nbytes for t in profile.tensors), default=1 << 20)
    bw = profile.bandwidth
    remote = {"h2remote": bw.d2h / 3, "remote2h": bw.h2d / 2, "issue_s": 3e-6}
    squeezed = {
        "bandwidth": remote,
        "inflight_bytes": int(big * 2.5),
        "prefetch_bytes": int(big * 1.5),
        "move_s_per_byte": 1e-11,
        "other_fwd_s": profile.other_fwd_s + 0.01,
    }
    flipped = {"unified": not profile.unified, "device": "cuda" if profile.unified else "cpu"}
    return [{}, flipped, squeezed, {**squeezed, **flipped, "base_bytes": 12345}]


def _plans(profile: Profile, rng: random.Random, n: int) -> list[dict]:
    from tensortier.planner.policies import Options, _candidates, plan_all
    from tensortier.planner.simulator import resolve_codecs

    opts = Options(tiers=("host", "disk", "remote"), allow_lossy=True)
    plans = []
    for i in range(n):
        actions = {u.name: rng.choice(_candidates(profile, opts, u)) for u in profile.units}
        plan = Plan(f"random{i}", {u: a for u, a in actions.items() if rng.random() > 0.15})
        if rng.random() < 0.8:
            resolve_codecs(profile, plan, allow_lossy=rng.random() < 0.5)
        plans.append(plan.to_dict())
    total = sum(t.nbytes for t in profile.tensors)
    fast = Options(search_iters=40, search_seconds=2, plan_seconds=6, tiers=opts.tiers)
    for choice in plan_all(profile, profile.base_bytes + total // 2, fast).values():
        plans.append(choice.plan.to_dict())
    return plans


def write_expected(gpt_profile: str) -> None:
    """Store the cases with the results of the simulator imported now."""
    from tests.planner.conftest import chain

    profiles = {
        "chain": chain(),
        "chain-device": chain(
            n_units=6, per_unit=3, transient_factor=1.5, zero_frac=0.5, unified=False
        ),
        "gpt": Profile.load(gpt_profile),  # tensortier plan --model gpt --layers 2 --embd 64 ...
    }
    rng = random.Random(26)
    cases = []
    for name, base in profiles.items():
        for overrides in _variants(base):
            profile = _variant(base, overrides)
            runs = [
                [plan, _observed(simulate(profile, Plan.from_dict(plan)))]
                for plan in _plans(profile, rng, 16)
            ]
            cases.append({"profile": name, "variant": overrides, "runs": runs})
    data = {"profiles": {k: p.to_dict() for k, p in profiles.items()}, "cases": cases}
    DATA.write_text(json.dumps(data, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    import sys

    write_expected(sys.argv[1])
