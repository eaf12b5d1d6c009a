"""Suffix-automaton drafter over prompt + generated text (model-free, like SuffixDecoding/REST-lite).

The automaton is extended online as tokens are committed (amortised O(1) per token). To draft,
take the longest suffix of the context that occurred before (the suffix-link state of the whole
text) and copy what followed its most recent earlier occurrence.
"""
from __future__ import annotations

from typing import Annotated

from ...core.draft import Draft
from ...common.specs import Range
from .base import Arm, ArmEnv, register
from .ngram import _truncate


class SuffixAutomaton:
    """Classic online suffix automaton; ``last_end[s]`` = latest end position of state s's strings
    excluding the current text end (kept up to date along suffix links on each extension)."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.last_end: list[int] = [-1]
        self.last = 0
        self.text: list[int] = []

    def extend(self, tok: int) -> None:
        pos = len(self.text)
        self.text.append(tok)
        cur = len(self.next)
        self.next.append({})
        self.length.append(self.length[self.last] + 1)
        self.link.append(-1)
        self.last_end.append(pos)
        p = self.last
        while p != -1 and tok not in self.next[p]:
            self.next[p][tok] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][tok]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.next)
                self.next.append(dict(self.next[q]))
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.last_end.append(self.last_end[q])
                while p != -1 and self.next[p].get(tok) == q:
                    self.next[p][tok] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur

    def match(self) -> tuple[int, int]:
        """(length, end position) of the longest suffix with an earlier occurrence (0, -1 if none)."""
        s = self.link[self.last]
        if s <= 0:
            return 0, -1
        return self.length[s], self._latest_end(s)

    def _latest_end(self, s: int) -> int:
        n = len(self.text)
        L = self.length[s]
        end = self.last_end[s]
        # last_end starts as the first recorded end; look for a later one (newest first) and cache it
        pattern = self.text[n - L:]
        for e in range(n - 2, end, -1):
            if e - L + 1 < 0:
                break
            if self.text[e] == pattern[-1] and self.text[e - L + 1:e + 1] == pattern:
                end = e
                break
        self.last_end[s] = end
        return end


class SuffixArm(Arm):
    name = "suffix"
    free_counterfactual = True

    def __init__(self, L: int = 8, min_match: int = 2):
        super().__init__(L)
        self.min_match = min_match
        self.sa = SuffixAutomaton()

    def reset(self, prompt_ids):
        self.sa = SuffixAutomaton()

    def _sync(self, context):
        n = len(self.sa.text)
        if len(context) < n or (n and context[n - 1] != self.sa.text[-1]):
            self.sa = SuffixAutomaton()  # not an extension of what we indexed (new query): rebuild
        for tok in context[len(self.sa.text):]:
            self.sa.extend(tok)

    def propose(self, context, max_len, keep_going=None) -> Draft:
        L = min(self.L, max_len)
        self.last_match = 0
        if L <= 0:
            return Draft.empty()
        self._sync(context)
        length, end = self.sa.match()
        self.last_match = length
        if length < self.min_match or end < 0:
            return Draft.empty()
        cont = context[end + 1:end + 1 + L]
        return Draft(_truncate(cont, keep_going)) if cont else Draft.empty()


@register("suffix")
def _make(env: ArmEnv, L: Annotated[int, Range(0)] = 8, min_match: Annotated[int, Range(1)] = 2):
    return SuffixArm(L, min_match)
