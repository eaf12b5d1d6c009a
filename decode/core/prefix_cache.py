"""Prompts' and answers' KV kept across requests, so a prompt that starts with one seen before prefills only what
is new.

What vLLM's automatic prefix caching and SGLang's RadixAttention do for a server: a multi-turn chat re-sends its
whole history every turn, clients share system prompts, and a retried request repeats its prompt. On a CPU the
prefill is compute-bound (the default target on 2 cores: ~1.5 ms a prompt token, a 600-token prompt ~0.9 s) and it
runs alone, while a batch's other rows wait: in a served load of 8 clients over Spec-Bench dev it was over a
quarter of the batched server's wall time (docs/serving.md).

An entry holds the cached positions of one prompt, or of one finished sequence (prompt and answer: a chat's next
turn re-sends both), every token but the last, as the engines cache them: each layer's keys and values
``[kv heads, n, dim]``, and what the engine reads beside them at those positions (the target's hidden states for
arms that draft from them, a batch drafter's features), keyed by what they are. A finished sequence's entry
replaces its prompt's (``put`` drops an entry that a new one starts with). A new
prompt takes the longest run of its first tokens that an entry (holding every state it needs) starts with, and the
engine feeds the target the rest. Entries are evicted least recently used past ``max_bytes``. Each entry holds its
own copy of what it shares with others (no radix tree: a few hundred prompts of a server's recent traffic).

Reuse is exact for a repeated prompt (the same tensors its own prefill made). An answer's positions were cached by
the rounds that verified them (blocks of a few positions, not one prefill); a longer prompt's new positions
attend over the stored keys and values as a round attends over the cache: the same arithmetic, another matrix
shape than one prefill over the whole prompt (float summation order, as between any two batch sizes), which greedy
decoding absorbs except at a near-tie of the target itself; the tests check equality with plain ``generate``.
Off by default (``decode eval`` and ``decode generate`` time each prompt's own prefill); ``decode serve`` turns it on
(``--prefix-cache-mib``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from ..common.errors import UserError


@dataclass
class CachedPrefix:
    """One prompt's cached positions: per layer ``[kv heads, n, dim]`` keys and values, and named states (tensors or
    objects with tensors, e.g. HiddenStates) at the same n positions."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    states: dict[Hashable, object] = field(default_factory=dict)
    ids: torch.Tensor = field(init=False, repr=False)  # the tokens as a tensor (compared against a prompt at once)

    def __post_init__(self):
        self.ids = torch.tensor(self.tokens, dtype=torch.long)

    def head(self, n: int) -> "CachedPrefix":
        """The first ``n`` positions (views of this entry's tensors; a state is cut by its ``rows`` or by slicing)."""
        cut = slice(0, n)
        return CachedPrefix(self.tokens[:n], [k[:, cut] for k in self.keys], [v[:, cut] for v in self.values],
                            {name: s.rows(cut) if hasattr(s, "rows") else s[cut] for name, s in self.states.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values)) + sum(_nbytes(s) for s in self.states.values())


def _nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.nbytes
    return sum(t.nbytes for t in vars(state).values() if isinstance(t, torch.Tensor)) if hasattr(state, "__dict__") \
        else 0


DEFAULT_MIB = 512  # decode serve's --prefix-cache-mib and decode generate --chat's budget


class PrefixCache:
    """Prompts' KV across requests, least recently used evicted past ``max_bytes`` (module docstring)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise UserError(f"the prefix cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self.nbytes = 0
        self.reused_tokens = 0  # prompt positions taken from entries instead of prefilled (every lookup's)

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, ids: Sequence[int], needs: Sequence[Hashable] = ()) -> CachedPrefix | None:
        """The longest run of ``ids``' first tokens that an entry holding every state in ``needs`` starts with, as
        that entry's first positions (a view; the entry is now the most recently used), or None. A prompt that
        shares only its beginning with an entry (a system prompt, the history of another branch of a chat) takes
        that beginning."""
        if not self._entries or not len(ids):
            return None
        query = torch.as_tensor(list(ids), dtype=torch.long)
        best, best_n = None, 0
        for key, entry in self._entries.items():
            n = min(len(key), len(query))
            if n <= best_n or key[0] != ids[0] or not all(k in entry.states for k in needs):
                continue
            differs = (entry.ids[:n] != query[:n]).nonzero()
            n = int(differs[0]) if len(differs) else n
            if n > best_n:
                best, best_n = entry, n
        if best is None:
            return None
        self._entries.move_to_end(best.tokens)
        self.reused_tokens += best_n
        return best if best_n == len(best.tokens) else best.head(best_n)

    def put(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor],
            states: dict[Hashable, object] | None = None) -> bool:
        """Keep ``tokens``' keys and values (per layer ``[kv heads, n, dim]``, not copied: pass tensors nothing
        writes to again) and states; an entry for the same tokens takes the new states beside its own. An entry
        whose tokens begin the new one's and whose states it holds too is dropped: the new entry's first positions
        serve every lookup it served (a finished answer's entry replaces its prompt's). Returns whether it is kept
        (an entry larger than the whole cache is not)."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens or any(k.shape[-2] != len(tokens) for k in (*keys, *values)):
            raise ValueError(f"keys and values must hold the {len(tokens)} positions of the tokens")
        old = self._entries.pop(tokens, None)
        if old is not None:
            self.nbytes -= old.nbytes
        entry = CachedPrefix(tokens, list(keys), list(values), {**(old.states if old else {}), **(states or {})})
        if entry.nbytes > self.max_bytes:
            return False
        for key, held in list(self._entries.items()):
            if len(key) < len(tokens) and tokens[:len(key)] == key and held.states.keys() <= entry.states.keys():
                del self._entries[key]
                self.nbytes -= held.nbytes
        while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
        self._entries[tokens] = entry
        self.nbytes += entry.nbytes
        return True
