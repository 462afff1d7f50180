"""`tensortier plan`: profile a model (or load a profile), choose a plan, print it, draw a report.

tensortier plan --model gpt --layers 24 --budget 2GiB --policy auto --report plan.html
tensortier plan --profile prof.json --budget 2GiB          # no model: plan from a saved profile
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap

from tensortier._units import format_size, format_size_up, parse_size, print_table
from tensortier.errors import BudgetError, ConfigError, TensortierError


def _positive(text: str) -> int:
    """argparse type of the model's sizes: 0 or a negative number profiled an empty model."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    d = " (default: %(default)s)"
    p.add_argument("--model", default="gpt", choices=["gpt", "llama"], help="model to profile" + d)
    p.add_argument("--layers", type=_positive, default=6, help="blocks" + d)
    p.add_argument("--embd", type=_positive, default=384, help="width, a multiple of --heads" + d)
    p.add_argument("--heads", type=_positive, default=6, help="attention heads" + d)
    p.add_argument("--seq", type=_positive, default=256, help="tokens per sample" + d)
    p.add_argument("--batch", type=_positive, default=8, help="samples per step" + d)
    p.add_argument("--vocab", type=_positive, default=4096, help="vocabulary size" + d)
    p.add_argument("--budget", required=True, help="memory budget, e.g. 2GiB")
    p.add_argument(
        "--policy",
        default="auto",
        help="keep, swap_all, recompute_all, flashneuron, capuchin, fine, search or auto" + d,
    )
    p.add_argument(
        "--spill-dir", default=tempfile.gettempdir(), help="directory for the disk tier" + d
    )
    p.add_argument("--profile", default=None, help="plan from this profile JSON instead of a model")
    p.add_argument("--save-profile", default=None, help="write the measured profile to this JSON")
    p.add_argument("--report", default=None, help="write an HTML report (and PNG) here")
    p.add_argument("--lossy", action="store_true", help="allow fp16/bf16 down-cast codecs")
    p.add_argument("--seed", type=int, default=0, help="seed of the search policy")


def profile_gpt(args, budget: int | None = None) -> object:
    """Warm-up iteration, the probe pass and two timing passes of a GPT (or Llama) with random
    tokens; the timing passes keep the groups of units predicted under ``budget``."""
    import torch

    from tensortier._memory import release_freed_memory
    from tensortier.activations import Offloader
    from tensortier.models import GPT, GPTConfig, Llama, LlamaConfig, random_batch
    from tensortier.planner.profiler import Profiler, calibrate, timing_groups

    release_freed_memory()
    torch.manual_seed(0)
    common = dict(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
        block_size=args.seq,
        vocab_size=args.vocab,
    )
    cfg = LlamaConfig(**common) if args.model == "llama" else GPTConfig(**common)
    model = Llama(cfg) if args.model == "llama" else GPT(cfg)
    x, y = random_batch(cfg, args.batch, args.seq)
    warm = Offloader("disk", spill_dir=args.spill_dir, decide=lambda info: "disk")
    with warm:
        loss = model(x, y)
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    prof = Profiler(spill_dir=args.spill_dir, offloader=warm)
    with prof.forward():
        loss = model(x, y)
    loss.backward()
    del loss
    groups = [[], []]
    if budget is not None:
        groups = timing_groups(calibrate(prof.provisional()), int(0.9 * budget), 2)
    for group in groups:  # timing passes under the budget (they calibrate the simulator)
        model.zero_grad(set_to_none=True)
        with prof.timing(keep=group):
            loss = model(x, y)
        loss.backward()
        del loss
    profile = calibrate(
        prof.finish(meta={"model": args.model, "config": cfg.__dict__, "batch": args.batch})
    )
    warm.close()
    return profile


def run(args) -> int:
    """`tensortier plan`; a bad flag or file is one line naming it and exit code 2."""
    try:
        return _run(args)
    except (TensortierError, OSError) as exc:
        print(f"tensortier plan: error: {exc}", file=sys.stderr)
        return 2


def _check_args(args) -> int:
    """The budget; the flags checked before minutes of profiling, not after."""
    from tensortier.planner.policies import POLICIES

    budget = parse_size(args.budget, name="--budget", allow_zero=False)
    if not args.profile and args.embd % args.heads:
        raise ConfigError(
            f"--embd {args.embd} is not a multiple of --heads {args.heads}; "
            f"pass e.g. --embd {args.heads * max(1, args.embd // args.heads)}"
        )
    if not args.profile and args.model == "llama" and (args.embd // args.heads) % 2:
        raise ConfigError(
            f"--model llama needs an even head size (rotary embedding); --embd {args.embd} / "
            f"--heads {args.heads} is odd: pass e.g. --embd {2 * args.embd}"
        )
    if args.policy not in POLICIES:
        raise ConfigError(
            f"--policy {args.policy!r} is unknown; choose one of {', '.join(POLICIES)}"
        )
    for flag, path in (("--report", args.report), ("--save-profile", args.save_profile)):
        if path and os.path.isdir(path):
            raise ConfigError(f"{flag} {path!r} is a directory; pass a file name such as plan.html")
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            raise ConfigError(
                f"{flag} {path!r}: directory {folder!r} does not exist; create it "
                "(mkdir -p) or pass a path in an existing directory"
            )
    return budget


def _run(args) -> int:
    from tensortier.planner.policies import Options, choose, plan_all, planning_budget
    from tensortier.planner.profile import CHANNELS, Profile
    from tensortier.planner.report import (
        COLUMNS,
        action_rows,
        added_text,
        apply_hint,
        legend,
        write_report,
    )

    budget = _check_args(args)
    profile = Profile.load(args.profile) if args.profile else profile_gpt(args, budget)
    if args.save_profile:
        profile.save(args.save_profile)
    opts = Options(seed=args.seed, allow_lossy=args.lossy)
    print(
        f"profile: {len(profile.tensors)} saved tensors, {format_size(profile.saved_bytes)}; "
        + ", ".join(
            f"{c} {profile.bandwidth.of(c) / 1e9:.2f} GB/s"
            for c in CHANNELS
            if profile.bandwidth.of(c) > 0
        )
    )
    try:
        choice = choose(profile, budget, args.policy, opts)
    except BudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        print(f"try: tensortier plan ... --budget {format_size_up(e.minimum)}", file=sys.stderr)
        return 2
    print_table(
        action_rows(profile, choice.plan), ["unit", "action", "saved", "moved", "tensors", "codecs"]
    )
    for line in [*legend(choice.plan), COLUMNS]:
        print(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="    "))
    goal = planning_budget(budget, opts)
    r = choice.result
    print(
        f"plan {choice.plan.policy}: predicted peak {format_size(r.peak_bytes)} "
        f"(budget {format_size(budget)}, planned for {format_size(goal)}: "
        f"{opts.margin:.0%} margin), step {r.step_s:.3f}s, exposed transfer {r.exposed_s:.3f}s, "
        f"added {added_text(r)}; planned in {choice.plan_s:.2f}s"
    )
    print("to run your model under this budget:")
    print(textwrap.indent(apply_hint(budget, args.policy), "    "))
    if args.report:
        others = {} if args.policy == "auto" else plan_all(profile, goal, opts)
        html_path, png_path = write_report(
            args.report, profile, choice, others, budget=budget, planned_for=goal
        )
        print(f"wrote {html_path} and {png_path}")
    return 0
