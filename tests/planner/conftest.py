from __future__ import annotations

import pytest

from tensortier.planner.profile import Bandwidth, Profile, TensorProfile, UnitProfile
from tensortier.tiers.codecs import CodecSpeed

GB = 10**9


def chain(
    n_units: int = 4,
    tensor_bytes: int = GB,
    per_unit: int = 2,
    fwd_s: float = 1.0,
    bwd_s: float = 2.0,
    bw: float = 2 * GB,
    unified: bool = True,
    zero_frac: float = 0.0,
    transient_factor: float = 0.0,
) -> Profile:
    """A stack of identical units, each saving ``per_unit`` tensors (no op temporaries unless
    ``transient_factor`` says so, so that every byte of a peak can be counted by hand)."""
    units, tensors = [], []
    for i in range(n_units):
        name = f"h.{i}"
        units.append(UnitProfile(name, fwd_s, bwd_s, input_bytes=tensor_bytes // 4, grad_bytes=0))
        for _ in range(per_unit):
            tensors.append(
                TensorProfile(
                    index=len(tensors),
                    unit=name,
                    nbytes=tensor_bytes,
                    zero_frac=zero_frac,
                    ratios={"sparse": 1 / 32 + 1 - zero_frac, "zstd": 0.95, "bf16": 0.5},
                )
            )
    speeds = {
        "sparse": CodecSpeed("sparse", 20 * GB, 20 * GB, 0.5, True),
        "zstd": CodecSpeed("zstd", 0.5 * GB, 1 * GB, 0.95, True),
        "bf16": CodecSpeed("bf16", 20 * GB, 20 * GB, 0.5, False),
    }
    return Profile(
        device="cpu" if unified else "cuda",
        units=units,
        tensors=tensors,
        bandwidth=Bandwidth(d2h=bw, h2d=bw, h2disk=bw, disk2h=bw),
        codecs=speeds,
        unified=unified,
        prefetch_bytes=4 * GB,
        transient_factor=transient_factor,
    )


@pytest.fixture
def make_profile():
    return chain
