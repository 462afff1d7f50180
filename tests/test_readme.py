"""Every ```python block of README.md runs as written (issue 23 #4: two of them did not).

Each block runs in a fresh Python process whose working directory is a new temporary directory
(so relative paths such as ``"ckpts/"`` land there), after :data:`PREAMBLE`, which defines, tiny,
the names the README leaves to the reader: ``model`` (the package's GPT returning an object with
``.loss``, as a Hugging Face model does), ``batch``, ``loader``, ``activation``, ``opt``,
``sched``, RL transitions, catalog records, ranks. The absolute paths that stand for the reader's
disks are replaced by directories under the temporary one (:data:`PATHS`); any other absolute
path fails the test, so a new one gets a mapping instead of writing outside the sandbox.

A block that uses Ray (``ray.``, ``tt.rl.serve(``, ``RemoteStore(``) connects to a local cluster
of simulated nodes this module starts (``RAY_ADDRESS``; ``tests/ray_cluster.py``, removed at the
end); a block that calls ``dist.init_process_group()`` runs under ``torchrun`` with the two ranks
its comment names. After each block the spill directories must be empty again.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

PREAMBLE = '''
import types
import numpy as np
import torch
import tensortier as tt
from tensortier.models.gpt import GPT, GPTConfig, random_batch

class LM(GPT):
    """The package's GPT, called like a Hugging Face model: model(batch).loss."""
    def forward(self, batch):
        return types.SimpleNamespace(loss=super().forward(*batch))

torch.manual_seed(0)
cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128)
model = LM(cfg)
batch = random_batch(cfg, 4)                                   # (tokens, next tokens)
loader = [batch, random_batch(cfg, 4, seed=1)]
loader_state = {"epoch": 0, "position": 0}
total_steps = 3
activation = torch.randn(256, 1024)                            # 1 MiB
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
obs, a, r = np.zeros(8, np.float32), 1, 0.5                    # one transition
item = {"obs": obs, "action": a, "reward": r}
td_error = torch.rand(256)                                     # a learner's, per sampled item
episodes, policy_version = [[item] * 250] * 4, 1               # 4 episodes of 250 steps
td = torch.rand(64, 80)                                        # per step of 64 slices of 80
items = [item] * 512
records = [f"record {i}".encode() for i in range(1000)]
rank, world_size = 0, 1
'''

# the reader's disks -> directories under the block's temporary directory (made before it runs)
PATHS = {
    "/mnt/nvme/tt": "mnt/nvme/tt",
    "/data/rb": "data/rb",
    "/data/meta": "data/meta",
    "/data/meta-tok": "data/meta-tok",
}
SPILL_DIRS = ("mnt/nvme/tt", "data/rb")  # must exist before, and be empty after, every block
RAY = re.compile(r"\bray\.|tt\.rl\.serve\(|RemoteStore\(")
TORCHRUN = "dist.init_process_group()"
# packages a block may import that are optional (the GPU machine's image has none of them)
OPTIONAL = re.compile(r"^\s*(?:import|from)\s+(datasets|pyarrow|lmdb|deepspeed|torchrl)\b", re.M)


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of README.md."""
    out, start, code = [], None, []
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if start is None and line.strip() == "```python":
            start, code = n + 1, []
        elif start is not None and line.strip() == "```":
            out.append((start, "\n".join(code) + "\n"))
            start = None
        elif start is not None:
            code.append(line)
    return out


def printed_literals(code: str) -> list:
    """The values a block shows as ``print(...)  # <a Python literal>`` (a list may end in
    ``...``: its other items must be printed); the block must print each so."""
    shown = []
    for line in code.splitlines():
        m = re.match(r"\s*print\(.*\)\s*#\s*(.+)$", line)
        if m is None:
            continue
        try:
            value = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):  # prose, not an output
            continue
        if value is not ...:
            shown.append(value)
    return shown


def test_printed_literals_reads_only_outputs():
    code = "print(a)   # ['x:0', 'y:0']\nprint(b)  # ['x', ...]\nprint(c)  # bytes per tier\n"
    assert printed_literals(code) == [["x:0", "y:0"], ["x", ...]]
    code = 'print(d)  # {"kind": "offloader", "n": ..., ...}\n'
    assert printed_literals(code) == []


def _sandboxed(code: str, tmp: pathlib.Path) -> str:
    paths = set(re.findall(r"""["'](/[^"']*)["']""", code))
    assert paths <= set(PATHS), f"absolute paths {paths - set(PATHS)}: add them to PATHS"
    for path, rel in PATHS.items():
        code = code.replace(f'"{path}"', repr(str(tmp / rel)))
    return code


@pytest.fixture(scope="module")
def ray_address():
    """A local cluster of a head and two memory nodes (1 GiB object stores, lazily backed)."""
    pytest.importorskip("ray")
    from tests.ray_cluster import local_cluster

    with local_cluster(workers=2, store=1 << 30) as lc:
        yield lc.cluster.address, lc.tmp


def test_the_readme_has_the_blocks_this_test_knows():
    blocks = python_blocks()
    assert len(blocks) >= 11
    assert sum(bool(RAY.search(code)) for _, code in blocks) >= 3
    assert sum(TORCHRUN in code for _, code in blocks) == 1


def _cases() -> list:
    """One case per block, named by its line; Ray and torchrun blocks are marked slow."""
    return [
        pytest.param(
            line,
            code,
            id=f"line{line}",
            marks=[pytest.mark.slow] if RAY.search(code) or TORCHRUN in code else [],
        )
        for line, code in python_blocks()
    ]


@pytest.mark.parametrize("line,code", _cases())
def test_readme_block_runs(line, code, tmp_path, request):
    for rel in SPILL_DIRS:
        (tmp_path / rel).mkdir(parents=True)
    script = tmp_path / "block.py"
    script.write_text(PREAMBLE + f"\n# README.md line {line}\n" + _sandboxed(code, tmp_path))
    path = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script)]
    for name in OPTIONAL.findall(code):
        pytest.importorskip(name)
    if RAY.search(code):
        address, ray_tmp = request.getfixturevalue("ray_address")
        env.update(RAY_ADDRESS=address, RAY_TMPDIR=ray_tmp)
    if TORCHRUN in code:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README.md block at line {line} failed:\n{proc.stderr[-4000:]}"
    for shown in printed_literals(code):  # `print(x)  # [...]`: the output the README shows
        parts = [p for p in shown if p is not ...] if ... in shown else [shown]  # elided list
        missing = [p for p in parts if repr(p) not in proc.stdout]
        assert not missing, f"line {line} shows {shown!r}, printed:\n{proc.stdout}"
    for rel in SPILL_DIRS:
        assert os.listdir(tmp_path / rel) == [], f"block at line {line} left files in {rel}"
