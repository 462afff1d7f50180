"""sample(seq_len=T): slices inside one episode, R2D2 priorities, padding; max_staleness."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensortier.rl import Prioritized, ReplayBuffer, Uniform, _sequence


def _fill(buf, lengths, rng, chunk=3, version=None):
    """Episodes of ``lengths`` added interleaved in chunks, as concurrent collectors do."""
    cursors = [0] * len(lengths)
    while any(c < n for c, n in zip(cursors, lengths)):
        e = int(rng.choice([i for i, n in enumerate(lengths) if cursors[i] < n]))
        k = min(chunk, lengths[e] - cursors[e])
        steps = list(range(cursors[e], cursors[e] + k))
        buf.extend(
            [{"ep": e, "t": t} for t in steps],
            episode=e,
            step=steps,
            version=version if version is None else [version(e, t) for t in steps],
        )
        cursors[e] += k


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    seq_len=st.integers(1, 6),
    pad=st.booleans(),
    prioritized=st.booleans(),
    seed=st.integers(0, 1000),
    delete=st.integers(0, 5),
)
def test_slices_never_cross_episode_ends(lengths, seq_len, pad, prioritized, seed, delete):
    rng = np.random.default_rng(seed)
    sampler = Prioritized(alpha=0.7) if prioritized else Uniform()
    buf = ReplayBuffer(200, sampler=sampler, seed=seed)
    _fill(buf, lengths, rng)
    idx = buf.indices()
    if prioritized:
        buf.update_priorities(idx, rng.random(len(idx)) + 0.01)
    if delete:  # holes inside episodes end runs too
        del buf[rng.choice(idx, min(delete, len(idx)), replace=False)]
    live = {(it["ep"], it["t"]) for it in buf[buf.indices()]}
    full = any(
        all((e, t + j) in live for j in range(seq_len)) for e, t in live
    )  # some run holds seq_len steps
    if not live or (not full and not pad):  # nothing to slice (deletes may empty the buffer)
        with pytest.raises(IndexError, match="seq_len"):
            buf.sample(8, seq_len=seq_len)
        buf.close()
        return
    b = buf.sample(8, seq_len=seq_len, pad=pad)
    assert b.indices.shape == b.mask.shape == (8, seq_len) and b.weights.shape == (8,)
    ep, t = b.items["ep"], b.items["t"]
    assert ep.shape == (8, seq_len)
    for i in range(8):
        m = int(b.mask[i].sum())
        assert b.mask[i, :m].all() and not b.mask[i, m:].any()  # real steps, then padding
        assert m >= 1 and (pad or m == seq_len)
        assert (ep[i] == ep[i, 0]).all()  # one episode
        assert (np.diff(t[i, :m]) == 1).all()  # consecutive steps
        if m < seq_len:  # padded: the slice reached its run's end, padding repeats the last step
            assert (ep[i, 0], t[i, m - 1] + 1) not in live
            assert (b.indices[i, m:] == b.indices[i, m - 1]).all()
    buf.close()


@settings(max_examples=40, deadline=None)
@given(
    prio=st.lists(st.floats(0, 10), min_size=1, max_size=30),
    cuts=st.lists(st.integers(1, 29), max_size=4),
    seq_len=st.integers(1, 5),
    eta=st.floats(0, 1),
)
def test_slice_priority_is_eta_max_plus_mean(prio, cuts, seq_len, eta):
    p = np.array(prio)
    episode = np.zeros(len(p), np.int64)
    for c in cuts:
        episode[c:] += 1
    step = np.arange(len(p))
    order, left = _sequence.runs(episode, step)
    starts = np.arange(len(p))
    got = _sequence.slice_priorities(p[order], left, starts, seq_len, eta)
    for s in starts:
        k = min(seq_len, int(left[s]))
        w = p[order][s : s + k]
        assert episode[order][s : s + k].tolist() == [episode[order][s]] * k
        assert got[s] == pytest.approx(eta * w.max() + (1 - eta) * w.mean())


def test_slices_are_drawn_by_their_r2d2_priority():
    """Only slices holding a positive-priority step are drawn; weights follow (P/P_min)^-beta."""
    buf = ReplayBuffer(100, sampler=Prioritized(alpha=1.0, beta=0.5), seed=0)
    a = buf.extend([{"t": t} for t in range(6)], episode=0, step=list(range(6)))
    b = buf.extend([{"t": t} for t in range(6)], episode=1, step=list(range(6)))
    buf.update_priorities(np.concatenate([a, b]), np.zeros(12))
    buf.update_priorities([b[2], b[4]], [4.0, 1.0])
    batch = buf.sample(4000, seq_len=2)
    starts = batch.indices[:, 0]
    eta = 0.9
    # slices of episode 1 starting at steps 1, 2, 3, 4 hold a positive step
    expected = {
        b[1]: eta * 4 + 0.1 * 2,  # [0, 4]
        b[2]: eta * 4 + 0.1 * 2,  # [4, 0]
        b[3]: eta * 1 + 0.1 * 0.5,  # [0, 1]
        b[4]: eta * 1 + 0.1 * 0.5,  # [1, 0]
    }
    assert set(starts.tolist()) == set(expected)
    total = sum(expected.values())
    for k, v in expected.items():
        freq = float((starts == k).mean())
        assert abs(freq - v / total) < 0.02  # stratified draws: close to the expectation
    lo = min(expected.values())
    for s, w in zip(starts.tolist(), batch.weights.tolist()):
        assert w == pytest.approx((expected[s] / lo) ** -0.5, rel=1e-5)
    buf.close()


def test_slice_priorities_belong_to_their_own_steps_when_other_items_lack_an_episode():
    """Items added without episode/step sit among the live slots; the slices' priorities must
    still come from the slices' own steps (they were shifted onto the wrong items before)."""
    buf = ReplayBuffer(100, sampler=Prioritized(alpha=1.0), seed=0)
    lone = buf.add({"t": -1})  # no episode: never in a slice, but a live slot before the others
    a = buf.extend([{"t": t} for t in range(2)], episode=0, step=[0, 1])
    b = buf.extend([{"t": t} for t in range(2)], episode=1, step=[0, 1])
    buf.update_priorities([lone, *a, *b], [5.0, 0.0, 0.0, 1.0, 1.0])
    batch = buf.sample(500, seq_len=2)
    # episode 0's steps have priority 0: its slice is never drawn while episode 1's can be
    assert set(batch.indices[:, 0].tolist()) == {int(b[0])}
    np.testing.assert_array_equal(batch.weights, np.ones(500, np.float32))
    buf.close()


def test_max_staleness_excludes_old_items():
    buf = ReplayBuffer(200, sampler=Prioritized(), seed=0)
    for v in range(10):
        buf.extend([{"v": v, "t": t} for t in range(5)], episode=v, step=list(range(5)), version=v)
    buf.extend([{"v": -1, "t": 0}])  # no version: excluded when filtering by staleness
    assert buf.policy_version == 9
    b = buf.sample(500, max_staleness=2)
    assert set(b.items["v"].tolist()) == {7, 8, 9}
    b = buf.sample(200, seq_len=3, max_staleness=0)
    assert (b.items["v"] == 9).all() and b.items["t"].shape == (200, 3)
    buf.policy_version = 20  # the learner moved on: nothing is fresh enough
    with pytest.raises(IndexError, match="max_staleness 5"):
        buf.sample(4, max_staleness=5)
    assert set(buf.sample(300).items["v"].tolist()) == set(range(-1, 10))  # no filter
    buf.close()


def test_episode_step_version_survive_save_load_and_checkpoint(tmp_path):
    buf = ReplayBuffer(50, sampler=Prioritized(), seed=0)
    buf.extend([{"t": t} for t in range(4)], episode=3, step=[0, 1, 2, 3], version=7)
    buf.save(tmp_path / "saved")
    back = ReplayBuffer.load(tmp_path / "saved", seed=0)
    assert back.policy_version == 7
    assert back.sample(10, seq_len=4).items["t"].tolist() == [[0, 1, 2, 3]] * 10
    back.close()
    buf.close()
    d = str(tmp_path / "durable")
    dur = ReplayBuffer(50, durable=True, spill_dir=d)
    dur.extend([{"t": t} for t in range(3)], episode=1, step=[0, 1, 2], version=2)
    dur.checkpoint()
    dur.extend([{"t": 9}], episode=1, step=3)
    dur.close()  # close checkpoints: everything is kept
    again = ReplayBuffer(50, durable=True, spill_dir=d, seed=0)
    assert again.sample(5, seq_len=4).items["t"].tolist() == [[0, 1, 2, 9]] * 5
    assert again.policy_version == 2
    again.close()


def test_bad_sequence_arguments_are_refused():
    buf = ReplayBuffer(10)
    with pytest.raises(ValueError, match="episode must be an int >= 0"):
        buf.add({"x": 1}, episode=-2)
    with pytest.raises(ValueError, match="one such int per item"):
        buf.extend([{"x": 1}, {"x": 2}], step=[1, 2, 3])
    buf.add({"x": 1}, episode=0, step=0)
    with pytest.raises(ValueError, match="seq_len must be"):
        buf.sample(1, seq_len=0)
    with pytest.raises(ValueError, match="max_staleness must be"):
        buf.sample(1, max_staleness=-1)
    assert len(buf) == 1
    buf.close()
