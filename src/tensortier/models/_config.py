"""The sizes both reference decoders share: :func:`~tensortier.models.random_batch`, the planner
CLI and the benchmarks build either model from them (``LlamaConfig(**sizes)`` or
``GPTConfig(**sizes)``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecoderConfig:
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256  # longest sequence (positions)
    vocab_size: int = 4096
