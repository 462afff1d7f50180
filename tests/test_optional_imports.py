"""Every test module imports where the optional packages are missing, as on the GPU machine's
image (no ray, datasets, pyarrow, lmdb, deepspeed, torchrl): a test that needs one skips, never
errors, so a collection error there is a real one (issue 25)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONAL = ("ray", "datasets", "pyarrow", "lmdb", "deepspeed", "torchrl", "gymnasium")
# None in sys.modules: `import ray` raises ModuleNotFoundError and importlib.util.find_spec gives
# None, as if not installed (transformers probes for deepspeed that way)
COLLECT = f"""
import sys
import pytest

sys.modules.update(dict.fromkeys({OPTIONAL!r}))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
"""


@pytest.mark.slow
def test_every_test_module_imports_without_the_optional_packages():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "could not import 'ray'" in proc.stdout  # the finder did hide them
