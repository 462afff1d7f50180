"""Helpers that several test folders share (issue 26 #6: written once, not per file)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import torch


def run_benchmark(out: pathlib.Path, command: str, directory: os.PathLike | None = None) -> dict:
    """``python -m benchmarks <command> [--dir directory] --json <out> --quiet-wait 0`` in this
    process (``command``: words split on spaces); the JSON it wrote. Why: each benchmark test runs
    one as a user does and reads its machine-readable output, and none may wait for a quiet
    machine (``--quiet-wait 0``)."""
    from benchmarks.__main__ import main

    where = [] if directory is None else ["--dir", os.fspath(directory)]
    main([*command.split(), *where, "--json", str(out), "--quiet-wait", "0"])
    return json.loads(out.read_text())


def run_fresh(script: str, *args, env: dict | None = None, timeout: float = 600):
    """Run ``script`` (``python -c``) in a fresh process with ``args``; the JSON of its last
    stdout line. Why: memory tests need a process whose heap nothing touched before (glibc's
    state is the subject). ``env``: the environment (default: this one without ``MALLOC_*``
    settings, which would hide what is tested); this process's ``sys.path`` is passed on."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env = {**env, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------ the exact reference of offloading
class HostAdamW(torch.optim.Optimizer):
    """What offloading AdamW to the host means, in plain PyTorch: the exact reference for
    ``OffloadedAdamW`` on any device (issue 25). fp32 CPU master copies of the parameters are
    updated by ``torch.optim.AdamW(fused=True)`` on the CPU; ``step()`` copies the gradients to
    the host and the updated masters back into the parameters. Why: CUDA's fused AdamW rounds
    differently from the CPU kernel and Adam magnifies that on near-zero gradients (CPU, torch
    2.11: fused vs foreach 3.8e-3 apart on GPT-2's ``c_attn.bias``), so it can only be compared
    at a tolerance; this reference runs the computation offloading promises to keep, bit for bit.

    ``GradScaler`` drives it as it drives fused AdamW (``_step_supports_amp_scaling``):
    ``unscale_`` and ``clip_grad_norm_`` act on the parameters' own gradients, and
    ``GradScaler.step`` sets ``grad_scale`` (``None`` after ``unscale_``) and ``found_inf``,
    which reach the CPU AdamW the same way, copied to the host first and blocking (torch would
    copy them ``non_blocking`` from CUDA, racing the CPU kernel). Like fused AdamW it leaves the
    unscaled gradients in ``.grad``. One device's ``found_inf`` only: torch's fused kernels skip
    at exactly 1.0, not at the 2.0 that GradScaler sums from two devices' overflows."""

    _step_supports_amp_scaling = True

    def __init__(self, params, **adamw) -> None:
        params = list(params)
        super().__init__(params, {})
        self.masters = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self.host = torch.optim.AdamW(self.masters, **adamw, fused=True)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "HostAdamW takes no closure"
        params = self.param_groups[0]["params"]
        for p, m in zip(params, self.masters):
            m.grad = None if p.grad is None else p.grad.to("cpu", torch.float32, copy=True)
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self.host.grad_scale = None if scale is None else scale.to("cpu")
        self.host.found_inf = None if found is None else found.to("cpu")
        self.host.step()
        for p, m in zip(params, self.masters):
            if p.grad is not None:
                p.copy_(m)
                if scale is not None:  # the CPU kernel wrote the unscaled gradient into m.grad
                    p.grad.copy_(m.grad)


@dataclasses.dataclass
class Trace:
    """One run, step by step: after each ``step()`` clones of the parameters and the gradients
    left in ``.grad``, and GradScaler's scale after ``update()``. Recorded on the parameters'
    device with no host sync (a sync per step could hide a missing stream wait); compared at
    the end by :func:`assert_same_trace`."""

    model: torch.nn.Module
    params: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    grads: list[list[torch.Tensor | None]] = dataclasses.field(default_factory=list)
    scales: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def record(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """Call after ``step()`` (and ``scaler.update()``), before ``zero_grad()``."""
        ps = list(self.model.parameters())
        self.params.append([p.detach().clone() for p in ps])
        self.grads.append([None if p.grad is None else p.grad.clone() for p in ps])
        if scaler is not None:
            self.scales.append(scaler._get_scale_async().clone())


def _differences(names: list[str], got: list, want: list, suffix: str = "") -> list[str]:
    from tests.conftest import bit_equal

    bad = []
    for name, a, b in zip(names, got, want):
        if a is None or b is None:
            if (a is None) != (b is None):
                bad.append(f"{name}{suffix}: None in one run only")
        elif not bit_equal(a, b):
            diff = (a.double().cpu() - b.double().cpu()).abs().max().item()
            bad.append(f"{name}{suffix}: max |diff| {diff:.3g}")
    return bad


def assert_same_trace(got: Trace, want: Trace, what: str, context: str = "") -> None:
    """``got`` bit-identical to ``want`` after every step: parameters, gradients, scales. The
    message names the first step that differs, each tensor there with its largest difference,
    and both runs' GradScaler scale per step."""
    names = [n for n, _ in got.model.named_parameters()]
    assert len(got.params) == len(want.params), (len(got.params), len(want.params))
    scales = [[float(s) for s in run.scales] for run in (got, want)]
    history = f"GradScaler scale after each step: {what} {scales[0]}, reference {scales[1]}"
    for step, (gp, wp, gg, wg) in enumerate(zip(got.params, want.params, got.grads, want.grads)):
        bad = _differences(names, gp, wp) + _differences(names, gg, wg, ".grad")
        assert not bad, (
            f"{what} differs from the host reference after step {step} in {len(bad)} "
            f"tensors: {'; '.join(bad[:8])}; {history}; {context}"
        )
    assert scales[0] == scales[1], f"{what}: {history}; {context}"
