"""Small reference models for the demo, benchmarks and tests (no downloads, random data)."""

from tensortier.models.gpt import GPT, GPTConfig, random_batch
from tensortier.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "random_batch"]
