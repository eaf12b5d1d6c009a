"""Batched speculative rounds (issue 32 §1): B sequences advance per round, each with its own context, its own
policy and its own instances of the pool's arms; the target scores every row in ONE forward.

A round: every row's policy picks an arm, the arm drafts up to ``min(L, remaining - 1)`` tokens for that row
(``none`` drafts nothing: a plain step), the rows' blocks ``[last token] + draft`` are right-padded to the widest,
the target scores the ``[B, W]`` block with per-row position ids and a per-row additive mask, the verifier accepts
per row, and each row commits its tokens, rolls its cache back and updates its own policy.

Cache (:class:`RowCache`): one HF ``DynamicCache`` ``[B, heads, T, dim]`` for all rows and a validity mask
``[B, T]``. A forward appends W slots to every row (its block, padded); afterwards a row keeps the slots of its
last token and its accepted drafts and marks the rest invalid — rollback is a per-row mask, not a crop. Keys were
rotated at their row's *logical* positions, so where a slot sits does not matter: attention is over the visible
set, and :meth:`RowCache.compact` gathers each row's valid slots to the front when padding and rejected drafts pile
up. Rows join between rounds (their prompt is prefilled alone and padded into the batch) and leave
(``batch_select_indices``): continuous batching.

Lossless per row: a row's tokens are what the verifier accepts from that row's own logits, which depend only on
that row's visible slots; so its greedy output equals its plain greedy decoding whatever its batch-mates do, up to
the float rounding of another batch shape (tests/test_batch_engine.py checks it on a float64 target).

Not here yet (issue 32 §1–§3, later): neural arms (EAGLE, drafters) drafting batched, lengths chosen jointly for
the batch from a learnt block-cost model, statistics shared across rows, ``decode eval --batch`` and a batching
server. Arms that own a model or a cache are refused with a clear error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from ..choose.arms.base import Arm
from ..choose.policies.base import Policy
from ..common.errors import UserError
from ..core.draft import RoundRecord
from ..core.verify import Verifier


# --------------------------------------------------------------------------- the cache

class RowCache:
    """One KV cache for B rows with per-row valid slots (see the module docstring)."""

    def __init__(self):
        self.hf: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, T], on the CPU (masks are built there)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def lengths(self) -> list[int]:
        return self.valid.sum(1).tolist()

    def _layers(self, cache: DynamicCache):
        return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]

    def add(self, cache: DynamicCache | None, n: int) -> None:
        """Append one row whose cache holds ``n`` slots (all valid); ``cache`` None for ``n == 0``."""
        valid = torch.ones(1, n, dtype=torch.bool)
        if self.hf is None:  # no slot yet in any row: the new row's cache, with empty rows put before it
            if cache is not None and self.rows:
                cache = _batch_cache(cache, self.rows)
            self.hf = cache
            self.valid = torch.cat([torch.zeros(self.rows, n, dtype=torch.bool), valid])
            return
        T = max(self.slots, n)
        self.valid = torch.cat([_pad(self.valid, T), _pad(valid, T)])
        new_layers = self._layers(cache) if cache is not None else None
        for k, mine in enumerate(self._layers(self.hf)):
            if new_layers is None:  # an empty row: zero slots of its own, all padding
                nk = mine.keys.new_zeros(1, mine.keys.shape[1], T, mine.keys.shape[3])
                nv = mine.values.new_zeros(1, mine.values.shape[1], T, mine.values.shape[3])
            else:
                nk, nv = _pad_slots(new_layers[k].keys, T), _pad_slots(new_layers[k].values, T)
            mine.keys = torch.cat([_pad_slots(mine.keys, T), nk])
            mine.values = torch.cat([_pad_slots(mine.values, T), nv])

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order)."""
        idx = torch.tensor(keep, dtype=torch.long)
        self.valid = self.valid[idx]
        if self.hf is not None:
            self.hf.batch_select_indices(idx.to(self._layers(self.hf)[0].keys.device))
        if not keep:
            self.hf, self.valid = None, torch.zeros(0, 0, dtype=torch.bool)

    def attention(self, block_valid: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive mask ``[B, 1, W, T + W]`` for a forward of W block slots per row: query j of row b sees that
        row's valid cached slots and the real block slots k <= j (and itself, so a padding query is finite)."""
        B, W = block_valid.shape
        T = self.slots
        causal = torch.tril(torch.ones(W, W, dtype=torch.bool))
        block = causal[None] & block_valid[:, None, :]
        block |= torch.eye(W, dtype=torch.bool)[None]
        visible = torch.cat([self.valid[:, None, :].expand(B, W, T), block], dim=2)
        mask = torch.zeros(B, W, T + W, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None].to(device)

    def commit(self, keep_block: torch.Tensor) -> None:
        """After a forward of W block slots: row b keeps the block slots ``keep_block[b]`` ([B, W] bool)."""
        self.valid = torch.cat([self.valid, keep_block], dim=1)

    def compact(self) -> None:
        """Gather each row's valid slots to the front ([B, max valid]); order within a row is kept."""
        if self.hf is None or not self.rows:
            return
        n = self.valid.sum(1)
        width = int(n.max())
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # valid slots first
        new_valid = torch.arange(width)[None, :] < n[:, None]
        for layer in self._layers(self.hf):
            idx = order.to(layer.keys.device)[:, None, :, None]
            layer.keys = torch.gather(layer.keys, 2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = torch.gather(layer.values, 2,
                                        idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self.valid = new_valid


def _pad(valid: torch.Tensor, T: int) -> torch.Tensor:
    return torch.cat([valid, torch.zeros(valid.shape[0], T - valid.shape[1], dtype=torch.bool)], dim=1)


def _pad_slots(t: torch.Tensor, T: int) -> torch.Tensor:
    if t.shape[2] == T:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], T - t.shape[2], t.shape[3])], dim=2)


def _batch_cache(cache: DynamicCache, rows: int) -> DynamicCache:
    """``cache`` (one row) with ``rows`` empty rows of the same slot count put before it (their slots invalid)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        layer.keys = torch.cat([layer.keys.new_zeros(rows, *layer.keys.shape[1:]), layer.keys])
        layer.values = torch.cat([layer.values.new_zeros(rows, *layer.values.shape[1:]), layer.values])
    return cache


# --------------------------------------------------------------------------- rows and the engine

@dataclass
class Row:
    """One sequence in the batch."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arms: list[Arm]
    policy: Policy
    ctx: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    stopped_by: str = "length"
    joined: float = 0.0  # perf_counter() when it joined
    finished: float = 0.0

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.stopped_by == "eos" or self.remaining <= 0


@dataclass
class BatchRound:
    """What one batched round did: rows (ids) in it, block width, each row's drafted/accepted, seconds."""

    rows: list[int]
    width: int
    drafted: list[int]
    accepted: list[int]
    draft_time: float
    verify_time: float


class BatchEngine:
    """Continuous batching of speculative rounds over one target (module docstring).

    ``make_arms()`` builds one row's arm instances (every row gets its own: model-free arms keep per-sequence
    state); ``make_policy(K)`` one row's policy over them."""

    def __init__(self, model, make_arms: Callable[[], list[Arm]], make_policy: Callable[[int], Policy],
                 verifier: Verifier, eos_token_ids=(), pad_id: int = 0, compact_slack: int = 64):
        self.model = model
        self.compact_slack = compact_slack  # compact once the cache holds > 2 × the longest row + this many slots
        self.make_arms = make_arms
        self.make_policy = make_policy
        self.verifier = verifier
        self.eos = {int(e) for e in eos_token_ids}
        self.pad_id = int(pad_id)
        self.cache = RowCache()
        self.rows: list[Row] = []
        self.history: list[BatchRound] = []
        self.forwards = 0
        self._next = 0
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        probe_arms = make_arms()
        for a in probe_arms:
            if getattr(a, "uses_target_hidden", False) or getattr(a, "owns_model", False) or a.name not in MODEL_FREE:
                raise UserError(f"batched rounds take model-free arms ({', '.join(sorted(MODEL_FREE))}) for now; "
                                f"{a.label} drafts with a model of its own (issue 32: neural arms drafting batched "
                                f"per arm are not built yet)")
        policy = make_policy(len(probe_arms))
        if getattr(policy, "uses_cost", False) or getattr(policy, "fullinfo", False):
            raise UserError(f"policy {policy.name}: batched rounds do not yet give a policy the cost curve or "
                            f"counterfactual feedback; use a bandit that learns from its own rounds (ucbspec, exp3spec, "
                            f"thompson, fixed)")

    # ---- rows join and leave ------------------------------------------------------------------------------

    def add(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """A new row, prefilled now (alone) and padded into the batch; returns its id."""
        if max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if not prompt_ids:
            raise UserError("empty prompt: there is nothing to continue")
        arms = self.make_arms()
        row = Row(self._next, list(prompt_ids), max_new_tokens, arms, self.make_policy(len(arms)),
                  ctx=list(prompt_ids), joined=time.perf_counter())
        self._next += 1
        row.policy.new_query()
        for a in arms:
            a.reset(row.prompt)
        n = len(prompt_ids) - 1  # the cache holds every token but the last (fed by the first round)
        cache = None
        if n:
            cache = DynamicCache()
            ids = torch.tensor([prompt_ids[:-1]], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.cache.add(cache, n)
        self.rows.append(row)
        return row.rid

    def _drop_finished(self) -> list[Row]:
        done = [r for r in self.rows if r.done]
        if done:
            keep = [i for i, r in enumerate(self.rows) if not r.done]
            self.cache.select(keep)
            self.rows = [self.rows[i] for i in keep]
        return done

    # ---- one round ------------------------------------------------------------------------------------------

    def step(self) -> list[Row]:
        """One round for every row in the batch; returns the rows that finished in it (removed)."""
        if not self.rows:
            return []
        t0 = time.perf_counter()
        picks, drafts = [], []
        for r in self.rows:
            i = r.policy.select()
            a = r.arms[i]
            d = a.propose(r.ctx, max(0, min(a.L, r.remaining - 1)), None)
            picks.append(i)
            drafts.append(d)
        lens = [1 + len(d) for d in drafts]
        W = max(lens)
        B = len(self.rows)
        ids = torch.full((B, W), self.pad_id, dtype=torch.long)
        pos = torch.zeros(B, W, dtype=torch.long)
        block_valid = torch.zeros(B, W, dtype=torch.bool)
        for b, (r, d) in enumerate(zip(self.rows, drafts)):
            ids[b, 0] = r.ctx[-1]
            if len(d):
                ids[b, 1:lens[b]] = d.tokens.to(torch.long).cpu()
            pos[b] = len(r.ctx) - 1 + torch.arange(W)
            block_valid[b, :lens[b]] = True
        mask = self.cache.attention(block_valid, self.dtype, self.device)
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), attention_mask=mask,
                             past_key_values=self.cache.hf if self.cache.hf is not None else DynamicCache(),
                             use_cache=True)
        if self.cache.hf is None:
            self.cache.hf = out.past_key_values
        self.forwards += 1
        keep = torch.zeros(B, W, dtype=torch.bool)
        accepted = []
        for b, (r, d, i) in enumerate(zip(self.rows, drafts, picks)):
            outcome = self.verifier.verify(out.logits[b, :lens[b]].float(), d)
            keep[b, :outcome.accepted + 1] = True
            new = outcome.tokens[:r.remaining]
            for j, tok in enumerate(new):
                if tok in self.eos:
                    new = new[:j + 1]
                    r.stopped_by = "eos"
                    break
            r.ctx.extend(new)
            r.tokens.extend(new)
            for a in r.arms:
                a.observe(r.ctx, None)
            rec = RoundRecord(arm=i, drafted=len(d), accepted=min(outcome.accepted, len(new)), new_tokens=len(new),
                              draft_time=(t1 - t0) / B, verify_time=0.0, tv=outcome.tv,
                              accept_prob=outcome.accept_prob, max_len=r.arms[i].L)
            r.rounds.append(rec)
            r.policy.update(i, rec)
            accepted.append(rec.accepted)
        self.cache.commit(keep)
        t2 = time.perf_counter()
        for rec in (r.rounds[-1] for r in self.rows):
            rec.verify_time = (t2 - t1) / B
        self.history.append(BatchRound([r.rid for r in self.rows], W, [len(d) for d in drafts], accepted,
                                       t1 - t0, t2 - t1))
        finished = self._drop_finished()
        for r in finished:
            r.finished = t2
        if self.cache.rows and self.cache.slots > 2 * max(self.cache.lengths()) + self.compact_slack:
            self.cache.compact()  # padding and rejected drafts have piled up: attend over what is valid only
        return finished

    def generate(self, prompts: list[list[int]], max_new_tokens: int, max_batch: int | None = None) -> list[Row]:
        """Decode every prompt, at most ``max_batch`` rows at a time (None = all at once); a finished row's place
        is taken by the next prompt before the next round. Returns the rows in prompt order."""
        queue = list(enumerate(prompts))
        cap = max_batch or len(prompts)
        if cap < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        by_rid: dict[int, int] = {}
        out: dict[int, Row] = {}
        while queue or self.rows:
            while queue and len(self.rows) < cap:
                k, p = queue.pop(0)
                by_rid[self.add(p, max_new_tokens)] = k
            for r in self.step():
                out[by_rid[r.rid]] = r
        return [out[k] for k in range(len(prompts))]


MODEL_FREE = {"pld", "suffix", "none"}
