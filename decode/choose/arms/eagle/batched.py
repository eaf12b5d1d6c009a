"""EAGLE chains drafted for every row of a batched engine at once (issue 32 §1: neural arms draft batched per arm).

One :class:`EagleBatch` per head serves all rows of a :class:`~decode.engine.batch.BatchEngine`; each row keeps
its own :class:`~decode.choose.arms.eagle.chain.EagleArm` instance (its L, label, sampling and generator: the
policy's arm), but the head's state for every row lives here, in one :class:`~decode.core.row_cache.RowCache`
over the head's single decoder layer, rows in the engine's order.

The bookkeeping is the serial chain's (chain.py), per row: head entry j = layer(fc([emb(x_{j+1}), f_j])) built
from TRUE target features only. A row joining is prefilled alone from the target's prefill features (entries
0..P-2, whose last output predicts the feature after the prompt). After every target round the engine hands
each row's features at the positions that produced its new tokens (:meth:`observe`); they wait as pending
entries until a round in which some row drafts with this head, when ONE head forward over a padded block
brings every row's true entries up to its context (:meth:`catch_up`), then one head forward per further draft
position advances the rows still drafting (the others sit in it as padding). The draft positions' slots are
invisible once the drafts are out (``RowCache.forget``): EAGLE recomputes them from the target's features.

A row's drafts are therefore the serial chain's from the same context (tests/test_batch_eagle.py checks it token
for token on a float64 target), and lossless follows from the verifier, as for every arm.

Not batched (refused with a clear error by the batched engine): EAGLE trees and K sampled chains (tree.py), and
``counterfactual=true`` (the serial arm's unplayed drafts for the router).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ....core.draft import Draft
from ....core.hidden import layer_features
from ....core.row_cache import RowCache
from ....core.sampling import choose_token
from ...heads import EagleHead
from .chain import EagleArm


def drafts_batched(arm) -> bool:
    """Whether batched rounds draft ``arm`` through an :class:`EagleBatch` (a plain EAGLE chain)."""
    return type(arm) is EagleArm and not arm.greedy_counterfactual


class EagleBatch:
    """One head's drafting for every row of a batched engine (module docstring). ``rows``: the rows already in
    the batch when it is made (none of them drafts with it)."""

    def __init__(self, head: EagleHead, rows: int = 0, compact_slack: int = 32):
        self.head = head
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layers = head.target_layers  # the target hidden-state layers its features are read from
        self.cache = RowCache(head.model.config)
        self.compact_slack = compact_slack
        self.used: list[bool] = []  # the row drafts with this head (else it is an empty row, kept for the order)
        self.entries: list[int] = []  # true head entries (positions 0..entries-1) per row
        self.pending: list[list[tuple[torch.Tensor, list[int]]]] = []  # (target rows, their next tokens) not fed yet
        self.after: list[torch.Tensor | None] = []  # the head's prediction after the row's context (None: none yet)
        for _ in range(rows):
            self.add_row(None, None)

    @property
    def rows(self) -> int:
        return len(self.used)

    def features(self, hidden_states) -> torch.Tensor:
        """This head's target rows ``[B, T, d·len(layers)]`` out of an HF forward's ``hidden_states``."""
        return layer_features(hidden_states, self.layers)

    # ---- rows join and leave ------------------------------------------------------------------------------

    @torch.inference_mode()
    def add_row(self, prompt: list[int] | None, feats: torch.Tensor | None) -> None:
        """Append a row. ``prompt`` None: a row that does not draft with this head. ``feats``: the target's rows
        ``[P-1, ·]`` at the prompt's positions 0..P-2 (its prefill; None for a one-token prompt)."""
        self.used.append(prompt is not None)
        self.pending.append([])
        self.after.append(None)
        n = 0 if prompt is None or feats is None else len(prompt) - 1
        cache = None
        if n:
            cache = DynamicCache()
            out = self.head(self.head.input_features(feats[None].to(self.device, self.dtype)),
                            torch.tensor([prompt[1:]], device=self.device), past_key_values=cache, use_cache=True,
                            position_ids=torch.arange(n, device=self.device)[None])
            self.after[-1] = out[0, -1]
        self.entries.append(n)
        self.cache.add(cache, n)

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order), as the engine does."""
        self.cache.select(keep)
        for name in ("used", "entries", "pending", "after"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])

    def observe(self, row: int, feats: torch.Tensor, tokens: list[int]) -> None:
        """After a target round: the row's target rows at the positions that produced ``tokens`` (its new ones)."""
        if self.used[row] and len(tokens):
            self.pending[row].append((feats[:len(tokens)], list(tokens)))

    # ---- drafting ---------------------------------------------------------------------------------------

    def _forward(self, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One head forward of a ``[B, W]`` block over every row; the caller commits the slots."""
        mask = self.cache.block(valid, self.dtype, self.device)
        return self.head(feats, ids.to(self.device), past_key_values=self.cache.hf, attention_mask=mask,
                         use_cache=True, position_ids=pos.to(self.device))

    @torch.inference_mode()
    def catch_up(self) -> None:
        """Feed every row's pending true entries in one forward; each such row's prediction after its context."""
        widths = [sum(len(t) for _, t in p) for p in self.pending]
        W = max(widths, default=0)
        if not W:
            return
        B, d = self.rows, self.head.embed.weight.shape[1]
        feats = torch.zeros(B, W, d, device=self.device, dtype=self.dtype)
        ids = torch.zeros(B, W, dtype=torch.long)
        valid = torch.zeros(B, W, dtype=torch.bool)
        pos = torch.zeros(B, W, dtype=torch.long)
        for b, (p, n) in enumerate(zip(self.pending, widths)):
            if n:
                rows = torch.cat([f for f, _ in p]).to(self.device, self.dtype)
                feats[b, :n] = self.head.input_features(rows).to(self.dtype)
                ids[b, :n] = torch.tensor([t for _, toks in p for t in toks])
                valid[b, :n] = True
            pos[b] = self.entries[b] + torch.arange(W)
        out = self._forward(feats, ids, pos, valid)
        self.cache.commit(valid)
        for b, n in enumerate(widths):
            if n:
                self.after[b] = out[b, n - 1]
                self.entries[b] += n
                self.pending[b] = []

    @torch.inference_mode()
    def propose(self, rows: list[int], caps: list[int], arms: list[EagleArm]) -> list[Draft]:
        """Chains of up to ``caps[k]`` tokens for the rows ``rows[k]``, each drafted under its arm's sampling and
        generator; a row with nothing to draft from (a one-token prompt) gets an empty draft."""
        self.catch_up()
        drafts = [Draft.empty() for _ in rows]
        live = [k for k, (b, c) in enumerate(zip(rows, caps)) if c > 0 and self.after[b] is not None]
        if not live:
            return drafts
        f = torch.stack([self.after[rows[k]] for k in live])  # the feature each live row drafts its next token from
        tokens: dict[int, list[int]] = {k: [] for k in live}
        dists: dict[int, list[torch.Tensor]] = {k: [] for k in live}
        hidden: dict[int, list[torch.Tensor]] = {k: [] for k in live}
        start = self.cache.slots
        for i in range(max(caps[k] for k in live)):
            going = [j for j, k in enumerate(live) if caps[k] > i]
            if i > 0:  # one head step for the rows still drafting, the others padding
                B = self.rows
                step = torch.zeros(B, 1, f.shape[-1], device=self.device, dtype=self.dtype)
                ids = torch.zeros(B, 1, dtype=torch.long)
                valid = torch.zeros(B, 1, dtype=torch.bool)
                pos = torch.zeros(B, 1, dtype=torch.long)
                at = [rows[live[j]] for j in going]
                step[at, 0] = f[going].to(self.dtype)
                ids[at, 0] = torch.tensor([tokens[live[j]][-1] for j in going])
                valid[at] = True
                pos[at, 0] = torch.tensor([self.entries[b] + i - 1 for b in at])
                out = self._forward(step, ids, pos, valid)
                self.cache.commit(valid)
                f[going] = out[at, 0].to(f.dtype)
            logits = self.head.draft_logits(f[going]).float()
            for j, row_logits in zip(going, logits):
                k = live[j]
                tok, dist = choose_token(row_logits, arms[k].sampling, arms[k].generator)
                tokens[k].append(int(tok))
                dists[k].append(dist)
                hidden[k].append(f[j].float().clone())  # f changes in place next step
        self.cache.forget(start)  # the draft positions' entries were built from predicted features
        self.cache.tidy(self.compact_slack)
        for k in live:
            drafts[k] = Draft(torch.tensor(tokens[k]), q=torch.stack(dists[k]), hidden=torch.stack(hidden[k]))
        return drafts
