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

With a draft vocabulary (decode/core/vocab.py) the head's logits cover only its N tokens: the matching
rows of the target's LM head are copied once at construction into a [N, d] buffer (not saved; the
folder keeps the ids in ``draft_vocab.safetensors``), so a drafted token costs N·d instead of V·d.

Serving layouts: vLLM, SGLang and speculators run the drafter's first decoder layer without an input
RMSNorm, and vLLM's EAGLE-1 drafter builds ``fc`` without a bias. ``input_norm=False`` (the layer's input
norm replaced by an identity, so no ``input_layernorm.weight``) and ``fc_bias=False`` give a head that
`python -m toolkit export --format speculators|eagle` writes as one layer (no pass-through layer) and vLLM
loads; the defaults (True/True) keep the original head.

EAGLE-3 option (ALGORITHMS.md §9), ``feature_layers=(low, mid, high)``: ids into HF ``hidden_states`` (0 =
embeddings, i = output of layer i; :func:`eagle3_layers` gives EAGLE-3's choice). The head's input feature is
g_j = fuse(cat[h_low_j, h_mid_j, h_high_j]) with ``fuse`` = Linear(3d→d, no bias), and the head no longer
predicts a target feature: its decoder layer's output h_j is recurrent (the next draft step's feature in place
of g) and tokens come from lm_head(norm(h)). ``norm`` is the head's own RMSNorm (as EAGLE-3), initialised as
a copy of the target's final norm and trained. Deviations from EAGLE-3 (kept simple, stated here):
  * the layer is EAGLE-1's: fc(cat[emb(x), g]) 2d→d, then one decoder layer of the target's class; EAGLE-3's
    reference layer instead normalises the embedding and the feature separately and feeds their 2d concat to
    an attention whose q/k/v take 2d inputs (so its layer is not the target's class);
  * the LM head stays the target's frozen one (rows of the draft vocabulary), where EAGLE-3 trains its own
    draft-vocabulary LM head;
  * ``fuse`` starts as "take h_high" (identity on the last listed layer, zero elsewhere) so training starts
    from a logit-lens guess, where EAGLE-3 starts it at random;
  * any number ≥ 1 of layers is accepted (EAGLE-3: three).
``layer="eagle3"`` (fused heads only) removes the first deviation: no ``fc``, and the decoder layer is EAGLE-3's
own (decode/choose/heads/eagle3_layer.py: separate norms of embedding and feature, 2d q/k/v, the feature as the
residual), exactly the ``fc`` + first layer + ``norm`` of speculators' ``Eagle3DraftModel``, so such a head
exports to speculators' EAGLE-3 format (``toolkit export --format speculators``) with nothing approximated.
Callers feed raw target rows through :meth:`input_features` (g for a fused head, the feature itself for
EAGLE-1) and the head's own outputs back as they are; :meth:`logits` applies the norm. So chain and tree
drafting are the same code for both styles.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ...common.errors import UserError
from ...core.vocab import DraftVocab
from ...core.hidden import check_hidden_layers
from ...core.lean import LeanLayers, stack_unusable
from .common import DraftVocabMixin, Head, base_model, build_stack, clone_layer, sub_config
from .eagle3_layer import to_eagle3_layer


def eagle3_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high feature layers for an ``n_layers``-layer target, as HF ``hidden_states`` ids: its
    reference code records the input of decoder layers 2, N//2 and N-3 (= the outputs of layers 2, N//2, N-3 in
    HF's numbering, where hidden_states[i] is the input of layer i)."""
    if n_layers < 4:
        raise UserError(f"EAGLE-3's default feature layers (2, N//2, N-3) need a target of >= 4 layers, this one "
                        f"has {n_layers}: set head.feature_layers explicitly")
    return 2, n_layers // 2, n_layers - 3


class EagleHead(DraftVocabMixin, Head):
    kind = "eagle"

    INITS = ("identity", "last_layer", "random")
    LAYERS = ("eagle1", "eagle3")

    def __init__(self, target: nn.Module, init: str = "identity", draft_vocab: DraftVocab | None = None,
                 input_norm: bool = True, fc_bias: bool = True, feature_layers=None, layer: str = "eagle1"):
        """init: ``identity`` = the target's last layer with its output projections zeroed, so the
        head starts as f̂_{t+1} = f_t and learns a residual (a copy of the last layer applied to a
        post-norm feature starts far off); ``last_layer`` = plain copy; ``random`` = fresh layer.
        draft_vocab: draft from these target ids only (None = the full vocabulary).
        input_norm / fc_bias: keep the decoder layer's input RMSNorm / a bias on ``fc`` (module docstring).
        feature_layers: None = EAGLE-1 (post-norm final feature, predicted); a tuple of hidden-state ids = EAGLE-3
        fusion (module docstring).
        layer: ``eagle1`` = fc(cat[emb, feature]) then the target's layer class; ``eagle3`` = EAGLE-3's first layer
        (fused heads only; no fc, so ``fc_bias`` does not apply; it normalises its inputs itself)."""
        super().__init__()
        if init not in self.INITS:
            raise UserError(f"eagle head init must be one of {', '.join(self.INITS)}, got '{init}'")
        if layer not in self.LAYERS:
            raise UserError(f"eagle head layer must be one of {', '.join(self.LAYERS)}, got '{layer}'")
        if layer == "eagle3" and (feature_layers is None or not input_norm):
            raise UserError("eagle head layer=eagle3 is EAGLE-3's first layer: it reads fused target layers "
                            "(set head.features=fused) and normalises its inputs (keep head.input_norm=true)")
        base = base_model(target)
        total = len(base.layers)
        d = target.config.hidden_size
        self._remember_target(target)
        self.layer = layer
        self.init, self.input_norm, self.fc_bias = init, bool(input_norm), bool(fc_bias) and layer == "eagle1"
        self.feature_layers = None if feature_layers is None else check_hidden_layers(
            feature_layers, total, "eagle head feature_layers")
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
        if self.layer == "eagle3":
            layer = to_eagle3_layer(layer, target.config.model_type, fresh=init == "random")
        # tuple: the target's modules are used but not registered (not trained, not saved)
        self._shared = (base.embed_tokens, target.get_output_embeddings())
        self.model = build_stack(target, [layer], [total - 1], norm=nn.Identity(), embed=nn.Identity())
        p = next(base.parameters())
        if self.layer == "eagle1":
            self.fc = nn.Linear(2 * d, d, bias=self.fc_bias, device=p.device, dtype=p.dtype)
            with torch.no_grad():  # start as "pass the feature through" so early training is stable
                self.fc.weight.zero_()
                self.fc.weight[:, d:].copy_(torch.eye(d))
                if self.fc_bias:
                    self.fc.bias.zero_()
        if self.feature_layers is not None:
            n = len(self.feature_layers)
            self.fuse = nn.Linear(n * d, d, bias=False, device=p.device, dtype=p.dtype)
            with torch.no_grad():  # start as "take the high layer" (module docstring)
                self.fuse.weight.zero_()
                self.fuse.weight[:, (n - 1) * d:].copy_(torch.eye(d))
            self.norm = copy.deepcopy(base.norm)
            for q in self.norm.parameters():
                q.requires_grad_(True)
        self._set_draft_vocab(draft_vocab, target)
        self.lean: LeanLayers | None = None  # decoding steps' loop (run_lean)
        if draft_vocab is not None:
            out = target.get_output_embeddings()
            self.register_buffer("draft_weight", self.draft_rows(out.weight), persistent=False)
            self.register_buffer("draft_bias", None if getattr(out, "bias", None) is None
                                 else self.draft_rows(out.bias), persistent=False)

    def run_lean(self, cache_kind: str) -> str | None:
        """Decoding steps (no grad, with a cache) through decode/core/lean.py's loop over the head's layer instead of
        transformers' model forward (its mask factory, hooks and dispatch: ~0.5 ms a step on a CPU), where that loop
        can run this stack with this cache; returns why not (None: it will)."""
        why = stack_unusable(self.model, cache_kind)
        self.lean = LeanLayers(self.model) if why is None else None
        return why

    @property
    def embed(self) -> nn.Module:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    @property
    def fused(self) -> bool:
        """EAGLE-3 style: fused multi-layer input, recurrent output (module docstring)."""
        return self.feature_layers is not None

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target hidden-state layers this head reads (``Target.request_hidden``): (-1,) = post-norm final."""
        return self.feature_layers if self.fused else (-1,)

    def input_features(self, rows: torch.Tensor) -> torch.Tensor:
        """Target rows [..., d·len(target_layers)] → the head's input feature [..., d] (g = fuse(rows) when
        fused; the rows themselves for EAGLE-1)."""
        return self.fuse(rows.to(self.fuse.weight.dtype)) if self.fused else rows

    def head_config(self) -> dict:
        fused = {"feature_layers": list(self.feature_layers)} if self.fused else {}
        if self.layer != "eagle1":  # head.json of EAGLE-1-layer heads stays as it was before the option existed
            fused["layer"] = self.layer
        return {"init": self.init, "input_norm": self.input_norm, "fc_bias": self.fc_bias, **fused,
                "target": self._signature, **self.draft_vocab_config()}

    @classmethod
    def from_head_config(cls, meta: dict, target, draft_vocab: DraftVocab | None = None) -> "EagleHead":
        # heads saved before input_norm/fc_bias existed had both; before feature_layers, all were EAGLE-1 heads
        return cls(cls._check_target(meta, target), init=meta.get("init", "identity"), draft_vocab=draft_vocab,
                   input_norm=meta.get("input_norm", True), fc_bias=meta.get("fc_bias", True),
                   feature_layers=meta.get("feature_layers"), layer=meta.get("layer", "eagle1"))

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, past_key_values=None,
                attention_mask=None, use_cache: bool = False, position_ids=None) -> torch.Tensor:
        """features [B, T, d] (f_0..f_{T-1}), next_tokens [B, T] (x_1..x_T) → predicted f_1..f_T (fused: the
        recurrent states h_0..h_{T-1}, whose tokens are x_2..x_{T+1}'s drafts). features = ``input_features`` of
        target rows, or the head's own earlier outputs."""
        with torch.no_grad():
            e = self.embed(next_tokens)
        x = torch.cat([e.to(features.dtype), features], dim=-1)
        if self.layer == "eagle1":
            x = self.fc(x)
        if (self.lean is not None and x.shape[0] == 1 and past_key_values is not None and use_cache
                and position_ids is not None and not torch.is_grad_enabled()):  # a serial decoding step: the lean loop
            return self.lean(x, position_ids, past_key_values, attention_mask)
        out = self.model(inputs_embeds=x, attention_mask=attention_mask, past_key_values=past_key_values,
                         use_cache=use_cache, position_ids=position_ids)
        return out.last_hidden_state

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ([..., N]; [..., V] without one) of a head output (fused: after the
        head's norm)."""
        if self.fused:
            features = self.norm(features)
        if self.draft_vocab is None:  # the target's own LM head, in the target's dtype (a head may run in another)
            return self.lm_head(features.to(self.lm_head.weight.dtype))
        packed = getattr(self, "draft_projection", None)  # a PackedLinear: decode/core/linear.py pack_arm_linears
        if packed is not None and not torch.is_grad_enabled() and features.dtype == self.draft_weight.dtype:
            return packed(features)
        return F.linear(features, self.draft_weight.to(features.dtype),
                        None if self.draft_bias is None else self.draft_bias.to(features.dtype))

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary, ``-inf`` outside the draft vocabulary (what is sampled)."""
        return self.full_logits(self.logits(features))
