"""`tensortier catalog build|info|verify`."""

import json

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
