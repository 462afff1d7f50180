"""The sizes both reference decoders share: :func:`~tensortier.models.random_batch`, the planner
CLI and the benchmarks build either model from them (``LlamaConfig(**sizes)`` or
``GPTConfig(**sizes)``)."""

from __future__ import annotations

from dataclasses import dataclass

from tensortier.errors import ConfigError


@dataclass
class DecoderConfig:
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256  # longest sequence (positions)
    vocab_size: int = 4096

    def __post_init__(self) -> None:
        """Checked here: a bad size otherwise built a model silently (``n_layer=-1``: no block)
        or failed in its first forward with a reshape error naming none of these fields."""
        name = type(self).__name__
        for field in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, field)
            least = 0 if field == "n_layer" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name}: {field}={value!r}; pass an integer >= {least}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"{name}: n_embd={self.n_embd} is not a multiple of n_head={self.n_head} (each "
                f"head gets n_embd // n_head channels); pass an n_embd that n_head divides"
            )

    def check_length(self, length: int) -> None:
        """A sequence longer than ``block_size`` has no position (an embedding row, a rotary
        angle): say so instead of an index or broadcast error."""
        if length > self.block_size:
            raise ConfigError(
                f"sequence length {length} is longer than block_size={self.block_size}; pass "
                f"shorter sequences or build the model with a larger block_size"
            )
