"""EAGLE-3's first decoder layer (ALGORITHMS.md §9), the one EAGLE-3's reference code, ``speculators``
(``Eagle3DraftModel``) and vLLM run: its input is cat[embedding, feature] (2d), the embedding and the feature are
normalised separately (``input_layernorm`` and ``hidden_norm``), attention's q/k/v read the normalised 2d
concat, and the residual stream carries the raw feature only (``norm_before_residual: false``); o_proj, the
post-attention norm and the MLP are the target layer's.

Built by converting a copy of a target decoder layer in place (:func:`to_eagle3_layer`), so parameter names stay
those of the target's layer class plus ``hidden_norm`` — the names ``speculators`` writes under ``layers.0.``.
Only layer classes with the Llama layout (self_attn.{q,k,v,o}_proj, input/post-attention RMSNorms, mlp; Llama,
Mistral, Qwen2, Qwen3) can be converted; others are refused by name.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ...common.errors import UserError

LAYOUT_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # layer classes whose forward this one re-implements

_CLASSES: dict[type, type] = {}


class Eagle3FirstLayer:
    """Mixin placed before the target's layer class: the forward of EAGLE-3's first layer (module docstring)."""

    hidden_norm: nn.Module

    def attention_input(self, hidden_states: torch.Tensor, norm=lambda module, x: module(x)):
        """(what q/k/v read, the residual) of the input cat[embedding, feature]; ``norm(module, x)`` runs a norm (the
        lean loop's, decode/core/lean.py, passes its own)."""
        embeds, hidden = hidden_states.chunk(2, dim=-1)
        return torch.cat([norm(self.input_layernorm, embeds), norm(self.hidden_norm, hidden)], dim=-1), hidden

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        x, residual = self.attention_input(hidden_states)
        x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache,
                              position_embeddings=position_embeddings, **kwargs)
        h = residual + x
        return h + self.mlp(self.post_attention_layernorm(h))


def _eagle3_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Eagle3{base.__name__}", (Eagle3FirstLayer, base), {"__module__": __name__})
    return _CLASSES[base]


def to_eagle3_layer(layer: nn.Module, model_type: str, *, fresh: bool = False) -> nn.Module:
    """Turn ``layer`` (a copy of a target decoder layer; changed in place and returned) into EAGLE-3's first layer.
    q/k/v become 2d → heads·head_dim: the feature half starts as the layer's own weights and the embedding half at
    zero (``fresh``: both halves at nn.Linear's random init); ``hidden_norm`` starts as a copy of the input norm."""
    if model_type not in LAYOUT_TYPES:
        raise UserError(f"eagle head layer=eagle3 re-implements the Llama-layout decoder layer "
                        f"({', '.join(LAYOUT_TYPES)}); this target is '{model_type}': use head.layer=eagle1")
    attn = layer.self_attn
    d = layer.input_layernorm.weight.shape[0]
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        new = nn.Linear(2 * d, old.out_features, bias=old.bias is not None, device=old.weight.device,
                        dtype=old.weight.dtype)
        if not fresh:
            with torch.no_grad():
                new.weight.zero_()
                new.weight[:, d:].copy_(old.weight)
                if old.bias is not None:
                    new.bias.copy_(old.bias)
        setattr(attn, name, new)
    layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
    layer.__class__ = _eagle3_class(type(layer))
    return layer
