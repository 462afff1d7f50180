"""A small Llama-style decoder, readable top to bottom (no downloads, random weights).

Same block as Meta's Llama: pre-RMSNorm, rotary position embeddings on queries and keys, causal
self-attention, a SwiGLU MLP (``w2(silu(w1 x) * w3 x)``), untied input and output embeddings.
Written with plain ops, like :mod:`tensortier.models.gpt`, so every activation is an ordinary
saved tensor: the norms, the rotary products and the gating save many cheap elementwise
intermediates beside the matmul inputs, which is where selective recompute pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tensortier.errors import ConfigError
from tensortier.models._config import DecoderConfig


@dataclass
class LlamaConfig(DecoderConfig):
    multiple_of: int = 64  # the MLP width is rounded up to this
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"LlamaConfig: head size n_embd // n_head = {self.n_embd // self.n_head} is odd; "
                f"rotary embeddings rotate pairs of channels: pass an even head size"
            )
        if self.multiple_of < 1 or not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(
                f"LlamaConfig: multiple_of={self.multiple_of!r}, norm_eps={self.norm_eps!r}, "
                f"rope_theta={self.rope_theta!r}; pass multiple_of >= 1 and positive norm_eps "
                f"and rope_theta"
            )

    @property
    def hidden(self) -> int:
        h = int(2 * (4 * self.n_embd) / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = (
            w(x).view(B, T, self.n_head, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.feed_forward = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        hd = cfg.n_embd // cfg.n_head
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(cfg.block_size).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the mean cross-entropy loss when ``targets`` is given, else the logits."""
        T = idx.size(1)
        self.cfg.check_length(T)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
