"""`tensortier catalog build|info|verify`."""

import json

import pytest

from tensortier.cli import main
from tensortier.data import Catalog


def test_build_info_verify_from_lines_and_files(tmp_path, capsys):
    names = tmp_path / "names.txt"
    names.write_text("".join(f"images/{i:05d}.jpg\n" for i in range(500)))
    out = tmp_path / "by-lines"
    assert main(["catalog", "build", str(out), "--lines", str(names), "--quiet"]) == 0
    assert "500 records" in capsys.readouterr().out
    assert Catalog.open(out)[7] == "images/00007.jpg"
    assert main(["catalog", "info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 500
    assert main(["catalog", "verify", str(out), "--quiet"]) == 0
    assert "OK: 500 records" in capsys.readouterr().out

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.bin").write_bytes(b"\x00\x01")
    (src / "y.bin").write_bytes(b"yy")
    files = tmp_path / "by-files"
    assert main(["catalog", "build", str(files), "--files", f"{src}/**/*.bin", "--quiet"]) == 0
    cat = Catalog.open(files)
    assert [r["data"] for r in cat[:]] == [b"\x00\x01", b"yy"]
    assert cat[0]["path"].endswith("x.bin")


def test_verify_reports_damage_and_exits_1(tmp_path, capsys):
    out = tmp_path / "c"
    Catalog.build(out, [b"x" * 100] * 20).close()
    seg = next(out.glob("seg-*.ttr"))
    data = bytearray(seg.read_bytes())
    data[-10] ^= 1  # inside the last record
    seg.write_bytes(bytes(data))
    assert main(["catalog", "verify", str(out), "--quiet"]) == 1
    text = capsys.readouterr().out
    assert "record 19 in" in text and "DAMAGED (1 records)" in text
    assert main(["catalog", "info", str(tmp_path / "none")]) == 2
    assert "no catalog" in capsys.readouterr().err


def _rows() -> list[dict]:
    return [
        {"id": i, "text": f"t{i}", "ids": list(range(i % 4)), "ok": i % 2 == 0} for i in range(50)
    ]


def test_build_from_jsonl(tmp_path):
    rows = _rows()
    src = tmp_path / "rows.jsonl"
    src.write_text(
        "\n".join(json.dumps(r) for r in rows[:20])
        + "\n\n"
        + "\n".join(json.dumps(r) for r in rows[20:])
    )  # a blank line is skipped
    assert main(["catalog", "build", str(tmp_path / "j"), "--jsonl", str(src), "--quiet"]) == 0
    got = Catalog.open(tmp_path / "j")[:]
    assert len(got) == 50 and got[7]["text"] == "t7" and got[7]["ok"] is False
    assert [g["ids"].tolist() for g in got] == [r["ids"] for r in rows]


def test_build_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")  # the GPU machine's image has none
    import pyarrow.parquet as pq

    rows = _rows()
    for k in range(2):
        pq.write_table(
            pa.Table.from_pylist(rows[25 * k : 25 * (k + 1)]), tmp_path / f"p{k}.parquet"
        )
    pattern = str(tmp_path / "p*.parquet")
    assert main(["catalog", "build", str(tmp_path / "q"), "--parquet", pattern, "--quiet"]) == 0
    got = Catalog.open(tmp_path / "q")[:]
    assert [g["id"] for g in got] == list(range(50)) and got[9]["ids"].tolist() == [0]


def test_build_from_npy(tmp_path):
    import numpy as np

    feats = tmp_path / "feats"
    feats.mkdir()
    arrays = [np.full((i + 1, 3), i, np.float32) for i in range(5)]
    for i, a in enumerate(arrays):
        np.save(feats / f"{i:03d}.npy", a)
    assert main(["catalog", "build", str(tmp_path / "n"), "--npy", str(feats), "--quiet"]) == 0
    got = Catalog.open(tmp_path / "n")[:]
    assert all(
        np.array_equal(g["data"], a) and g["data"].dtype == a.dtype for g, a in zip(got, arrays)
    )
    assert got[2]["path"].endswith("002.npy")
    tokens = np.arange(40, dtype=np.int32).reshape(10, 4)
    np.save(tmp_path / "tokens.npy", tokens)
    out = tmp_path / "rows"
    assert (
        main(["catalog", "build", str(out), "--npy", str(tmp_path / "tokens.npy"), "--quiet"]) == 0
    )
    assert all(np.array_equal(g, t) for g, t in zip(Catalog.open(out)[:], tokens))


def test_build_with_mode_644_shares_every_file(tmp_path):
    import os
    import stat

    names = tmp_path / "n.txt"
    names.write_text("a\nb\n")
    out = tmp_path / "c"
    assert (
        main(["catalog", "build", str(out), "--lines", str(names), "--mode", "644", "--quiet"]) == 0
    )
    assert {stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)} == {0o644}
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755


def test_bad_input_exits_2_naming_it_and_leaves_no_catalog(tmp_path, capsys, monkeypatch):
    out = tmp_path / "c"
    assert main(["catalog", "build", str(out), "--files", f"{tmp_path}/none/*.bin", "--quiet"]) == 2
    assert f"--files '{tmp_path}/none/*.bin' matches no file" in capsys.readouterr().err
    assert not out.exists()  # no empty catalog

    text = tmp_path / "latin1.txt"
    text.write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    assert main(["catalog", "build", str(out), "--lines", str(text), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        f"line 2 of {text} is not UTF-8 (byte 0xe9 at column 4)" in err and "Traceback" not in err
    )
    assert not out.exists()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": {"nested": 1}}\n')
    assert main(["catalog", "build", str(out), "--jsonl", str(bad), "--quiet"]) == 2
    assert f"line 2 of {bad}: field 'a' is a nested object" in capsys.readouterr().err
    bad.write_text('{"a": 1}\n{"a": [1, "x"]}\n')
    assert main(["catalog", "build", str(out), "--jsonl", str(bad), "--quiet"]) == 2
    assert (
        f"line 2 of {bad}: field 'a' is a list that is not all numbers" in capsys.readouterr().err
    )
    bad.write_text('{"a": 1}\nnot json\n')
    assert main(["catalog", "build", str(out), "--jsonl", str(bad), "--quiet"]) == 2
    assert f"line 2 of {bad} is not JSON" in capsys.readouterr().err
    assert main(["catalog", "build", str(out), "--npy", str(tmp_path), "--quiet"]) == 2
    assert "holds no .npy file" in capsys.readouterr().err
    assert not out.exists()

    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # pyarrow not installed
    assert main(["catalog", "build", str(out), "--parquet", str(tmp_path / "x.parquet")]) == 2
    assert "pip install 'tensortier[catalog]'" in capsys.readouterr().err
    assert not out.exists()
