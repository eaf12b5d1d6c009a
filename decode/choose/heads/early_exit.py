"""EESD early-exit drafter: the target's first N layers (shared, frozen) → one trainable decoder
layer initialised from the target's LAST layer → trainable final norm → trainable LM head
initialised from the target's (ALGORITHMS.md §4).

The stack is an instance of the target's own decoder class whose ``layers`` are
``target.layers[:N] + [exit layer]``, so HF's forward does the masks, rotary embeddings and KV cache
(the exit layer sits in cache slot N).

With a draft vocabulary (decode/core/vocab.py) the trainable LM head has only the N rows of its tokens
(initialised from the target's rows) and ``forward`` maps its logits back to the target vocabulary
(``-inf`` outside), so arms and held-out metrics see target-vocabulary rows.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...common.errors import UserError
from ...core.vocab import DraftVocab
from .common import DraftVocabMixin, Head, base_model, build_stack, clone_layer


def default_exit_layers(num_layers: int) -> int:
    """≈10% of the target's layers, at least 1 (EESD: 5–10%)."""
    return max(1, round(0.1 * num_layers))


class EarlyExitDrafter(DraftVocabMixin, Head):
    kind = "early_exit"

    def __init__(self, target: nn.Module, n_layers: int | None = None, draft_vocab: DraftVocab | None = None):
        super().__init__()
        base = base_model(target)
        total = len(base.layers)
        n = default_exit_layers(total) if n_layers is None else int(n_layers)
        if not 1 <= n < total:
            raise UserError(f"early-exit n_layers must be in [1, {total - 1}] for a {total}-layer target, got {n}")
        self.n_layers = n
        self._remember_target(target)
        exit_layer = clone_layer(base.layers[-1], n)
        self.model = build_stack(target, list(base.layers[:n]) + [exit_layer], list(range(n)) + [total - 1],
                                 norm=copy.deepcopy(base.norm), embed=base.embed_tokens)
        self._set_draft_vocab(draft_vocab, target)
        out = target.get_output_embeddings()
        rows = self.draft_rows(out.weight)  # [N, d] with a draft vocabulary, else the full [V, d]
        self.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=out.bias is not None,
                                 device=out.weight.device, dtype=out.weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)
            if out.bias is not None:
                self.lm_head.bias.copy_(self.draft_rows(out.bias))
        for p in self.model.norm.parameters():
            p.requires_grad_(True)

    # -- trainable part -------------------------------------------------------------------------
    def _trainable_prefixes(self) -> tuple[str, ...]:
        return (f"model.layers.{self.n_layers}.", "model.norm.", "lm_head.")

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith(self._trainable_prefixes())}

    def trainable_parameters(self):
        return [p for k, p in self.named_parameters() if k.startswith(self._trainable_prefixes())]

    def freeze_shared(self) -> None:
        """Only the exit layer, norm and head train; the target's layers and embedding stay frozen."""
        for k, p in self.named_parameters():
            p.requires_grad_(k.startswith(self._trainable_prefixes()))

    def head_config(self) -> dict:
        return {"n_layers": self.n_layers, "target": self._signature, **self.draft_vocab_config()}

    @classmethod
    def from_head_config(cls, meta: dict, target, draft_vocab: DraftVocab | None = None) -> "EarlyExitDrafter":
        return cls(cls._check_target(meta, target), meta["n_layers"], draft_vocab=draft_vocab)

    # -- compute ----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, past_key_values=None, attention_mask=None, use_cache: bool = False,
                position_ids=None, **_) -> CausalLMOutputWithPast:
        """Causal-LM output: ``logits`` [B, T, V] and ``hidden_states = (post-norm exit states,)``
        (the shape generic tools such as held-out agreement expect of a drafter)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         use_cache=use_cache, position_ids=position_ids)
        h = out.last_hidden_state
        return CausalLMOutputWithPast(logits=self.full_logits(self.lm_head(h)), hidden_states=(h,),
                                      past_key_values=out.past_key_values)
