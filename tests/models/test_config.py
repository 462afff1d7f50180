import pytest
import torch

from tensortier.errors import ConfigError
from tensortier.models import GPT, GPTConfig, Llama, LlamaConfig, random_batch

SIZES = dict(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)


@pytest.mark.parametrize("config", [GPTConfig, LlamaConfig])
@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(n_layer=-1), "n_layer=-1"),  # built a model without blocks, silently
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(n_head=0), "n_head=0"),
        (dict(n_embd=8.0), "n_embd=8.0"),
        (dict(block_size=True), "block_size=True"),
        (dict(n_head=3, n_embd=20), "n_embd=20 is not a multiple of n_head=3"),
    ],
)
def test_a_bad_size_is_refused_naming_the_field(config, bad, match):
    """Heads not dividing ``n_embd`` failed in the first forward with torch's "shape '[1, 8, 4,
    7]' is invalid for input of size 240"."""
    sizes = {**SIZES, **bad}
    if "n_embd" in bad and "n_head" not in bad:
        sizes["n_head"] = 1
    with pytest.raises(ConfigError, match=match):
        config(**sizes)


def test_llama_refuses_an_odd_head_size_and_bad_rotary_settings():
    with pytest.raises(ConfigError, match="head size .* 3 is odd"):
        LlamaConfig(**{**SIZES, "n_embd": 6})
    with pytest.raises(ConfigError, match="rope_theta"):
        LlamaConfig(**SIZES, rope_theta=0.0)
    with pytest.raises(ConfigError, match="dropout"):
        GPTConfig(**SIZES, dropout=1.0)
    assert LlamaConfig(**{**SIZES, "n_layer": 0}).n_layer == 0  # embeddings only: allowed


@pytest.mark.parametrize("model", [GPT, Llama])
def test_a_sequence_longer_than_block_size_names_block_size(model):
    """GPT raised an IndexError from the position embedding, Llama a broadcast error."""
    cfg = (GPTConfig if model is GPT else LlamaConfig)(**SIZES)
    net = model(cfg)
    idx, _ = random_batch(cfg, 1)
    assert net(idx).shape == (1, 8, 16)  # block_size itself is fine
    with pytest.raises(ConfigError, match="length 9 is longer than block_size=8"):
        net(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ConfigError, match="block_size=8"):
        random_batch(cfg, 1, seq=9)
