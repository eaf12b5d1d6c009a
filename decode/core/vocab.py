"""Draft vocabulary (FR-Spec; EAGLE-3's ``d2t``): a self-drafting head drafts from the N most frequent
tokens of the target's own outputs plus the special tokens, so a drafted token pays an [N, d] LM head
instead of the target's [V, d] one (49,152 × 576 on the default target, ~21% of a target forward).

``d2t`` is the sorted int64 tensor of target ids (draft index → target id); ``t2d`` its inverse over the
target vocabulary (-1 outside the subset).

Exactness: a head computes logits over the subset only and :func:`expand_logits` scatters them into a
full-vocabulary row with ``-inf`` elsewhere. ``decode.core.sampling.choose_token`` on that row is the same
as choosing a draft index over the subset and mapping it through ``d2t`` (``d2t`` is sorted, so the
inverse-CDF draw lands on the same token), and its distribution q is the full-vocabulary row the
verifier needs, zero outside the subset: speculative sampling stays exact; under greedy a token outside
the subset cannot be drafted (the verifier rejects the draft there and emits the target's token).

Sampling settings apply to the subset's logits: the draft samples at the run's temperature from the
subset; top-k keeps the k best tokens *of the subset* (all of it when k ≥ N); top-p keeps the smallest
set of subset tokens whose mass *within the subset* reaches p. Only q changes; the target's p is
processed over the full vocabulary as always, so this moves acceptance, never the output distribution.

Saved in a head folder as ``draft_vocab.safetensors``: tensor ``d2t`` plus string metadata (``info``:
JSON with the vocabulary size it indexes, coverage, counts). No pickle.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from ..common.errors import UserError
from ..common.io import atomic_path

VOCAB_FILE = "draft_vocab.safetensors"


class DraftVocab:
    """A sorted subset of the target vocabulary and the record of how it was chosen."""

    def __init__(self, d2t, vocab_size: int, info: dict | None = None):
        d2t = torch.as_tensor(d2t).detach().cpu()
        if d2t.dim() != 1 or d2t.numel() == 0 or d2t.dtype.is_floating_point:
            raise UserError(f"a draft vocabulary is a non-empty 1-D integer id tensor, got shape {tuple(d2t.shape)} "
                            f"({d2t.dtype})")
        d2t = d2t.long()
        if bool((d2t[1:] <= d2t[:-1]).any()):
            raise UserError("draft vocabulary ids must be sorted and distinct (d2t maps draft index → target id)")
        if int(d2t[0]) < 0 or int(d2t[-1]) >= vocab_size:
            raise UserError(f"draft vocabulary ids must lie in [0, {vocab_size}), got [{int(d2t[0])}, {int(d2t[-1])}]")
        self.d2t = d2t
        self.vocab_size = int(vocab_size)
        self.info = {**(info or {}), "size": len(d2t), "vocab_size": self.vocab_size}

    def __len__(self) -> int:
        return self.d2t.numel()

    @property
    def t2d(self) -> torch.Tensor:
        """[V] long: target id → draft index, -1 for ids outside the subset."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.long)
        out[self.d2t] = torch.arange(len(self))
        return out

    def save(self, folder) -> Path:
        from safetensors.torch import save_file

        path = Path(folder) / VOCAB_FILE
        with atomic_path(path) as tmp:
            save_file({"d2t": self.d2t.contiguous()}, str(tmp),
                      metadata={"info": json.dumps(self.info, sort_keys=True)})
        return path

    @classmethod
    def load(cls, folder, vocab_size: int) -> "DraftVocab":
        """Read ``draft_vocab.safetensors`` and check it indexes a vocabulary of ``vocab_size`` ids."""
        from safetensors import safe_open

        path = Path(folder) / VOCAB_FILE
        if not path.is_file():
            raise UserError(f"{folder}: head.json names a draft vocabulary but {VOCAB_FILE} is missing; copy the "
                            "whole head folder or retrain the head")
        with safe_open(str(path), framework="pt") as f:
            d2t = f.get_tensor("d2t")
            info = json.loads((f.metadata() or {}).get("info", "{}"))
        if info.get("vocab_size") != vocab_size:
            raise UserError(f"{path} indexes a vocabulary of {info.get('vocab_size')} tokens but the target has "
                            f"{vocab_size}; pass the target the head was trained on or retrain the head")
        return cls(d2t, vocab_size, info)


def expand_logits(logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., N] logits over the draft vocabulary → [..., V] over the target's, ``-inf`` outside."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, d2t, logits)


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int, chunk: int = 1 << 20) -> torch.Tensor:
    """[V] int64 occurrence counts of the ids in ``sequences`` (negative ids, e.g. -100 labels, skipped);
    one bincount per ``chunk`` ids, so a large corpus costs O(tokens), not O(sequences × V)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    buf: list[int] = []

    def flush():
        ids = torch.tensor(buf, dtype=torch.long)
        ids = ids[ids >= 0]
        if len(ids) and int(ids.max()) >= vocab_size:
            raise UserError(f"token id {int(ids.max())} is outside the target vocabulary [0, {vocab_size}); the "
                            "distilled data was tokenised for another target")
        counts.add_(torch.bincount(ids, minlength=vocab_size))
        buf.clear()

    for seq in sequences:
        buf.extend(seq)
        if len(buf) >= chunk:
            flush()
    flush()
    return counts


def select_draft_vocab(counts: torch.Tensor, *, size: int | None = None, coverage: float | None = None,
                       special_ids: Iterable[int] = ()) -> DraftVocab:
    """The ``size`` most frequent ids (ties: lower id first), or the fewest whose counts reach ``coverage``
    of all counted tokens, plus ``special_ids`` (end-of-turn must stay draftable). ``info`` records the
    coverage the final set achieves on the counted tokens."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    V = counts.numel()
    total = int(counts.sum())
    if total == 0:
        raise UserError("no output tokens to choose a draft vocabulary from (the distilled responses are empty)")
    if (size is None) == (coverage is None):
        raise UserError("choose a draft vocabulary by draft_vocab.size or by draft_vocab.coverage (exactly one)")
    order = torch.sort(counts, descending=True, stable=True).indices
    if size is not None:
        if not 1 <= size <= V:
            raise UserError(f"draft_vocab.size must be in [1, {V}] (the target vocabulary), got {size}")
        n = size
    else:
        if not 0.0 < coverage <= 1.0:
            raise UserError(f"draft_vocab.coverage must be in (0, 1], got {coverage}")
        cum = torch.cumsum(counts[order].double(), 0) / total
        n = int(torch.searchsorted(cum, torch.tensor([coverage - 1e-12], dtype=torch.float64))) + 1
    special = sorted({int(i) for i in special_ids if i is not None and 0 <= int(i) < V})
    ids = torch.unique(torch.cat([order[:n], torch.tensor(special, dtype=torch.long)]))  # sorted
    info = {"frequent": n, "special": len(special), "coverage": int(counts[ids].sum()) / total,
            "coverage_target": coverage, "counted_tokens": total, "distinct_tokens": int((counts > 0).sum())}
    return DraftVocab(ids, V, info)


def special_token_ids(tokenizer) -> list[int]:
    """The tokenizer's special ids (end of turn, chat markers): always in a draft vocabulary."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def describe(vocab: DraftVocab | None) -> str:
    """One line for logs and reports."""
    if vocab is None:
        return "draft vocabulary: the full target vocabulary"
    i = vocab.info
    cov = f", covering {i['coverage']:.1%} of {i['counted_tokens']} output tokens" if "coverage" in i else ""
    return f"draft vocabulary: {len(vocab)} of {vocab.vocab_size} tokens{cov}"
