"""The target's forward without transformers' per-call machinery: one loop over the HF model's own modules.

Why: on a CPU a verification forward of the default target (30 layers, a few positions) spends a tenth of its time
in transformers' Python around the kernels: output-capturing hooks on every layer, the mask factory, the attention
interface's dispatch, keyword plumbing through three module levels, a five-op RMSNorm. Measured (AMX Xeon,
2 threads, the engine's run model, prefix cache at 300 tokens, hidden states of 4 layers; ``Target.score_tree``
interleaved 40 times, medians; runs/diag/lean_ab.py): 1 / 4 / 8 / 11 positions 56.7 / 66.3 / 66.7 / 80.6 ms →
51.8 / 59.9 / 63.5 / 76.2, with identical logits and hidden states; a fixed tree arm 1.18× → 1.23× plain
``generate`` (docs/performance.md). gpt-fast and vLLM run their own model loops for the same reason.

What it runs is the HF model's modules and weights, not a copy: the embedding, ``rotary_emb`` (so any RoPE
scaling the config sets), the q/k/v/o and MLP projections as loaded (PackedLinears included), the cache's own
``update`` (dynamic or prefix). Between them, on a float32 CPU target (``fused``), the fused ops of
decode/core/kernels/glue.py: RMSNorm, rotary embedding, the gated SiLU and the attention of up to 32 queries (they
took a verification forward from 51.1 to 45.6 ms at 12 positions: docs/performance.md). Elsewhere PyTorch's:
``torch.nn.functional.rms_norm`` for float32 norms (the same ops as HF's norm there; the module itself in other
dtypes), transformers' ``apply_rotary_pos_emb``, the MLP module, the engine's attention function
(decode/core/attention.py, the one the HF path calls). Ours either way: the residual adds and a boolean causal mask
for several positions (True = attend, what transformers builds for SDPA).

Which models: the Llama layout (:data:`LAYOUT_TYPES`) with full attention in every layer; a sliding window,
per-head q/k norms (Qwen3) or any other layer type is left to transformers (:func:`lean_unusable` says why). The
engines run it for the serial target's eager forwards (``--forward auto``, the default, where usable), and an EAGLE
head's decoding steps then run its one-layer stack through the same loop (:class:`LeanLayers`;
``EagleHead.run_lean``: 1.63x -> 1.66x plain ``generate`` with the shipped pool). The batched engine's blocks run
it too (B rows, or a ragged block's real slots: the fused ops row-wise, attention the engine's own, which scatters
a ragged block; at B = 1 the shipped pool went from 1.18x to 1.41x plain ``generate``); the compiled static-cache
forward keeps transformers'. Outputs are checked against HF's forward (logits, every hidden state, the cache) in
tests/test_lean.py and tests/test_eagle3.py, and every decode against plain greedy.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..common.errors import UserError
from . import ragged
from .attention import NAME as GQA_ATTENTION, _attention_shape, gqa_sdpa_attention
from .kernels import glue

FORWARD_KINDS = ("auto", "lean", "hf")
LAYOUT_TYPES = ("llama", "qwen2")  # model types whose decoder layer this loop re-implements (module docstring)


@dataclass
class LeanOutput:
    """What the engines read of an HF ``CausalLMOutputWithPast``."""
    logits: torch.Tensor  # [1, n or logits_to_keep, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # HF's tuple: embeddings, each layer's output, the normed final


def lean_unusable(model, cache_kind: str, compile: bool = False) -> str | None:
    """Why the lean forward cannot run ``model`` (a causal LM) with this cache (None: it can)."""
    return stack_unusable(model.model, cache_kind, compile)


def stack_unusable(inner, cache_kind: str, compile: bool = False) -> str | None:
    """Why :class:`LeanLayers` cannot run the decoder stack ``inner`` (an HF ``LlamaModel``-like module: ``config``,
    ``layers``, ``rotary_emb``) with this cache (None: it can)."""
    cfg = inner.config
    if compile:
        return "--compile runs transformers' forward through torch.compile"
    if cache_kind not in ("dynamic", "prefix"):
        return f"the {cache_kind} cache attends over its whole allocation (lean runs dynamic and prefix caches)"
    if cfg.model_type not in LAYOUT_TYPES:
        return f"model type '{cfg.model_type}' is not one whose layer it re-implements ({', '.join(LAYOUT_TYPES)})"
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or (getattr(cfg, "use_sliding_window", False)
                                             and getattr(cfg, "sliding_window", None)):
        return "a sliding-window layer needs its window in the mask"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 splits the linears"
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in ("sdpa", GQA_ATTENTION):
        return f"attention '{attn}' (lean runs SDPA, as the engines' attention does)"
    layer = inner.layers[0]
    missing = [n for n in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp") if not hasattr(layer, n)]
    missing += [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(layer.self_attn, n)]
    if missing or hasattr(layer.self_attn, "q_norm"):
        return f"its decoder layer is not the Llama layout ({', '.join(missing) or 'q/k norms'})"
    return None


def glue_unusable(model) -> str | None:
    """Why the lean forward runs PyTorch's ops, not the fused ones of decode/core/kernels/glue.py (None: it runs
    those): they are float32 CPU kernels."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"the fused layer ops are float32 CPU kernels (the target is {param.dtype} on {param.device.type})"
    head_dim = _attention_shape(model)[2]
    if head_dim > glue.MAX_HEAD_DIM:
        return f"head_dim {head_dim} is over the fused attention's {glue.MAX_HEAD_DIM}"
    return glue.glue_usable()


def resolve_forward(spec: str, model, cache_kind: str, compile: bool = False) -> str:
    """``--forward``: ``lean`` (refused with the reason where it cannot run), ``hf``, or ``auto`` = lean where it can
    run, else hf (the reason on stderr)."""
    if spec not in FORWARD_KINDS:
        raise UserError(f"--forward must be one of {', '.join(FORWARD_KINDS)}, got '{spec}'")
    if spec == "hf":
        return "hf"
    why = lean_unusable(model, cache_kind, compile)
    if why is None:
        if next(model.parameters()).device.type == "cpu" and (slow := glue_unusable(model)) is not None:
            print(f"--forward {spec}: the lean loop runs PyTorch's ops between the linears ({slow})", file=sys.stderr)
        return "lean"
    if spec == "lean":
        raise UserError(f"--forward lean cannot run this target: {why}; use --forward hf (or auto)")
    print(f"--forward auto: transformers' forward ({why})", file=sys.stderr)
    return "hf"


class LeanLayers:
    """An HF decoder stack's layers as one loop (the module docstring): ``x`` [B, n, d] in (embeddings, or what a
    head's stack takes; a batched round's block, or its ragged ``[1, N, d]`` slots), the last layer's output out,
    every layer's output appended to ``states`` when given. A layer that reads its input otherwise (EAGLE-3's first
    layer) says how with ``attention_input(x, norm)`` → (what q/k/v read, the residual); a plain layer's is its input
    norm and ``x``."""

    def __init__(self, inner):
        self.inner = inner
        param = next(inner.parameters())
        self.float32_norms = param.dtype == torch.float32
        self.fused = glue_unusable(inner) is None  # the layer's small ops as decode/core/kernels/glue.py's
        mlp = inner.layers[0].mlp
        self.silu_mlp = (getattr(inner.config, "hidden_act", None) in ("silu", "swish")
                         and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")))

    def norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if getattr(norm, "weight", None) is None:  # nn.Identity (a head without its input norm)
            return norm(x)
        if self.fused:
            return glue.rms_norm(x, norm.weight, norm.variance_epsilon)
        if self.float32_norms:  # the same float32 ops as HF's RMSNorm, fused
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
        return norm(x)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: tuple):
        """The q and k projections' outputs ``[B, n, heads * D]``, rotated, as ``[B, heads, n, D]`` (``shape``: the
        ``[B, n, heads, D]`` view)."""
        if self.fused:  # in place, then the views
            glue.rope_(q, k, cos, sin)
            return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
        return apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)

    def _attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                fused: bool) -> torch.Tensor:
        """``[B, n, heads * D]``, what o_proj takes."""
        if fused:
            return glue.attention(q, k, v, mask, attn.scaling)
        o, _ = gqa_sdpa_attention(attn, q, k, v, mask, scaling=attn.scaling)
        return o.reshape(q.shape[0], q.shape[2], -1)

    def _mlp(self, mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.fused and self.silu_mlp:
            return mlp.down_proj(glue.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return mlp(h)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, past_key_values,
                 attention_mask: torch.Tensor | None = None, states: list | None = None) -> torch.Tensor:
        B, n = x.shape[0], x.shape[1]
        cos, sin = self.inner.rotary_emb(x, position_ids)
        mask = attention_mask
        # the fused attention takes one sequence; a batched block (B rows, or ragged: decode/core/ragged.py) and a
        # prefill go to the engine's attention
        fused_attention = self.fused and B == 1 and n <= glue.ATTENTION_MAX_QUERIES and ragged.active() is None
        if mask is None and n > 1 and B == 1:  # a chain: query i sees keys 0..start+i
            start = past_key_values.get_seq_length()
            if start > 0 or fused_attention:
                keys = torch.arange(start + n, device=x.device)
                mask = (keys[None, :] <= (start + torch.arange(n, device=x.device))[:, None])[None, None]
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            custom = getattr(layer, "attention_input", None)
            h, residual = custom(x, self.norm) if custom is not None else (self.norm(layer.input_layernorm, x), x)
            shape = (B, n, -1, attn.head_dim)
            q, k = self._rope(attn.q_proj(h), attn.k_proj(h), cos, sin, shape)
            k, v = past_key_values.update(k, attn.v_proj(h).view(shape).transpose(1, 2), i)
            x = residual + attn.o_proj(self._attend(attn, q, k, v, mask, fused_attention))
            x = x + self._mlp(layer.mlp, self.norm(layer.post_attention_layernorm, x))
            if states is not None:
                states.append(x)
        return x


class LeanForward:
    """Calls like the HF causal LM for the engines' forwards: ``input_ids`` [1, n], ``position_ids`` [1, n], an HF
    cache, an optional 4-D additive ``attention_mask`` (a tree's; None = causal), ``output_hidden_states``,
    ``logits_to_keep`` (0 = every position); ``use_cache`` is taken for the HF signature (the cache is always
    written)."""

    def __init__(self, model):
        self.model = model
        self.layers = LeanLayers(model.model)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_key_values,
                 attention_mask: torch.Tensor | None = None, output_hidden_states: bool = False,
                 logits_to_keep: int = 0, use_cache: bool = True) -> LeanOutput:
        inner = self.model.model
        x = inner.embed_tokens(input_ids)
        states = [x] if output_hidden_states else None
        x = self.layers.norm(inner.norm, self.layers(x, position_ids, past_key_values, attention_mask, states))
        if states is not None:
            states[-1] = x  # HF's tuple ends with the normed final state in place of the last layer's output
        logits = self.model.lm_head(x if not logits_to_keep else x[:, -logits_to_keep:])
        return LeanOutput(logits, tuple(states) if states is not None else None)
