"""Prompt-lookup decoding (PLD): copy what followed the latest earlier occurrence of the last n-gram; with
``K=k``, what followed each of the k latest occurrences whose continuations start differently, as a tree."""
from __future__ import annotations

from typing import Annotated

from ...core.draft import Draft
from ...common.errors import UserError
from ...common.specs import Range
from ...core.tree import merge_chains
from .base import Arm, ArmEnv, register


class PromptLookupArm(Arm):
    """Tries n = max_ngram … min_ngram; the most recent earlier match wins (recency tracks the
    text being generated better than the first match HF's prompt lookup uses).

    ``K > 1`` (not in HF's prompt lookup): the continuations of up to K earlier occurrences, each starting with a
    token no more recent one starts with, longest n-gram first and the latest occurrence first within an n, merged
    into one prefix tree (the most recent continuation is its first chain, so K=1's draft is always in it). A text
    that repeats a phrase with different endings (list items, code, a summary reusing the article's sentences) is
    continued in each way at once, and verification keeps the one the target takes. Deterministic, so exact under
    sampling too (one-hot q: recursive rejection sampling over siblings)."""

    name = "pld"
    free_counterfactual = True

    def __init__(self, L: int = 4, max_ngram: int = 3, min_ngram: int = 1, K: int = 1):
        super().__init__(L)
        if not 1 <= min_ngram <= max_ngram:
            raise UserError(f"pld: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.K = max_ngram, min_ngram, int(K)

    @property
    def label(self) -> str:
        return f"pld@{self.L}" if self.K == 1 else f"pld@{self.L}x{self.K}"

    @property
    def max_nodes(self) -> int:
        return self.K * self.L

    def propose(self, context, max_len, keep_going=None) -> Draft:
        L = min(self.L, max_len)
        n_ctx = len(context)
        self.last_match = 0
        if L <= 0:
            return Draft.empty()
        found: list[list[int]] = []  # continuations, each starting with a token none before it starts with
        firsts: set[int] = set()
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            pattern = context[n_ctx - n:]
            first = pattern[0]
            # scan right-to-left for the latest occurrences that are not the suffix itself
            for start in range(n_ctx - n - 1, -1, -1):
                if context[start] == first and context[start:start + n] == pattern:
                    cont = context[start + n:start + n + L]  # not empty: the occurrence ends before the suffix
                    if self.K == 1:  # the latest occurrence of the longest n-gram, whatever follows it
                        self.last_match = n
                        return Draft(_truncate(cont, keep_going))
                    if cont[0] not in firsts:
                        self.last_match = self.last_match or n
                        firsts.add(cont[0])
                        found.append(_truncate(cont, keep_going))
                        if len(found) == self.K:
                            return merge_chains([Draft(c) for c in found])
        if len(found) > 1:
            return merge_chains([Draft(c) for c in found])
        return Draft(found[0]) if found else Draft.empty()


def _truncate(tokens: list[int], keep_going) -> list[int]:
    """Apply a draft-length controller to a deterministic draft (one-hot q → no distribution)."""
    if keep_going is None:
        return tokens
    out = []
    for i, t in enumerate(tokens):
        if i > 0 and not keep_going(i, None):
            break
        out.append(t)
    return out


@register("pld")
def _make(env: ArmEnv, L: Annotated[int, Range(0)] = 4, n: Annotated[int, Range(1)] | None = None,
          max_ngram: Annotated[int, Range(1)] = 3, min_ngram: Annotated[int, Range(1)] = 1,
          K: Annotated[int, Range(1)] = 1):
    """``n`` is shorthand for ``max_ngram``; L=0 makes a plain decoding step (a γ = 0 arm); ``K=k``: up to k
    continuations as a tree (see :class:`PromptLookupArm`)."""
    return PromptLookupArm(L, max_ngram if n is None else n, min_ngram, K)
