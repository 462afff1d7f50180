"""Shape buckets: inputs whose shapes round up to the same powers of two share a plan.

A planned offload profiles one iteration; inputs of another bucket (a longer sequence, a larger
batch) get a plan of their own, made from that profile scaled to the bucket's shapes
(:func:`scale_profile`) instead of profiling again. The plan cache keys plans by bucket. Nothing
here runs a model or plans.
"""

from __future__ import annotations

from tensortier.planner.profile import OpProfile, Profile
from tensortier.planner.profiler import tensors_in


def bucket(n: int) -> int:
    """A dimension's shape bucket: the next power of two (1 for 0 and 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def input_shapes(args, kwargs) -> list[tuple[list[int], str]]:
    """Shape and dtype (``"float32"``) of every tensor among a forward's arguments, in order."""
    flat = tensors_in(list(args)) + tensors_in(dict(sorted(kwargs.items())))
    return [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in flat]


def dimension_map(old: list, new: list) -> dict[int, int]:
    """Tensor dimension sizes of the profiled inputs -> their size for ``new`` inputs (rounded up
    to the bucket): every product of input dimensions, since a model flattens (batch x sequence
    is a matmul's rows). Where two products coincide the larger new size wins (memory errs
    high)."""
    out: dict[int, int] = {}
    for (a, _), (b, _) in zip(old, new):
        if len(a) != len(b) or len(a) > 6:
            continue
        nb = [bucket(d) for d in b]
        for mask in range(1, 1 << len(a)):
            pa = pb = 1
            for i in range(len(a)):
                if mask >> i & 1:
                    pa, pb = pa * a[i], pb * nb[i]
            if pa > 1 and pb != pa:
                out[pa] = max(out.get(pa, pb), pb)
            elif pa > 1:
                out.setdefault(pa, pa)
    return {k: v for k, v in out.items() if k != v}


def scale_profile(profile: Profile, sizes: dict[int, int]) -> Profile:
    """The profile of another input shape without profiling it: every tensor dimension whose
    profiled size is a key of ``sizes`` takes the mapped size; bytes scale with the shape, a
    unit's times, operators and inputs with its bytes."""
    p = Profile.from_dict(profile.to_dict())
    ratios: dict[str, tuple[int, int]] = {}
    for t in p.tensors:
        factor = 1.0
        shape = []
        for d in t.shape:
            new = sizes.get(d, d)
            factor *= new / d if d else 1.0
            shape.append(new)
        old = t.nbytes
        t.nbytes = int(round(old * factor))
        t.shape = shape
        a, b = ratios.get(t.unit, (0, 0))
        ratios[t.unit] = (a + old, b + t.nbytes)
    for u in p.units:
        old, new = ratios.get(u.name, (1, 1))
        r = new / old if old else 1.0
        u.fwd_s *= r
        u.bwd_s *= r
        u.input_bytes = int(u.input_bytes * r)
        u.grad_bytes = u.grad_bytes  # parameter gradients do not depend on the input
        u.ops = [
            OpProfile(
                o.index,
                o.name,
                int(o.out_bytes * r),
                o.seconds * r,
                int(o.saved_bytes * r),
                o.view,
                o.random,
                o.pinned,
            )
            for o in u.ops
        ]
    total_old = sum(a for a, _ in ratios.values()) or 1
    total_new = sum(b for _, b in ratios.values())
    r = total_new / total_old
    p.other_fwd_s *= r
    p.other_bwd_s *= r
    p.passes = []  # measured at the profiled shape only
    return p
