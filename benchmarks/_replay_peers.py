"""One replay-buffer peer measured in its own process (so peak RSS is its own).

Run as ``python _replay_peers.py PEER N ITEM_BYTES BATCH ROUNDS DIR [BUDGET]``; prints one JSON
line. Imports only numpy/torch/psutil at the top so it also runs in the TorchRL virtual
environment, where tensortier is not installed; each peer imports its library itself.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import numpy as np

ALPHA, BETA = 0.6, 0.4


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    """This process's own peak RSS (VmHWM). Not ``ru_maxrss``: exec keeps the high-water mark
    of the memory it replaced, which after the parent's vfork is the parent's own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not in /proc/self/status")


def _payload(nbytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)


def _timed(fn, count: int) -> float:
    t0 = time.perf_counter()
    fn()
    return count / (time.perf_counter() - t0)


def _item(payload: np.ndarray, i: int) -> dict:
    """One transition as every peer stores it: its observation, action and reward."""
    return {"obs": payload.copy(), "action": i % 4, "reward": float(i)}


def collate(items: list[dict]) -> dict:
    """The batch a learner consumes, one stacked array per field, as tensortier's ``sample``
    and TorchRL's return it: peers that hand back a list collate it inside their sample time."""
    return {k: np.stack([np.asarray(it[k]) for it in items]) for k in items[0]}


def _extend_rates(out: dict, extend, n: int, item_bytes: int, prepare=None) -> None:
    """``extend`` stores the n prepared items 1000 at a time: into an empty buffer, then again
    into the full one (the steady state: every call evicts as many items as it adds).
    ``prepare``, untimed before each pass: a peer that cannot take the same items twice."""
    for key in ("extend_items_per_s", "extend_steady_items_per_s"):
        if prepare is not None:
            prepare()
        out[key] = _timed(extend, n)
    out["extend_gb_per_s"] = out["extend_items_per_s"] * item_bytes / 1e9
    out["extend_steady_gb_per_s"] = out.pop("extend_steady_items_per_s") * item_bytes / 1e9


def run_tensortier(n, item_bytes, batch, rounds, directory, budget=None):
    from tensortier.rl import Prioritized, ReplayBuffer

    payload = _payload(item_bytes)
    base = _rss()
    buf = ReplayBuffer(
        n,
        host_budget=budget or (2 * n * (item_bytes + 200)),
        spill_dir=directory,
        sampler=Prioritized(alpha=ALPHA, beta=BETA),
        seed=0,
    )
    rng = np.random.default_rng(1)
    out = {}

    def add():
        for i in range(n):
            buf.add(_item(payload, i))

    out["add_per_s"] = _timed(add, n)
    out["rss_after_add"] = _rss() - base
    batches = []

    def sample():
        for _ in range(rounds):
            batches.append(buf.sample(batch).indices)  # keep indices only, as a learner does

    out["sample_items_per_s"] = _timed(sample, rounds * batch)
    out["sample_ms"] = batch / out["sample_items_per_s"] * 1e3
    prios = [rng.random(batch) + 0.01 for _ in range(rounds)]

    def update():
        for b, p in zip(batches, prios):
            buf.update_priorities(b, p)

    out["update_items_per_s"] = _timed(update, rounds * batch)
    out["stats"] = {k: v for k, v in buf.stats.items() if isinstance(v, int)}
    out["rss_growth"] = _rss() - base
    buf.close()
    batches.clear()
    # extend: the same items built first (the collector's data), then stored 1000 at a time; the
    # heap the add run freed is reused, so this measures the copy more than fresh-page faults
    items = [_item(payload, i) for i in range(n)]
    buf = ReplayBuffer(
        n,
        host_budget=budget or (2 * n * (item_bytes + 200)),
        sampler=Prioritized(alpha=ALPHA, beta=BETA),
        seed=0,
    )

    def extend():
        for i in range(0, n, 1000):
            buf.extend(items[i : i + 1000])

    _extend_rates(out, extend, n, item_bytes)
    buf.close()
    return out


def run_tensortier_ratelimited(n, item_bytes, batch, rounds, directory, budget=None):
    """A collector thread (extend, 32 items a call) and a learner (sample batch, update) in one
    process, held to samples_per_insert=8 by a RateLimit; reports both rates and how far the
    sample count strayed from 8 x inserts (must stay within the error buffer + a batch)."""
    import threading

    from tensortier.rl import Prioritized, RateLimit, ReplayBuffer

    spi, eb = 8.0, 4.0 * batch
    payload = _payload(item_bytes)
    rl = RateLimit(spi, min_size_to_sample=batch, error_buffer=eb, timeout=120)
    buf = ReplayBuffer(
        n, host_budget=2 * n * (item_bytes + 200), sampler=Prioritized(), seed=0, rate_limit=rl
    )
    lim = buf._limiter
    rng = np.random.default_rng(1)

    def collector():
        for i in range(0, n, 32):
            buf.extend({"obs": payload.copy(), "action": j % 4} for j in range(i, min(n, i + 32)))

    t0 = time.perf_counter()
    th = threading.Thread(target=collector)
    th.start()
    worst, sampled = 0.0, 0
    target = spi * (lim.stats.inserts) - spi * rl.min_size_to_sample
    while th.is_alive() or lim.can_sample(batch, len(buf)):
        try:
            b = buf.sample(batch, timeout=1.0)
        except TimeoutError:
            continue
        buf.update_priorities(b.indices, rng.random(batch) + 0.01)
        sampled += batch
        with buf._lock:
            target = spi * lim.stats.inserts - spi * rl.min_size_to_sample
            worst = max(worst, abs(lim.stats.samples - target))
    th.join()
    wall = time.perf_counter() - t0
    st = buf.stats["rate_limiter"]
    buf.close()
    return {
        "add_per_s": n / wall,
        "sample_items_per_s": sampled / wall,
        "samples_per_insert": st["samples"] / st["inserts"],
        "target_samples_per_insert": spi,
        "max_drift_items": worst,
        "allowed_drift_items": eb + batch,
        "insert_waits": st["insert_waits"],
        "sample_waits": st["sample_waits"],
    }


def run_torchrl(n, item_bytes, batch, rounds, directory, budget=None):
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, PrioritizedSampler, TensorDictReplayBuffer

    payload = _payload(item_bytes)
    base = _rss()
    rb = TensorDictReplayBuffer(
        storage=LazyMemmapStorage(n, scratch_dir=directory),
        sampler=PrioritizedSampler(n, alpha=ALPHA, beta=BETA),
        batch_size=batch,
    )
    rng = np.random.default_rng(1)
    out = {"torch": torch.__version__}

    def add():
        for i in range(n):
            td = TensorDict(
                {
                    "obs": torch.from_numpy(payload.copy()),
                    "action": torch.tensor(i % 4),
                    "reward": torch.tensor(float(i)),
                },
                [],
            )
            rb.add(td)

    out["add_per_s"] = _timed(add, n)
    out["rss_after_add"] = _rss() - base
    batches = []

    def sample():
        for _ in range(rounds):
            batches.append(rb.sample()["index"])

    out["sample_items_per_s"] = _timed(sample, rounds * batch)
    out["sample_ms"] = batch / out["sample_items_per_s"] * 1e3
    prios = [torch.from_numpy(rng.random(batch) + 0.01).float() for _ in range(rounds)]

    def update():
        for b, p in zip(batches, prios):
            rb.update_priority(b, p)

    out["update_items_per_s"] = _timed(update, rounds * batch)
    out["rss_growth"] = _rss() - base
    batches.clear()
    rb = None  # the add run's buffer goes before the items are built, as tensortier's
    # extend, as tensortier's: the collector's batches built first (TensorDicts of 1000 items,
    # TorchRL's unit of a batched insert), then stored into a fresh buffer
    chunks = [
        TensorDict(
            {
                "obs": torch.from_numpy(np.stack([payload] * min(1000, n - i))),
                "action": torch.arange(i, min(n, i + 1000)) % 4,
                "reward": torch.arange(i, min(n, i + 1000), dtype=torch.float32),
            },
            [min(1000, n - i)],
        )
        for i in range(0, n, 1000)
    ]
    rb = TensorDictReplayBuffer(
        storage=LazyMemmapStorage(n, scratch_dir=directory),
        sampler=PrioritizedSampler(n, alpha=ALPHA, beta=BETA),
        batch_size=batch,
    )

    def extend():
        for chunk in chunks:
            rb.extend(chunk)

    _extend_rates(out, extend, n, item_bytes)
    return out


def run_rllib(n, item_bytes, batch, rounds, directory, budget=None):
    """RLlib's PrioritizedEpisodeReplayBuffer: transitions arrive as 100-step episode chunks
    (RLlib's unit of insertion), so add throughput counts timesteps."""
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
        PrioritizedEpisodeReplayBuffer,
    )

    payload = _payload(item_bytes)
    base = _rss()
    buf = PrioritizedEpisodeReplayBuffer(capacity=n, alpha=ALPHA)
    rng = np.random.default_rng(1)
    out = {"note": "episodes of 100 steps; items = timesteps"}
    T = 100

    def add():
        for start in range(0, n, T):
            buf.add([_episode(payload, start, min(T, n - start))])

    out["add_per_s"] = _timed(add, n)
    out["rss_after_add"] = _rss() - base
    prios = [rng.random(batch) + 0.01 for _ in range(rounds)]
    t_sample = t_update = 0.0
    for p in prios:  # RLlib updates the priorities of the last sampled batch only
        t0 = time.perf_counter()
        collate([_step_of(ep) for ep in buf.sample(num_items=batch, beta=BETA, n_step=1)])
        t1 = time.perf_counter()
        buf.update_priorities(p)
        t_update += time.perf_counter() - t1
        t_sample += t1 - t0
    out["sample_items_per_s"] = rounds * batch / t_sample
    out["sample_ms"] = batch / out["sample_items_per_s"] * 1e3
    out["update_items_per_s"] = rounds * batch / t_update
    out["rss_growth"] = _rss() - base
    del buf
    # extend, as tensortier's: the collector's episodes built first (new ones for each pass:
    # RLlib takes an episode it holds as a continuation), 1000 steps per add call
    episodes: list = []
    buf = PrioritizedEpisodeReplayBuffer(capacity=n, alpha=ALPHA)

    def prepare():
        episodes[:] = [_episode(payload, start, min(T, n - start)) for start in range(0, n, T)]

    def extend():
        for i in range(0, len(episodes), 1000 // T):
            buf.add(episodes[i : i + 1000 // T])

    _extend_rates(out, extend, n, item_bytes, prepare)
    return out


def _episode(payload: np.ndarray, start: int, steps: int):
    """``steps`` transitions from ``start`` as one RLlib episode chunk."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    return SingleAgentEpisode(
        observations=[payload.copy() for _ in range(steps + 1)],
        actions=[i % 4 for i in range(start, start + steps)],
        rewards=[float(i) for i in range(start, start + steps)],
        len_lookback_buffer=0,
    )


def _step_of(episode) -> dict:
    """The transition a one-step sample of RLlib holds, as the other peers store it."""
    return {
        "obs": episode.get_observations(0),
        "action": episode.get_actions(0),
        "reward": episode.get_rewards(0),
    }


def run_deque(n, item_bytes, batch, rounds, directory, budget=None):
    """What one writes without a library: a deque of dicts and a list of priorities."""
    payload = _payload(item_bytes)
    base = _rss()
    items: collections.deque = collections.deque(maxlen=n)
    prios: list[float] = []
    rng = np.random.default_rng(1)
    out = {}

    def add():
        maxp = 1.0
        for i in range(n):
            items.append(_item(payload, i))
            prios.append(maxp)
            if len(prios) > n:
                prios.pop(0)

    out["add_per_s"] = _timed(add, n)
    out["rss_after_add"] = _rss() - base
    drawn = []

    def sample():
        for _ in range(rounds):
            p = np.asarray(prios) ** ALPHA
            p /= p.sum()
            idx = rng.choice(len(p), batch, p=p)
            w = (len(p) * p[idx]) ** -BETA
            w /= w.max()
            collate([items[i] for i in idx])  # the batch a learner consumes
            drawn.append((idx, w))

    out["sample_items_per_s"] = _timed(sample, rounds * batch)
    out["sample_ms"] = batch / out["sample_items_per_s"] * 1e3
    new = [rng.random(batch) + 0.01 for _ in range(rounds)]

    def update():
        for (idx, _), p in zip(drawn, new):
            for i, v in zip(idx.tolist(), p.tolist()):
                prios[i] = v

    out["update_items_per_s"] = _timed(update, rounds * batch)
    out["rss_growth"] = _rss() - base
    items.clear()
    prios.clear()
    batch_items = [_item(payload, i) for i in range(n)]  # the collector's, built first

    def extend():
        for i in range(0, n, 1000):
            chunk = batch_items[i : i + 1000]
            items.extend(chunk)
            prios.extend([1.0] * len(chunk))
            del prios[: max(0, len(prios) - n)]

    _extend_rates(out, extend, n, item_bytes)
    return out


def run_tensortier_spill(n, item_bytes, batch, rounds, directory, budget=None):
    """Store n items with a RAM budget far below n * item_bytes; report RSS against the budget."""
    from tqdm import tqdm

    from tensortier.rl import Prioritized, ReplayBuffer

    payload = _payload(item_bytes)
    base = _rss()
    buf = ReplayBuffer(
        n,
        host_budget=budget,
        spill_dir=directory,
        sampler=Prioritized(alpha=ALPHA, beta=BETA),
        seed=0,
    )
    out = {"budget": budget}
    peak = 0
    t0 = time.perf_counter()
    step = 1000
    for start in tqdm(range(0, n, step), desc="spill run: add", unit_scale=step, leave=False):
        for i in range(start, min(n, start + step)):
            buf.add(_item(payload, i))
        peak = max(peak, _rss() - base)
    wall = time.perf_counter() - t0
    out["add_per_s"] = n / wall
    # the rate items leave for disk, counted over the whole add phase (encode, RAM and writes)
    written = buf.stats.get("disk_bytes_written", 0)
    out["spill_bytes"] = written
    out["spill_gb_per_s"] = written / wall / 1e9
    st = buf.stats  # the write path alone: bytes spilled over the time spent writing them
    out["spill_write_gb_per_s"] = st["spill_bytes"] / max(st["spill_ns"], 1)
    rng = np.random.default_rng(1)
    batches = []
    t0 = time.perf_counter()
    for _ in range(rounds):
        batches.append(buf.sample(batch).indices)
        peak = max(peak, _rss() - base)
    out["sample_items_per_s"] = rounds * batch / (time.perf_counter() - t0)
    out["sample_ms"] = batch / out["sample_items_per_s"] * 1e3
    t0 = time.perf_counter()
    for b in batches:
        buf.update_priorities(b, rng.random(batch) + 0.01)
    out["update_items_per_s"] = rounds * batch / (time.perf_counter() - t0)
    out["rss_growth"] = peak
    out["rss_growth_over_budget"] = peak / budget
    out["stats"] = {k: v for k, v in buf.stats.items() if isinstance(v, int)}
    buf.close()
    return out


def run_latency(n, item_bytes, batch, rounds, directory, budget=None):
    """Prioritized sample latency of tensortier with n small items (index/sampler scaling)."""
    from tensortier.rl import Prioritized, ReplayBuffer

    buf = ReplayBuffer(n, host_budget="8GiB", sampler=Prioritized(alpha=ALPHA, beta=BETA), seed=0)
    payload = _payload(item_bytes)
    step = 10_000
    for start in range(0, n, step):
        buf.extend({"obs": payload, "i": i} for i in range(start, min(n, start + step)))
    rng = np.random.default_rng(0)
    buf.update_priorities(buf.indices(), rng.random(n) + 0.01)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        buf.sample(batch)
        times.append(time.perf_counter() - t0)
    buf.close()
    return {"sample_ms": float(np.median(times)) * 1e3}


PEERS = {
    "tensortier": run_tensortier,
    "torchrl": run_torchrl,
    "deque": run_deque,
    "rllib": run_rllib,
    "tensortier-spill": run_tensortier_spill,
    "tensortier-ratelimited": run_tensortier_ratelimited,
    "latency": run_latency,
}


# what a peer's library needs to load (``make bench-peers`` installs them)
NEEDS = {"torchrl": ("torchrl", "tensordict"), "rllib": ("ray.rllib",)}


def missing(peer: str) -> str | None:
    """Why ``peer``'s library does not load here (None: it does): its row then says so, with
    no figures, rather than an exit code's traceback."""
    import importlib

    for module in NEEDS.get(peer, ()):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"not installed: {module} ({exc})"
    return None


def main(argv: list[str]) -> None:
    peer, n, item_bytes, batch, rounds, directory = argv[:6]
    budget = int(argv[6]) if len(argv) > 6 else None
    why = missing(peer)
    if why is not None:
        print("RESULT " + json.dumps({"error": why, "not_installed": True}), flush=True)
        return
    out = PEERS[peer](int(n), int(item_bytes), int(batch), int(rounds), directory, budget)
    out["peak_rss"] = _peak_rss()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path = [p for p in sys.path if os.path.abspath(p) != os.path.dirname(__file__)]
    main(sys.argv[1:])
