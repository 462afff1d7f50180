"""Phases of ``scripts/gpu_check.sh``: the GPU tests and the headline figures on one GPU.

Each phase writes ``<phase>-<tag>.json`` into ``--out`` after every row it measures, so a phase
stopped by its time cap still leaves what it measured. ``<tag>`` names the device (``h100``,
``h200``; ``cpu-dry`` for ``--dry-run``, which runs every phase at a tiny size on the CPU so the
first GPU call cannot fail on a typo, an import or an argument).

Phases (``python scripts/gpu_check.py PHASE[,PHASE...] --out DIR``; several run in one process,
as the dry run does, each reported and the next run even when one raises):

* ``transfer``: the transfer engine's device<->host copies from its pinned pool against a plain
  pinned ``copy_`` (the PCIe limit), many copies in flight, bytes checked.
* ``pytest``: every ``@pytest.mark.gpu`` test, each under a timeout; failures with their text.
* ``activations`` (GPT-2) and ``llama``: Hugging Face GPT-2 and Llama (from configs, SDPA attention, bf16 autocast)
  sized so plain training fills ``--fill`` of the GPU; ``plain``, ``checkpoint`` (HF gradient
  checkpointing), ``save_on_cpu``, torchtune's ``OffloadActivations``, ``tt-host``, ``tt-disk``
  and ``tt.offload(budget=)`` at fractions of plain's iteration peak: peak device memory, step
  time, gradients against plain's (bit for bit, by fingerprint), backward wait time.
* ``optimizer``: ``OffloadedAdamW`` (host states) against torchao's ``CPUOffloadOptimizer`` and
  ``torch.optim.AdamW(fused=True)`` on the GPU: device memory of the model states, iteration
  time, update time left exposed after backward, parameters against fused AdamW's; the host's
  threads, ``step()`` split into its host part and the device work left after it, and
  ``OffloadedAdamW``'s counters per measured step (``per_step``: waiting for speculative updates,
  the gradient check (device digests by default; ``tt-offloaded-adamw-bits``: copied to the host
  and compared there), gradients reaching the host, spare copies, kernel).
* ``checkpoint``: the training loop's stall per checkpoint with tensortier's ``Checkpointer``
  against DCP ``async_save``, the model and its AdamW states on the GPU; the saved model read
  back bit for bit.

Time ratios come from one process, variants run one after another on a quiet dedicated machine
(the load average is recorded); treat single-run spreads as the noise floor they show.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------- output and environment


def device_tag() -> str:
    """``h100``/``h200`` from the device name; ``cpu-dry`` without a GPU."""
    if not CUDA:
        return "cpu-dry"
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4", "b200", "gh200"):
        if tag in name:
            return tag
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")[:24] or "gpu"


def environment() -> dict:
    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "packages": {},
        # the caching allocator's settings change every reserved figure (expandable_segments)
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        or os.environ.get("PYTORCH_ALLOC_CONF"),
    }
    if CUDA:
        props = torch.cuda.get_device_properties(DEV)
        env.update(
            device=torch.cuda.get_device_name(DEV),
            device_memory=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
        )
    else:
        env["device"] = "cpu"
    for name in ("tensortier", "transformers", "torchao", "torchtune", "zstandard", "lz4"):
        try:
            from importlib.metadata import version

            env["packages"][name] = version(name)
        except Exception:
            env["packages"][name] = None
    # the site dir gpu_check.sh installed into, or src/ where that install failed
    spec = importlib.util.find_spec("tensortier")
    env["tensortier_from"] = spec.origin if spec else None
    env["tensortier_cli"] = shutil.which("tensortier")
    return env


class Report:
    """One phase's JSON, rewritten after every row (a capped phase keeps what it measured)."""

    def __init__(self, phase: str, out: str, tag: str, **settings: Any):
        self.path = os.path.join(out, f"{phase}-{tag}.json")
        self.data = {
            "phase": phase,
            "tag": tag,
            "environment": environment(),
            "settings": settings,
            "rows": [],
            "complete": False,
        }
        self.write()

    def add(self, row: dict) -> dict:
        self.data["rows"].append(row)
        print(json.dumps(_short(row)), flush=True)
        self.write()
        return row

    def set(self, **kv: Any) -> None:
        self.data.update(kv)
        self.write()

    def finish(self) -> None:
        self.data["complete"] = True
        self.data["environment"]["loadavg_end"] = list(os.getloadavg())
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _short(row: dict) -> dict:
    return {k: v for k, v in row.items() if not isinstance(v, (list, dict)) or k == "error"}


def guarded(report: Report, name: str, fn: Callable[[], dict]) -> dict | None:
    """Runs one measurement; an exception becomes a row with its traceback, not a lost phase."""
    try:
        return report.add({"variant": name, **fn()})
    except Exception as exc:  # a finding to report, the next variant still runs
        traceback.print_exc()
        return report.add(
            {
                "variant": name,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
                **({"stats": exc.tt_stats} if hasattr(exc, "tt_stats") else {}),
            }
        )
    finally:
        release_memory()


# ---------------------------------------------------------------- timing and memory


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def release_memory() -> None:
    """Between variants: nothing of the last one stays cached (device or pinned host)."""
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:  # PyTorch's pinned-block cache never unpins on its own
            host_empty()


class Peak:
    """Device high-water marks of one region, relative to what was allocated when it began."""

    def __enter__(self) -> Peak:
        sync()
        self.alloc0 = torch.cuda.memory_allocated() if CUDA else 0
        self.reserved0 = torch.cuda.memory_reserved() if CUDA else 0
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        sync()
        self.alloc = torch.cuda.max_memory_allocated() if CUDA else 0
        self.reserved = torch.cuda.max_memory_reserved() if CUDA else 0
        self.added_alloc = self.alloc - self.alloc0
        self.added_reserved = self.reserved - self.reserved0


def median_spread(xs: list[float]) -> dict:
    if not xs:
        return {"median": None}
    m = statistics.median(xs)
    return {"median": m, "min": min(xs), "max": max(xs), "n": len(xs)}


# ---------------------------------------------------------------- gradient fingerprints


def fingerprint(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Two integer sums of each gradient's bit pattern (plain and position-weighted), on the
    device: equal fingerprints mean equal bits up to a vanishing chance, without copying the
    gradients to the host."""
    sums = []
    for p in model.parameters():
        if p.grad is None:
            sums.append(torch.zeros(2, dtype=torch.int64, device=p.device))
            continue
        g = p.grad.detach().contiguous().view(-1)
        bits = g.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[g.element_size()])
        bits = bits.to(torch.int64)
        w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        sums.append(torch.stack([bits.sum(), (bits * w).sum()]))
    return [tuple(x) for x in torch.stack(sums).tolist()]


def grads_to_host(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().float().cpu() for p in model.parameters()]


def max_rel_diff(model: torch.nn.Module, ref: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for p, r in zip(model.parameters(), ref):
        if p.grad is None or r is None:
            continue
        d = (p.grad.detach().float().cpu() - r).abs().max().item()
        worst = max(worst, d / max(r.abs().max().item(), 1e-30))
    return worst


# ---------------------------------------------------------------- peers


def torchtune_offload_class() -> tuple[type, str]:
    """torchtune's ``OffloadActivations``, and how it was imported.

    ``import torchtune`` pulls in its whole recipe stack (torchdata, datasets, omegaconf,
    kagglehub, ...), none of which the class uses. Where those are missing, the class's own file
    from the installed torchtune wheel is loaded with the two names it imports from torchtune
    (``TiedLinear`` for an isinstance check, ``get_logger``) provided: the code measured is
    torchtune's, unchanged.
    """
    try:
        from torchtune.training import OffloadActivations

        return OffloadActivations, "torchtune.training"
    except ImportError as exc:
        reason = str(exc)
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"torchtune is not installed ({reason})")
    path = os.path.join(spec.submodule_search_locations[0], "training", "_activation_offloading.py")
    import logging

    fake = {
        "torchtune.modules": types.SimpleNamespace(TiedLinear=type("TiedLinear", (), {})),
        "torchtune.utils": types.SimpleNamespace(get_logger=logging.getLogger),
    }
    saved = {k: sys.modules.get(k) for k in ("torchtune", *fake)}
    try:
        sys.modules["torchtune"] = types.ModuleType("torchtune")
        sys.modules.update(fake)  # type: ignore[arg-type]
        loader_spec = importlib.util.spec_from_file_location("_tt_torchtune_offload", path)
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module.OffloadActivations, f"file {path} (package import failed: {reason})"


# ---------------------------------------------------------------- models


def hf_model(kind: str, layers: int, width: int, heads: int, seq: int, vocab: int):
    """A Hugging Face GPT-2 or Llama from a config (no download), SDPA attention, no dropout."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=layers,
            n_embd=width,
            n_head=heads,
            n_positions=seq,
            vocab_size=vocab,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
        )
        cls = tf.GPT2LMHeadModel
    else:
        cfg = tf.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=width,
            intermediate_size=int(width * 8 / 3) // 64 * 64,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=seq,
            vocab_size=vocab,
            attn_implementation="sdpa",
        )
        cls = tf.LlamaForCausalLM
    model = cls(cfg).to(DEV)
    model.train()
    return model


def token_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(DEV)


def train_step(model, x: torch.Tensor, ctx: Callable[[], Any]) -> float:
    """One forward (inside ``ctx()``, bf16 autocast on CUDA) and backward; returns the loss."""
    for p in model.parameters():
        p.grad = None
    with ctx(), torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=CUDA):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach()


# ---------------------------------------------------------------- phase: transfer


def phase_transfer(args: argparse.Namespace) -> None:
    import tensortier as tt

    size = (4 if args.dry_run else 256) * MiB
    count = 4 if args.dry_run else 16  # copies in flight, as an offloaded forward issues them
    rep = Report("transfer", args.out, args.tag, tensor_bytes=size, count=count)

    def gbps(seconds: float) -> float:
        return size * count / seconds / 1e9

    def timed(fn: Callable[[], Any], repeat: int = 5) -> list[float]:
        times = []
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return times

    src = [torch.randint(0, 255, (size,), dtype=torch.uint8, device=DEV) for _ in range(count)]
    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=CUDA) for _ in range(count)]
    back = [torch.empty_like(s) for s in src]

    def plain_d2h() -> None:
        for s, p in zip(src, pinned):
            p.copy_(s, non_blocking=True)

    def plain_h2d() -> None:
        for b, p in zip(back, pinned):
            b.copy_(p, non_blocking=True)

    limit = {}
    for name, fn in (("d2h", plain_d2h), ("h2d", plain_h2d)):
        t = timed(fn)
        limit[name] = gbps(min(t))
        rep.add({"variant": f"torch pinned copy_ {name}", "gbps": limit[name], **_gb(t, gbps)})
    pinned.clear()  # the pool's blocks are measured next, not these

    with tt.TransferEngine(host=tt.HostPool(size * count * 2)) as engine:
        held: list = []

        def tt_d2h() -> None:
            for h in held:
                h.free()
            held.clear()
            futures = [engine.to_host(s) for s in src]
            held.extend(f.result() for f in futures)

        def tt_h2d() -> None:
            futures = [engine.to_device(h) for h in held]
            outs = [f.result() for f in futures]
            back[:] = outs

        tt_d2h()  # warm: the pool pins its blocks once
        for name, fn in (("d2h", tt_d2h), ("h2d", tt_h2d)):
            t = timed(fn)
            rep.add(
                {
                    "variant": f"tensortier engine {name}",
                    "gbps": gbps(min(t)),
                    "ratio_vs_pinned_copy": gbps(min(t)) / limit[name],
                    **_gb(t, gbps),
                }
            )
        sync()
        rep.set(round_trip_intact=all(torch.equal(a, b) for a, b in zip(src, back)))
        for h in held:
            h.free()
    rep.finish()


def _gb(times: list[float], gbps: Callable[[float], float]) -> dict:
    return {"gbps_all": [gbps(t) for t in times], "seconds": median_spread(times)}


# ---------------------------------------------------------------- phase: pytest


def _workers(n: int) -> list[str]:
    """pytest-xdist's ``-n`` when it is installed: H100 run 2 needed 127 s for 69 tests on one
    process, and 81 tests no longer fit the phase's cap. The gpu tests order their streams with
    events and ``torch.cuda._sleep``, not with clocks, and read their own process's allocator
    statistics, so two processes sharing the device change no verdict, only the time."""
    if n <= 1 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(n)]


def phase_pytest(args: argparse.Namespace) -> None:
    """Every gpu test under a per-test timeout. Each result is written as the test ends
    (``_pytest_rows.py``), so a run stopped at ``--pytest-seconds`` keeps its failures' text
    and names the tests it never reached."""
    files = sorted(
        os.path.join(root, f)
        for root, _, names in os.walk("tests")
        for f in names
        if f.startswith("test_")
        and f.endswith(".py")
        and "mark.gpu" in pathlib.Path(root, f).read_text()
    )
    rep = Report("pytest", args.out, args.tag, files=files, per_test_timeout=args.test_timeout)
    rows = os.path.join(tempfile.mkdtemp(prefix="tt-gpu-pytest-"), "rows.jsonl")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TT_GPU_CHECK_ROWS=rows)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "_pytest_rows",
        "-p", "no:cacheprovider", f"--timeout={args.test_timeout}",
        "--continue-on-collection-errors", *_workers(args.pytest_workers), *files,
    ]  # fmt: skip
    rep.set(command=" ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its workers in its group
    try:
        proc.wait(timeout=args.pytest_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the xdist workers too: they hold the device
        proc.wait()
        rep.set(stopped=f"pytest stopped after {args.pytest_seconds} s")
    rep.set(exit_code=proc.returncode, seconds=time.perf_counter() - t0)
    counts: dict[str, int] = {}
    collected: list[str] = []
    finished = set()
    if os.path.exists(rows):
        for line in pathlib.Path(rows).read_text().splitlines():
            row = json.loads(line)
            if "collected" in row:
                collected = row["collected"]
                continue
            finished.add(row["test"])
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
            if row["outcome"] in ("failed", "error"):
                rep.add(row)
    rep.set(counts=counts, not_run=[t for t in collected if t not in finished])
    rep.finish()


# ---------------------------------------------------------------- phase: activations


def _size_batch(model, seq: int, vocab: int, fill: float, cap: int) -> tuple[int, dict]:
    """The batch at which plain training peaks at ``fill`` of the device's memory, from plain's
    peaks at batch 1 and 2 (memory grows linearly in the batch)."""
    peaks = {}
    for b in (2, 4):  # allocated, not reserved: the cache's segment sizes are not linear
        x = token_batch(vocab, b, seq)
        with Peak() as pk:
            train_step(model, x, contextlib.nullcontext)
        peaks[b] = pk.alloc
        release_memory()
    slope = max((peaks[4] - peaks[2]) // 2, 1)
    total = torch.cuda.get_device_properties(DEV).total_memory
    batch = int((fill * total - (peaks[2] - 2 * slope)) // slope)
    return max(1, min(cap, batch)), {"peak_b2": peaks[2], "peak_b4": peaks[4], "per_sample": slope}


def _variant_contexts(name: str, model, plain_added: int, args, spill_dir: str):
    """(context factory for the forward, stats getter, cleanup) of one activation strategy."""
    import tensortier as tt

    host_budget = max(4 * GiB, int(plain_added * 1.5))
    if name in ("plain", "plain-again"):
        return contextlib.nullcontext, dict, lambda: None
    if name == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return contextlib.nullcontext, dict, model.gradient_checkpointing_disable
    if name == "save_on_cpu":
        return (lambda: torch.autograd.graph.save_on_cpu(pin_memory=CUDA)), dict, lambda: None
    if name == "torchtune":
        cls, how = torchtune_offload_class()
        if not CUDA:
            raise RuntimeError(f"torchtune's OffloadActivations needs CUDA (imported from {how})")
        hooks = cls(use_pin_memory=True, use_streams=True)
        return (lambda: hooks), (lambda: {"imported_from": how}), lambda: None
    if name in ("tt-host", "tt-disk"):
        off = tt.Offloader(name[3:], spill_dir=spill_dir, host_budget=host_budget, min_bytes="1MiB")
        return (lambda: off), off.stats.as_dict, off.close
    if name.startswith("budget-"):
        from tensortier.planner.policies import Options

        frac = float(name.split("-")[1])
        off = tt.offload(
            budget=max(1, int(frac * plain_added)),
            tier="host",
            host_budget=host_budget,
            options=Options(plan_seconds=args.plan_seconds),
        )

        def stats() -> dict:
            choice = off.choice
            return {
                "budget": int(frac * plain_added),
                "policy": None if choice is None else choice.plan.policy,
                "predicted": None if choice is None else choice.result.summary(),
                "measured_peaks": list(off.measured_peaks),
                "replans": off.replans,
                "offloader": None if off.stats is None else off.stats.as_dict(),
                "profile": _profile_summary(off.profile),
            }

        return (lambda: off), stats, off.close
    raise ValueError(f"unknown variant {name!r}")


def _profile_summary(profile) -> dict | None:
    """What the planner measured and fitted (each pass's reserved and allocated peak, the
    transient factor): what its floor comes from, kept when it refuses a budget."""
    if profile is None:
        return None
    return {
        "transient_factor": profile.transient_factor,
        "saved_bytes": profile.saved_bytes,
        "largest_tensor": max((t.nbytes for t in profile.tensors), default=0),
        "passes": [
            {k: r.get(k) for k in ("kind", "peak_bytes", "allocated_bytes", "step_s")}
            | {"kept": len(r.get("kept") or [])}
            for r in profile.passes
        ],
    }


XS = "+xs"  # a variant name's suffix: run with the allocator's expandable segments


@contextlib.contextmanager
def expandable_segments(on: bool):
    """The caching allocator with ``expandable_segments`` for the variants named ``...+xs``:
    reserved memory then stays close to allocated (H100 run 2: full checkpointing reserved 6.84
    GB for 2.31 GB allocated, and budgets count reserved memory). Set at run time, as PyTorch's
    own ``test_cuda_expandable_segments.py`` does; segments made before keep their kind, so the
    cache is emptied on both sides. The dry run checks the call exists."""
    setting = torch.cuda.memory._set_allocator_settings  # no public setter
    if not (on and CUDA):
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    setting("expandable_segments:True")
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        setting("expandable_segments:False")


def _run_variant(name: str, model, x, steps: int, measured: int, ref: dict, args, spill: str,
                 expandable: bool = False):  # fmt: skip
    with expandable_segments(expandable):
        row = _measure_variant(name, model, x, steps, measured, ref, args, spill)
    return {**row, "expandable_segments": True} if expandable else row


def _measure_variant(name: str, model, x, steps: int, measured: int, ref: dict, args, spill: str):
    ctx, stats, cleanup = _variant_contexts(name, model, ref.get("added_reserved", 0), args, spill)
    try:
        times, peaks, prints, losses = [], [], [], []
        for _ in range(steps):
            for p in model.parameters():  # freed before the peak's start: the gradients
                p.grad = None  # count in "added", as in what tt.offload(budget=) counts
            with Peak() as pk:
                t0 = time.perf_counter()
                losses.append(train_step(model, x, ctx))
                sync()
                times.append(time.perf_counter() - t0)
            peaks.append((pk.added_alloc, pk.added_reserved, pk.alloc, pk.reserved))
            prints.append(fingerprint(model))
        row = {
            "steps": steps,
            "step_s": median_spread(times[-measured:]),
            "step_s_all": times,
            "peak_alloc": max(p[2] for p in peaks[-measured:]),
            "peak_reserved": max(p[3] for p in peaks[-measured:]),
            "added_alloc": max(p[0] for p in peaks[-measured:]),
            "added_alloc_all_steps": [p[0] for p in peaks],
            # reserved grows in the first step only (the cache keeps it): the highest step
            "added_reserved": max(p[1] for p in peaks),
            "added_reserved_all_steps": [p[1] for p in peaks],
            "loss": float(torch.stack(losses).float()[-1]),
            "stats": stats(),
        }
        if "prints" in ref:
            same = [p == ref["prints"] for p in prints]
            row["grads_identical_every_step"] = all(same)
            row["grads_identical_steps"] = same
            if not all(same):
                row["grads_max_rel_diff_last_step"] = max_rel_diff(model, ref["grads"])
        else:
            ref["prints"], ref["grads"] = prints[0], grads_to_host(model)
            row["plain_deterministic_across_steps"] = all(p == prints[0] for p in prints)
        if "step_s" in ref and row["step_s"]["median"]:
            row["time_vs_plain"] = row["step_s"]["median"] / ref["step_s"]
            row["added_reserved_vs_plain"] = row["added_reserved"] / max(ref["added_reserved"], 1)
        return row
    except Exception as exc:  # a refused budget: keep what the planner measured (guarded)
        try:
            exc.tt_stats = stats()
        except Exception:  # the stats are a diagnosis: the error itself is reported
            pass
        raise
    finally:
        cleanup()
        for p in model.parameters():
            p.grad = None


def phase_activations(args: argparse.Namespace) -> None:
    """GPT-2 (the full set of variants)."""
    _activations(args, "activations", "gpt2", args.fill, args.variants.split(","))


def phase_llama(args: argparse.Namespace) -> None:
    """Llama (rotary embeddings, SwiGLU): fewer variants, a smaller fill, its own time cap."""
    _activations(args, "llama", "llama", args.fill * 0.6, args.llama_variants.split(","))


def _activations(args: argparse.Namespace, phase: str, kind: str, fill: float, variants: list):
    layers, width, heads, seq, vocab = (
        (2, 64, 4, 32, 128) if args.dry_run else (12, 2048, 16, 1024, 32768)
    )
    rep = Report(phase, args.out, args.tag, model=kind, layers=layers, width=width, heads=heads,
                 seq=seq, vocab=vocab, fill=fill, variants=variants)  # fmt: skip
    spill = tempfile.mkdtemp(prefix="tt-gpu-check-", dir=args.spill_dir)
    try:
        model = hf_model(kind, layers, width, heads, seq, vocab)
        params = sum(p.numel() for p in model.parameters())
        if CUDA:
            batch, sizing = _size_batch(model, seq, vocab, fill, cap=256)
        else:  # the dry run: budgets are RSS there, a generous one still runs the planner
            batch, sizing = 2, {"per_sample": 64 * MiB}
        x = token_batch(vocab, batch, seq)
        rep.add({"variant": "config", "params": params, "batch": batch, **sizing})
        ref: dict = {} if CUDA else {"added_reserved": 512 * MiB}
        refs = {"": ref, XS: dict(ref)}  # "+xs" rows: budgets and ratios against plain+xs
        for name in variants:
            if name == "tt-disk":
                continue  # at its own size, below
            base, xs = name.removesuffix(XS), name.endswith(XS)
            steps = args.budget_steps if base.startswith("budget-") else args.steps
            r = refs[XS if xs else ""]
            row = guarded(rep, name, lambda b=base, s=steps, r=r, xs=xs: _run_variant(
                b, model, x, s, args.measured, r, args, spill, expandable=xs))  # fmt: skip
            if base == "plain" and row and "error" not in row:
                r["step_s"] = row["step_s"]["median"]
                r["added_reserved"] = row["added_reserved"] or r.get("added_reserved", 0)
            if "prints" in ref and "prints" not in refs[XS]:  # gradients: plain's, every row
                refs[XS].update(prints=ref["prints"], grads=ref["grads"])
        if "tt-disk" in variants:  # the device's local disk: a smaller batch bounds the bytes
            free = shutil.disk_usage(spill).free
            per_sample = sizing["per_sample"]
            small = max(1, min(batch, int(min(args.disk_bytes, free / 4) // per_sample)))
            xs = token_batch(vocab, small, seq)
            dref: dict = {} if CUDA else {"added_reserved": 512 * MiB}
            for name in ("plain", "tt-disk"):
                row = guarded(rep, f"{name}@batch{small}", lambda n=name: {
                    "batch": small, "disk_free": free,
                    **_run_variant(n, model, xs, args.steps, args.measured, dref, args, spill),
                })  # fmt: skip
                if name == "plain" and row and "error" not in row:
                    dref["step_s"] = row["step_s"]["median"]
                    dref["added_reserved"] = row["added_reserved"] or dref["added_reserved"]
        rep.finish()
    finally:
        shutil.rmtree(spill, ignore_errors=True)


# ---------------------------------------------------------------- phase: optimizer


def _optimizer(name: str, model: torch.nn.Module, lr: dict) -> torch.optim.Optimizer:
    """The optimizer a variant of the optimizer phase names, over ``model``'s parameters."""
    if name == "fused-adamw":
        return torch.optim.AdamW(model.parameters(), fused=CUDA, **lr)
    if name.startswith("tt-offloaded-adamw"):
        import tensortier as tt

        # default: speculation validated by device-side digests; -bits: gradients copied back
        # and compared on the host (the path of H100 run 1), to see what the digests save;
        # -deferred: the parameters' write-back overlaps the next forward (defer_write_back)
        validate = "bits" if name.endswith("-bits") else "auto"
        defer = name.endswith("-deferred")
        return tt.OffloadedAdamW(
            model.parameters(), tier="host", validate=validate, defer_write_back=defer, **lr
        )
    if name == "torchao-cpu-offload":
        from torchao.optim import CPUOffloadOptimizer

        if not CUDA:
            raise RuntimeError("torchao's CPUOffloadOptimizer needs CUDA (import checked)")
        return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **lr)
    raise ValueError(name)


WARMUP = 2  # optimizer phase: iterations left out (first touch, pinning, calibration)


def host_threads() -> dict:
    """The CPU parallelism the host update can use: ATen's threads and the cores it may run on."""
    return {
        "torch": torch.get_num_threads(),
        "interop": torch.get_num_interop_threads(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def timing_row(times: list[float], fwd_bwd: list[float], returned: list[float]) -> dict:
    """Iteration, forward+backward and ``step()`` times of the measured iterations; ``step()``
    split into its host part (until it returned) and the device work left after it."""
    t, f, r = times[WARMUP:], fwd_bwd[WARMUP:], returned[WARMUP:]
    return {
        "iteration_s": median_spread(t),
        "iteration_s_all": times,
        "fwd_bwd_s": median_spread(f),
        "step_call_s": median_spread([a - b for a, b in zip(t, f)]),
        "step_return_s": median_spread(r),
        "step_device_tail_s": median_spread([a - b - c for a, b, c in zip(t, f, r)]),
        "host_threads": host_threads(),
    }


def step_breakdown(stats: dict, steps: int) -> dict:
    """``OffloadedAdamW``'s counters over the measured steps, per step: where ``step()``'s time
    went (waiting for speculative updates, the gradient check's copy and comparison, write-back)
    and the worker's (gradients reaching the host, spare copies, the kernel), threads used."""
    per = {k: v / max(steps, 1) for k, v in stats.items() if k.endswith("_seconds")}
    per.update({k: stats[k] for k in ("kernel_threads", "compare_threads") if k in stats})
    for k in ("launched_in_backward", "launched_in_step", "validated", "redone", "digest_checks"):
        if k in stats:
            per[k] = stats[k] / max(steps, 1)
    return per


def pipelined_iteration(model, opt, xs: list[torch.Tensor]) -> float:
    """Seconds per iteration as a training loop runs them: no sync between iterations (a
    deferred write-back overlaps the next forward only then)."""
    sync()
    t0 = time.perf_counter()
    for x in xs:
        train_step(model, x, contextlib.nullcontext)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - t0) / len(xs)


def vs_fused(row: dict, params: torch.Tensor, ref: dict, first: bool) -> None:
    """The first row (fused AdamW) becomes ``ref``; every later one is compared with it."""
    if first:
        ref.update(params=params, t=row["iteration_s"]["median"],
                   fwd_bwd=row["fwd_bwd_s"]["median"], pipelined=row["pipelined_iteration_s"],
                   bytes=row["device_bytes_after_step_with_grads"])  # fmt: skip
        return
    diff = (params - ref["params"]).abs().max().item()
    row["params_max_abs_diff_vs_fused"] = diff
    row["params_identical_to_fused"] = diff == 0.0
    row["time_vs_fused"] = row["iteration_s"]["median"] / ref["t"]
    row["pipelined_vs_fused"] = row["pipelined_iteration_s"] / ref["pipelined"]
    row["exposed_update_s"] = row["iteration_s"]["median"] - ref["fwd_bwd"]
    row["device_bytes_vs_fused"] = row["device_bytes_after_step_with_grads"] / max(ref["bytes"], 1)


def phase_optimizer(args: argparse.Namespace) -> None:
    dry = args.dry_run
    kind, layers, width, heads, seq, vocab, batch = (
        ("gpt2", 2, 64, 4, 32, 128, 2) if dry else ("gpt2", 8, 2048, 16, 1024, 32768, 16)
    )
    rep = Report("optimizer", args.out, args.tag, model=kind, layers=layers, width=width,
                 seq=seq, batch=batch, steps=args.steps + 2)  # fmt: skip
    xs = [token_batch(vocab, batch, seq, seed=i) for i in range(args.steps + 2)]
    lr = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref: dict = {}

    def run(name: str) -> dict:
        model = hf_model(kind, layers, width, heads, seq, vocab)
        release_memory()
        base = torch.cuda.memory_allocated() if CUDA else 0
        opt = _optimizer(name, model, lr)
        times, fwd_bwd, states, returned = [], [], [], []
        try:
            for i, x in enumerate(xs):
                if i == WARMUP and hasattr(opt, "reset_stats"):
                    opt.reset_stats()  # the counters cover the measured iterations only
                sync()
                t0 = time.perf_counter()
                train_step(model, x, contextlib.nullcontext)
                sync()
                t1 = time.perf_counter()
                opt.step()
                tr = time.perf_counter()  # step() returned; the sync: device work left (H2D)
                sync()
                t2 = time.perf_counter()
                times.append(t2 - t0)
                fwd_bwd.append(t1 - t0)
                returned.append(tr - t1)
                states.append((torch.cuda.memory_allocated() - base) if CUDA else 0)
                opt.zero_grad(set_to_none=True)
            after = [(torch.cuda.memory_allocated() - base) if CUDA else 0]
            stats = opt.stats().as_dict() if hasattr(opt, "stats") else None
            pipelined = pipelined_iteration(model, opt, xs[WARMUP:])
            getattr(opt, "synchronize", lambda: None)()  # before reading parameters directly
            params = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
            row = {
                **timing_row(times, fwd_bwd, returned),
                "pipelined_iteration_s": pipelined,
                "device_bytes_after_step_with_grads": max(states[WARMUP:]),
                "device_bytes_between_steps": after[0],
                "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            }
            vs_fused(row, params, ref, first=name == "fused-adamw")
            if stats is not None:  # the synced iterations' counters
                row["stats"] = stats
                row["per_step"] = step_breakdown(stats, len(xs) - WARMUP)
            return row
        finally:
            close = getattr(opt, "close", None)
            if close is not None:
                close()
            del opt, model

    # the -bits variant last: a phase stopped at its cap has measured the others
    for name in ("fused-adamw", "tt-offloaded-adamw", "torchao-cpu-offload",
                 "tt-offloaded-adamw-deferred", "tt-offloaded-adamw-bits"):  # fmt: skip
        guarded(rep, name, lambda n=name: run(n))
    rep.finish()


# ---------------------------------------------------------------- phase: checkpoint


def phase_checkpoint(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dry = args.dry_run
    kind, layers, width, heads, seq, vocab, batch = (
        ("gpt2", 2, 64, 4, 32, 128, 2) if dry else ("gpt2", 8, 2048, 16, 1024, 32768, 8)
    )
    # the first save is a warm-up (it pins its host images once); each later one starts with the
    # previous persist drained (outside the timed step), as saves minutes apart would
    steps, saves = (8, (1, 3, 5)) if dry else (10, (1, 4, 7))
    rep = Report("checkpoint", args.out, args.tag, model=kind, layers=layers, width=width,
                 batch=batch, steps=steps, save_at=saves)  # fmt: skip
    root = tempfile.mkdtemp(prefix="tt-gpu-ckpt-", dir=args.spill_dir)
    if not dist.is_initialized():  # DCP's async_save runs its collectives on a process group
        store = dist.FileStore(os.path.join(root, "pg-store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    x = token_batch(vocab, batch, seq)
    shape = (kind, layers, width, heads, seq, vocab)
    try:
        rows = {}
        for name in ("tensortier", "dcp-async"):
            rows[name] = guarded(
                rep, name, lambda n=name: _checkpoint_variant(n, root, shape, x, steps, saves)
            )
        tt_row, dcp_row = rows["tensortier"], rows["dcp-async"]
        if tt_row and dcp_row and "error" not in tt_row and "error" not in dcp_row:
            rep.set(stall_ratio_vs_dcp_async=[
                a / b if b > 0 else None
                for a, b in zip(tt_row["stall_per_save_s"], dcp_row["stall_per_save_s"])
            ])  # fmt: skip
        rep.finish()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


def _checkpoint_variant(
    name: str, root: str, shape: tuple, x: torch.Tensor, steps: int, saves: tuple[int, ...]
) -> dict:
    """One variant of the checkpoint phase: its stall per save against the clean steps, the
    drain at the end, and (tensortier) the restored model compared bit for bit."""
    import tensortier as tt

    model = hf_model(*shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=CUDA)
    directory = os.path.join(root, name)
    ck = tt.Checkpointer(directory, keep=2, every=10**9) if name == "tensortier" else None
    try:
        times, drains, saved_params, pending = _train_with_saves(
            model, opt, ck, directory, x, steps, saves
        )
        t_wait = time.perf_counter()
        _drain(ck, pending)
        drain = time.perf_counter() - t_wait
        clean = [t for i, t in enumerate(times) if i not in saves and i > 0]
        base = statistics.median(clean)
        row = {
            "step_s_clean": median_spread(clean),
            "step_s_all": times,
            "first_save_stall_s": times[saves[0]] - base,
            "stall_per_save_s": [times[i] - base for i in saves[1:]],
            "persist_wait_before_each_save_s": drains,
            "drain_s": drain,
            "state_bytes": sum(t.numel() * t.element_size()
                               for t in _tensors(model.state_dict(), opt.state_dict())),
        }  # fmt: skip
        if ck is not None:
            row["checkpointer_stats"] = ck.stats().as_dict()
            ck.close()
            fresh = hf_model(*shape)
            with contextlib.closing(tt.Checkpointer(directory)) as reader:
                reader.restore(model=fresh)
            row["restored_model_bit_identical"] = all(
                torch.equal(v.detach().cpu(), saved_params[k])
                for k, v in fresh.state_dict().items()
            )
            del fresh
        return row
    finally:
        if ck is not None:
            ck.close()
        del opt, model


def _train_with_saves(model, opt, ck, directory: str, x, steps: int, saves: tuple[int, ...]):
    """``(step times, drain before each save, parameters at the last save, DCP's pending
    save)``: each save is in its step's time, the previous persist's drain is not."""
    import torch.distributed.checkpoint as dcp

    pending = None
    times, drains, saved_params = [], [], None
    for step in range(steps):
        if step in saves:
            t_drain = time.perf_counter()
            _drain(ck, pending)
            drains.append(time.perf_counter() - t_drain)
        if step == saves[-1]:  # the reference the restored model must equal
            saved_params = {k: v.detach().cpu().clone()
                            for k, v in model.state_dict().items()}  # fmt: skip
        sync()
        t0 = time.perf_counter()
        if step in saves:
            if ck is not None:
                ck.save(step, model=model, optimizer=opt)
            else:
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                pending = dcp.async_save(state, checkpoint_id=f"{directory}/step-{step}")
        train_step(model, x, contextlib.nullcontext)
        if ck is not None:
            ck.before_optimizer_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    return times, drains, saved_params, pending


def _drain(ck: Any, pending: Any) -> None:
    """Wait for the persist in flight: tensortier's, or DCP's ``async_save``."""
    if ck is not None:
        ck.wait()
    elif pending is not None:
        _dcp_wait(pending)


def _dcp_wait(pending: Any) -> None:
    """DCP's ``async_save`` returns a Future, or (newer stagers) a response holding one."""
    getattr(pending, "upload_completion", pending).result()


def _tensors(*trees: Any) -> Iterator[torch.Tensor]:
    for tree in trees:
        if isinstance(tree, torch.Tensor):
            yield tree
        elif isinstance(tree, dict):
            yield from _tensors(*tree.values())
        elif isinstance(tree, (list, tuple)):
            yield from _tensors(*tree)


# ---------------------------------------------------------------- summary


def summary(args: argparse.Namespace) -> None:
    """A short table of every phase's JSON (the tool shows the end of the output)."""
    for phase in args.phases.split(","):
        path = os.path.join(args.out, f"{phase}-{args.tag}.json")
        if not os.path.exists(path):
            print(f"{phase:12s} no result")
            continue
        data = json.loads(pathlib.Path(path).read_text())
        state = "complete" if data.get("complete") else "INCOMPLETE (capped or crashed)"
        print(f"{phase:12s} {state}")
        if phase == "pytest":
            print(f"  counts {data.get('counts')} exit {data.get('exit_code')}")
            print(f"  not run {data.get('not_run')}")
        for row in data["rows"]:
            keys = ("variant", "test", "model", "gbps", "ratio_vs_pinned_copy", "time_vs_plain",
                    "added_reserved_vs_plain", "grads_identical_every_step", "time_vs_fused",
                    "pipelined_vs_fused", "device_bytes_vs_fused", "stall_per_save_s", "error")  # fmt: skip
            bits = []
            for k in keys:
                if k in row:
                    v = row[k]
                    if isinstance(v, float):
                        v = f"{v:.3g}"
                    elif isinstance(v, list):
                        v = "[" + ",".join(f"{e:.3g}" for e in v) + "]"
                    elif k == "error":
                        v = str(v)[:160]
                    bits.append(f"{k}={v}")
            if "step_s" in row and isinstance(row["step_s"], dict) and row["step_s"]["median"]:
                bits.append(f"step={row['step_s']['median']:.3g}s")
            if row.get("added_reserved"):
                bits.append(f"added={row['added_reserved'] / GiB:.2f}GiB")
            stats = row.get("stats") or {}
            if isinstance(stats, dict):
                if stats.get("policy"):
                    bits.append(f"policy={stats['policy']}")
                waited = stats.get("wait_seconds") or (stats.get("offloader") or {}).get(
                    "wait_seconds"
                )
                if waited:
                    bits.append(f"bwd_wait={waited:.3g}s")
            print("  " + " ".join(bits))
            if isinstance(row.get("per_step"), dict):
                print("    per step: " + _per_step_line(row["per_step"]))
        if "stall_ratio_vs_dcp_async" in data:
            print(f"  stall ratio vs DCP async_save: {data['stall_ratio_vs_dcp_async']}")


def _per_step_line(per: dict) -> str:
    """OffloadedAdamW's per-step breakdown in ms, and the threads its update and check used."""
    ms = " ".join(
        f"{k[: -len('_seconds')]}={v * 1e3:.1f}ms" for k, v in per.items() if k.endswith("_seconds")
    )
    return f"{ms} threads kernel={per.get('kernel_threads')} compare={per.get('compare_threads')}"


PHASES = {
    "transfer": phase_transfer,
    "pytest": phase_pytest,
    "activations": phase_activations,
    "llama": phase_llama,
    "optimizer": phase_optimizer,
    "checkpoint": phase_checkpoint,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "phase",
        type=_phase_list,
        help=f"tag, summary, or phases to run in this one process, comma-separated: {','.join(PHASES)}",
    )
    p.add_argument("--out", default=".")
    p.add_argument("--phases", default=",".join(PHASES), help="summary: the phases run")
    p.add_argument("--tag", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--spill-dir", default=tempfile.gettempdir(), help="the device's local disk")
    p.add_argument("--fill", type=float, default=0.3, help="plain GPT-2's peak / device memory")
    p.add_argument("--steps", type=int, default=3, help="steps per variant (last --measured)")
    p.add_argument("--measured", type=int, default=2)
    p.add_argument("--budget-steps", type=int, default=7, help="steps of a budget= variant")
    p.add_argument("--plan-seconds", type=float, default=10.0)
    p.add_argument("--disk-bytes", type=float, default=6 * GiB, help="tt-disk's bytes per step")
    p.add_argument("--test-timeout", type=int, default=30, help="seconds per gpu test")
    p.add_argument("--pytest-seconds", type=float, default=140, help="then pytest is stopped")
    p.add_argument(
        "--pytest-workers", type=int, default=2, help="pytest-xdist processes (1: one process)"
    )
    p.add_argument(
        "--variants",
        default="plain,plain-again,tt-host,budget-0.4,plain+xs,budget-0.4+xs,checkpoint,"
        "save_on_cpu,torchtune,budget-0.3,budget-0.5,tt-disk",
        help="in the order run (most wanted first: a phase may hit its time cap); a name ending "
        "in +xs runs with the allocator's expandable segments, against plain+xs",
    )
    p.add_argument(
        "--llama-variants", default="plain,plain-again,tt-host,budget-0.4,checkpoint,torchtune"
    )
    args = p.parse_args(argv)
    args.tag = args.tag or device_tag()
    if args.phase == ["tag"]:
        print(args.tag)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.phase == ["summary"]:
        summary(args)
        return 0
    if args.dry_run:
        args.steps, args.measured, args.budget_steps, args.plan_seconds = 2, 1, 6, 2.0
    sys.stdout.reconfigure(line_buffering=True)
    if len(args.phase) > 1:
        _freeze_imports()
    ok = True
    for phase in args.phase:
        ok = _run_phase(phase, args) and ok
    return 0 if ok else 1


def _phase_list(text: str) -> list[str]:
    """``tag``, ``summary`` or a comma-separated list of phases (argparse's ``type``)."""
    names = text.split(",")
    if names in (["tag"], ["summary"]) or all(n in PHASES for n in names):
        return names
    raise argparse.ArgumentTypeError(
        f"unknown phase in {text!r}: pass tag, summary or some of {','.join(PHASES)}"
    )


def _freeze_imports() -> None:
    """Several phases in one process: import what they import, then move it out of the garbage
    collector's sight (``gc.freeze``), so the ``gc.collect`` between two variants walks what the
    variants made, not all of torch and transformers (a quarter second a call on the CPU)."""
    import transformers

    import tensortier  # noqa: F401

    transformers.GPT2LMHeadModel, transformers.LlamaForCausalLM  # noqa: B018 - lazy imports
    gc.collect()
    gc.freeze()


def _run_phase(phase: str, args: argparse.Namespace) -> bool:
    """One phase; with several in one process (the dry run: torch and transformers imported
    once, not once per phase) a phase that raises is reported and the next one still runs."""
    print(f"== {phase} on {args.tag} ({DEV})")
    if len(args.phase) == 1:
        PHASES[phase](args)
        return True
    start = time.perf_counter()
    try:
        PHASES[phase](args)
    except Exception:
        traceback.print_exc()
        print(f"== {phase} failed after {time.perf_counter() - start:.0f} s")
        return False
    finally:
        release_memory()
    print(f"== {phase} done after {time.perf_counter() - start:.0f} s")
    return True


if __name__ == "__main__":
    sys.exit(main())
