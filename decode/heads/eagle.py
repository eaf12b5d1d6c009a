"""EAGLE feature head (ALGORITHMS.md §5): concat(embedding of x_{t+1}, feature f_t) → linear 2d→d →
one decoder layer of the target's architecture family → predicted feature f_{t+1}; tokens come
from the target's frozen LM head.

Feature = the target's final-layer hidden state after the final norm, i.e. exactly the input of
the LM head (what EAGLE's reference code feeds: ``model.model(...)[0]``; "second-to-top" = the
layer under the LM head). It is what the verification forward already returns, so decoding needs
no extra target computation. The head therefore predicts a post-norm feature and has no norm of
its own. The decoder layer is the target's own HF layer class (a copy of its last layer as the
initial weights), run through the target's decoder class so masks/rotary/KV cache are HF's.
The target's embedding and LM head are used, not owned: they are neither trained nor saved.

With a draft vocabulary (decode/vocab.py) the head's logits cover only its N tokens: the matching
rows of the target's LM head are copied once at construction into a [N, d] buffer (not saved; the
folder keeps the ids in ``draft_vocab.safetensors``), so a drafted token costs N·d instead of V·d.

Serving layouts: vLLM, SGLang and speculators run the drafter's first decoder layer without an input
RMSNorm, and vLLM's EAGLE-1 drafter builds ``fc`` without a bias. ``input_norm=False`` (the layer's input
norm replaced by an identity, so no ``input_layernorm.weight``) and ``fc_bias=False`` give a head that
`python -m toolkit export --format speculators|eagle` writes as one layer (no pass-through layer) and vLLM
loads; the defaults (True/True) keep the original head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..vocab import DraftVocab
from .common import DraftVocabMixin, Head, base_model, build_stack, clone_layer, sub_config


class EagleHead(DraftVocabMixin, Head):
    kind = "eagle"

    INITS = ("identity", "last_layer", "random")

    def __init__(self, target: nn.Module, init: str = "identity", draft_vocab: DraftVocab | None = None,
                 input_norm: bool = True, fc_bias: bool = True):
        """init: ``identity`` = the target's last layer with its output projections zeroed, so the
        head starts as f̂_{t+1} = f_t and learns a residual (a copy of the last layer applied to a
        post-norm feature starts far off); ``last_layer`` = plain copy; ``random`` = fresh layer.
        draft_vocab: draft from these target ids only (None = the full vocabulary).
        input_norm / fc_bias: keep the decoder layer's input RMSNorm / a bias on ``fc`` (module docstring)."""
        super().__init__()
        if init not in self.INITS:
            raise UserError(f"eagle head init must be one of {', '.join(self.INITS)}, got '{init}'")
        base = base_model(target)
        total = len(base.layers)
        d = target.config.hidden_size
        self._remember_target(target)
        self.init, self.input_norm, self.fc_bias = init, bool(input_norm), bool(fc_bias)
        layer = clone_layer(base.layers[-1], 0)
        if init == "identity":
            with torch.no_grad():
                for name, p in layer.named_parameters():
                    if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias")):
                        p.zero_()
        if init == "random":
            layer = type(base.layers[-1])(sub_config(target.config, [total - 1]), 0).to(
                next(base.parameters()).device)
        if not input_norm:
            if not hasattr(layer, "input_layernorm"):
                raise UserError(f"eagle head input_norm=false: {type(layer).__name__} has no input_layernorm to drop")
            layer.input_layernorm = nn.Identity()
        # tuple: the target's modules are used but not registered (not trained, not saved)
        self._shared = (base.embed_tokens, target.get_output_embeddings())
        self.model = build_stack(target, [layer], [total - 1], norm=nn.Identity(), embed=nn.Identity())
        p = next(base.parameters())
        self.fc = nn.Linear(2 * d, d, bias=self.fc_bias, device=p.device, dtype=p.dtype)
        with torch.no_grad():  # start as "pass the feature through" so early training is stable
            self.fc.weight.zero_()
            self.fc.weight[:, d:].copy_(torch.eye(d))
            if self.fc_bias:
                self.fc.bias.zero_()
        self._set_draft_vocab(draft_vocab, target)
        if draft_vocab is not None:
            out = target.get_output_embeddings()
            self.register_buffer("draft_weight", self.draft_rows(out.weight), persistent=False)
            self.register_buffer("draft_bias", None if getattr(out, "bias", None) is None
                                 else self.draft_rows(out.bias), persistent=False)

    @property
    def embed(self) -> nn.Module:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    def head_config(self) -> dict:
        return {"init": self.init, "input_norm": self.input_norm, "fc_bias": self.fc_bias,
                "target": self._signature, **self.draft_vocab_config()}

    @classmethod
    def from_head_config(cls, meta: dict, target, draft_vocab: DraftVocab | None = None) -> "EagleHead":
        # heads saved before input_norm/fc_bias existed had both
        return cls(cls._check_target(meta, target), init=meta.get("init", "identity"), draft_vocab=draft_vocab,
                   input_norm=meta.get("input_norm", True), fc_bias=meta.get("fc_bias", True))

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, past_key_values=None,
                attention_mask=None, use_cache: bool = False, position_ids=None) -> torch.Tensor:
        """features [B, T, d] (f_0..f_{T-1}), next_tokens [B, T] (x_1..x_T) → predicted f_1..f_T."""
        with torch.no_grad():
            e = self.embed(next_tokens)
        x = self.fc(torch.cat([e.to(features.dtype), features], dim=-1))
        out = self.model(inputs_embeds=x, attention_mask=attention_mask, past_key_values=past_key_values,
                         use_cache=use_cache, position_ids=position_ids)
        return out.last_hidden_state

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ([..., N]; [..., V] without one)."""
        if self.draft_vocab is None:
            return self.lm_head(features)
        return F.linear(features, self.draft_weight.to(features.dtype),
                        None if self.draft_bias is None else self.draft_bias.to(features.dtype))

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary, ``-inf`` outside the draft vocabulary (what is sampled)."""
        return self.full_logits(self.logits(features))
