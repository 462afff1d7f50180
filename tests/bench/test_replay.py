import json
import subprocess
import sys

import pytest

from benchmarks._common import child_env
from tests._helpers import run_benchmark


@pytest.mark.slow
def test_bench_replay_runs_peers_and_writes_ratios(tmp_path):
    data = run_benchmark(
        tmp_path / "replay.json",
        "replay --quick --items 600 --batches 4 --rounds 2 --item-bytes 2KB --spill-items 800 "
        "--spill-budget 256KiB --skip torchrl,rllib,ray,sharded,params,nodes",
        tmp_path,
    )
    rows = {(r["section"], r["peer"]): r for r in data["rows"]}
    assert {("main", "tensortier"), ("main", "deque"), ("spill", "tensortier")} <= set(rows)
    main_row = rows[("main", "tensortier")]
    assert "error" not in main_row and main_row["add_per_s"] > 0 and main_row["peak_rss"] > 0
    assert rows[("spill", "tensortier")]["stats"]["disk_items"] > 0
    assert "vs_deque_sample_items_per_s" in data["ratios"]
    # the main run's peers interleaved in rounds, ratios within a round, medians in the rows
    m = data["measurement"]
    assert m["order"] == ["tensortier", "deque"] * 2
    ratio = m["ratios"]["vs_deque_add_per_s"]
    assert len(ratio["per_round"]) == 2 and data["ratios"]["vs_deque_add_per_s"] == ratio["median"]
    assert main_row["add_per_s"] == main_row["add_per_s_stats"]["median"]


PARENT = """
import json, sys
from benchmarks.replay import _run_peer
big = bytearray(600 << 20)
for i in range(0, len(big), 4096):
    big[i] = 1
del big
print(json.dumps(_run_peer(sys.executable, "deque", 50, 100, 8, 2, sys.argv[1])))
"""


def test_a_peer_reports_its_own_peak_rss_not_its_parents(tmp_path):
    """A replay peer's ``peak_rss`` is its own process's: ``ru_maxrss`` after the driver's
    vfork + exec was the driver's high-water mark (a deque of 50 small items read 600+ MiB)."""
    out = subprocess.run(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < row["peak_rss"] < 300 << 20  # numpy + psutil + 50 items: tens of MiB


@pytest.mark.parametrize("module", ["replay_sharded", "params_nodes"])
def test_a_section_run_alone_records_the_load(module, tmp_path, monkeypatch):
    """``python -m benchmarks.replay_sharded`` / ``.params_nodes`` wrote no load (the first only
    its end's load average): no measurement block, no noise verdict."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    row = {"section": "s", "peer": "p"}
    if module == "replay_sharded":
        monkeypatch.setattr(mod, "sharded_section", lambda *a: ([row], {"r": 1.0}))
    else:
        monkeypatch.setattr(mod, "section", lambda sizes, rounds: [row])
    out = tmp_path / "s.json"
    mod.main(["--quiet-wait", "0", "--json", str(out)])
    m = json.loads(out.read_text())["measurement"]
    assert m["load_before"]["cpus"] > 0 and m["load_after"] and m["noisy"] is True
    assert "1 round: spread unknown" in m["noisy_reasons"]


def test_a_shard_limiter_out_of_its_error_buffer_fails_the_run(tmp_path, monkeypatch):
    """``replay_sharded``'s error-buffer check was a ratio in the JSON: a rate limiter whose
    ``diff`` left ``[min_diff, max_diff]`` still exited 0. It now exits non-zero after the JSON."""
    from benchmarks import replay_sharded

    ratios = {"sharded_ratelimit_within_error_buffer": 0.0}
    monkeypatch.setattr(replay_sharded, "sharded_section", lambda *a: ([{"peer": "p"}], ratios))
    out = tmp_path / "s.json"
    with pytest.raises(SystemExit, match="inside the error buffer"):
        replay_sharded.main(["--quiet-wait", "0", "--json", str(out)])
    assert json.loads(out.read_text())["ratios"] == ratios


def test_the_replay_runs_checks_fail_it(tmp_path, monkeypatch):
    """``replay`` exited 0 whatever its checks said: the rate-limited drift, the shards' error
    buffer, the disk tier's read-back."""
    import argparse

    from benchmarks import replay, replay_sharded

    def peer(python, name, n, *a, **kw):
        if name == "tensortier-ratelimited":
            return {"samples_per_insert": 8.0, "max_drift_items": 5000, "allowed_drift_items": 2048}
        return {"add_per_s": 1.0, "sample_items_per_s": 1.0, "update_items_per_s": 1.0}

    monkeypatch.setattr(replay, "_run_peer", peer)
    monkeypatch.setattr(replay, "_main_peers", lambda *a: {"tensortier": sys.executable})
    monkeypatch.setattr(replay, "_ray_sections", lambda *a: None)
    p = argparse.ArgumentParser()
    replay.add_args(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--quick", "--spill-items", "0", "--quiet-wait", "0", "--json", str(out)])
    with pytest.raises(SystemExit, match="drift stayed inside"):
        replay.run(args)
    assert json.loads(out.read_text())["ratios"]["ratelimit_drift_within_buffer"] == 0.0
    assert replay._checks([], {"sharded_ratelimit_within_error_buffer": 1.0}) == {
        "the rate-limited shards kept diff inside the error buffer": True
    }
    assert replay_sharded.checks({}) == {}


@pytest.mark.parametrize("peer", ["deque", "rllib", "torchrl"])
def test_every_peer_extends_and_collates_its_samples_as_tensortier(peer, tmp_path, monkeypatch):
    """RLlib's sample returned a list of episodes (tensortier's and TorchRL's a stacked batch),
    and only tensortier's ``extend`` was measured: the peers now do the same work."""
    from benchmarks import _replay_peers as rp

    if rp.missing(peer):
        pytest.skip(rp.missing(peer))
    real, calls = rp.collate, []
    monkeypatch.setattr(rp, "collate", lambda items: calls.append(len(items)) or real(items))
    out = rp.PEERS[peer](1200, 64, 16, 3, str(tmp_path))
    assert out["extend_items_per_s"] > 0 and out["extend_steady_gb_per_s"] > 0
    if peer != "torchrl":  # TorchRL's sample is a stacked TensorDict already
        assert calls == [16] * 3


def test_collate_stacks_every_field():
    import numpy as np

    from benchmarks._replay_peers import collate

    got = collate([{"obs": np.zeros(3, np.uint8), "action": 1, "reward": 0.5}] * 2)
    assert got["obs"].shape == (2, 3) and got["action"].tolist() == [1, 1]
    assert got["reward"].dtype == np.float64


def test_a_peer_that_is_not_installed_says_so_with_no_figures(tmp_path, monkeypatch, capsys):
    """A peer whose library does not load ended as an exit code's traceback (RLlib) or had no
    row at all (TorchRL without its venv); its row now says ``not installed`` and holds no
    figures."""
    import argparse

    from benchmarks import _replay_peers as rp
    from benchmarks import replay

    monkeypatch.setitem(rp.NEEDS, "deque", ("tt_no_such_module",))
    rp.main(["deque", "10", "8", "2", "1", str(tmp_path)])
    got = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    assert got == {"error": got["error"], "not_installed": True}
    assert got["error"].startswith("not installed: tt_no_such_module")

    def peer(python, name, *a, **kw):
        return {"add_per_s": 1.0, "extend_items_per_s": 1.0, "sample_items_per_s": 1.0,
                "update_items_per_s": 1.0}  # fmt: skip

    monkeypatch.setattr(replay, "_run_peer", peer)
    monkeypatch.setattr(replay, "_torchrl_python", lambda d: (None, "its venv did not build"))
    p = argparse.ArgumentParser()
    replay.add_args(p)
    argv = ["--quick", "--spill-items", "0", "--skip", "rllib,ratelimit,ray,sharded,params,nodes"]
    out = tmp_path / "r.json"
    replay.run(p.parse_args([*argv, "--quiet-wait", "0", "--json", str(out)]))
    rows = {r["peer"]: r for r in json.loads(out.read_text())["rows"] if r["section"] == "main"}
    assert rows["torchrl"]["error"] == "not installed: its venv did not build"
    assert "add_per_s" not in rows["torchrl"] and rows["deque"]["add_per_s"] == 1.0


def test_a_reader_that_gets_another_version_fails_the_params_nodes_run(tmp_path, monkeypatch):
    """The readers' latency counted any version that arrived (a stale one too): nothing
    checked what they read. Each reader now returns its tensors' first values, and a reader
    that did not read the version just published fails the run after the JSON."""
    import numpy as np

    from benchmarks import params_nodes as pn
    from tensortier.rl import param_nodes

    _, firsts = pn.Reader().set_weights(param_nodes.encode(pn._state(64, 3)))  # raw bytes
    assert pn._touch(list(pn._state(64, 3).values())) == firsts  # the served path's float32
    assert pn._is_version(firsts, 3) and not pn._is_version(firsts, 2)
    assert not pn._is_version([3.0, 4.0, 5.0, np.float32(7.0)], 3)
    row = {"section": "params-nodes", "peer": "p", "bytes": 64, "intact": False}
    monkeypatch.setattr(pn, "section", lambda sizes, rounds: [row])
    out = tmp_path / "pn.json"
    with pytest.raises(SystemExit, match="read the version just published"):
        pn.main(["--quiet-wait", "0", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == [row]
