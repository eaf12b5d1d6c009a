"""Prompt-lookup decoding (PLD): copy what followed the latest earlier occurrence of the last n-gram."""
from __future__ import annotations

from typing import Annotated

from ...core.draft import Draft
from ...common.errors import UserError
from ...common.specs import Range
from .base import Arm, ArmEnv, register


class PromptLookupArm(Arm):
    """Tries n = max_ngram … min_ngram; the most recent earlier match wins (recency tracks the
    text being generated better than the first match HF's prompt lookup uses)."""

    name = "pld"
    free_counterfactual = True

    def __init__(self, L: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(L)
        if not 1 <= min_ngram <= max_ngram:
            raise UserError(f"pld: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context, max_len, keep_going=None) -> Draft:
        L = min(self.L, max_len)
        n_ctx = len(context)
        self.last_match = 0
        if L <= 0:
            return Draft.empty()
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            pattern = context[n_ctx - n:]
            # scan right-to-left for the latest occurrence that is not the suffix itself
            for start in range(n_ctx - n - 1, -1, -1):
                if context[start:start + n] == pattern:
                    cont = context[start + n:start + n + L]
                    if cont:
                        self.last_match = n
                        return Draft(_truncate(cont, keep_going))
                    break
        return Draft.empty()


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
          max_ngram: Annotated[int, Range(1)] = 3, min_ngram: Annotated[int, Range(1)] = 1):
    """``n`` is shorthand for ``max_ngram``; L=0 makes a plain decoding step (a γ = 0 arm)."""
    return PromptLookupArm(L, max_ngram if n is None else n, min_ngram)
