"""Neural arms drafting for every row of a batched engine at once (issue 32 §1: neural arms draft batched per arm).

A :class:`~decode.engine.batch.BatchEngine` gives each row its own instance of every arm (its L, label, sampling
and generator: what the row's policy plays), but an arm that drafts with a model of its own — an EAGLE head, a
drafter LM — would run that model once per row. Such an arm names a ``batch_key`` (its module: rows whose arms
share it draft together) and builds a :class:`BatchDrafter` for it (``batch_drafter``): one
:class:`~decode.core.row_cache.RowCache` over the module's layers holds every row's cache, rows in the engine's
order, and every row that plays the arm in a round drafts in one forward per draft position.

Per row, as each serial arm does it: the module's cache holds entries built from TRUE inputs only (committed tokens;
for EAGLE, with the target's features at them), and nothing is fed before a row drafts: a joining row's prompt
(:meth:`add_row`) and, after every target round, its new tokens (with, for a drafter that ``needs_hidden``, the
target's hidden states at the positions that produced them: :meth:`observe`) wait as pending entries until a round in
which that row drafts with this module (at 16 rows most rounds draft nothing, and prefilling a head for every joining
row cost 9 ms a row here; a row that never drafts holds its entries, for an EAGLE-3 head 3 × hidden floats a token,
until it leaves). Then :meth:`catch_up` feeds a row whose prompt is still pending alone (one long prompt padded in
with the others would widen every row's block to its length), and the other drafting rows' pending entries in ONE
forward over a padded block; then one forward per further draft position advances the rows still drafting, the others
sitting in it as padding (not computed where the engine feeds ragged blocks and the module can: :meth:`feed_ragged`,
decode/core/ragged.py). The draft positions' slots become invisible once the drafts are out (``RowCache.forget``).
A row's drafts are therefore the serial arm's from the same context (tested token for token on float64 targets), and
lossless follows from the verifier, as for every arm.

A subclass says what a forward takes and returns (:meth:`_run`), how its output becomes logits over the target
vocabulary (:meth:`_logits`), what a draft step feeds besides the drafted token (:meth:`_step_input`), and what a
joining row's prefill feeds (:meth:`_prefill`).
"""
from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from ...common.device import synchronize
from ...core import ragged
from ...core.draft import Draft
from ...core.row_cache import RowCache
from ...core.sampling import choose_token, probs


BACKLOG = 8  # a catch-up of more pending entries than a round commits: rounds drafted otherwise (``catch_up``)


def drafts_batched(arm) -> bool:
    """Whether batched rounds draft ``arm`` through a :class:`BatchDrafter` (else: per row, model-free)."""
    return getattr(arm, "batch_key", None) is not None


class BatchDrafter:
    """One drafting module's state for every row of a batched engine (module docstring). ``config``: the HF config
    that sizes its cache; ``rows``: the rows already in the batch when it is made (none of them drafts with it)."""

    needs_hidden = False  # reads the target's hidden states (observe gets them)
    ragged = False  # blocks with padding are fed as their real slots (:meth:`feed_ragged`)

    def __init__(self, module: torch.nn.Module, config, rows: int = 0, compact_slack: int = 32):
        p = next(module.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache = RowCache(config)
        self.compact_slack = compact_slack
        self.used: list[bool] = []  # the row drafts with this module (else an empty row, kept for the order)
        self.entries: list[int] = []  # true cache entries (positions 0..entries-1) per row
        # per row, inputs not fed yet: (extra input rows [n, ·] or None, their tokens)
        self.pending: list[list[tuple[torch.Tensor | None, list[int]]]] = []
        self.after: list[torch.Tensor | None] = []  # the module's output after the row's context (None: none yet)
        self.fed_seconds = 0.0  # spent feeding rows' prompts alone (one-off work per row: not a draft step's cost)
        self.backlog_seconds = 0.0  # spent catching up backlogs (``catch_up``: the round's cost, not a forward's)
        for _ in range(rows):
            self.add_row(None, None)

    # ---- what a subclass says ---------------------------------------------------------------------------

    def features(self, hidden_states) -> torch.Tensor:
        """The target rows this drafter reads out of an HF forward's ``hidden_states`` (``needs_hidden`` only)."""
        raise NotImplementedError

    def _prefill(self, prompt: list[int], feats: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """A joining row's true inputs at positions 0..n-1: (tokens, extra input rows or None)."""
        raise NotImplementedError

    def _run(self, ids: torch.Tensor, extra: torch.Tensor | None, pos: torch.Tensor, cache, mask) -> torch.Tensor:
        """One forward of a ``[B, W]`` block: its output per position ``[B, W, d]``."""
        raise NotImplementedError

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs ``[n, d]`` → logits over the target vocabulary ``[n, V]`` (``-inf`` outside a draft vocabulary)."""
        raise NotImplementedError

    def _step_input(self, out: torch.Tensor) -> torch.Tensor | None:
        """What a draft step feeds beside its token, from the output it drafted that token from (None: tokens only)."""
        return None

    def _extra(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored extra input rows → what the module reads (EAGLE-3 fuses the target's layers here)."""
        return rows

    def feed_ragged(self) -> bool:
        """From now on feed blocks with padding as their real slots (decode/core/ragged.py), where the module can:
        its stack must run our attention, which unpacks them. Returns whether it does (here: no)."""
        return False

    # ---- rows join and leave ------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.used)

    def add_row(self, prompt: list[int] | None, feats: torch.Tensor | None) -> None:
        """Append a row; its prompt's entries wait as its first pending ones (fed alone by the first round in which
        it drafts with this module: :meth:`catch_up`). ``prompt`` None: a row that does not draft with this module.
        ``feats``: the target's rows at the prompt's cached positions 0..P-2 (``needs_hidden`` drafters; None
        otherwise)."""
        self.used.append(prompt is not None)
        ids, extra = ([], None) if prompt is None else self._prefill(prompt, feats)
        self.pending.append([(extra, list(ids))] if ids else [])
        self.after.append(None)
        self.entries.append(0)
        self.cache.add(None, 0)

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order), as the engine does."""
        self.cache.select(keep)
        for name in ("used", "entries", "pending", "after"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])

    def observe(self, row: int, feats: torch.Tensor | None, tokens: list[int]) -> None:
        """After a target round: the row's new ``tokens`` (and the target's rows at the positions that produced
        them, for a drafter that ``needs_hidden``)."""
        if self.used[row] and len(tokens):
            self.pending[row].append((None if feats is None else feats[:len(tokens)], list(tokens)))

    # ---- drafting ---------------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, extra: torch.Tensor | None, pos: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
        """One forward of a ``[B, W]`` block over every row's cache, its real slots then kept. Fed ragged
        (:meth:`feed_ragged`) where it has padding: at 16 rows a catch-up block is as wide as the longest row's
        pending entries and a draft step holds every row not drafting; the padding slots' outputs are left unset
        (nothing reads them)."""
        mask = self.cache.block(valid, self.dtype, self.device)
        block = ragged.RaggedBlock.of_padded(valid) if self.ragged else None
        if block is not None:
            ids, pos = block.gather(ids), block.gather(pos)
            block = block.to(self.device)
            extra = None if extra is None else block.gather(extra)
        with ragged.running(block):
            out = self._run(ids.to(self.device), extra, pos.to(self.device), self.cache.hf, mask)
        self.cache.commit(valid)
        return out if block is None else block.scatter(out, fill=False)

    @torch.inference_mode()
    def catch_up(self, rows: list[int]) -> None:
        """Feed the pending true entries of the rows ``rows`` (those about to draft); each one's output after its
        context. A row with no entry yet (its prompt pending) is fed alone, into its empty cache row: padded in
        with the others, one long prompt would widen every row's block to its length. The rest go in one forward,
        every other row padding in it; rows not drafting keep their pending entries for a round in which they do.
        A catch-up wider than BACKLOG entries pays off rounds in which its rows drafted otherwise (``backlog_seconds``):
        counted as a module forward's cost it made the module dearer the longer the rows had not drafted with it, so
        they drafted with it less and the backlogs grew (the suspect where, on an EPYC, the router stopped drafting
        with the head for the rest of a run); it stays the drafting round's cost, which the round's cost correction
        reads."""
        for b in rows:
            if not self.entries[b] and self.pending[b]:
                self._feed_alone(b)
        inputs = {b: self._inputs(b) for b in rows if self.pending[b]}  # row -> its tokens, what it reads beside
        if not inputs:
            return
        t = time.perf_counter()
        W = max(len(toks) for toks, _ in inputs.values())
        B = self.rows
        ids = torch.zeros(B, W, dtype=torch.long)
        valid = torch.zeros(B, W, dtype=torch.bool)
        pos = torch.arange(W)[None] + torch.tensor(self.entries)[:, None]
        extra = None
        for b, (toks, rows_in) in inputs.items():
            n = len(toks)
            ids[b, :n] = torch.tensor(toks)
            valid[b, :n] = True
            if rows_in is not None:
                if extra is None:
                    extra = torch.zeros(B, W, rows_in.shape[-1], device=self.device, dtype=self.dtype)
                extra[b, :n] = rows_in
        out = self._forward(ids, extra, pos, valid)
        for b, (toks, _) in inputs.items():
            self.after[b] = out[b, len(toks) - 1]
            self.entries[b] += len(toks)
            self.pending[b] = []
        if W > BACKLOG:
            synchronize(self.device)
            self.backlog_seconds += time.perf_counter() - t

    def _inputs(self, b: int) -> tuple[list[int], torch.Tensor | None]:
        """Row ``b``'s pending entries: their tokens and what the module reads beside them (None: tokens only)."""
        p = self.pending[b]
        toks = [t for _, ts in p for t in ts]
        if p[0][0] is None:
            return toks, None
        return toks, self._extra(torch.cat([f for f, _ in p]).to(self.device, self.dtype)).to(self.dtype)

    def _feed_alone(self, b: int) -> None:
        """Row ``b``'s pending entries in a forward of its own (its cache row is empty), then written into its row."""
        t = time.perf_counter()
        toks, rows_in = self._inputs(b)
        n = len(toks)
        cache = DynamicCache()
        out = self._run(torch.tensor([toks], device=self.device), None if rows_in is None else rows_in[None],
                        torch.arange(n, device=self.device)[None], cache, None)
        self.cache.fill(b, cache, n)
        self.after[b] = out[0, -1]
        self.entries[b] = n
        self.pending[b] = []
        synchronize(self.device)
        self.fed_seconds += time.perf_counter() - t

    @torch.inference_mode()
    def propose(self, rows: list[int], caps: list[int], arms: list) -> list[Draft]:
        """Chains of up to ``caps[k]`` tokens for the rows ``rows[k]``, each drafted under its arm's sampling and
        generator; a row with nothing to draft from yet gets an empty draft. Nothing runs when every cap is 0 (the
        pending entries wait for a round that drafts). An arm that grows a tree along its chain (``chain_tree``:
        an EAGLE ``expand=1`` tree, the chain with each depth's runner-up tokens) gets that tree, ``caps[k]`` deep:
        its chain's tokens are the tree's, fed as a chain's are."""
        drafts = [Draft.empty() for _ in rows]
        if not any(caps):
            return drafts
        self.catch_up([b for b, c in zip(rows, caps) if c > 0])
        live = [k for k, (b, c) in enumerate(zip(rows, caps)) if c > 0 and self.after[b] is not None]
        if not live:
            return drafts
        out = torch.stack([self.after[rows[k]] for k in live])  # what each live row drafts its next token from
        grown = {k: t for k in live if (t := arms[k].chain_tree()) is not None}
        tokens: dict[int, list[int]] = {k: [] for k in live}
        dists: dict[int, list[torch.Tensor]] = {k: [] for k in live}
        hidden: dict[int, list[torch.Tensor]] = {k: [] for k in live}
        start = self.cache.slots
        for i in range(max(caps[k] for k in live)):
            going = [j for j, k in enumerate(live) if caps[k] > i]
            if i > 0:  # one step for the rows still drafting, the others padding
                at = [rows[live[j]] for j in going]
                ids = torch.zeros(self.rows, 1, dtype=torch.long)
                valid = torch.zeros(self.rows, 1, dtype=torch.bool)
                pos = torch.zeros(self.rows, 1, dtype=torch.long)
                ids[at, 0] = torch.tensor([tokens[live[j]][-1] for j in going])
                valid[at] = True
                pos[at, 0] = torch.tensor([self.entries[b] + i - 1 for b in at])
                step = self._step_input(out[going])
                extra = None
                if step is not None:
                    extra = torch.zeros(self.rows, 1, step.shape[-1], device=self.device, dtype=self.dtype)
                    extra[at, 0] = step.to(self.dtype)
                out[going] = self._forward(ids, extra, pos, valid)[at, 0].to(out.dtype)
            logits = self._logits(out[going]).float()
            for j, row_logits in zip(going, logits):
                k = live[j]
                if k in grown:
                    tokens[k].append(grown[k].grow(probs(row_logits, arms[k].sampling)))
                    continue
                tok, dist = choose_token(row_logits, arms[k].sampling, arms[k].generator)
                tokens[k].append(int(tok))
                dists[k].append(dist)
                hidden[k].append(out[j].float().clone())  # out changes in place next step
        self.cache.forget(start)  # the draft positions' entries were built from drafted inputs
        self.cache.tidy(self.compact_slack)
        for k in live:
            drafts[k] = grown[k].draft() if k in grown else Draft(torch.tensor(tokens[k]), q=torch.stack(dists[k]),
                                                                    hidden=torch.stack(hidden[k]))
        return drafts
