"""``python -m toolkit export ARTIFACT --format eagle|speculators|hf --out DIR``: a trained arm in the
layout a serving stack loads, with a README beside the weights (vLLM ``speculative_config``, SGLang
flags, a transformers snippet) and the vLLM config as its own JSON file.

What each artifact kind can become (anything else is refused, never approximated):

* EAGLE head (``head.json`` kind ``eagle``) → ``eagle``: EAGLE-1's reference layout (SafeAILab/EAGLE
  ``cnets1``, read by EAGLE and SGLang's ``LlamaForCausalLMEagle``): ``config.json`` (the target's
  architecture, ``num_hidden_layers`` = drafter layers, ``bias`` = whether ``fc`` has one) and
  ``model.safetensors`` with ``fc.*`` and ``layers.N.*``. EAGLE-1 runs its first layer without the
  input RMSNorm; our head normalises its fused input, so the export puts an exact pass-through layer
  first (all projections zero: it adds nothing to the residual stream) and our layer second, where
  the norm is kept. Embedding and LM head are the target's, as in EAGLE-1: not written.
  → ``speculators``: the EAGLE-1 layout of the ``speculators`` library (``speculators_model_type:
  eagle``, one ``transformer`` layer, ``fusion_fc``). That layer always runs without an input norm, so
  a head that normalises its input cannot be written exactly there; it is refused with the reason.
* EAGLE-3 head (``feature_layers`` set, ``layer: eagle3``: EAGLE-3's own first layer) → ``speculators``: the
  ``speculators`` EAGLE-3 layout (``speculators_model_type: eagle3``, ``Eagle3DraftModel``; read by vLLM's
  ``eagle3`` method): ``fc`` (our ``fuse``), ``layers.0.*``, ``norm``, ``lm_head`` (the draft vocabulary's rows
  of the target's LM head), ``embed_tokens`` (the target's) and the draft vocabulary as speculators stores it
  (``d2t`` offsets, ``t2d`` mask);
  ``eagle_aux_hidden_state_layer_ids`` = our feature layers (both count the input of decoder layer i as i), written
  ascending with ``fc``'s input blocks permuted to match: vLLM collects the aux states while it runs the target's
  layers, so in ascending layer order whatever order the config lists, and sizes ``fc`` for exactly 3 of them
  (:func:`eagle3_layer_problem`: 3 distinct layers in 0..N-1, or the export is refused; ``head.layer=eagle3``
  recipes are checked the same way when they are read). A target with tied embeddings gets two equal tensors
  (``embed_tokens``, ``lm_head``): safetensors writes no shared storage.
  Checked by reading the export back into an EagleHead (:func:`load_speculators_eagle3_export`): the same draft
  logits. A fused head with the EAGLE-1 layer (fc + the target's layer class) has no exact speculators form and
  is refused with the reason (train with ``head.layer=eagle3``).
* Drafter model (``drafter.json``) → ``hf``: the HF folder as it is (config, weights, tokenizer).
* Early-exit heads and calibrators are runtime-only (they reuse the target's own layers or only score
  drafts); no serving stack has a slot for them.

Every EAGLE export is checked before it is published: the head read back from the exported folder
(:func:`load_eagle_export`) must give the same draft logits as the original on fixed inputs.

Pruned draft vocabularies (decode/core/vocab.py): EAGLE-1 layouts have no slot for one, so the exported head
drafts from the target's whole vocabulary. Its logits over the N kept tokens are the trained head's
exactly (the check compares those columns), but it may now draft tokens outside them: verification
stays lossless, acceptance can differ slightly, and every draft pays the full LM head again. The
README says so, and the subset travels beside the weights (``draft_vocab.safetensors``) for tools that
can use it.
"""
from __future__ import annotations

import datetime as _dt
import json
import shutil
from pathlib import Path

import torch

from decode.common.errors import UserError
from decode.common.io import atomic_path, atomic_write_json

FORMATS = ("eagle", "speculators", "hf")
SUPPORTED = {"eagle": ("eagle", "speculators"), "drafter": ("hf",), "early_exit": (), "calibrator": ()}
EXPORT_META = "adaspec_export.json"
VLLM_CONFIG = "vllm_speculative_config.json"
WEIGHTS = "model.safetensors"
LAYER = "model.layers.0."  # prefix of the decoder layer in an EagleHead state dict
INPUT_NORM = "input_layernorm.weight"
# speculators' EagleSpeculatorConfig as of the last release that has it (0.4.x)
SPECULATORS_SCHEMA = "0.4.0.1"
# speculators' Eagle3SpeculatorConfig as checked by scripts/check_export_speculators.py --eagle3
SPECULATORS_EAGLE3_SCHEMA = "0.9.0"


# --------------------------------------------------------------------------- what the artifact is

def artifact_kind(folder: Path) -> str:
    """``eagle``/``early_exit``/``calibrator`` for a head folder, ``drafter`` for a drafter export."""
    from decode.choose.heads import HEAD_CONFIG, read_head_config

    from .export import DRAFTER_META, read_metadata

    if not folder.is_dir():
        raise UserError(f"ARTIFACT {folder} is not a folder; pass a trained head folder (runs/heads/<kind>/<task>) "
                        "or a drafter export (the train-drafter `export` folder)")
    if (folder / HEAD_CONFIG).is_file():
        return str(read_head_config(folder).get("kind"))
    if (folder / DRAFTER_META).is_file():
        return str(read_metadata(folder).get("kind", "drafter"))
    raise UserError(f"ARTIFACT {folder} holds neither {HEAD_CONFIG} (a trained head) nor {DRAFTER_META} "
                    "(a drafter export); pass a folder written by `make train-eagle` or `make train-drafter`")


def check_format(kind: str, fmt: str, folder: Path) -> None:
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    if kind not in SUPPORTED:
        raise UserError(f"{folder}: unknown artifact kind '{kind}' (known: {', '.join(SUPPORTED)})")
    if fmt not in SUPPORTED[kind]:
        table = "; ".join(f"{k}: {', '.join(v) or 'none (runtime-only)'}" for k, v in SUPPORTED.items())
        raise UserError(f"{folder} is a '{kind}' artifact, which cannot be exported as --format {fmt} "
                        f"(formats per kind: {table})")


# --------------------------------------------------------------------------- EAGLE head layouts

def _split_head_state(state: dict[str, torch.Tensor], folder) -> tuple[dict, dict]:
    """(fc tensors, decoder-layer tensors keyed relative to the layer) of an EagleHead state dict."""
    fc = {k[3:]: v for k, v in state.items() if k.startswith("fc.")}
    layer = {k[len(LAYER):]: v for k, v in state.items() if k.startswith(LAYER)}
    other = sorted(set(state) - {f"fc.{k}" for k in fc} - {LAYER + k for k in layer})
    if "weight" not in fc or not layer or other:
        raise UserError(f"{folder}: head weights are not an EAGLE head's (fc.weight present: {'weight' in fc}, "
                        f"unexpected {other[:3]}); re-export from a folder written by `make train-eagle`")
    return fc, layer


def _passthrough(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer with the same tensors that adds nothing to its input: every projection is zero (so attention
    and MLP outputs are exactly 0), norms are ones; no input norm (EAGLE-1 drops it on the first layer)."""
    return {k: (torch.ones_like(v) if "norm" in k else torch.zeros_like(v))
            for k, v in layer.items() if k != INPUT_NORM}


def _layer_config(target_config, n_layers: int) -> dict:
    """The target's config as a drafter of ``n_layers`` copies of its last layer (HF to_dict form)."""
    from decode.choose.heads.common import sub_config

    last = target_config.num_hidden_layers - 1
    cfg = sub_config(target_config, [last] * n_layers).to_dict()
    cfg.pop("_name_or_path", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"  # the head is saved in float32; servers cast to their dtype
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # readers on transformers < 5 (EAGLE, SGLang, speculators
        cfg.setdefault("rope_theta", rope["rope_theta"])  # 0.4) know only these two keys; without them they would
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}  # silently use rope_theta=10000
        cfg.setdefault("rope_scaling", scaling if scaling.get("rope_type", "default") != "default" else None)
    return cfg


def eagle_layout(state: dict[str, torch.Tensor], target_config, folder) -> tuple[dict, dict, dict]:
    """(tensors, config.json, facts) of EAGLE-1's reference layout for an EagleHead state dict."""
    fc, layer = _split_head_state(state, folder)
    layers = [_passthrough(layer), layer] if INPUT_NORM in layer else [layer]
    bias = "bias" in fc and bool(fc["bias"].abs().max() > 0)  # an all-zero bias is dropped (exact, and vLLM has none)
    tensors = {"fc.weight": fc["weight"], **({"fc.bias": fc["bias"]} if bias else {})}
    for i, lay in enumerate(layers):
        tensors.update({f"layers.{i}.{k}": v for k, v in lay.items()})
    cfg = _layer_config(target_config, len(layers))
    cfg["bias"] = bias  # EAGLE's ea_model reads it to build fc
    facts = {"layers": len(layers), "passthrough_first_layer": len(layers) == 2, "fc_bias": bias}
    return tensors, cfg, facts


def _speculators_config(algorithm: str, target_config, verifier: str, num_tokens: int) -> dict:
    """speculators' ``speculators_config``: a greedy chain of ``num_tokens`` drafts, verified by ``verifier``."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.architectures or [])}}


def speculators_layout(state: dict[str, torch.Tensor], target_config, folder, *, verifier: str,
                       num_tokens: int) -> tuple[dict, dict, dict]:
    """(tensors, config.json, facts) of speculators' EAGLE-1 layout (EagleSpeculatorConfig, layernorms=false)."""
    fc, layer = _split_head_state(state, folder)
    if INPUT_NORM in layer:
        raise UserError(
            f"{folder}: --format speculators cannot hold this head exactly: speculators' EAGLE-1 model "
            "(EagleSpeculator, speculators<=0.4) runs its one decoder layer without the input RMSNorm, as EAGLE-1 "
            f"does, and this head normalises its fused input ({LAYER}{INPUT_NORM}). Use --format eagle (exact: a "
            "pass-through first layer keeps the norm; read by EAGLE and SGLang), or train a head without the input "
            "norm")
    bias = "bias" in fc and bool(fc["bias"].abs().max() > 0)
    tensors = {"fusion_fc.weight": fc["weight"], **({"fusion_fc.bias": fc["bias"]} if bias else {})}
    tensors.update({f"transformer.{k}": v for k, v in layer.items()})
    layer_cfg = _layer_config(target_config, 1)
    # speculators builds its layer from this config alone; without an attention implementation named
    # there its layer fails at the first forward (KeyError: None, seen with speculators 0.4.0.1)
    layer_cfg["attn_implementation"] = "sdpa"
    decoder = type(target_config).__name__.removesuffix("Config") + "DecoderLayer"
    cfg = {
        "architectures": ["EagleSpeculator", decoder],
        "speculators_model_type": "eagle",
        "speculators_version": SPECULATORS_SCHEMA,
        "transformer_layer_architecture": decoder,
        "transformer_layer_config": layer_cfg,
        "layernorms": False,
        "fusion_bias": bias,
        "torch_dtype": "float32",
        "speculators_config": _speculators_config("eagle", target_config, verifier, num_tokens),
    }
    return tensors, cfg, {"layers": 1, "passthrough_first_layer": False, "fc_bias": bias}


EAGLE3_AUX_LAYERS = 3  # speculators' Eagle3DraftModel and vLLM's eagle3 drafters build fc for exactly 3 aux states


def eagle3_layer_problem(layers, n_layers: int | None = None, *, ordered: bool = True) -> str | None:
    """Why vLLM's ``eagle3`` method would not read ``layers`` (HF ``hidden_states`` ids; as
    ``eagle_aux_hidden_state_layer_ids``, both count the input of decoder layer i as i) as our fused head does, or
    None. vLLM appends the aux state of layer i when its decoder loop reaches layer i: each id once, in ascending
    order whatever order the config lists, only for i in 0..N-1 (-1 = HF's post-norm final state and N = the last
    layer's output are never collected), and its ``fc`` takes exactly 3. ``ordered``: also require ascending
    (a recipe; the export permutes ``fc`` instead). ``n_layers`` None: the upper bound is not checked."""
    layers = [int(i) for i in layers]
    n = f"N = {n_layers}" if n_layers is not None else "N = the target's layer count"
    if len(layers) != EAGLE3_AUX_LAYERS:
        return (f"{len(layers)} layer(s) given; vLLM's and speculators' EAGLE-3 fc fuses exactly "
                f"{EAGLE3_AUX_LAYERS} target layers")
    if len(set(layers)) != len(layers):
        return ("the layers must be distinct: vLLM collects each target layer once, so it would fuse fewer states "
                "than fc reads")
    bad = [i for i in layers if i < 0 or (n_layers is not None and i >= n_layers)]
    if bad:
        return (f"vLLM collects the inputs of decoder layers 0..N-1 ({n}) and would never collect {bad} (-1 is the "
                "post-norm final state, N the last layer's output)")
    if ordered and layers != sorted(layers):
        return ("the layers must be ascending: vLLM collects them in ascending layer order whatever order they "
                "are listed in, and fc's input blocks follow that order")
    return None


def speculators_eagle3_layout(head, target_config, folder, *, verifier: str,
                              num_tokens: int) -> tuple[dict, dict, dict]:
    """(tensors, config.json, facts) of speculators' EAGLE-3 layout (Eagle3SpeculatorConfig) for a fused EagleHead
    with EAGLE-3's first layer (``layer: eagle3``)."""
    if not head.fused or head.layer != "eagle3":
        raise UserError(
            f"{folder}: --format speculators writes an EAGLE-3 head exactly only when its layer is EAGLE-3's own "
            f"(head.layer=eagle3: separate norms of embedding and feature, 2d q/k/v, no fc); this head "
            + ("uses the EAGLE-1 layer (fc over [embedding, feature] + the target layer class)" if head.fused
               else "is not fused")
            + ". Retrain with `--recipe recipes/heads/eagle3.yaml` (head.layer=eagle3)")
    n_layers = target_config.num_hidden_layers
    layers = list(head.feature_layers)
    problem = eagle3_layer_problem(layers, n_layers, ordered=False)
    if problem:
        raise UserError(f"{folder}: feature layers {layers} cannot be written as speculators' "
                        f"eagle_aux_hidden_state_layer_ids for this {n_layers}-layer target: {problem}. Retrain with "
                        f"head.feature_layers set to {EAGLE3_AUX_LAYERS} distinct layers in 0..{n_layers - 1}")
    state = head.trainable_state_dict()
    # vLLM concatenates the aux states in ascending layer order: write the ids so and permute fc's input blocks along
    order = sorted(range(len(layers)), key=layers.__getitem__)
    fc = state["fuse.weight"]
    d = fc.shape[1] // len(layers)
    fc = torch.cat([fc[:, j * d:(j + 1) * d] for j in order], 1) if order != sorted(order) else fc
    aux_ids = [layers[j] for j in order]
    # the embedding too, as speculators' own checkpoints hold it: without it, speculators 0.9's from_pretrained was
    # seen to initialise embed_tokens at random instead of leaving it for load_verifier_weights to fill
    tensors = {"fc.weight": fc, "norm.weight": state["norm.weight"],
               "embed_tokens.weight": head.embed.weight.detach()}
    tensors.update({k[len("model."):]: v for k, v in state.items() if k.startswith(LAYER)})
    lm = head.lm_head.weight
    vocab_size = lm.shape[0]
    if head.draft_vocab is None:
        tensors["lm_head.weight"] = lm.detach()
        draft_size = vocab_size
    else:
        ids = head.draft_vocab.d2t
        tensors["lm_head.weight"] = head.draft_rows(lm)
        tensors["d2t"] = ids - torch.arange(len(ids))  # speculators/vLLM: target id = draft index + d2t[index]
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        draft_size = len(ids)
    layer_cfg = _layer_config(target_config, 1)
    cfg = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_EAGLE3_SCHEMA,
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": draft_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "torch_dtype": "float32",
        "speculators_config": _speculators_config("eagle3", target_config, verifier, num_tokens),
    }
    facts = {"layers": 1, "passthrough_first_layer": False, "fc_bias": False, "eagle3": True,
             "feature_layers": aux_ids, "draft_vocab_size": draft_size}
    if aux_ids != layers:
        facts["head_feature_layers"] = layers  # the head's own order; fc's input blocks were permuted to aux_ids
    return tensors, cfg, facts


def load_speculators_eagle3_export(folder, target) -> torch.nn.Module:
    """A fused :class:`decode.choose.heads.EagleHead` (``layer: eagle3``) on ``target`` rebuilt from a speculators
    EAGLE-3 export (the round trip of :func:`speculators_eagle3_layout`); its LM-head rows must be the target's."""
    from safetensors.torch import load_file

    from decode.choose.heads import EagleHead
    from decode.core.vocab import DraftVocab

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise UserError(f"{folder} is not a speculators EAGLE-3 export (speculators_model_type "
                        f"{cfg.get('speculators_model_type')!r})")
    state = load_file(str(folder / WEIGHTS))
    lm = target.get_output_embeddings().weight
    vocab = None
    if "d2t" in state:
        ids = state["d2t"] + torch.arange(len(state["d2t"]))
        vocab = DraftVocab(ids, lm.shape[0])
    aux = [int(i) for i in cfg.get("eagle_aux_hidden_state_layer_ids") or ()]
    problem = eagle3_layer_problem(aux, target.config.num_hidden_layers, ordered=False)
    if problem:
        raise UserError(f"{folder}: eagle_aux_hidden_state_layer_ids {aux} cannot be read as vLLM reads them: "
                        f"{problem}")
    # in vLLM's order (ascending, whatever the config lists), so the head fuses what vLLM's fc is given
    head = EagleHead(target, feature_layers=tuple(sorted(aux)), layer="eagle3", draft_vocab=vocab)
    want_rows = head.draft_rows(lm)
    if state["lm_head.weight"].shape != want_rows.shape or not torch.equal(state["lm_head.weight"], want_rows):
        raise UserError(f"{folder}: lm_head.weight is not the target's LM head (over the draft vocabulary); "
                        "an EagleHead drafts through the target's own")
    embed = state.get("embed_tokens.weight")
    if embed is not None and not torch.equal(embed, head.embed.weight):
        raise UserError(f"{folder}: embed_tokens.weight is not the target's embedding; an EagleHead reads the "
                        "target's own")
    mine = {"fuse.weight": state["fc.weight"], "norm.weight": state["norm.weight"]}
    mine.update({"model." + k: v for k, v in state.items() if k.startswith("layers.0.")})
    head.load_trainable_state_dict(mine)
    return head.eval()


def load_eagle_export(folder, target) -> torch.nn.Module:
    """An :class:`decode.choose.heads.EagleHead` on ``target`` rebuilt from an ``eagle``-format export (the round trip
    of :func:`eagle_layout`): two layers, the first a pass-through (a head with its input norm), or one layer
    without an input norm (a head trained with ``input_norm: false``)."""
    from safetensors.torch import load_file

    from decode.choose.heads import EagleHead
    from decode.choose.heads.common import check_signature

    folder = Path(folder)
    cfg_path, weights = folder / "config.json", folder / WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise UserError(f"{folder} is not an eagle-format export (needs config.json and {WEIGHTS}); "
                        "write one with `python -m toolkit export HEAD --format eagle --out DIR`")
    cfg = json.loads(cfg_path.read_text())
    # the drafter's own layer count is not the target's: compare the rest
    check_signature({"model_type": cfg.get("model_type"), "hidden_size": cfg.get("hidden_size"),
                     "vocab_size": cfg.get("vocab_size"), "num_hidden_layers": target.config.num_hidden_layers},
                    target, folder)
    state = load_file(str(weights))
    n = int(cfg.get("num_hidden_layers", 0))
    first = {k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")}
    if n == 1 and INPUT_NORM not in first:  # a head trained with input_norm=false: its one layer as it is
        head = EagleHead(target, input_norm=False, fc_bias="fc.bias" in state)
        mine = {k: v for k, v in state.items() if k.startswith("fc.")}
        mine.update({LAYER + k: v for k, v in first.items()})
        head.load_trainable_state_dict(mine)
        return head.eval()
    if n != 2 or any(v.abs().max() > 0 for k, v in first.items() if "norm" not in k):
        raise UserError(f"{folder}: an EagleHead holds one decoder layer, with its input norm after a pass-through "
                        f"layer or without one; this export has {n} layer(s)"
                        f"{' and a first layer that is not a pass-through' if n == 2 else ''}, so it "
                        "cannot be loaded as an EagleHead")
    head = EagleHead(target)
    mine = {"fc.weight": state["fc.weight"],
            "fc.bias": state.get("fc.bias", torch.zeros(cfg["hidden_size"], dtype=state["fc.weight"].dtype))}
    mine.update({LAYER + k[len("layers.1."):]: v for k, v in state.items() if k.startswith("layers.1.")})
    head.load_trainable_state_dict(mine)
    return head.eval()


def write_layout(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """``model.safetensors`` + ``config.json`` of a layout into an existing folder. Tensors that share storage
    (``embed_tokens`` and ``lm_head`` of a target with tied embeddings) are written as separate copies:
    safetensors refuses shared storage, and readers load each name on its own."""
    from safetensors.torch import save_file

    out, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel():
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    save_file(out, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.inference_mode()
def draft_logits(head, target, seed: int = 0, length: int = 12) -> torch.Tensor:
    """Draft logits of ``head`` on fixed inputs: the target's real features of a seeded random token sequence
    (what the eagle arm feeds it), teacher-forced, one step ahead."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, length + 1), generator=g)
    if getattr(head, "fused", False):  # EAGLE-3: the fused layers' rows
        states = target(input_ids=ids[:, :-1], output_hidden_states=True).hidden_states
        feats = head.input_features(torch.cat([states[i] for i in head.feature_layers], -1).float())
    else:
        feats = target.get_decoder()(input_ids=ids[:, :-1]).last_hidden_state.float()
    f = head(feats, ids[:, 1:])
    # over the target vocabulary (-inf outside a pruned head's draft vocabulary)
    return (head.draft_logits(f) if hasattr(head, "draft_logits") else head.logits(f)).float()


def _verify_eagle(src: Path, exported: Path, target, load=None) -> float:
    """Max |Δlogit| between the original head and the one read back from ``exported`` (by ``load``, default
    :func:`load_eagle_export`) over the tokens the original drafts from (all of them, or its pruned vocabulary);
    refuses any mismatch."""
    from decode.choose.heads import load_head

    ours = draft_logits(load_head(src, target, expect="eagle"), target)
    back = draft_logits((load or load_eagle_export)(exported, target), target)
    kept = torch.isfinite(ours[0, 0])  # the original's draft vocabulary
    ours, back = ours[..., kept], back[..., kept]
    diff = float((ours - back).abs().max())
    if diff > 1e-4 or not torch.equal(ours.argmax(-1), back.argmax(-1)):
        raise RuntimeError(f"exported head drafts differently from {src} (max |Δlogit| {diff:.3g}); "
                           "nothing was written")
    return diff


# --------------------------------------------------------------------------- README and serving configs

def serving_snippets(kind: str, fmt: str, out: Path, *, target: str, source: str, k: int, vllm_ok: bool,
                     why_not: str = "", passthrough: bool = False, pruned: dict | None = None,
                     eagle3: bool = False) -> tuple[dict | None, str]:
    """(vLLM speculative_config or None when vLLM cannot load this export exactly, README text)."""
    path = str(out.resolve())
    if kind == "drafter":
        vllm = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
        sglang_algo, tf = "STANDALONE", (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"tok = AutoTokenizer.from_pretrained({target!r})\n"
            f"target = AutoModelForCausalLM.from_pretrained({target!r})\n"
            f"assistant = AutoModelForCausalLM.from_pretrained({path!r})\n"
            "inputs = tok(\"Question: 2 + 3 = ?\", return_tensors=\"pt\")\n"
            f"out = target.generate(**inputs, assistant_model=assistant, num_assistant_tokens={k}, max_new_tokens=64)\n"
            "print(tok.decode(out[0], skip_special_tokens=True))")
    else:
        vllm = {"method": "eagle3" if eagle3 else "eagle", "model": path, "num_speculative_tokens": k}
        loader = "load_speculators_eagle3_export" if eagle3 else "load_eagle_export"
        sglang_algo, tf = "EAGLE3" if eagle3 else "EAGLE", (
            "# transformers' assisted generation takes a whole draft model, not a feature head; run the head\n"
            "# with this project's runtime instead (it reads the original head folder):\n"
            f"#   python -m decode generate 'PROMPT' --target {target} --arms 'eagle:path={source},L={k}'\n"
            "# or rebuild it from this folder in Python:\n"
            f"from decode.core.models import load_model\nfrom toolkit.export_formats import {loader}\n"
            f"target, tok = load_model({target!r})\nhead = {loader}({path!r}, target)")
    sglang = (f"python -m sglang.launch_server --model-path {target} \\\n  --speculative-algorithm {sglang_algo} "
              f"--speculative-draft-model-path {path} \\\n  --speculative-num-steps {k} --speculative-eagle-topk 1 "
              f"--speculative-num-draft-tokens {k + 1}")
    lines = [f"# Exported {kind} ({fmt} format)", "",
             f"Written by `python -m toolkit export` for the target `{target}`; drafts {k} tokens per step "
             "(a chain: top-k 1). Change `num_speculative_tokens` / `--speculative-num-steps` freely.", ""]
    if fmt == "eagle":
        lines += ["Layout: EAGLE-1's reference checkpoint (`config.json`, `model.safetensors` with `fc.*` and "
                  "`layers.N.*`). The embedding and the LM head are the target's, as in EAGLE-1, which loads the "
                  "embedding from the base model and drafts through the base model's LM head; SGLang and vLLM share "
                  "both with the target the same way, so neither is stored here.", ""]
        if passthrough:
            lines += ["This head normalises its fused input; EAGLE-1 runs its first layer without that norm, so "
                      "layer 0 here is an exact pass-through (all projections zero) and layer 1 is the trained "
                      "layer: the same draft logits, for one extra small layer of drafting compute.", ""]
    elif fmt == "speculators" and eagle3:
        lines += ["Layout: the `speculators` library's EAGLE-3 format (`speculators_model_type: eagle3`, "
                  f"`Eagle3DraftModel`, schema of speculators {SPECULATORS_EAGLE3_SCHEMA}): `fc` fuses the target "
                  "layers `eagle_aux_hidden_state_layer_ids`, one EAGLE-3 decoder layer, `norm`, `lm_head` over the "
                  "draft vocabulary (`d2t`/`t2d`) and the target's embedding (`embed_tokens`).", ""]
    elif fmt == "speculators":
        lines += ["Layout: the `speculators` library's EAGLE-1 format (`speculators_model_type: eagle`, "
                  f"schema of speculators {SPECULATORS_SCHEMA}); embedding and LM head come from the verifier.", ""]
    else:
        lines += ["Layout: a plain Hugging Face model folder (config, weights, tokenizer) plus `drafter.json`, "
                  "the target it was trained for and its held-out evaluation.", ""]
    if pruned:
        lines += [f"The trained head drafts from a pruned vocabulary of {pruned.get('size')} tokens (coverage "
                  f"{pruned.get('coverage')} of the target's own outputs). This layout has no draft vocabulary, so "
                  "the exported head drafts from the target's whole vocabulary: over those tokens its logits are "
                  "the trained head's exactly, but it may draft others (verification stays lossless; acceptance can "
                  "differ slightly) and pays the full LM head per drafted token. The subset is kept beside the "
                  "weights in `draft_vocab.safetensors` (`d2t`: draft index → target id).", ""]
    lines += ["## vLLM", ""]
    if vllm_ok:
        lines += [f"`{VLLM_CONFIG}` (beside this file) holds the `speculative_config`:", "", "```json",
                  json.dumps(vllm, indent=2), "```", "",
                  f"    vllm serve {target} --speculative-config \"$(cat {path}/{VLLM_CONFIG})\"", ""]
    else:
        lines += [f"vLLM cannot load this export exactly: {why_not}. No `{VLLM_CONFIG}` is written.", ""]
    lines += ["## SGLang", "", "```bash", sglang, "```", "", "## transformers", "", "```python", tf, "```", ""]
    return (vllm if vllm_ok else None), "\n".join(lines)


# --------------------------------------------------------------------------- the command

def export(artifact, fmt: str, out, *, target: str | None = None, num_tokens: int = 4, force: bool = False) -> Path:
    """Write ``artifact`` to ``out`` in ``fmt`` (atomically: a failed export leaves nothing); returns ``out``."""
    src, out = Path(artifact), Path(out)
    kind = artifact_kind(src)
    check_format(kind, fmt, src)
    if num_tokens < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1, got {num_tokens}")
    if out.resolve() == src.resolve():
        raise UserError(f"--out {out} is the artifact itself; pass another folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UserError(f"--out {out} exists and is not empty; pass --force to replace it, or another folder")
    meta = {"format": fmt, "kind": kind, "source": str(src.resolve()), "num_speculative_tokens": num_tokens,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    with atomic_path(out, directory=True) as tmp:
        if kind == "drafter":
            from .export import read_metadata
            target = target or read_metadata(src).get("target")
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            vllm_ok, why = True, ""
        else:
            from decode.choose.heads import read_head_config
            from decode.choose.heads.common import read_head_weights
            from decode.core.models import load_model
            head_cfg = read_head_config(src)
            state = read_head_weights(src)  # a damaged or missing file: one error naming the folder, before any load
            target = target or head_cfg.get("target_spec") or head_cfg.get("target", {}).get("name_or_path")
            if not target:
                raise UserError(f"{src}/head.json does not name its target; pass --target")
            model, _ = load_model(target)
            from decode.choose.heads.common import check_signature
            check_signature(head_cfg.get("target", {}), model, src)
            eagle3 = bool(head_cfg.get("feature_layers"))
            if eagle3 and fmt == "eagle":
                raise UserError(f"{src} is an EAGLE-3 (fused) head; EAGLE-1's layout has no slot for fused target "
                                "layers: use --format speculators (EAGLE-3 format)")
            if fmt == "eagle":
                tensors, cfg, facts = eagle_layout(state, model.config, src)
            elif eagle3:
                from decode.choose.heads import load_head
                tensors, cfg, facts = speculators_eagle3_layout(load_head(src, model, expect="eagle"), model.config,
                                                                src, verifier=target, num_tokens=num_tokens)
            else:
                tensors, cfg, facts = speculators_layout(state, model.config, src, verifier=target,
                                                         num_tokens=num_tokens)
            write_layout(tmp, tensors, cfg)
            from decode.core.vocab import VOCAB_FILE
            if (src / VOCAB_FILE).exists() and not eagle3:  # no slot for it: keep it beside, say what changes
                shutil.copy2(src / VOCAB_FILE, tmp / VOCAB_FILE)
                dv = head_cfg.get("draft_vocab") or {}
                facts["pruned_vocab_dropped"] = {"size": dv.get("size"), "coverage": dv.get("coverage")}
            meta.update(facts)
            meta["max_abs_logit_diff"] = (_verify_eagle(src, tmp, model) if fmt == "eagle" else
                                          _verify_eagle(src, tmp, model, load_speculators_eagle3_export) if eagle3
                                          else None)
            vllm_ok = not facts["fc_bias"]
            why = "" if vllm_ok else (
                "the head's fc layer has a bias, and vLLM's EAGLE-1 drafter (EagleLlamaForCausalLM) builds fc "
                "without one; serve it with SGLang or EAGLE, or train a head whose fc has no bias")
        from decode.core.models import resolve_path
        meta["target"] = target
        vllm, readme = serving_snippets(kind, fmt, out, target=resolve_path(target), source=meta["source"],
                                        k=num_tokens, vllm_ok=vllm_ok,
                                        why_not=why, passthrough=meta.get("passthrough_first_layer", False),
                                        pruned=meta.get("pruned_vocab_dropped"), eagle3=meta.get("eagle3", False))
        meta["vllm_loadable"] = vllm_ok
        if vllm is not None:
            (tmp / VLLM_CONFIG).write_text(json.dumps(vllm, indent=2) + "\n")
        (tmp / "README.md").write_text(readme)
        atomic_write_json(tmp / EXPORT_META, meta, indent=2)
    return out


def add_arguments(p) -> None:
    p.add_argument("artifact", help="a trained EAGLE head folder (head.json) or a drafter export (drafter.json)")
    p.add_argument("--format", required=True,
                   help=f"one of {', '.join(FORMATS)} (eagle heads: eagle, speculators; drafters: hf)")
    p.add_argument("--out", required=True, help="folder to write (must be new or empty unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--target", default=None, help="target model (default: the one the artifact was trained for)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="draft length in the serving configs (default 4)")


def run(args) -> int:
    out = export(args.artifact, args.format, args.out, target=args.target, num_tokens=args.num_speculative_tokens,
                 force=args.force)
    meta = json.loads((out / EXPORT_META).read_text())
    print(f"wrote {out} ({meta['kind']} as {meta['format']}); serving snippets in {out / 'README.md'}")
    if not meta["vllm_loadable"]:
        print(f"note: vLLM cannot load it exactly ({out / 'README.md'} says why)")
    return 0
