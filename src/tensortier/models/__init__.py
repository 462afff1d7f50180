"""Small reference models for the demo, benchmarks and tests (no downloads, random data)."""

from tensortier.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
