"""PyTorch reference verifier (ALGORITHMS.md §1): greedy and speculative sampling, batched.

Shapes: B rows, L draft positions, V vocabulary.
  target_logits [B, L+1, V]  raw target logits at [last token] + draft
  draft_tokens  [B, L]
  draft_probs   [B, L, V] processed draft distributions, or None (one-hot drafts)
  uniforms      [B, L+1]  explicit randomness: L acceptance tests, then one draw for the
                          residual/bonus sample (ignored in greedy mode)
Randomness is explicit so the fused kernel can be compared with this reference draw for draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig, probs, sample_from


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] long, 0..L
    next_token: torch.Tensor  # [B] long: correction at the first rejection, or bonus
    accept_prob: torch.Tensor  # [B, L] float
    tv: torch.Tensor  # [B, L] float


def _draft_dist(draft_tokens, draft_probs, vocab: int) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs.float()
    return torch.nn.functional.one_hot(draft_tokens, vocab).float()


def _first_false(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first False along the last dim (= length when all True)."""
    L = mask.shape[-1]
    if L == 0:
        return torch.zeros(mask.shape[:-1], dtype=torch.long)
    return torch.cumprod(mask.long(), dim=-1).sum(dim=-1)


def verify_reference(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, cfg: SamplingConfig,
                     uniforms: torch.Tensor | None = None) -> VerifyResult:
    B, L1, V = target_logits.shape
    L = L1 - 1
    assert draft_tokens.shape == (B, L), (draft_tokens.shape, (B, L))
    p = probs(target_logits, cfg)  # [B, L+1, V]
    q = _draft_dist(draft_tokens, draft_probs, V)  # [B, L, V]
    tv = 0.5 * (p[:, :L] - q).abs().sum(-1) if L else p.new_zeros(B, 0)
    rows = torch.arange(B)
    if cfg.greedy:
        best = target_logits.argmax(-1)  # [B, L+1]
        ok = draft_tokens == best[:, :L]
        accepted = _first_false(ok)
        return VerifyResult(accepted, best[rows, accepted], ok.float(), tv)

    if uniforms is None:
        raise ValueError("sampling verification needs explicit uniforms [B, L+1]")
    p_tok = p[:, :L].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_tok = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(q_tok > 0, (p_tok / q_tok.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(p_tok))
    ok = uniforms[:, :L] <= ratio
    accepted = _first_false(ok)
    # distribution for the final token: residual Norm([p - q]_+) at a rejection, p itself for the bonus
    p_at = p[rows, accepted]  # [B, V]
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)
    resid = (p_at - q_pad[rows, accepted]).clamp_min(0.0)
    mass = resid.sum(-1, keepdim=True)
    final = torch.where(mass > 0, resid, p_at)  # p == q exactly: rejection has probability 0
    next_token = sample_from(final, uniforms[:, L])
    return VerifyResult(accepted, next_token, ratio, tv)
