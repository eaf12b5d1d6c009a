"""PyTorch reference verifier (ALGORITHMS.md §1): greedy and speculative sampling, batched.

Shapes: B rows, L draft positions, V vocabulary.
  target_logits [B, L+1, V]  raw target logits at [last token] + draft
  draft_tokens  [B, L]
  draft_probs   [B, L, V] processed draft distributions, or None (one-hot drafts)
  uniforms      [B, L+1]  explicit randomness in [0, 1): L acceptance tests, then one draw for the
                          residual/bonus sample (ignored in greedy mode)
Randomness is explicit so the fused kernel can be compared with this reference draw for draw.

Acceptance is ``u < min(1, p/q)``: with u ~ U[0, 1) that happens with probability exactly the ratio,
and a token the target cannot emit (p = 0, e.g. outside top-k/top-p) is never accepted, even at
u = 0.0 (which torch.rand can return). A drafted token with q(x̃) = 0 < p(x̃) has ratio 1 (the limit
of p/q): under a drafter that samples from q this has probability 0, so exactness does not depend on
it; with p(x̃) = 0 as well it is rejected like any p = 0 token.

Invalid inputs (NaN/+inf target logits, draft ids outside [0, V), NaN draft probabilities) are
reported in ``VerifyResult.status`` and raised as a UserError (see :func:`raise_for_status`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...common.errors import UserError
from ..sampling import SamplingConfig, probs, sample_from

# VerifyResult.status bits (0 = valid row)
BAD_LOGITS = 1  # NaN or +inf in the row's target logits
BAD_TOKEN = 2  # a draft token id outside [0, V)
BAD_PROBS = 4  # NaN in the row's draft probabilities


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] long, 0..L
    next_token: torch.Tensor  # [B] long: correction at the first rejection, or bonus
    accept_prob: torch.Tensor  # [B, L] float
    tv: torch.Tensor  # [B, L] float
    status: torch.Tensor | None = None  # [B] int32 input-error bits (BAD_*); 0 = valid


def input_status(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None) -> torch.Tensor:
    """[B] int32 BAD_* bits, computed on the inputs' device without reading anything back to the host."""
    V = target_logits.shape[-1]
    top = target_logits.amax(-1)  # one pass; max propagates NaN, and is +inf iff some logit is
    status = (torch.isnan(top) | torch.isposinf(top)).any(-1).int() * BAD_LOGITS
    status |= ((draft_tokens < 0) | (draft_tokens >= V)).any(-1).int() * BAD_TOKEN
    if draft_probs is not None and draft_probs.numel():
        status |= torch.isnan(draft_probs.amax(-1)).any(-1).int() * BAD_PROBS
    return status


def raise_for_status(status: torch.Tensor | None, V: int, draft_tokens: torch.Tensor | None = None) -> None:
    """Raise a UserError naming the first kind of invalid input, if any row has one.

    Costs one host read of ``status`` (a device sync on CUDA); the details are only gathered on the
    error path.
    """
    if status is None or not bool(status.any()):
        return
    status = status.cpu()

    def rows(bit):
        return torch.nonzero(status & bit).flatten().tolist()

    if rows(BAD_LOGITS):
        raise UserError(f"the target's logits contain NaN or +inf (batch rows {rows(BAD_LOGITS)[:8]}): the model "
                        "overflowed or its weights are broken; try a wider dtype (--dtype float32 or bfloat16)")
    if rows(BAD_TOKEN):
        bad = ""
        if draft_tokens is not None:
            t = draft_tokens.cpu()
            bad = f" {t[(t < 0) | (t >= V)][:8].tolist()}"
        raise UserError(f"draft token ids{bad} are outside the target's vocabulary [0, {V}) (batch rows "
                        f"{rows(BAD_TOKEN)[:8]}): the drafter and the target must share one vocabulary")
    raise UserError(f"the draft probabilities contain NaN (batch rows {rows(BAD_PROBS)[:8]}): the drafter's "
                    "logits overflowed or its weights are broken")


def _draft_dist(draft_tokens, draft_probs, vocab: int) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs.float()
    return torch.nn.functional.one_hot(draft_tokens, vocab).float()


def _first_false(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first False along the last dim (= length when all True)."""
    L = mask.shape[-1]
    if L == 0:
        return torch.zeros(mask.shape[:-1], dtype=torch.long, device=mask.device)
    return torch.cumprod(mask.long(), dim=-1).sum(dim=-1)


def acceptance_ratio(p_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """min(1, p/q); q = 0 gives 1 if p > 0 and 0 if p = 0 (a token the target cannot emit)."""
    safe_q = torch.where(q_tok > 0, q_tok, torch.ones_like(q_tok))
    return torch.where(q_tok > 0, (p_tok / safe_q).clamp(max=1.0), (p_tok > 0).to(p_tok.dtype))


def verify_reference(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, cfg: SamplingConfig,
                     uniforms: torch.Tensor | None = None, check: bool = True) -> VerifyResult:
    """check=False: don't raise on invalid inputs (no host sync); the caller reads ``status`` itself."""
    B, L1, V = target_logits.shape
    L = L1 - 1
    if tuple(draft_tokens.shape) != (B, L):
        raise ValueError(f"draft_tokens has shape {tuple(draft_tokens.shape)}, expected {(B, L)}")
    status = input_status(target_logits, draft_tokens, draft_probs)
    if check:
        raise_for_status(status, V, draft_tokens)
    draft_tokens = draft_tokens.clamp(0, V - 1)  # rows flagged in status compute garbage, in bounds
    p = probs(target_logits, cfg)  # [B, L+1, V]
    q = _draft_dist(draft_tokens, draft_probs, V)  # [B, L, V]
    tv = 0.5 * (p[:, :L] - q).abs().sum(-1) if L else p.new_zeros(B, 0)
    rows = torch.arange(B, device=target_logits.device)
    if cfg.greedy:
        best = target_logits.argmax(-1)  # [B, L+1]
        ok = draft_tokens == best[:, :L]
        accepted = _first_false(ok)
        return VerifyResult(accepted, best[rows, accepted], ok.float(), tv, status)

    if uniforms is None:
        raise ValueError("sampling verification needs explicit uniforms [B, L+1]")
    p_tok = p[:, :L].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_tok = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    ratio = acceptance_ratio(p_tok, q_tok)
    accepted = _first_false(uniforms[:, :L] < ratio)
    # distribution for the final token: residual Norm([p - q]_+) at a rejection, p itself for the bonus
    p_at = p[rows, accepted]  # [B, V]
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)
    resid = (p_at - q_pad[rows, accepted]).clamp_min(0.0)
    mass = resid.sum(-1, keepdim=True)
    final = torch.where(mass > 0, resid, p_at)  # p == q exactly: rejection has probability 0
    next_token = sample_from(final, uniforms[:, L])
    return VerifyResult(accepted, next_token, ratio, tv, status)
