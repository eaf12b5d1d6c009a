"""Logits processing, defined once and applied identically to target and draft distributions.

Order (as in HF ``generate``): temperature → top-k → top-p. ``temperature == 0`` means greedy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def scale_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits / T in float32, as a product with the float32 reciprocal.

    Why not ``/ T``: PyTorch's CUDA kernel already turns division by a scalar into this product while
    the CPU divides, and the two differ in the last bit for ~10% of values. A product is rounded the
    same everywhere (CPU, CUDA, the fused kernel), so the top-k/top-p cut, which compares these
    values, keeps the same tokens, ties included, on every backend.
    """
    return logits.float() * (1.0 / cfg.temperature)


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Return processed logits (masked entries = -inf) for sampling mode. Works on [..., V]."""
    x = scale_logits(logits, cfg)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution a token is drawn from (sampling) or scored against (greedy: plain softmax).

    In greedy mode the *token* is the argmax; the softmax at temperature 1 is only used for
    statistics such as the TV distance of block-divergence rewards.
    """
    if cfg.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return torch.softmax(process_logits(logits, cfg), dim=-1)


def sample_from(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from rows of ``p`` with explicit uniforms ``u`` in [0, 1) (same shape minus V).

    Explicit uniforms let a fused kernel and this reference be compared draw for draw.
    """
    cdf = torch.cumsum(p, dim=-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, (u.unsqueeze(-1) * total).contiguous(), right=True).squeeze(-1)
    # u·total rounded up to the total (or u = 1): fall back to the last token with mass, never to a
    # zero-probability tail token (V - 1 only for a row without mass)
    V = p.shape[-1]
    last = torch.where(p > 0, torch.arange(V, device=p.device), -1).amax(-1)
    return torch.where(idx < V, idx, torch.where(last >= 0, last, V - 1))


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None):
    """Pick one token per row from raw logits. Returns (token ids, distribution used)."""
    dist = probs(logits, cfg)
    if cfg.greedy:
        return logits.argmax(dim=-1), dist
    # drawn on the generator's device (a seeded CPU generator), then moved: same draws on every device
    u = torch.rand(dist.shape[:-1], generator=generator).to(dist.device)
    return sample_from(dist, u), dist
