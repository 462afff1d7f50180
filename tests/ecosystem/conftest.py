"""Ecosystem suite: tensortier used the way users use it, with third-party code nobody here wrote.

Every model is built from a config (no downloads): the Hugging Face libraries are forced offline
and their cache points at a private temporary directory, removed when the session ends.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
import torch

from tensortier._lifetime import quiesce

_CACHES = tempfile.mkdtemp(prefix="tt-eco-")
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": os.path.join(_CACHES, "hf"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(_CACHES, "inductor"),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
    }
)


def pytest_unconfigure(config):
    shutil.rmtree(_CACHES, ignore_errors=True)


@pytest.fixture
def spill_dir(tmp_path):
    """As ``tests/conftest.py``'s (empty again when the test ends), but a full garbage
    collection (a quarter second with torch and transformers loaded) runs only when files are
    still there: these tests close what they open."""
    d = tmp_path / "spill"
    d.mkdir()
    yield str(d)
    quiesce()
    if os.listdir(d):
        gc.collect()  # stores dropped without close() are cleaned up by the reaper thread
        quiesce()
    leftovers = os.listdir(d)
    assert leftovers == [], f"files left behind in the spill directory: {leftovers}"


@pytest.fixture(autouse=True, scope="session")
def _warm_model_kernels(_warm_cpu_kernels):
    """The activations of the models below run once on every intra-op thread before any compare
    (see ``tests/conftest.py``: the first parallel call of a float kernel may differ)."""
    x = torch.randn(256, 256, requires_grad=True)
    for f in (
        torch.nn.functional.silu,
        torch.nn.functional.gelu,
        lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        torch.erf,
        torch.rsqrt,
        lambda t: t.pow(3),
        lambda t: torch.nn.functional.layer_norm(t, (256,)),
        lambda t: torch.nn.functional.dropout(t, 0.1),
        lambda t: torch.nn.functional.cross_entropy(t, torch.zeros(256, dtype=torch.long)),
    ):
        f(x).sum().backward()
    yield
