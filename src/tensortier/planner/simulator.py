"""Event simulation of one training iteration under a plan: predicted peak memory and step time.

The model (SwapAdvisor/AutoTM style, driven by a measured :class:`Profile`):

* one **compute stream** runs the units' forward in order, then their backward in reverse;
  codec encode/decode, the per-move issue cost and recompute run on it too;
* six **copy channels** (``d2h``, ``h2d``, ``h2disk``, ``disk2h``, ``h2remote``, ``remote2h``)
  each move one payload at a time at their measured bandwidth. On a unified machine (CPU)
  "device" memory is host RAM, so a swap to disk is one ``h2disk`` hop and host-tier bytes count
  in the device peak; the remote tier (other machines' RAM) is modelled as the disk is: a swap is
  device -> host -> remote (one ``h2remote`` hop on a unified machine), its bytes leave the local
  peak once they are out, and it takes no codec;
* a saved tensor's device bytes are freed when its outbound copy completes; in backward, reads
  are issued in need order as early as the offloader's prefetch window allows; a unit's backward
  consumes its saved tensors one at a time (reverse pack order, freeing each after use) and
  waits for a read that has not arrived (that wait is the *exposed transfer time*);
* a recomputed unit keeps only its inputs during the gap; its backward first reruns its forward;
* a *selective* unit (PyTorch's selective activation checkpointing) keeps its inputs and the
  outputs of the operators it caches; its backward reruns only the other operators (plus the
  dispatch cost per operator, ``Profile.sac_op_s``), and the cached outputs that autograd does
  not need are dropped after that rerun;
* a unit swapped in *part* moves only the tensors its action names (ordinals within the unit)
  and keeps the others.

Peak memory is the steady-state peak of an iteration: ``base + workspace + max over time of
(saved bytes resident + payloads in flight + gradients allocated so far + the temporaries of the
op running now)``. An op's temporaries are ``transient_factor`` x the saved tensor it produces
(forward) or consumes (backward): the factor is calibrated against a measured iteration. Memory held across
iterations (parameters, optimizer state, the offloader's persistent staging buffers, reported as
``Profile.offload_overhead_bytes``) is not part of it, as with CUDA's ``max_memory_allocated``. The simulator never runs a model and never touches a tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from tensortier.planner.profile import CHANNELS, Profile, TensorProfile, fold_sum

HOST_CODECS = ("zstd", "lz4")  # run on host bytes: encoding already moves the data to the host
_TICK = 1e-9  # the shortest op: zero-time units still order their memory events


class Mode(str, Enum):
    KEEP = "keep"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # other machines' RAM through a RemoteStore (no codec)
    RECOMPUTE = "recompute"
    SELECTIVE = "selective"  # torch.utils.checkpoint with a per-operator save/recompute policy


@dataclass(frozen=True)
class UnitAction:
    mode: Mode = Mode.KEEP
    compress: bool = False  # host/disk: use the cheapest codec where it pays (see choose_codec)
    # host/disk: ordinals (within the unit, pack order) of the tensors that move, None = all;
    # selective: indices of the operators recomputed (every other one is cached)
    part: frozenset[int] | None = None

    def label(self) -> str:
        text = self.mode.value + ("+codec" if self.compress else "")
        if self.part is not None:
            text += "[" + ",".join(str(i) for i in sorted(self.part)) + "]"
        return text

    @classmethod
    def parse(cls, label: str) -> UnitAction:
        head, _, rest = label.partition("[")
        part = None
        if rest:
            inner = rest.rstrip("]")
            part = frozenset(int(i) for i in inner.split(",") if i)
        mode, _, codec = head.partition("+")
        return cls(Mode(mode), compress=codec == "codec", part=part)


SWAPS = (Mode.HOST, Mode.DISK, Mode.REMOTE)  # the modes that move saved tensors to a tier


@dataclass
class Plan:
    """Per-unit actions and the codec resolved for each offloaded tensor (by pack index)."""

    policy: str
    actions: dict[str, UnitAction]
    codecs: dict[int, str | None] = field(default_factory=dict)

    def action(self, unit: str) -> UnitAction:
        return self.actions.get(unit, UnitAction())

    def tier_of(self, t: TensorProfile, ordinal: int | None = None) -> str:
        """Where ``t`` goes; ``ordinal`` (its position in its unit) decides a partial swap."""
        a = self.action(t.unit)
        if a.mode not in SWAPS:
            return "keep"
        if a.part is not None and (ordinal is None or ordinal not in a.part):
            return "keep"
        return a.mode.value

    def selective(self) -> dict[str, frozenset[int]]:
        """Unit -> recomputed operator indices, for the units under selective recompute."""
        return {
            u: a.part or frozenset() for u, a in self.actions.items() if a.mode == Mode.SELECTIVE
        }

    def recomputed(self) -> list[str]:
        return [u for u, a in self.actions.items() if a.mode == Mode.RECOMPUTE]

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "actions": {u: a.label() for u, a in self.actions.items()},
            "codecs": {str(k): v for k, v in self.codecs.items() if v},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        actions = {unit: UnitAction.parse(label) for unit, label in d["actions"].items()}
        return cls(d["policy"], actions, {int(k): v for k, v in d.get("codecs", {}).items()})


@dataclass
class Span:
    lane: str  # "compute" or a channel name
    start: float
    end: float
    label: str


# what adds time to the compute stream besides the model's own work: issuing and copying
# payloads (copy threads share the cores), encoding/decoding them, rerunning forwards
OVERHEADS = ("copies", "codecs", "recompute")


@dataclass
class SimResult:
    peak_bytes: int
    step_s: float
    exposed_s: float  # compute stream waiting on transfers
    overhead_s: float  # codec, issue and recompute time added to the compute stream
    forward_s: float
    host_peak_bytes: int
    timeline: list[tuple[float, int]]  # (time, device bytes) after each change
    spans: list[Span]
    overhead_by: dict[str, float] = field(default_factory=dict)  # overhead_s per OVERHEADS cause

    def summary(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "step_s": self.step_s,
            "exposed_s": self.exposed_s,
            "overhead_s": self.overhead_s,
            "host_peak_bytes": self.host_peak_bytes,
        }


# ------------------------------------------------------------------ cost helpers
def path_of(profile: Profile, tier: str, codec: str | None, *, outbound: bool) -> list[str]:
    """The channels a payload crosses, in order."""
    on_host = codec in HOST_CODECS  # the codec already left the payload on the host
    if tier == "host":
        return [] if profile.unified or on_host else (["d2h"] if outbound else ["h2d"])
    out, back = ("h2remote", "remote2h") if tier == "remote" else ("h2disk", "disk2h")
    if profile.unified or on_host:
        return [out] if outbound else [back]
    return ["d2h", out] if outbound else [back, "h2d"]


def move_seconds(profile: Profile, tier: str, codec: str | None, nbytes: float) -> float:
    """Busy time of the slowest channel both ways (the pipelined cost of moving ``nbytes``)."""
    bw = profile.bandwidth
    total = 0.0
    for outbound in (True, False):
        hops = path_of(profile, tier, codec, outbound=outbound)
        total += max((nbytes / bw.of(c) for c in hops), default=0.0)
    return total


def codec_seconds(profile: Profile, t: TensorProfile, codec: str) -> tuple[float, float]:
    speed = profile.codecs[codec]
    return t.nbytes / speed.encode_bps, t.nbytes / speed.decode_bps


def choose_codec(
    profile: Profile, t: TensorProfile, tier: str, *, allow_lossy: bool = False
) -> str | None:
    """The codec with the lowest encode + move + decode time, if it beats moving raw bytes.

    On the unified host tier nothing moves, so a codec is chosen when it saves memory at all
    (the lowest time among codecs that shrink the tensor by >= 10%). The remote tier takes none.
    """
    if tier == "remote":
        return None
    raw = move_seconds(profile, tier, None, t.nbytes)
    best, best_cost = None, float("inf") if tier == "host" and profile.unified else raw
    for name, ratio in sorted(t.ratios.items()):
        speed = profile.codecs.get(name)
        if speed is None or (not speed.lossless and not allow_lossy) or ratio > 0.9:
            continue
        enc, dec = codec_seconds(profile, t, name)
        cost = enc + dec + move_seconds(profile, tier, name, t.nbytes * ratio)
        if cost < best_cost:
            best, best_cost = name, cost
    return best


def resolve_codecs(profile: Profile, plan: Plan, *, allow_lossy: bool = False) -> Plan:
    """Fills ``plan.codecs`` for every tensor of a unit whose action asks for compression."""
    codecs: dict[int, str | None] = {}
    ordinal = ordinals(profile)
    for t in profile.tensors:
        a = plan.action(t.unit)
        if a.compress and plan.tier_of(t, ordinal[t.index]) != "keep":
            codecs[t.index] = choose_codec(profile, t, a.mode.value, allow_lossy=allow_lossy)
    plan.codecs = codecs
    return plan


def ordinals(profile: Profile) -> dict[int, int]:
    """Pack index -> position of the tensor within its unit (what a partial swap names)."""
    out: dict[int, int] = {}
    counts: dict[str, int] = {}
    for t in profile.tensors:
        out[t.index] = counts.get(t.unit, 0)
        counts[t.unit] = out[t.index] + 1
    return out


def selective_sets(profile: Profile, plan: Plan) -> dict[str, frozenset[int]]:
    """Per selective unit, the operators to recompute: the plan's, plus those that always rerun:
    views and in-place ops (caching one would keep or write a storage another op owns), random
    ops and ops whose output is later written in place (see ``OpRecorder``). Used by the runtime
    (what it recomputes) and the report (what it shows)."""
    out = {}
    for name, ops in plan.selective().items():
        try:
            unit = profile.unit(name)
        except KeyError:
            continue
        out[name] = ops | {o.index for o in unit.ops if o.pinned or o.view}
    return out


@dataclass
class Selective:
    """What selective recompute of one unit holds and costs (see the module docstring)."""

    cached_bytes: int  # outputs of the cached operators, resident from forward to backward
    cached_unsaved: int  # of those, what autograd does not need: dropped after the rerun
    rerun_s: float  # the recomputed operators plus the policy's dispatch cost in backward
    fwd_extra_s: float  # the policy's dispatch cost in forward
    recomputed: set[int]  # pack indices of the saved tensors the rerun materialises


def selective_costs(profile: Profile, unit, recompute: frozenset[int]) -> Selective:
    ops = unit.ops
    cached_ops = {o.index for o in ops if o.index not in recompute and not (o.view or o.pinned)}
    cached = sum(o.out_bytes for o in ops if o.index in cached_ops)
    saved_cached = sum(min(o.saved_bytes, o.out_bytes) for o in ops if o.index in cached_ops)
    rerun = fold_sum(o.seconds for o in ops if o.index not in cached_ops)
    dispatch = len(ops) * profile.sac_op_s
    recomputed = {t.index for t in profile.tensors_of(unit.name) if t.op_index not in cached_ops}
    return Selective(cached, cached - saved_cached, rerun + dispatch, dispatch, recomputed)


# ------------------------------------------------------------------ simulation
class _Memory:
    """One memory's timeline: (time, +/- bytes) events, swept into its peak."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []

    def add(self, t: float, n: float) -> None:
        if n:
            self.events.append((t, int(n)))

    def sweep(self) -> tuple[int, list[tuple[float, int]]]:
        level, peak, timeline = 0, 0, [(0.0, 0)]
        # frees before allocations at the same instant: a buffer is reused, not doubled
        for t, d in sorted(self.events, key=lambda e: (e[0], e[1] > 0)):
            level += d
            peak = max(peak, level)
            if timeline[-1][0] == t:  # one point per instant: no zero-width dips in the plot
                timeline[-1] = (t, level)
            else:
                timeline.append((t, level))
        return peak, timeline


@dataclass
class _Read:
    t: TensorProfile
    tier: str
    codec: str | None
    payload: float
    avail: float  # outbound copy finished
    arrive: float = 0.0
    consume: float | None = None
    issued: bool = False


@dataclass
class _Window:
    """The backward's read-ahead: reads start in need order while the bytes issued and not yet
    consumed fit the offloader's prefetch window."""

    order: list[_Read]  # need order
    size: float  # the window, bytes
    last: float  # start of the latest read (a start never precedes the previous one)
    issued: list[_Read] = field(default_factory=list)  # in issue order, consumed in that order
    head: int = 0  # issued[:head] are consumed
    inflight: float = 0.0  # bytes issued and not consumed
    cursor: int = 0  # order[:cursor] are issued


def _check_remote(profile: Profile, plan: Plan) -> None:
    bw = profile.bandwidth
    if not bw.remote and any(a.mode == Mode.REMOTE for a in plan.actions.values()):
        from tensortier.errors import ConfigError

        raise ConfigError(
            f"plan {plan.policy!r} sends units to the remote tier, but the profile has no "
            f"measured remote channels (h2remote={bw.h2remote}, remote2h={bw.remote2h}); "
            f"profile with tt.offload(budget=..., remote=pool) or drop the remote actions"
        )


class _Iteration:
    """One simulated iteration: the compute stream's clock, the copy channels, device and host
    memory, and the spans drawn; :meth:`forward` then :meth:`backward` advance it in order."""

    def __init__(self, profile: Profile, plan: Plan):
        self.profile, self.plan, self.bw = profile, plan, profile.bandwidth
        self.dev = _Memory()
        self.host = self.dev if profile.unified else _Memory()  # where host-side payloads live
        self.spans: list[Span] = []
        self.chan = dict.fromkeys(CHANNELS, 0.0)  # when each channel is free
        self.now = 0.0  # the compute stream's clock
        self.added = dict.fromkeys(OVERHEADS, 0.0)  # seconds added to the compute stream
        self.exposed = 0.0  # seconds the compute stream waited on transfers
        # a hop allocates its destination when it starts and frees its source when it ends;
        # remote bytes are off this machine
        dev, host = self.dev, self.host
        self.src_of = {"d2h": dev, "h2disk": host, "disk2h": None, "h2d": host}
        self.dst_of = {"d2h": host, "h2disk": None, "disk2h": host, "h2d": dev}
        self.src_of.update(h2remote=host, remote2h=None)
        self.dst_of.update(h2remote=None, remote2h=host)
        self.groups: dict[str, list[TensorProfile]] = {}
        for t in profile.tensors:
            self.groups.setdefault(t.unit, []).append(t)
        self.ordinal = ordinals(profile)
        self.sel: dict[str, Selective] = {}  # the units under selective recompute
        self.recomputed: set[str] = set()  # every unit whose forward reruns in backward
        self.resident: dict[int, tuple[float, _Memory]] = {}  # held until the unit's backward
        self.reads: list[_Read] = []
        self.limit = profile.inflight_bytes or 0  # the engine's bound on bytes in flight
        self.writes: list[tuple[float, float]] = []  # (completion, bytes) holding tickets
        self.window = _Window([], profile.prefetch_bytes, 0.0)  # set up by backward
        self.read_of: dict[int, _Read] = {}  # pack index -> its read

    # -------------------------------------------------------------- channels and the stream
    def hop(self, channel: str, ready: float, nbytes: float, label: str, count=True) -> float:
        """``nbytes`` over ``channel`` once both it and the payload are ready; its end."""
        start = max(ready, self.chan[channel])
        end = start + nbytes / self.bw.of(channel)
        self.chan[channel] = end
        self.spans.append(Span(channel, start, end, label))
        if self.dst_of[channel] is not None and count:
            self.dst_of[channel].add(start, nbytes)
        if self.src_of[channel] is not None:
            self.src_of[channel].add(end, -nbytes)
        return end

    def transient(self, start: float, end: float, nbytes: float) -> None:
        """Temporaries of the op that produces (forward) or consumes (backward) a saved tensor."""
        self.dev.add(start, self.profile.transient_factor * nbytes)
        self.dev.add(end, -self.profile.transient_factor * nbytes)

    def spend(self, seconds: float, cause: str) -> None:
        """The compute stream busy with offload work (an OVERHEADS ``cause``), no span."""
        self.now += seconds
        self.added[cause] += seconds

    def run(self, seconds: float, label: str, cause: str) -> None:
        """The compute stream busy with offload work, drawn as a span."""
        self.spans.append(Span("compute", self.now, self.now + seconds, label))
        self.spend(seconds, cause)

    def wait(self, until: float, label: str) -> None:
        """The compute stream idle until ``until``: exposed transfer time."""
        self.spans.append(Span("compute", self.now, until, label))
        self.exposed += until - self.now
        self.now = until

    # -------------------------------------------------------------- forward
    def forward(self) -> float:
        """Every unit's forward, then the loss; the forward's end."""
        p, plan = self.profile, self.plan
        for u in p.units:
            action = plan.action(u.name)
            if action.mode == Mode.SELECTIVE and u.recomputable and u.selective:
                self.sel[u.name] = selective_costs(p, u, action.part or frozenset())
            if u.name in self.sel or (action.mode == Mode.RECOMPUTE and u.recomputable):
                self.recomputed.add(u.name)
                self.forward_checkpointed(u)
            else:
                self.forward_saving(u)
        extra = p.other_fwd_s + p.other_bwd_s
        if extra:
            self.spans.append(Span("compute", self.now, self.now + extra, "loss"))
        self.now += extra
        return self.now

    def forward_checkpointed(self, u) -> None:
        """A recomputed unit keeps its inputs (and, selective, its cached operator outputs);
        its saved tensors are alive only while it runs."""
        ts, sel, dev = self.groups.get(u.name, []), self.sel.get(u.name), self.dev
        start = self.now
        fwd_s = u.fwd_s + (sel.fwd_extra_s if sel is not None else 0.0)
        dev.add(start, u.input_bytes)
        for k, t in enumerate(ts):
            at = start + fwd_s * (k + 1) / (len(ts) + 1)
            dev.add(at, t.nbytes)
            self.transient(at, at + fwd_s / (len(ts) + 1), t.nbytes)
            dev.add(start + fwd_s, -t.nbytes)
        if sel is not None:  # the cached operator outputs stay until backward reruns the unit
            dev.add(start + fwd_s, sel.cached_bytes)
            self.added["recompute"] += sel.fwd_extra_s
        self.now += fwd_s
        kind = "selective" if sel is not None else "ckpt"
        self.spans.append(Span("compute", start, self.now, f"fwd {u.name} ({kind})"))

    def forward_saving(self, u) -> None:
        """A unit whose saved tensors are made one after another, each kept or sent out."""
        ts = self.groups.get(u.name, [])
        start = self.now
        seg = max(u.fwd_s / max(1, len(ts)), _TICK)  # a tick: every op's temporaries show
        if not ts:
            self.now += u.fwd_s
        for t in ts:
            self.transient(self.now, self.now + seg, t.nbytes)
            self.now += seg
            self.dev.add(self.now, t.nbytes)
            self.pack(t)
        self.spans.append(Span("compute", start, self.now, f"fwd {u.name}"))

    def pack(self, t: TensorProfile) -> None:
        """The saved tensor ``t`` just made: kept, or encoded and sent over its channels."""
        p = self.profile
        tier = self.plan.tier_of(t, self.ordinal[t.index])
        codec = self.plan.codecs.get(t.index) if tier != "keep" else None
        hops = path_of(p, tier, codec, outbound=True) if tier != "keep" else []
        if tier == "keep" or (codec is None and not hops):  # nothing leaves the device
            self.resident[t.index] = (t.nbytes, self.dev)
            return
        payload: float = t.nbytes
        if codec is not None:
            payload = t.nbytes * t.ratios[codec]
        if self.limit and hops:
            self.throttle(payload)
        self.spend(self.bw.issue_s + payload * p.move_s_per_byte, "copies")  # threads share cores
        where = self.dev
        if codec is not None:
            where = self.encode(t, codec, payload)
        ready = self.now
        for c in hops:
            ready = self.hop(c, ready, payload, f"{c} #{t.index}")
            where = self.dst_of[c] or where
        if self.limit:
            self.writes.append((ready, payload))
        if tier == "host":  # the payload waits in memory for its backward
            self.resident[t.index] = (payload, where)
        self.reads.append(_Read(t, tier, codec, payload, avail=ready))

    def throttle(self, payload: float) -> None:
        """The engine's throttle: pack waits for earlier writes to land."""
        self.writes = [w for w in self.writes if w[0] > self.now]
        while self.writes and sum(n for _, n in self.writes) + payload > self.limit:
            self.wait(min(e for e, _ in self.writes), "throttle")
            self.writes = [w for w in self.writes if w[0] > self.now]

    def encode(self, t: TensorProfile, codec: str, payload: float) -> _Memory:
        """Encode ``t`` on the compute stream; the memory its payload lands in."""
        enc, _ = codec_seconds(self.profile, t, codec)
        self.run(enc, f"encode {codec} #{t.index}", "codecs")
        where = self.host if codec in HOST_CODECS else self.dev
        where.add(self.now, payload)
        self.dev.add(self.now, -t.nbytes)
        return where

    # -------------------------------------------------------------- backward
    def backward(self) -> None:
        """Every unit's backward in reverse, with the reads prefetched ahead of their need."""
        rank = {u.name: i for i, u in enumerate(self.profile.units)}
        order = sorted(self.reads, key=lambda r: (-rank[r.t.unit], -r.t.index))  # need order
        self.window = _Window(order, self.profile.prefetch_bytes, self.now)
        self.read_of = {r.t.index: r for r in order}
        for u in reversed(self.profile.units):
            self.backward_unit(u)

    def backward_unit(self, u) -> None:
        """Autograd consumes the unit's saved tensors in reverse pack order, one node at a time,
        and frees each once its node ran."""
        ts, dev = self.groups.get(u.name, []), self.dev
        recompute = u.name in self.recomputed
        self.pump()
        if recompute:
            self.rerun(u, ts)
        start = self.now
        need = list(reversed(ts))
        seg = max(u.bwd_s / max(1, len(need)), _TICK)
        if not need:
            self.now += u.bwd_s
        for t in need:
            r = None if recompute else self.read_of.get(t.index)
            if r is not None:
                self.read_in(r)
            self.transient(self.now, self.now + seg, t.nbytes)
            self.now += seg
            if recompute:
                dev.add(self.now, -t.nbytes)
            elif r is not None:  # raw bytes arrived in the device (h2d) or, unified, in RAM
                dev.add(self.now, -(t.nbytes if r.codec is not None else r.payload))
            elif t.index in self.resident:
                n, mem = self.resident.pop(t.index)
                mem.add(self.now, -n)
        self.spans.append(Span("compute", start, self.now, f"bwd {u.name}"))
        dev.add(self.now, u.grad_bytes)
        if recompute:
            dev.add(self.now, -u.input_bytes)
        self.pump()

    def rerun(self, u, ts: list[TensorProfile]) -> None:
        """The unit's forward runs again and materialises its saved tensors (selective: the
        recomputed operators' only, and then lets go of the cached outputs autograd skips)."""
        selective = self.sel.get(u.name)
        rerun = u.fwd_s if selective is None else selective.rerun_s
        made = [t for t in ts if selective is None or t.index in selective.recomputed]
        self.dev.add(self.now, sum(t.nbytes for t in made))
        self.transient(self.now, self.now + rerun, max((t.nbytes for t in made), default=0))
        self.run(rerun, f"recompute {u.name}", "recompute")
        if selective is not None:
            self.dev.add(self.now, -selective.cached_unsaved)

    def read_in(self, r: _Read) -> None:
        """The backward needs ``r`` now: issue it if the window had no room, wait for it,
        copy it in and decode it."""
        p, dev = self.profile, self.dev
        if not r.issued:
            self.issue(r, True, self.now)  # on demand: the window had no room for it earlier
        if r.arrive > self.now:
            self.wait(r.arrive, "wait")
        r.consume = self.now
        if p.unified and r.tier in ("disk", "remote"):
            dev.add(self.now, r.payload)
        self.spend(r.payload * p.move_s_per_byte, "copies")
        if r.codec is not None:
            _, dec = codec_seconds(p, r.t, r.codec)
            dev.add(self.now, r.t.nbytes)
            self.run(dec, f"decode {r.codec} #{r.t.index}", "codecs")
            arrived_in = (
                dev
                if path_of(p, r.tier, r.codec, outbound=False)[-1:] == ["h2d"]
                else (self.host if r.codec in HOST_CODECS or r.tier == "disk" else dev)
            )
            arrived_in.add(self.now, -r.payload)
        self.pump()

    def pump(self) -> None:
        """Start every read the window allows, in need order."""
        w = self.window
        while w.cursor < len(w.order) and (
            w.order[w.cursor].issued or self.issue(w.order[w.cursor])
        ):
            w.cursor += 1

    def issue(self, r: _Read, force: bool = False, not_before: float = 0.0) -> bool:
        """Start ``r`` when the window has room for it (``force``: now); False when the room
        comes only once a unit not yet simulated consumes a read."""
        w = self.window
        s = self.read_start(r, force, max(r.avail, w.last, not_before))
        if s is None:
            return False
        w.last = ready = s
        for c in path_of(self.profile, r.tier, r.codec, outbound=False):
            # unified: reads land in the host pool's buffers, resident from the first iteration
            # on (persistent, like the staging buffers); they count once backward holds them
            ready = self.hop(
                c, ready, r.payload, f"{c} #{r.t.index}", count=not self.profile.unified
            )
        if r.tier == "host":
            self.resident.pop(r.t.index, None)
        r.arrive, r.issued = ready, True
        w.issued.append(r)
        w.inflight += r.payload
        return True

    def read_start(self, r: _Read, force: bool, s: float) -> float | None:
        """The earliest time from ``s`` on at which ``r`` fits the window (reads consumed by
        then leave it), or None."""
        w = self.window
        while True:
            while w.head < len(w.issued):  # drop reads already consumed by time s
                x = w.issued[w.head]
                if x.consume is None or x.consume > s:
                    break
                w.inflight -= x.payload
                w.head += 1
            if force or not w.inflight or w.inflight + r.payload <= w.size:
                return s
            x = w.issued[w.head]
            if x.consume is None:
                return None  # the window opens when a unit not yet simulated consumes
            s = x.consume

    # -------------------------------------------------------------- result
    def result(self, forward_s: float) -> SimResult:
        peak, timeline = self.dev.sweep()
        host_peak = peak if self.profile.unified else self.host.sweep()[0]
        base = self.profile.base_bytes + self.profile.workspace_bytes
        return SimResult(
            peak_bytes=int(base + peak),
            step_s=self.now,
            exposed_s=self.exposed,
            overhead_s=fold_sum(self.added.values()),
            overhead_by=self.added,
            forward_s=forward_s,
            host_peak_bytes=int(host_peak),
            timeline=[(t, base + b) for t, b in timeline],
            spans=self.spans,
        )


def simulate(profile: Profile, plan: Plan) -> SimResult:
    """Runs one iteration of ``plan`` on ``profile``'s costs; see the module docstring."""
    _check_remote(profile, plan)
    it = _Iteration(profile, plan)
    forward_s = it.forward()
    it.backward()
    return it.result(forward_s)


STALL = 1e-3  # the outbound channels' bandwidth, scaled, when writes stall (simulate_worst)
_OUTBOUND = ("d2h", "h2disk", "h2remote")


def simulate_worst(profile: Profile, plan: Plan) -> SimResult:
    """:func:`simulate`, its peak raised to the one reached when the writes stall (a disk or a
    link slowed down by another job, a copy thread starved of a core): each source then stays in
    memory as long as the offloader's write throttle lets it (``Profile.inflight_bytes``),
    instead of as long as the measured bandwidth takes. Step time and timeline stay those of the
    measured bandwidths (whose peak the timeline shows). Without a throttle nothing bounds the
    writes in flight, and the peak is :func:`simulate`'s.

    Why: the memory of copies in flight depends on timing, which the load on the machine
    changes from step to step. A plan's own configuration, measured twelve times in a row, peaked
    at 0.60-0.64x its budget and once at 0.76x (issue 23), and this stalled case predicted the
    step to step spread (0.09-0.13x). Planning for it makes the budget hold whatever the timing;
    reads cannot raise the peak in the same way: their memory is taken when they are issued,
    which the prefetch window bounds whatever the timing.
    """
    result = simulate(profile, plan)
    if not profile.inflight_bytes:
        return result
    bw = profile.bandwidth
    slow = replace(bw, **{c: getattr(bw, c) * STALL for c in _OUTBOUND})
    stalled = simulate(replace(profile, bandwidth=slow), plan).peak_bytes
    result.peak_bytes = max(result.peak_bytes, stalled)
    return result
