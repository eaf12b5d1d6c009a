"""Held-out drafter quality against the target, measured on the target's own (distilled) text.

Per response position, with P the target's and Q the drafter's next-token distribution:
* agreement  = 1{argmax Q == argmax P}: the chance a greedy draft token is accepted;
* acceptance = 1 − TV(P, Q) = Σ min(P, Q): the speculative-sampling acceptance probability
  (ALGORITHMS.md §1, §3 "block divergence"), at the logits processing of ``sampling``.
``expected_mat`` turns a per-position rate α into the tokens per round of L-token drafts under an
i.i.d. assumption, (1 − α^{L+1}) / (1 − α) — an estimate; ``decode eval`` measures the real MAT.
"""
from __future__ import annotations

import torch

from decode.core.sampling import SamplingConfig, probs


def position_stats(p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingConfig | None = None) -> dict:
    """Sums over rows of [N, V] target/drafter logits: agreement and acceptance counts."""
    sampling = sampling or SamplingConfig()
    agree = (p_logits.argmax(-1) == q_logits.argmax(-1)).sum().item()
    P, Q = probs(p_logits, sampling), probs(q_logits, sampling)
    overlap = torch.minimum(P, Q).sum(-1).sum().item()  # Σ_x min(P, Q) = 1 − TV
    return {"n": int(p_logits.shape[0]), "agree": float(agree), "overlap": float(overlap)}


def expected_mat(alpha: float, L: int) -> float:
    if alpha >= 1.0:
        return float(L + 1)
    return (1.0 - alpha ** (L + 1)) / (1.0 - alpha)


@torch.inference_mode()
def heldout_agreement(drafter, target, examples, *, L: int = 4, sampling: SamplingConfig | None = None,
                      progress: bool = True) -> dict:
    """Agreement/acceptance of ``drafter`` with ``target`` on tokenised examples (input_ids + labels)."""
    from tqdm.auto import tqdm

    dev = next(drafter.parameters()).device
    tot = {"n": 0, "agree": 0.0, "overlap": 0.0, "nll": 0.0, "nll_n": 0, "label_hits": 0.0}
    for ex in tqdm(examples, desc="held-out agreement", disable=not progress):
        ids = torch.tensor([ex["input_ids"]], device=dev)
        labels = torch.tensor(ex["labels"][1:], device=dev)
        mask = labels != -100
        if not mask.any():
            continue
        p = target(input_ids=ids).logits[0, :-1][mask].float()
        q = drafter(input_ids=ids).logits[0, :-1][mask].float()
        s = position_stats(p, q, sampling)
        for k in ("n", "agree", "overlap"):
            tot[k] += s[k]
        lab = labels[mask]
        # a pruned draft vocabulary gives -inf to labels outside it: NLL over the labels it can draft
        inside = torch.isfinite(q.gather(-1, lab[:, None]).squeeze(-1))
        if inside.any():
            tot["nll"] += torch.nn.functional.cross_entropy(q[inside], lab[inside], reduction="sum").item()
            tot["nll_n"] += int(inside.sum())
        tot["label_hits"] += (q.argmax(-1) == lab).sum().item()
    n = max(tot["n"], 1)
    agreement, acceptance = tot["agree"] / n, tot["overlap"] / n
    return {
        "examples": len(examples), "positions": tot["n"],
        "agreement": agreement, "acceptance": acceptance,
        "drafter_nll": tot["nll"] / max(tot["nll_n"], 1), "label_accuracy": tot["label_hits"] / n,
        # share of labels the drafter cannot draft (outside a pruned vocabulary; 0 for a full one)
        "labels_outside_vocab": 1.0 - tot["nll_n"] / n if tot["n"] else 0.0,
        "L": L, "expected_mat_greedy": expected_mat(agreement, L), "expected_mat_sampled": expected_mat(acceptance, L),
    }
