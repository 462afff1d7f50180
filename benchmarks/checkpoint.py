"""`python -m benchmarks checkpoint`: training stall and persist speed of torch.save, DCP async_save, tensortier.

An MLP whose parameters plus AdamW state make about ``--state-size`` trains on CPU (or a lent GPU);
each variant checkpoints every ``--every`` steps in the same run: ``torch.save`` (synchronous, as
most loops do), ``torch.distributed.checkpoint.async_save`` (single process) and
``tt.Checkpointer``. Per variant: the seconds the loop was blocked per checkpoint, the time until
the checkpoint was durable, its bandwidth against ``dd`` O_DIRECT on the same directory (the disk
limit of the tiers benchmark), peak extra RSS, and the loop slowdown against the same steps with no
checkpoint. Then ``every="auto"`` with ``--max-overhead`` runs ``--auto-steps`` steps against a
plain run of the same length. Run: ``python -m benchmarks checkpoint --json out.json [--quick]``.
"""

from __future__ import annotations

import abc
import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from tqdm import tqdm

from benchmarks import _harness as harness
from benchmarks._common import PeakRSS, environment, write_json
from benchmarks._mlp import build, train
from benchmarks.checkpoint_replica import _clone, _same
from benchmarks.tiers import dd_bandwidth
from tensortier._device import default_device
from tensortier._memory import trim
from tensortier._units import format_size, parse_size, print_table
from tensortier.checkpoint import Checkpointer


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory for the checkpoints")
    p.add_argument(
        "--state-size", default=None, help="model+optimizer bytes (default 1GiB, 128MiB --quick)"
    )
    p.add_argument("--every", type=int, default=None, help="steps between checkpoints (10)")
    p.add_argument("--checkpoints", type=int, default=None, help="checkpoints per variant (3)")
    p.add_argument("--auto-steps", type=int, default=None, help="steps of the auto run (200)")
    p.add_argument("--max-overhead", type=float, default=0.035, help="auto run's allowed slowdown")
    p.add_argument("--batch", type=int, default=32, help="rows per training step")
    p.add_argument("--quick", action="store_true", help="small state, fewer steps")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    harness.add_args(p, rounds=3)
    p.add_argument(
        "--replica",
        action="store_true",
        help="instead: restore from an in-memory replica (replicas=1) vs the cold disk checkpoint",
    )


def _fsync_tree(path: str) -> None:
    for base, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class _Variant(abc.ABC):
    """Checkpoint every ``every`` steps with one method; records stall and time-to-durable.

    ``stalls``: seconds the loop was blocked per checkpoint. ``persists``: seconds the write
    took, from when the state was ready to write (DCP: ``async_save`` returned, its staging
    copy done; tensortier: its snapshot done; ``torch.save``: the call began, as it serializes
    while it writes) until the files were durable. ``durables``: from the checkpoint's start
    until durable (the time a crash would lose it).
    """

    name = ""

    def __init__(self, root: str, every: int):
        self.root, self.every = root, every
        self.stalls: list[float] = []
        self.persists: list[float] = []
        self.durables: list[float] = []
        self.nbytes = 0

    def before_step(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        return None

    @abc.abstractmethod
    def after_step(self, model, opt, i: int) -> None:
        """Checkpoint (or not) after optimizer step ``i``; record the seconds the loop was blocked."""

    def finish(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        return None


class TorchSave(_Variant):
    """``torch.save`` then fsync, both in the loop: the peers' checkpoints are durable too."""

    name = "torch.save (sync)"

    def after_step(self, model, opt, i):
        if (i + 1) % self.every:
            return
        path = os.path.join(self.root, f"step-{i}.pt")
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        _fsync_tree(self.root)  # durable, as DCP's and tensortier's writes are
        # the loop waits for the fsync too: its stall is the whole save, as its loop_s shows
        self.stalls.append(time.perf_counter() - t0)
        self.persists.append(self.stalls[-1])
        self.durables.append(self.stalls[-1])
        self.nbytes = os.path.getsize(path)
        os.unlink(path)


def dcp_async_writer(root: str):
    """As DCP's async recipe recommends for repeated saves on a GPU: one writer kept across
    saves with ``cache_staged_state_dict=True`` (a pinned staging copy allocated once, not per
    save). Without an accelerator it cannot pin: None, DCP's default stager."""
    if not torch.cuda.is_available():
        return None
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(root, cache_staged_state_dict=True)


class DcpAsync(_Variant):
    name = "torch DCP async_save"

    def __init__(self, root, every):
        super().__init__(root, every)
        self.future = None
        self.pending = None
        self.pg = False
        self.writer = dcp_async_writer(root)

    def _collect(self) -> None:
        """The previous save is done: record its write and time-to-durable and its size, remove
        its files."""
        t0, t_ready, done_box, path = self.pending
        self.persists.append(done_box[0] - t_ready if done_box else float("nan"))
        self.durables.append(done_box[0] - t0 if done_box else float("nan"))
        self.nbytes = sum(
            os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(path) for f in fs
        )
        shutil.rmtree(path, ignore_errors=True)
        self.pending = None

    def after_step(self, model, opt, i):
        import torch.distributed.checkpoint as dcp

        if (i + 1) % self.every:
            return
        t0 = time.perf_counter()
        if self.future is not None:  # DCP's docs: wait for the previous save before the next
            self.future.result()
            self._collect()
        waited = time.perf_counter() - t0
        path = os.path.join(self.root, f"step-{i}")
        t0 = time.perf_counter()  # the state dicts inside, as torch.save's and tensortier's
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        kw = {"checkpoint_id": path, "storage_writer": self.writer}
        try:
            future = dcp.async_save(state, **kw)
        except (RuntimeError, ValueError) as exc:  # needs a process group on this build
            if self.pg:
                raise
            self._init_gloo(exc)
            future = dcp.async_save(state, **kw)
        t_ready = time.perf_counter()  # staged: the write starts (tensortier: its snapshot done)
        self.stalls.append(waited + t_ready - t0)
        done_box: list[float] = []
        future.add_done_callback(lambda _f: done_box.append(time.perf_counter()))
        self.future, self.pending = future, (t0, t_ready, done_box, path)

    def _init_gloo(self, exc: BaseException) -> None:
        import torch.distributed as dist

        warnings.warn(
            f"DCP async_save needs a process group ({exc}); using gloo, world size 1", stacklevel=2
        )
        # an in-process store: a TCP one on a fixed port collided with a parallel run's
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.pg = True

    def finish(self):
        if self.future is not None:
            self.future.result()
            self._collect()
            self.future = None


class Tensortier(_Variant):
    name = "tensortier Checkpointer"

    def __init__(self, root, every, **settings):
        super().__init__(root, every)
        self.ck = Checkpointer(root, keep=2, every=every, **settings)
        self.current: float | None = None  # blocked seconds charged to the newest checkpoint

    def before_step(self):
        t0 = time.perf_counter()
        self.ck.before_optimizer_step()
        if self.current is not None:
            self.current += time.perf_counter() - t0

    def after_step(self, model, opt, i):
        t0 = time.perf_counter()
        started = self.ck.maybe_save(i, model=model, optimizer=opt)
        blocked = time.perf_counter() - t0
        if started:
            if self.current is not None:
                self.stalls.append(self.current)
            self.current = blocked
        elif self.current is not None:
            self.current += blocked

    def finish(self):
        self.ck.close()  # its wait shows in the loop time, not in a checkpoint's stall
        if self.current is not None:
            self.stalls.append(self.current)
        hist = list(self.ck.stats().history)
        self.persists = [h["persist_s"] for h in hist]
        self.durables = [h["snapshot_s"] + h["persist_s"] for h in hist]
        self.nbytes = hist[-1]["bytes"] if hist else 0


def idle_persist_gbps(model, opt, directory: str) -> tuple[float, bool]:
    """tensortier's persist bandwidth with the training loop idle (the writer alone), and
    whether its checkpoint restores the state it saved bit for bit (the rounds' figures are of
    checkpoints nothing read back)."""
    root = tempfile.mkdtemp(prefix="tt-bench-ckpt-", dir=directory)
    try:
        with Checkpointer(root, every=1) as ck:
            for step in range(2):  # the first save allocates and faults in the images
                ck.save(step, model=model, optimizer=opt)
                ck.wait()
            gbps = ck.stats().last_persist_gbps
            return gbps, restores_what_it_saved(ck, model, opt)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def restores_what_it_saved(ck: Checkpointer, model, opt) -> bool:
    """Clears the model's and the optimizer's state, restores ``ck``'s newest checkpoint into
    them and compares it with the state as saved, bit for bit."""
    saved = _clone({"model": model.state_dict(), "optimizer": opt.state_dict()})
    with torch.no_grad():  # a restore that loads nothing must not pass
        for t in [*model.parameters(), *(v for st in opt.state.values() for v in st.values())]:
            if torch.is_tensor(t):
                t.zero_()
    ck.restore(model=model, optimizer=opt)
    return _same({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)


def _fresh_start(rss: PeakRSS) -> int:
    """The RSS a variant's extra peak counts from, with the high-water mark reset to it. The
    variants share this process, so the heap an earlier one freed is given back first: else a
    later variant's copies reuse it unseen (tensortier measured 33 MiB after DCP, 129 MiB
    first, on a 128 MiB state)."""
    trim()
    return rss.reset()


def _measure(variant_fn: Callable[[str], _Variant], model, opt, width, args, steps, device, base):
    root = tempfile.mkdtemp(prefix="tt-bench-ckpt-", dir=args.dir)
    try:
        variant = variant_fn(root)
        after = variant.after_step
        rss = PeakRSS()
        start = _fresh_start(rss)
        t0 = time.perf_counter()
        train(
            model,
            opt,
            width,
            args.batch,
            steps,
            device,
            before_step=variant.before_step,
            after_step=lambda i: after(model, opt, i),
        )
        variant.finish()
        loop = time.perf_counter() - t0
        peak = max(0, rss.peak() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return variant, loop, peak


def _one_variant(variant_fn, model, opt, width, args, steps, device) -> dict:
    """One checkpointing variant's run: its medians over its checkpoints, loop time, peak."""
    variant, loop, peak = _measure(variant_fn, model, opt, width, args, steps, device, None)
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    persist = med(variant.persists)
    return {
        "name": variant.name,
        "nbytes": variant.nbytes,
        "stall_s": med(variant.stalls),
        "persist_s": persist,
        "persist_gbps": variant.nbytes / persist / 1e9 if persist else float("nan"),
        "durable_s": med(variant.durables),
        "loop_s": loop,
        "peak": peak,
    }


def _rows(session: harness.Session, per_round: list[dict], keys: list[str]):
    """One row per variant: medians over the rounds; its stall against torch.save's, its loop
    against the no-checkpoint loop and its persist bandwidth against ``dd``'s, each taken
    within a round (a disk's speed drifts with its other tenants, as a loop's does)."""
    rows, errors, timed, ratios = [], [], {}, {}
    for key in keys:
        runs = [got[key] for got in per_round if "error" not in got[key]]
        if not runs:
            errors.append({"variant": key, "error": per_round[0][key]["error"]})
            continue
        timed[key] = harness.variant_stats(per_round, key, ["stall_s", "persist_s", "loop_s"])
        ratios[f"{key}_stall_vs_torch_save"] = harness.round_ratios(
            per_round, key, "torch.save", "stall_s"
        )
        ratios[f"{key}_loop_vs_none"] = harness.round_ratios(per_round, key, "none", "loop_s")
        ratios[f"{key}_persist_vs_dd"] = harness.round_ratios(
            per_round, key, "dd", "persist_gbps", "write_gbps"
        )
        vs_dd = ratios[f"{key}_persist_vs_dd"]["median"]
        med = {m: s["median"] for m, s in timed[key].items()}
        durable = harness.spread_stats(r["durable_s"] for r in runs)["median"]
        gbps = runs[0]["nbytes"] / med["persist_s"] / 1e9 if med["persist_s"] else float("nan")
        stall_ratio = ratios[f"{key}_stall_vs_torch_save"]["median"]
        rows.append(
            {
                "variant": runs[0]["name"],
                "state_bytes": runs[0]["nbytes"],
                "stall_s": med["stall_s"],
                "stall_vs_torch_save": float("nan") if stall_ratio is None else stall_ratio,
                "persist_s": med["persist_s"],
                "durable_s": durable,
                "persist_gbps": gbps,
                "persist_vs_disk_limit": float("nan") if vs_dd is None else vs_dd,
                "peak_extra_rss": max(r["peak"] for r in runs),
                "slowdown": (ratios[f"{key}_loop_vs_none"]["median"] or float("nan")) - 1,
                **session.row_fields(timed[key]),
            }
        )
    return rows + errors, timed, ratios


COLUMNS = [
    "variant",
    "stall_s",
    "stall_vs_torch_save",
    "persist_s",
    "durable_s",
    "persist_gbps",
    "persist_vs_disk_limit",
    "peak_extra_rss",
    "slowdown",
]


def _auto_row(model, opt, width, args: argparse.Namespace, auto_steps: int, device) -> dict:
    """every="auto" against a plain run of the same length, back to back: plain runs before and
    after the auto run, so their mean cancels slow drifts of a shared machine."""
    c0 = time.process_time()
    plain_before = train(model, opt, width, args.batch, auto_steps, device)
    plain_cpu = time.process_time() - c0
    root = tempfile.mkdtemp(prefix="tt-bench-ckpt-", dir=args.dir)
    try:
        ck = Checkpointer(root, keep=2, every="auto", max_overhead=args.max_overhead)
        rss = PeakRSS()
        start = _fresh_start(rss)
        t0, c0 = time.perf_counter(), time.process_time()
        train(
            model,
            opt,
            width,
            args.batch,
            auto_steps,
            device,
            before_step=ck.before_optimizer_step,
            after_step=lambda i: ck.maybe_save(i, model=model, optimizer=opt),
        )
        ck.close()
        auto = time.perf_counter() - t0
        auto_cpu = time.process_time() - c0
        peak = max(0, rss.peak() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    c0 = time.process_time()
    plain_after = train(model, opt, width, args.batch, auto_steps, device)
    plain_cpu = (plain_cpu + time.process_time() - c0) / 2
    plain = (plain_before + plain_after) / 2
    return {
        "variant": f"tensortier every=auto (max_overhead={args.max_overhead})",
        "steps": auto_steps,
        "checkpoints": ck.stats().committed,
        "interval": ck.stats().interval,
        "steps_saved": [h["step"] for h in ck.stats().history],
        "total_stall_s": ck.stats().stall_seconds,
        "peak_extra_rss": peak,
        "plain_loop_s": plain,
        "plain_loop_before_after_s": [plain_before, plain_after],
        "auto_loop_s": auto,
        "slowdown": auto / plain - 1,
        # CPU seconds of this process: less sensitive to other tenants of a shared machine
        "plain_cpu_s": plain_cpu,
        "auto_cpu_s": auto_cpu,
        "cpu_slowdown": auto_cpu / plain_cpu - 1,
    }


def run(args: argparse.Namespace) -> list[dict]:
    if args.replica:
        from benchmarks import checkpoint_replica

        return checkpoint_replica.run(args)
    quick = args.quick
    state = parse_size(args.state_size or ("128MiB" if quick else "1GiB"), name="--state-size")
    every = args.every or (5 if quick else 10)
    count = args.checkpoints or (2 if quick else 3)
    auto_steps = args.auto_steps or (60 if quick else 200)
    device = default_device()
    model, opt, width = build(state, device)
    steps = every * count
    print(
        f"state {format_size(state)} (MLP width {width}) on {environment()['device']}, "
        f"checkpoint every {every} steps x {count}, auto run {auto_steps} steps, dir {args.dir}"
    )
    train(model, opt, width, args.batch, 3, device)  # warm up: optimizer state exists
    dd_bytes = min(state, 1 << 30)
    variants: dict[str, Callable[[str], _Variant]] = {
        "torch.save": lambda r: TorchSave(r, every),
        "dcp": lambda r: DcpAsync(r, every),
        "tensortier": lambda r: Tensortier(r, every),
    }

    session = harness.Session.from_args("checkpoint", args)
    bar = tqdm(total=session.rounds * 5, desc="checkpoint variants", unit="run")

    def measure(key: str, _round: int) -> dict:
        bar.update()
        if key == "dd":  # the disk's limit in this round, as the tiers benchmark takes it
            return {"write_gbps": dd_bandwidth(args.dir, dd_bytes)[0]}
        if key == "none":  # the same steps with no checkpoint, in the same round
            trim()  # from a given-back heap, as every checkpointing variant starts
            return {"loop_s": train(model, opt, width, args.batch, steps, device)}
        return _one_variant(variants[key], model, opt, width, args, steps, device)

    with session:
        per_round = session.run(["dd", "none", *variants], measure)
        bar.close()
        rows, timed, ratios = _rows(session, per_round, list(variants))
        base = harness.spread_stats(got["none"].get("loop_s") for got in per_round)["median"]
        timed["dd"] = harness.variant_stats(per_round, "dd", ["write_gbps"])
        dd_write = timed["dd"]["write_gbps"]["median"]
    idle_dd = dd_bandwidth(args.dir, dd_bytes)[0]  # the limit when the idle write runs
    idle, intact = idle_persist_gbps(model, opt, args.dir)
    auto_row = _auto_row(model, opt, width, args, auto_steps, device)
    print_table(rows, COLUMNS)
    print(
        f"\nauto: {auto_row['checkpoints']} checkpoints in {auto_steps} steps at steps "
        f"{auto_row['steps_saved']}, interval {auto_row['interval']}, slowdown "
        f"{auto_row['slowdown']:.2%} wall, {auto_row['cpu_slowdown']:.2%} CPU time (target < "
        f"{args.max_overhead:.1%}); disk limit (dd) "
        f"{dd_write:.2f} GB/s; tensortier persist with the loop idle {idle:.2f} GB/s "
        f"({idle / idle_dd:.0%} of dd's {idle_dd:.2f} GB/s just before it)"
    )
    measurement = session.report(timed, ratios)
    print(harness.summary_line(measurement))
    write_json(
        args.json,
        "checkpoint",
        rows,
        measurement=measurement,
        auto=auto_row,
        disk_limit_gbps=dd_write,
        tensortier_idle_persist_gbps=idle,
        tensortier_restored_bit_identical=intact,
        tensortier_idle_persist_vs_disk_limit=idle / idle_dd,
        disk_limit_before_idle_gbps=idle_dd,
        every=every,
        checkpoints_per_variant=count,
        baseline_loop_s=base,
        iteration_s=base / steps,
        state_size=state,
        dir=args.dir,
    )
    harness.require({"tensortier's checkpoint restored the state it saved bit for bit": intact})
    return rows + [auto_row]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
