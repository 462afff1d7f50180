"""Issue 27 #2: ``OffloadedAdamW(defer_gather=True)``: ``step()`` returns once this rank's updates
are done and their all-gathers handed to a thread; parameters are written before a forward, a
``state_dict()`` or a checkpoint reads them. Every case runs DDP + ``torch.optim.AdamW(fused=True)``
in the same processes (gloo, 2 ranks) and compares bit for bit.
"""

import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tensortier.errors import ConfigError
from tensortier.optim import OffloadedAdamW
from tests import distributed
from tests.optim.test_sharded import _iterate, _model, _square_model

STEPS = 5


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _pair(make, rank: int, group=None, wrap=None, **kw):
    """(reference model, its DDP, fused AdamW), (model, its DDP, OffloadedAdamW deferred), both
    over ``group`` (default: the world); ``wrap(model)`` instead of ``DDP(model)`` for the second
    (e.g. compiled)."""
    ref, m = make(), make()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = OffloadedAdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1, defer_gather=True, process_group=group, **kw
    )
    run = wrap(m) if wrap is not None else DDP(m, process_group=group)
    return (ref, DDP(ref, process_group=group), ropt), (m, run, opt)


def _reads(rank: int, world: int, root: str) -> dict:
    """A loop that reads ``model.state_dict()`` right after each step (no forward in between),
    saves a checkpoint after step 2, and restores it into a fresh model at the end."""
    from tensortier.checkpoint import Checkpointer

    (ref, rddp, ropt), (m, ddp, opt) = _pair(_model, rank, bucket_size="512B")
    g = torch.Generator().manual_seed(100 + rank)
    report: dict = {"read": []}
    with Checkpointer(root, keep=2, every=1000) as ck:
        for step in range(STEPS):
            _iterate(torch.randn(4, 8, generator=g), (rddp, ropt), (ddp, opt))
            report["read"].append(_same(m.state_dict(), ref.state_dict()))
            if step == 2:
                saved = {k: v.clone() for k, v in ref.state_dict().items()}
                ck.save(step, model=m, optimizer=opt)
                ck.wait()
        fresh = _model()
        fopt = OffloadedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, bucket_size="512B")
        ck.restore(model=fresh, optimizer=fopt, step=2)
        report["restored"] = _same(fresh.state_dict(), saved)
        fopt.close()
    x = torch.randn(4, 8, generator=g)  # a forward after the last step sees its values
    report["forward"] = torch.equal(m(x), ref(x))
    report["final"] = _same(m.state_dict(), ref.state_dict())
    opt.close()
    return report


def test_deferred_gathers_are_written_before_state_dict_checkpoint_and_forward(tmp_path):
    for r in distributed.run(_reads, 2, str(tmp_path)):
        assert r["read"] == [True] * STEPS
        assert r["restored"] is True and r["forward"] is True and r["final"] is True


def _gate_gathers(gate: threading.Event, log: list) -> None:
    """Every all-gather's ``wait()`` blocks until ``gate`` is set (at most 30 s)."""
    for name in ("all_gather_into_tensor", "all_gather_single"):  # whichever torch has
        real = getattr(dist, name, None)
        if real is None:
            continue

        def gated(*a, _real=real, **k):
            work = _real(*a, **k)
            log.append("issued")

            class Gated:
                def wait(self, *wa, **wk):
                    gate.wait(timeout=30)
                    log.append("completed")
                    return work.wait(*wa, **wk)

            return Gated()

        setattr(dist, name, gated)


def _structure(rank: int, world: int) -> dict:
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    assert len(opt._buckets) == 4
    g = torch.Generator().manual_seed(100 + rank)
    gate, log, out = threading.Event(), [], {"returned_before": [], "stale": [], "equal": []}
    _gate_gathers(gate, log)
    for _ in range(3):
        x = torch.randn(4, 64, generator=g)
        _iterate(x, (rddp, ropt))
        ddp(x).square().mean().backward()
        before = [p.detach().clone() for p in m.parameters()]
        gate.clear()
        log.clear()
        opt.step()  # would block 30 s per gather if it waited for one
        out["returned_before"].append("completed" not in log)
        out["stale"].append(all(torch.equal(p, q) for p, q in zip(m.parameters(), before)))
        gate.set()
        opt.zero_grad()  # touches gradients only: nothing waited for
        out["equal"].append(_same(m.state_dict(), ref.state_dict()))  # waits, then equal
    opt.close()
    return out


def test_step_returns_before_the_gathers_complete():
    """Structure, not time: with every gather's completion held back, ``step()`` returns and
    the parameters still hold their old values; once released, they are DDP + fused's."""
    for r in distributed.run(_structure, 2):
        assert r["returned_before"] == [True] * 3
        assert r["stale"] == [True] * 3
        assert r["equal"] == [True] * 3


def _gpt2(rank: int, world: int) -> dict:
    from tests.ecosystem import _hf

    (ref, rddp, ropt), (m, ddp, opt) = _pair(lambda: _hf.build("gpt2"), rank, bucket_size="16KiB")
    g = torch.Generator().manual_seed(100 + rank)
    equal = []
    for _ in range(4):
        ids = torch.randint(0, _hf.VOCAB, (2, _hf.SEQ), generator=g)
        for d, o in ((rddp, ropt), (ddp, opt)):
            d(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
        # the next forward reads the parameters through the hooks; logits compare every layer
        with torch.no_grad():
            equal.append(torch.equal(ddp(input_ids=ids).logits, rddp(input_ids=ids).logits))
    opt.synchronize()  # reading parameters directly: the documented call
    equal.append(all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters())))
    opt.close()
    return {"equal": equal, "buckets": len(opt._buckets)}


def test_hf_gpt2_under_ddp_deferred_matches_fused():
    pytest.importorskip("transformers")
    for r in distributed.run(_gpt2, 2, timeout=180):
        assert r["buckets"] > 2
        assert r["equal"] == [True] * 5


def test_defer_gather_needs_sharded_host_states():
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="defer_gather=True"):
        OffloadedAdamW(_model().parameters(), defer_gather=True)


def _group_count(rank: int, world: int) -> dict:
    import gc

    from tensortier._lifetime import quiesce

    pg_map = dist.distributed_c10d._world.pg_map
    start = len(pg_map)
    counts = {}
    for how in ("close", "collected"):
        (ref, rddp, ropt), (m, ddp, opt) = _pair(_model, rank)
        counts[f"{how}_open"] = len(pg_map) - start  # its gather group
        ddp(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        if how == "close":
            opt.close()
        else:
            del opt, ddp
            gc.collect()
            quiesce()  # the collected optimizer's cleanup runs on the reaper thread
        counts[how] = len(pg_map) - start
    return counts


def test_deferred_optimizer_destroys_its_process_group():
    """Each ``defer_gather=True`` optimizer makes a gloo group for its gathers; closing it, or
    letting it be collected, destroys that group (it used to live until the process ended)."""
    for r in distributed.run(_group_count, 2):
        assert r == {"close_open": 1, "close": 0, "collected_open": 1, "collected": 0}


def _recreated(rank: int, world: int) -> dict:
    """A trainer that builds its optimizer over a DeviceMesh dimension (ranks {0, 1} and {2, 3}),
    trains two steps, drops it and builds the next: closed, then collected at different times on
    the two ranks of a pair (rank 1 still holds the old one while the next is built), closed,
    collected. Per optimizer: its groups open after construction, and bit-identity with DDP +
    fused AdamW over the same group."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    from tensortier._lifetime import quiesce

    dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "dp")).get_group("dp")
    pg_map = dist.distributed_c10d._world.pg_map
    start, late = len(pg_map), []
    g = torch.Generator().manual_seed(100 + rank)
    out: dict = {"open": [], "equal": []}
    for how in ("close", "collected-late", "close", "collected"):
        (ref, rddp, ropt), (m, ddp, opt) = _pair(_model, rank, group=dp)
        out["open"].append(len(pg_map) - start)
        del late[:]  # the previous optimizer, kept alive by rank 1 until this one exists
        gc.collect()
        for _ in range(2):
            _iterate(torch.randn(4, 8, generator=g), (rddp, ropt), (ddp, opt))
        out["equal"].append(_same(m.state_dict(), ref.state_dict()))
        if how == "close":
            opt.close()
        elif how == "collected-late" and rank % 2:
            late += [opt, ddp]
        del opt, ddp
        gc.collect()
        quiesce()  # a collected optimizer's cleanup runs on the reaper thread
    out["left"] = len(pg_map) - start
    return out


def test_optimizers_rebuilt_over_a_subgroup_destroy_their_groups_and_never_hang():
    """A subgroup's gather group used to be kept for the life of the process (one more per
    optimizer); destroyed, torch gave the next one the same name and its rendezvous read the
    destroyed group's addresses: a hang. Now every one is destroyed, none hangs."""
    got = distributed.run(_recreated, 4, timeout=120)
    for rank, r in enumerate(got):
        late = [1, 1, 1 + rank % 2, 1]  # ranks 1 and 3 still hold the collected-late one
        assert r == {"open": late, "equal": [True] * 4, "left": 0}, rank


def _peer_skips_step(rank: int, world: int) -> dict:
    """Rank 1 never calls ``step()`` on an optimizer over a group with a 3 s timeout: rank 0's
    deferred gathers wait for it at most that long, and its next wait raises."""
    import datetime
    import time

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_model, rank, group=group)
    ddp(torch.randn(4, 8)).square().mean().backward()
    out: dict = {}
    if rank == 0:
        start = time.monotonic()
        opt.step()
        with pytest.raises(RuntimeError, match="deferred parameter all-gather failed"):
            opt.synchronize()
        out["waited_under_30s"] = time.monotonic() - start < 30
    opt.close()
    dist.barrier()
    return out


def test_deferred_gathers_wait_at_most_the_groups_timeout():
    """The gather group takes ``process_group``'s timeout (it had torch's default, 30 minutes: a
    rank that never joins held its peers' gathers that long)."""
    assert distributed.run(_peer_skips_step, 2, timeout=90)[0] == {"waited_under_30s": True}


def _seeded(rank: int, world: int) -> dict:
    """Per step: how many masters the update compared with their parameter (a parameter that
    changed since the optimizer last wrote it), and whether the run matches DDP + fused."""
    import tensortier.optim._update as upd

    compared: list[int] = []
    real = upd.Updater._masters

    def counting(bucket, slots, master, seeds, shadow):
        compared[-1] += sum(s is not None for s in seeds or ())
        return real(bucket, slots, master, seeds, shadow)

    upd.Updater._masters = staticmethod(counting)
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x = torch.randn(4, 64, generator=g)
        for d, o in ((rddp, ropt), (ddp, opt)):
            compared.append(0)
            d(x).square().mean().backward()
            o.step()
            o.zero_grad()
        compared.pop(-2)  # the reference's entry
    equal = _same(m.state_dict(), ref.state_dict())
    opt.close()
    return {"compared": compared, "equal": equal}


def test_deferred_gathers_do_not_make_the_next_step_reseed_masters():
    """The parameters the deferred gathers wrote are the optimizer's own writes: the next step
    updates its masters without comparing each with its parameter (only the first step seeds)."""
    for r in distributed.run(_seeded, 2):
        assert r["compared"][0] == 4  # one slot per bucket: every master seeded on step 1
        assert r["compared"][1:] == [0, 0, 0]
        assert r["equal"]


def _order(rank: int, world: int) -> dict:
    """Per step, the sequence of bucket updates (with the thread that ran each) and of gathers
    handed to the gather thread."""
    import tensortier.optim._shard as shard
    import tensortier.optim._update as upd

    events: list = []
    real_update, real_submit = upd.Updater._update, shard.GatherThread.submit

    def update(self, *a):
        events.append(("update", threading.current_thread() is threading.main_thread()))
        return real_update(self, *a)

    def submit(self, *a):
        events.append(("gather", None))
        return real_submit(self, *a)

    upd.Updater._update, shard.GatherThread.submit = update, submit
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    g = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(3):
        x = torch.randn(4, 64, generator=g)
        _iterate(x, (rddp, ropt))
        ddp(x).square().mean().backward()
        events.clear()
        opt.step()
        steps.append(list(events))
        opt.zero_grad()
    equal = _same(m.state_dict(), ref.state_dict())
    opt.close()
    return {"steps": steps, "equal": equal}


def test_deferred_step_updates_on_the_callers_thread_then_hands_the_gathers_over():
    """Structure, not time: the step runs its four bucket updates on the calling thread (no
    worker hand-off) and hands the gathers over only after the last one, so they overlap the
    next forward rather than the updates; results stay DDP + fused's."""
    for r in distributed.run(_order, 2):
        expected = [["update", True]] * 4 + [["gather", None]] * 4
        assert r["steps"] == [expected] * 3
        assert r["equal"]


def _log_gathers(log: list) -> None:
    """Append the issuing thread's name to ``log`` for every all-gather issued."""
    for name in ("all_gather_into_tensor", "all_gather_single"):  # whichever torch has
        real = getattr(dist, name, None)
        if real is None:
            continue

        def logged(*a, _real=real, **k):
            log.append(threading.current_thread().name)
            return _real(*a, **k)

        setattr(dist, name, logged)


def _held(rank: int, world: int) -> dict:
    """Per step: gathers issued by the time ``step()`` and ``zero_grad()`` returned and 0.5 s
    later (nothing read a parameter), then after the next forward began."""
    import time

    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    opt._deferred.thread.hold_s = 60.0  # (default 10 ms) released here by the forward only
    g = torch.Generator().manual_seed(100 + rank)
    log: list = []
    _log_gathers(log)
    out: dict = {"after_step": [], "idle": [], "after_forward": []}
    x = torch.randn(4, 64, generator=g)
    for _ in range(3):
        _iterate(x, (rddp, ropt))
        loss = ddp(x).square().mean()
        out["after_forward"].append(len(log))  # the last step's gathers: the forward released them
        loss.backward()
        log.clear()
        opt.step()
        opt.zero_grad()
        out["after_step"].append(len(log))
        time.sleep(0.5)  # a thread woken by the hand-over would have issued by now
        out["idle"].append(len(log))
        x = torch.randn(4, 64, generator=g)
    out["equal"] = _same(m.state_dict(), ref.state_dict())  # waits: the held gathers run
    opt.close()
    return out


def test_deferred_gathers_start_when_the_next_forward_begins():
    """Structure, not time: the gathers handed over at the end of ``step()`` are held until a
    parameter is read (here the next forward; at most ``hold_s``), so no thread competes with the
    rest of
    ``step()`` and ``zero_grad()`` for the cores and the GIL (2 ranks on 2 cores: the old
    hand-over woke the gather thread inside ``step()``); results stay DDP + fused's."""
    for r in distributed.run(_held, 2):
        assert r["after_step"] == [0, 0, 0]
        assert r["idle"] == [0, 0, 0]
        assert r["after_forward"][1:] == [4, 4], r["after_forward"]  # four buckets
        assert r["equal"]


def _collectives(rank: int, world: int, split: bool) -> dict:
    """All-reduces the caller's thread issues inside each deferred ``step()`` under GradScaler
    (step 2: an overflow on every rank, or with ``split`` on rank 1 only), what each step and
    the wait after it raised, and (without ``split``) whether the run matches DDP + fused."""
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    real, count = dist.all_reduce, [0]

    def counted(*a, **k):
        count[0] += threading.current_thread() is threading.main_thread()
        return real(*a, **k)

    g = torch.Generator().manual_seed(100 + rank)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    out: dict = {"all_reduces": [], "errors": []}
    for step in range(4):
        x = torch.randn(4, 64, generator=g)
        for (d, o), sc in zip(((rddp, ropt), (ddp, opt)), scalers):
            loss = d(x).square().mean() * (float("inf") if step == 2 and rank == 0 else 1.0)
            sc.scale(loss).backward()  # DDP's all-reduce: an overflow reaches every rank
            if split and step == 2 and o is opt:  # gradients that differ between ranks
                for p in m.parameters():
                    p.grad.fill_(1.0 if rank == 0 else float("inf"))
            if o is opt:
                count[0] = 0
                dist.all_reduce = counted
            try:
                sc.step(o)
                if o is opt:
                    out["all_reduces"].append(count[0])
                    dist.all_reduce = real
                    o.synchronize()  # the ranks' check ran on the gather thread
                    out["errors"].append(None)
            except RuntimeError as exc:
                out["errors"].append(str(exc))
            finally:
                dist.all_reduce = real
            sc.update()
            o.zero_grad()
        if split and step == 2:
            break
    out["equal"] = _same(m.state_dict(), ref.state_dict())
    out["skipped"] = opt.stats().skipped_steps
    opt.close()
    return out


def test_deferred_step_issues_no_collective():
    """Structure, not time: a deferred step issues no collective on the caller's thread (the
    ranks' agreement on the branch, sparse or GradScaler's skip, and on failures runs on the
    gather thread ahead of the gathers; it was an all-reduce before the updates and one after,
    each waiting for both ranks' threads); an overflow on every rank still skips the step
    everywhere and the run matches DDP + fused AdamW bit for bit."""
    for r in distributed.run(_collectives, 2, False):
        assert r["all_reduces"] == [0, 0, 0, 0], r["all_reduces"]
        assert r["errors"] == [None] * 4
        assert r["skipped"] == 1
        assert r["equal"]


def test_ranks_that_disagree_on_gradscalers_skip_raise_on_every_rank():
    """Gradients that differ between ranks after DDP (inf on rank 1 only): the ranks take
    different branches; both raise naming the cause at the wait after the step (no rank issues
    the step's gathers: none is left waiting for a peer)."""
    for rank, r in enumerate(distributed.run(_collectives, 2, True)):
        assert r["errors"][:2] == [None, None]
        assert "disagreed on GradScaler" in r["errors"][2], r["errors"]
        updated = "this rank updated" in r["errors"][2]
        assert updated == (rank == 0)


def _sparse(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(64, 16, sparse=True), torch.nn.Linear(16, 16))
    ddp = DDP(m)
    opt = OffloadedAdamW(m.parameters(), lr=1e-2, defer_gather=True)
    ddp(torch.tensor([[1, 2, 3]])).square().mean().backward()
    try:
        opt.step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    opt.zero_grad()
    opt.close()  # no gather left behind on any rank
    return {"error": error}


def test_deferred_step_with_sparse_gradients_raises_on_every_rank():
    for r in distributed.run(_sparse, 2):
        assert r["error"] == "OffloadedAdamW does not support sparse gradients"


def _rank0_reads(rank: int, world: int) -> dict:
    """Rank 0 alone reads the parameters after each step (``synchronize()``, as rank-0-only
    logging does), then every rank meets at a barrier before the next forward."""
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        _iterate(torch.randn(4, 64, generator=g), (rddp, ropt), (ddp, opt))
        if rank == 0:
            opt.synchronize()  # waits for rank 1's gathers: rank 1 reads nothing until the barrier
        dist.barrier()
    equal = _same(m.state_dict(), ref.state_dict())
    opt.close()
    return {"equal": equal}


def test_a_read_on_one_rank_only_does_not_wait_for_the_others_to_read():
    """The held gathers start by themselves after ``hold_s``: rank 0 waiting for them while rank 1
    waits at a barrier completes (held until a read on every rank, it hung until the timeout)."""
    for r in distributed.run(_rank0_reads, 2):
        assert r["equal"]


def _rolled_back(rank: int, world: int) -> dict:
    """A rollback right after a step: ``model.load_state_dict`` of the values after step 1 while
    step 2's gathers are still held (until a parameter is read); the next forward must see the
    loaded values, not step 2's gathered ones written over them."""
    (ref, rddp, ropt), (m, ddp, opt) = _pair(_square_model, rank, bucket_size="16KiB")
    opt._deferred.thread.hold_s = 60.0  # released by a reader only: the order is deterministic
    g = torch.Generator().manual_seed(100 + rank)
    _iterate(torch.randn(4, 64, generator=g), (rddp, ropt), (ddp, opt))
    saved = {k: v.clone() for k, v in ref.state_dict().items()}  # = m's values after step 1
    _iterate(torch.randn(4, 64, generator=g), (rddp, ropt), (ddp, opt))
    m.load_state_dict(saved)
    ref.load_state_dict(saved)
    x = torch.randn(4, 64, generator=g)
    out = {"forward": torch.equal(m(x), ref(x)), "params": _same(m.state_dict(), saved)}
    opt.close()
    return out


def test_a_model_load_state_dict_after_a_step_is_not_overwritten_by_its_gathers():
    for r in distributed.run(_rolled_back, 2):
        assert r == {"forward": True, "params": True}
