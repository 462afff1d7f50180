"""Device-side digests of gradients: speculation's validation without copying them to the host.

Why. ``step()`` keeps a speculative update only if every gradient still holds the bits it was
snapshotted with (``_speculation.py``). On CUDA, comparing by content meant copying the whole
model's gradients to the host again at every step and comparing them there (GPT-2 8 x 2048:
1.9 GB, ~35 ms of PCIe on an H100 alone, more than the issue-25 target leaves for the whole
update). A digest taken on the device with the snapshot, and again in ``step()``, reads the
gradients once at device bandwidth; the digests (0.4% of the gradients' bytes) stay on the device.

What. A bucket's gradient bytes, as int8, form rows of ``K`` bytes; the digest is their product
with a random ``K x COLS`` int8 matrix drawn once per process (``torch._int_mm``, int32
accumulate: exact integer arithmetic, so the digest does not depend on the kernel, the device or
the order of the sums). Equal bytes give equal digests. Different bytes give equal digests with
probability at most ``256 ** -COLS`` = 2^-64, whatever the change: a nonzero row difference ``d``
collides in one column only if that column's entry at one of ``d``'s nonzero positions takes the
single value that cancels the rest, and entries are uniform over 256 values.
``OffloadedAdamW(validate="bits")`` keeps the full comparison for a user who wants certainty.

Bytes that do not fill ``MIN_ROWS`` whole rows (``_int_mm`` needs more than 16 rows on CUDA) are
gathered from all of a bucket's gradients into one zero-padded block, one product for them all.

Whole rows are read in place from the gradient, unless its data pointer is not 16-byte aligned (a
gradient stolen by autograd as a view of a larger buffer, e.g. a slice of ``torch.cat``'s
gradient): cuBLASLt's int8 kernels need aligned operands (4 bytes at least, 16 for the fast ones;
PyTorch's ``int8_gemm`` passes no alignment preference), so such a gradient is copied first rather
than failing the GEMM and turning digests off for the device. The copy has the same bytes in the
same rows: the digest does not depend on it.

Each device is checked once (:meth:`Digests.usable`) against the same digest computed in int64
on the CPU; a device whose ``_int_mm`` fails or disagrees falls back to the full comparison with
a warning, so a broken kernel costs speed, never results. Never writes a gradient.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("tensortier.optim.adamw")

K = 8192  # bytes per row: K * 128 * 128 < 2^31, so the int32 sums are exact
COLS = 8  # columns: collision probability 256^-8 = 2^-64; _int_mm needs a multiple of 8
MIN_ROWS = 17  # _int_mm on CUDA needs more than 16 rows
ALIGN = 16  # bytes: operand alignment of cuBLASLt's fast int8 kernels (4 is their minimum)


def _blocks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``' bytes as int8 ``rows x K`` blocks: each tensor's whole rows when it has at
    least ``MIN_ROWS`` of them, then every remaining byte in one zero-padded block."""
    blocks, tails = [], []
    for t in tensors:
        b = t.detach().contiguous().view(-1).view(torch.int8)  # non-contiguous: copied first
        rows = b.numel() // K
        if rows >= MIN_ROWS:
            if b.data_ptr() % ALIGN:  # a view at an odd offset: copied, same bytes, same rows
                b = b.clone()
            blocks.append(b[: rows * K].view(rows, K))
            b = b[rows * K :]
        if b.numel():
            tails.append(b)
    if tails:
        n = sum(b.numel() for b in tails)
        rows = max(MIN_ROWS, -(-n // K))
        pad = torch.zeros(rows * K - n, dtype=torch.int8, device=tails[0].device)
        blocks.append(torch.cat([*tails, pad]).view(rows, K))
    return blocks


class Digests:
    """Digests of lists of tensors on their device (one random matrix per device)."""

    def __init__(self, seed: int | None = None):
        seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else seed
        gen = torch.Generator().manual_seed(seed)
        self._host = torch.randint(-128, 128, (COLS, K), dtype=torch.int8, generator=gen)
        self._mats: dict[torch.device, torch.Tensor] = {}
        self._usable: dict[torch.device, bool] = {}

    def _mat(self, device: torch.device) -> torch.Tensor:
        """The ``K x COLS`` matrix on ``device``, column-major (the layout int8 GEMMs take)."""
        m = self._mats.get(device)
        if m is None:
            m = self._mats[device] = self._host.to(device).t()
        return m

    def of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One int32 digest of ``tensors``' bytes, in order, on their (common) device."""
        device = tensors[0].device
        mat = self._mat(device)
        parts = [torch._int_mm(b, mat).reshape(-1) for b in _blocks(tensors)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32, device=device)

    def reference(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`of` computed in int64 on the CPU: what a device's digests are checked against."""
        mat = self._host.t().to(torch.int64)
        blocks = _blocks([t.detach().cpu() for t in tensors])
        parts = [(b.to(torch.int64) @ mat).reshape(-1) for b in blocks]
        return torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, dtype=torch.int32)

    def take(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """:meth:`of`, or None when the device cannot digest them (it is then not used again: an
        int8 GEMM refusing a shape the check did not try must not fail a backward pass)."""
        device = tensors[0].device
        if not self.usable(device):
            return None
        try:
            return self.of(tensors)
        except Exception as exc:  # noqa: BLE001 - the caller compares in full instead
            self._usable[device] = False
            log.warning(
                "tensortier: gradient digests failed on %s (%r): speculation is validated by a "
                "full comparison from now on (slower, same results)",
                device,
                exc,
            )
            return None

    def usable(self, device: torch.device) -> bool:
        """Whether digests on ``device`` agree with the CPU reference (checked once per device)."""
        ok = self._usable.get(device)
        if ok is None:
            ok = self._usable[device] = self._check(device)
        return ok

    def _check(self, device: torch.device) -> bool:
        g = torch.Generator().manual_seed(1)
        sample = [
            torch.randn(MIN_ROWS * K // 4 + 300, generator=g),  # whole rows and a tail
            torch.randn(7, 5, generator=g).to(torch.bfloat16),
        ]
        try:
            got = self.of([s.to(device) for s in sample]).cpu()
        except Exception as exc:  # noqa: BLE001 - any failure means: compare in full instead
            log.warning(
                "tensortier: gradient digests fail on %s (%r): speculation is validated by a "
                "full comparison of the gradients on the host instead (slower, same results)",
                device,
                exc,
            )
            return False
        if not torch.equal(got, self.reference(sample)):
            log.warning(
                "tensortier: gradient digests on %s disagree with the CPU's: speculation is "
                "validated by a full comparison of the gradients on the host instead",
                device,
            )
            return False
        return True
