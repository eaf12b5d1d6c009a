"""Retrieval drafting (REST, He et al. 2024; one of BanditSpec's arms) from a datastore of the target's own answers.

The datastore is a token corpus (the self-distilled answers ``toolkit answers`` ships: what the target itself wrote
for thousands of prompts), indexed as the sorted windows of its first ``depth`` tokens at every position. To draft,
take the longest suffix of the context (``min_match`` … ``max_match`` tokens) that occurs in the corpus; the
occurrences are one contiguous block of the sorted windows, and within it each next column is sorted, so the
continuations form a trie whose node counts are run lengths. The chain follows the most frequent child at each depth
(REST's trie, drafted as its most frequent path); ``nodes=n`` drafts the n most frequent trie nodes as a tree. The
draft is a deterministic function of the context, so it is exact under sampling as under greedy decoding (one-hot
q), and scorable without a forward like the other model-free arms.

Documents are separated by ``-1`` (no token id), which sorts first and never matches a query: no continuation
crosses from one answer into the next.
"""
from __future__ import annotations

import heapq
import time
from pathlib import Path
from typing import Annotated

import numpy as np

from ...common.answers import load_answers, read_record
from ...common.errors import UserError
from ...common.specs import Range
from ...core.draft import Draft
from ...core.tree import merge_chains
from .base import Arm, ArmEnv, register
from .ngram import _truncate

SEP = -1


class TokenStore:
    """The sorted ``depth``-token windows starting at every token of ``docs`` (``cols[j]``: the windows' j-th
    tokens, column-major so a block's column is one contiguous slice for ``np.searchsorted``)."""

    def __init__(self, docs, depth: int = 16):
        if depth < 2:
            raise ValueError(f"TokenStore depth must be >= 2, got {depth}")
        self.depth = int(depth)
        docs = [np.asarray(d, dtype=np.int32) for d in docs if len(d)]
        total = sum(len(d) + 1 for d in docs)
        tokens = np.full(total + self.depth, SEP, dtype=np.int32)
        starts = np.empty(total - len(docs), dtype=np.int64)
        pos = k = 0
        for d in docs:
            tokens[pos:pos + len(d)] = d
            starts[k:k + len(d)] = np.arange(pos, pos + len(d))
            pos, k = pos + len(d) + 1, k + len(d)
        self.size = int(k)  # tokens indexed
        self.max_token = int(tokens.max()) if k else -1
        windows = np.lib.stride_tricks.sliding_window_view(tokens, self.depth)[starts]
        order = np.lexsort(windows.T[::-1])  # last key is primary: column 0 first
        self.cols = np.ascontiguousarray(windows[order].T)

    def __len__(self) -> int:
        return self.size

    def block(self, query) -> tuple[int, int]:
        """[lo, hi): the windows that start with ``query`` (at most ``depth`` tokens); lo == hi: none."""
        lo, hi = 0, self.cols.shape[1]
        for j, tok in enumerate(np.asarray(query, dtype=np.int32)):  # int32 keys: another dtype copies the column
            col = self.cols[j, lo:hi]
            a = int(col.searchsorted(tok, "left"))
            b = int(col.searchsorted(tok, "right"))
            lo, hi = lo + a, lo + b
            if lo == hi:
                break
        return lo, hi

    def longest_suffix(self, context, max_match: int, min_match: int = 1) -> tuple[int, int, int]:
        """(m, lo, hi): the longest suffix of ``context`` of ``min_match`` … ``max_match`` tokens that occurs, and
        its block; (0, 0, 0) when none does. A suffix that occurs has every shorter suffix occurring (one position
        later, in the same window), so the length is found by binary search."""
        best = (0, 0, 0)
        lo_m, hi_m = min_match, min(max_match, len(context), self.depth - 1)
        while lo_m <= hi_m:
            m = (lo_m + hi_m) // 2
            lo, hi = self.block(context[len(context) - m:])
            if hi > lo:
                best, lo_m = (m, lo, hi), m + 1
            else:
                hi_m = m - 1
        return best

    def _runs(self, j: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Column ``j`` of block [lo, hi) as runs of one token: (tokens, starts, counts), tokens ascending; the
        document separator's run (it sorts first) has count 0: it is not a continuation."""
        col = self.cols[j, lo:hi]
        starts = np.flatnonzero(np.concatenate(([True], col[1:] != col[:-1])))
        counts = np.diff(np.append(starts, len(col)))
        if col[0] == SEP:
            counts[0] = 0
        return col[starts], starts + lo, counts

    def most_frequent(self, j: int, lo: int, hi: int) -> tuple[int, int, int] | None:
        """(token, lo, hi) of column ``j``'s most frequent token in block [lo, hi) (ties: the smaller token), or
        None when every window there has ended."""
        toks, starts, counts = self._runs(j, lo, hi)
        i = int(np.argmax(counts))  # the first maximum: the smallest token among the most frequent
        if counts[i] == 0:
            return None
        return int(toks[i]), int(starts[i]), int(starts[i] + counts[i])

    def children(self, j: int, lo: int, hi: int, k: int) -> list[tuple[int, int, int, int]]:
        """Column ``j``'s ``k`` most frequent tokens in block [lo, hi) as (count, token, lo, hi), most frequent
        first (ties: the smaller token first)."""
        toks, starts, counts = self._runs(j, lo, hi)
        if len(counts) > k:
            keep = np.argpartition(-counts, k - 1)[:k]
            toks, starts, counts = toks[keep], starts[keep], counts[keep]
        out = [(int(c), int(t), int(a), int(a + c)) for t, a, c in zip(toks, starts, counts) if c > 0]
        out.sort(key=lambda c: (-c[0], c[1]))
        return out


class RetrievalArm(Arm):
    """REST over a :class:`TokenStore`: the most frequent continuation of the longest matching context suffix
    (``nodes=1``), or the ``nodes`` most frequent trie nodes as a tree (each node's frequency is its count over the
    matched block's size: an estimate of its acceptance, so the tree keeps the nodes most likely accepted)."""

    name = "rest"
    free_counterfactual = True

    def __init__(self, store: TokenStore, L: int = 4, nodes: int = 1, max_match: int = 8, min_match: int = 2):
        super().__init__(L)
        if not 1 <= min_match <= max_match:
            raise UserError(f"rest: need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_match + L > store.depth:
            raise UserError(f"rest: max_match + L = {max_match + L} exceeds the store's window depth {store.depth}; "
                            f"lower max_match or L")
        self.store, self.nodes, self.max_match, self.min_match = store, int(nodes), int(max_match), int(min_match)

    @property
    def label(self) -> str:
        return f"rest@{self.L}" if self.nodes == 1 else f"rest@{self.L}/{self.nodes}nodes"

    @property
    def max_nodes(self) -> int:
        return max(self.nodes, self.L)

    def propose(self, context, max_len, keep_going=None) -> Draft:
        L = min(self.L, max_len)
        self.last_match = 0
        if L <= 0:
            return Draft.empty()
        m, lo, hi = self.store.longest_suffix(context, self.max_match, self.min_match)
        self.last_match = m
        if m == 0:
            return Draft.empty()
        if self.nodes == 1:
            chain = []
            for d in range(L):
                best = self.store.most_frequent(m + d, lo, hi)
                if best is None:
                    break
                tok, lo, hi = best
                chain.append(tok)
            return Draft(_truncate(chain, keep_going)) if chain else Draft.empty()
        return self._tree(m, lo, hi, L, keep_going)

    def _tree(self, m: int, lo: int, hi: int, L: int, keep_going) -> Draft:
        """The ``nodes`` most frequent trie nodes down to depth L, best first (a child is never more frequent than
        its parent, so every prefix of them is a tree: a controller that budgets nodes, ``--length cost``'s
        ``keep_going.node_budget``, keeps the prefix that pays on the verification curve, each node valued at its
        frequency), merged as root paths, the most frequent first."""
        t0 = time.perf_counter()
        total = hi - lo
        heap = [(-c, tok, a, b, 0, ()) for c, tok, a, b in self.store.children(m, lo, hi, self.nodes)]
        heapq.heapify(heap)
        kept: list[tuple[int, ...]] = []
        values: list[float] = []
        while heap and len(kept) < self.nodes:
            negc, tok, a, b, d, path = heapq.heappop(heap)
            path = path + (tok,)
            kept.append(path)
            values.append(-negc / total)
            if d + 1 < L and len(kept) < self.nodes:
                for c, t, aa, bb in self.store.children(m + d + 1, a, b, self.nodes - len(kept)):
                    heapq.heappush(heap, (-c, t, aa, bb, d + 1, path))
        budget = getattr(keep_going, "node_budget", None)
        if budget is not None and kept:
            kept = kept[:budget(values, time.perf_counter() - t0)]
        leaves = [p for p in kept if not any(len(q) > len(p) and q[:len(p)] == p for q in kept)]
        return merge_chains([Draft(list(p)) for p in leaves]) if leaves else Draft.empty()


def _answers(check, path: str):
    """``check(folder)`` (decode/common/answers.py: the run record, or every row), naming the arm and its fix."""
    try:
        return check(Path(path))
    except UserError as exc:
        raise UserError(f"rest: store={path} holds no answers: {exc}; pass an answers folder (`toolkit answers` "
                        f"writes one), e.g. store=pretrained/smollm2-135m-instruct/answers") from None


def load_store(path: str, depth: int = 16) -> TokenStore:
    """A datastore of the answers in an answers folder (every task's ``response_ids``)."""
    return TokenStore([r["response_ids"] for r in _answers(load_answers, path)], depth)


@register("rest", check=lambda typed: _answers(read_record, typed["store"]))
def _make(env: ArmEnv, store: str, L: Annotated[int, Range(0)] = 4, nodes: Annotated[int, Range(1)] = 1,
          max_match: Annotated[int, Range(1)] = 8, min_match: Annotated[int, Range(1)] = 2):
    """``store``: an answers folder of the target's (``toolkit answers``); indexed once per process."""
    index = env.once(("rest", store), lambda: load_store(store), store)
    vocab = getattr(getattr(env.target_model, "config", None), "vocab_size", None)
    if vocab is not None and index.max_token >= vocab:
        raise UserError(f"rest: store={store} holds token id {index.max_token}, outside the target's vocabulary of "
                        f"{vocab}: its answers were written by another tokenizer; pass the answers of this target")
    return RetrievalArm(index, L, nodes, max_match, min_match)
