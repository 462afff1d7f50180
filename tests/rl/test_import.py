import subprocess
import sys


def test_import_tensortier_does_not_import_ray_or_rl():
    code = (
        "import sys, tensortier as tt; assert 'ray' not in sys.modules; "
        "assert 'tensortier.rl' not in sys.modules; tt.rl.ReplayBuffer; "
        "assert 'ray' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_old_segments_import_path_still_works():
    """Scripts written before the move to tiers/ (the reliability reproducers) import it."""
    from tensortier.rl._segments import REC, Segments
    from tensortier.tiers import segments

    assert REC is segments.REC and Segments is segments.Segments
