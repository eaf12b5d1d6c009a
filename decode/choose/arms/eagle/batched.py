"""EAGLE chains drafted for every row of a batched engine at once (decode/choose/arms/batched.py).

The serial chain's bookkeeping (chain.py), per row: head entry j = layer(fc([emb(x_{j+1}), f_j])) built from TRUE
target features only. A joining row is prefilled from the target's prefill features (entries 0..P-2, whose last
output predicts the feature after the prompt); after every round the target's features at the positions that
produced the row's new tokens wait as pending entries; a draft step feeds the head's own output back with the
token drafted from it (EAGLE-1: the predicted feature; EAGLE-3: the recurrent state h).

An ``expand=1`` tree (tree.py: the chain with each depth's runner-up tokens) drafts here too: its chain is fed as
a chain's, and the runner-ups of each depth come from the same head row (``ChainTree``). Not batched (the engine
refuses them with a clear error): trees that expand more than one node a depth and K sampled chains (tree.py), and
``counterfactual=true`` (the serial arm's unplayed drafts for the router).
"""
from __future__ import annotations

import copy

import torch

from ....core.attention import our_attention_model
from ....core.hidden import layer_features
from ...heads import EagleHead
from ..batched import BatchDrafter


class EagleBatch(BatchDrafter):
    """One EAGLE head's drafting for every row of a batched engine."""

    needs_hidden = True

    def __init__(self, head: EagleHead, rows: int = 0, compact_slack: int = 32):
        self.head = head
        self.layers = head.target_layers  # the target hidden-state layers its features are read from
        super().__init__(head, head.model.config, rows, compact_slack)

    def features(self, hidden_states) -> torch.Tensor:
        return layer_features(hidden_states, self.layers)

    def _prefill(self, prompt, feats):
        if feats is None or len(prompt) < 2:
            return [], None
        return list(prompt[1:]), feats  # entry j: f_j with x_{j+1}, j = 0..P-2

    def _extra(self, rows: torch.Tensor) -> torch.Tensor:
        return self.head.input_features(rows)  # EAGLE-3: g = fuse(low, mid, high)

    def feed_ragged(self) -> bool:
        """The head's layer stack runs our attention from now on, on a copy that shares every weight (the head
        itself, which the serial arm runs, is left as it is): blocks with padding go ragged."""
        run = copy.copy(self.head)
        run._modules = {**self.head._modules, "model": our_attention_model(self.head.model)}
        self.head, self.ragged = run, True
        return True

    def _run(self, ids, extra, pos, cache, mask):
        return self.head(extra, ids, past_key_values=cache, attention_mask=mask, use_cache=True, position_ids=pos)

    def _logits(self, out):
        return self.head.draft_logits(out)

    def _step_input(self, out):
        return out  # the head's output is the next step's feature
