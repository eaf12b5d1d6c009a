"""`python -m toolkit export`: EAGLE heads in EAGLE-1's layout (read back exactly, and read by an independent
EAGLE-1 forward built only from the exported files), speculators' EAGLE-1 and EAGLE-3 layouts (the EAGLE-3 one
read by an independent Eagle3DraftModel forward built from the files), drafters as HF folders, and the errors
for inputs that cannot be exported."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from decode.choose.heads import EagleHead, EarlyExitDrafter, load_head, save_head
from toolkit.cli import main
from toolkit.export_formats import (EXPORT_META, VLLM_CONFIG, draft_logits, load_eagle_export,
                                    speculators_layout)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


def saved_target(folder, tokenizer_dir, *, layers: int, tied: bool, seed: int = 5):
    """A tiny random Llama of ``layers`` layers (tied embeddings or not) with the real tokenizer, saved to
    ``folder`` and loaded back (its ``_name_or_path`` is the folder, as export reads it)."""
    from transformers import LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tied)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def target4(tmp_path_factory, tiny_target_dir):
    """4 layers: room for the 3 distinct feature layers below N that speculators' / vLLM's EAGLE-3 read."""
    return saved_target(tmp_path_factory.mktemp("target4"), tiny_target_dir, layers=4, tied=False)


@pytest.fixture(scope="module")
def tied4(tmp_path_factory, tiny_target_dir):
    """As target4 with tied embeddings (embed_tokens and lm_head one tensor), like the default target."""
    m = saved_target(tmp_path_factory.mktemp("tied4"), tiny_target_dir, layers=4, tied=True, seed=6)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def trained_head(target, tmp_path, *, zero_bias=False, name="head"):
    """An EAGLE head moved away from its init (so a dropped or misplaced tensor shows in the logits)."""
    head = EagleHead(target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if zero_bias:
            head.fc.bias.zero_()
    folder = tmp_path / name
    save_head(head, folder, extra={"target_spec": target.config._name_or_path, "task": "math"})
    return folder


def export(*args) -> int:
    return main(["export", *map(str, args)])


def test_eagle_export_reads_back_to_the_same_draft_logits(target, tmp_path):
    src = trained_head(target, tmp_path)
    out = tmp_path / "out"
    assert export(src, "--format", "eagle", "--out", out, "--num-speculative-tokens", 3) == 0
    assert {"config.json", "model.safetensors", "README.md", EXPORT_META} <= {p.name for p in out.iterdir()}
    ours = draft_logits(load_head(src, target, expect="eagle"), target, seed=3)
    back = draft_logits(load_eagle_export(out, target), target, seed=3)
    torch.testing.assert_close(back, ours, rtol=0, atol=1e-6)
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["passthrough_first_layer"] and meta["fc_bias"] and meta["max_abs_logit_diff"] == 0.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["bias"] is True and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"]  # for readers on transformers < 5
    # a trained fc bias: vLLM's EAGLE-1 drafter has none, so no vLLM config is offered, and the README says why
    assert not meta["vllm_loadable"] and not (out / VLLM_CONFIG).exists()
    readme = (out / "README.md").read_text()
    assert "vLLM cannot load this export exactly" in readme and "fc layer has a bias" in readme
    assert "--speculative-algorithm EAGLE" in readme and "--speculative-num-steps 3" in readme
    assert "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in readme


def eagle1_reference_logits(folder, target, feats, tokens):
    """EAGLE-1's drafter (SafeAILab cnets1 / SGLang LlamaForCausalLMEagle) built from the exported files and HF
    Llama modules only: fc(cat(embed, feature)), layers with no input norm on layer 0, target LM head."""
    cfg_dict = json.loads((folder / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "bias")})
    cfg._attn_implementation = "eager"
    w = load_file(str(folder / "model.safetensors"))
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg_dict["bias"])
    fc.load_state_dict({k[3:]: v for k, v in w.items() if k.startswith("fc.")})
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = LlamaDecoderLayer(cfg, i)
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        layer.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in w.items() if k.startswith(f"layers.{i}.")})
        layers.append(layer.eval())
    T = tokens.shape[1]
    pos = torch.arange(T)[None]
    x = fc(torch.cat([target.get_input_embeddings()(tokens), feats], -1))
    rope = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    for layer in layers:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        x = x[0] if isinstance(x, tuple) else x
    return target.get_output_embeddings()(x)


@torch.inference_mode()
def test_eagle_export_drafts_like_an_independent_eagle1_forward(target, tmp_path):
    src = trained_head(target, tmp_path)
    out = tmp_path / "out"
    assert export(src, "--format", "eagle", "--out", out) == 0
    ids = torch.randint(0, target.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    feats = target.get_decoder()(input_ids=ids[:, :-1]).last_hidden_state
    head = load_head(src, target, expect="eagle")
    ours = head.logits(head(feats, ids[:, 1:]))
    ref = eagle1_reference_logits(out, target, feats, ids[:, 1:])
    torch.testing.assert_close(ref, ours, rtol=1e-5, atol=1e-5)
    # the same forward without the pass-through layer (layer 1 alone, its norm dropped) drafts differently:
    # the norm matters, so the extra layer is needed, not decoration
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    from safetensors.torch import save_file
    save_file({k.replace("layers.1.", "layers.0."): v for k, v in w.items()
               if not k.startswith("layers.0.") and "input_layernorm" not in k}, str(alone / "model.safetensors"))
    assert (eagle1_reference_logits(alone, target, feats, ids[:, 1:]) - ours).abs().max() > 1e-3


def test_all_zero_fc_bias_is_dropped_and_vllm_config_written(target, tmp_path):
    src = trained_head(target, tmp_path, zero_bias=True)
    out = tmp_path / "out"
    assert export(src, "--format", "eagle", "--out", out, "--num-speculative-tokens", 5) == 0
    assert "fc.bias" not in load_file(str(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["bias"] is False
    vllm = json.loads((out / VLLM_CONFIG).read_text())
    assert vllm == {"method": "eagle", "model": str(out.resolve()), "num_speculative_tokens": 5}
    assert json.dumps(vllm, indent=2) in (out / "README.md").read_text()
    torch.testing.assert_close(draft_logits(load_eagle_export(out, target), target),
                               draft_logits(load_head(src, target), target), rtol=0, atol=1e-6)


def test_speculators_format_refuses_a_head_that_normalises_its_input(target, tmp_path, capsys):
    src = trained_head(target, tmp_path)
    assert export(src, "--format", "speculators", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "input RMSNorm" in err and "--format eagle" in err
    assert not (tmp_path / "out").exists()


def test_speculators_layout_of_a_norm_free_head(target):
    """The layout speculators' EagleSpeculator (<= 0.4) reads: fusion_fc + one `transformer` layer."""
    state = {k: v for k, v in EagleHead(target).state_dict().items() if "input_layernorm" not in k}
    tensors, cfg, facts = speculators_layout(state, target.config, "HEAD", verifier="org/target", num_tokens=3)
    assert set(tensors) == {"fusion_fc.weight"} | {"transformer." + k[len("model.layers.0."):]
                                                    for k in state if k.startswith("model.layers.0.")}
    assert torch.equal(tensors["fusion_fc.weight"], state["fc.weight"])  # identity init: bias all zero, dropped
    assert cfg["speculators_model_type"] == "eagle" and cfg["layernorms"] is False and cfg["fusion_bias"] is False
    assert cfg["architectures"] == ["EagleSpeculator", "LlamaDecoderLayer"]
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    assert facts == {"layers": 1, "passthrough_first_layer": False, "fc_bias": False}


def test_drafter_exports_as_a_plain_hf_folder(tiny_target_dir, tmp_path):
    from helpers import tiny_llama

    from toolkit.export import export_model, read_metadata

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    drafter = tiny_llama(vocab=len(tok), hidden=32, layers=1, seed=5)
    src = export_model(drafter, tok, tmp_path / "drafter", target=tiny_target_dir, target_tokenizer=tok,
                       task="math", recipe={"r": 1})
    out = tmp_path / "out"
    assert export(src, "--format", "hf", "--out", out, "--num-speculative-tokens", 6) == 0
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, drafter(ids).logits, rtol=0, atol=0)
    assert read_metadata(out)["target_vocab_hash"] == read_metadata(src)["target_vocab_hash"]
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    assert json.loads((out / VLLM_CONFIG).read_text()) == {
        "method": "draft_model", "model": str(out.resolve()), "num_speculative_tokens": 6}
    readme = (out / "README.md").read_text()
    assert "assistant_model=assistant" in readme and "--speculative-algorithm STANDALONE" in readme
    for fmt in ("eagle", "speculators"):
        assert export(src, "--format", fmt, "--out", tmp_path / fmt) == 2


def test_bad_inputs_are_refused_with_the_fix(target, tmp_path, capsys):
    def err(*args):
        assert export(*args) == 2
        return capsys.readouterr().err

    assert "is not a folder" in err(tmp_path / "missing", "--format", "eagle", "--out", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    assert "neither head.json" in err(tmp_path / "empty", "--format", "eagle", "--out", tmp_path / "o")
    src = trained_head(target, tmp_path)
    assert "--format must be one of eagle, speculators, hf" in err(src, "--format", "onnx", "--out", tmp_path / "o")
    assert "--num-speculative-tokens must be >= 1" in err(src, "--format", "eagle", "--out", tmp_path / "o",
                                                          "--num-speculative-tokens", 0)
    ee = tmp_path / "ee"
    save_head(EarlyExitDrafter(target, 1), ee)
    msg = err(ee, "--format", "eagle", "--out", tmp_path / "o")
    assert "'early_exit' artifact" in msg and "early_exit: none (runtime-only)" in msg
    assert "eagle: eagle, speculators" in msg
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "pass --force" in err(src, "--format", "eagle", "--out", out)
    assert (out / "keep.txt").exists()
    assert export(src, "--format", "eagle", "--out", out, "--force") == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert "is the artifact itself" in err(src, "--format", "eagle", "--out", src, "--force")


def test_eagle_export_for_another_target_is_refused(target, tmp_path, capsys):
    from helpers import tiny_llama

    other = tmp_path / "other"
    tiny_llama(vocab=target.config.vocab_size, hidden=48, layers=2).save_pretrained(other)
    AutoTokenizer.from_pretrained(target.config._name_or_path).save_pretrained(other)
    src = trained_head(target, tmp_path)
    assert export(src, "--format", "eagle", "--out", tmp_path / "o", "--target", other) == 2
    assert "hidden_size" in capsys.readouterr().err
    out = tmp_path / "ok"
    assert export(src, "--format", "eagle", "--out", out) == 0
    with pytest.raises(Exception, match="hidden_size"):
        load_eagle_export(out, AutoModelForCausalLM.from_pretrained(other))


def test_loader_refuses_exports_an_eagle_head_cannot_hold(target, tmp_path):
    from decode.common.errors import UserError

    src = trained_head(target, tmp_path)
    out = tmp_path / "out"
    assert export(src, "--format", "eagle", "--out", out) == 0
    w = load_file(str(out / "model.safetensors"))
    w["layers.0.self_attn.o_proj.weight"] = torch.ones_like(w["layers.0.self_attn.o_proj.weight"])
    from safetensors.torch import save_file
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="not a pass-through"):
        load_eagle_export(out, target)
    with pytest.raises(UserError, match="not an eagle-format export"):
        load_eagle_export(tmp_path, target)


def test_speculators_library_reads_the_export_like_our_head():
    """The real library (in its own venv: see scripts/check_export_speculators.py) on the same inputs."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    if not (repo / "runs" / "speculators-venv" / "bin" / "python").is_file():
        pytest.skip("speculators 0.4 (its last release with EAGLE-1) does not import under transformers 5.23; "
                    "build its venv with `.venv/bin/python scripts/check_export_speculators.py --setup`")
    run = subprocess.run([sys.executable, str(repo / "scripts" / "check_export_speculators.py")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr  # 0: max |logit difference| <= 1e-5


def test_speculators_eagle3_reads_the_export_like_our_head():
    """speculators 0.9's Eagle3DraftModel (its own venv: scripts/check_export_speculators.py --eagle3) on the same
    inputs: the same draft-vocabulary logits and drafted ids."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    if not (repo / "runs" / "speculators-eagle3-venv" / "bin" / "python").is_file():
        pytest.skip("speculators 0.9 pins transformers<=5.19 (this project: 5.23); build its venv with "
                    "`.venv/bin/python scripts/check_export_speculators.py --eagle3 --setup`")
    run = subprocess.run([sys.executable, str(repo / "scripts" / "check_export_speculators.py"), "--eagle3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def test_pruned_eagle_head_exports_with_its_subset_beside_and_the_same_logits_over_it(target, tmp_path):
    """EAGLE-1 has no draft vocabulary: the export drafts from the whole vocabulary, equal over the kept tokens."""
    from decode.core.vocab import VOCAB_FILE, DraftVocab
    V = target.config.vocab_size
    head = EagleHead(target, draft_vocab=DraftVocab(torch.arange(0, V, 3), V, {"coverage": 0.9}))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
    src = tmp_path / "pruned"
    save_head(head, src, extra={"target_spec": target.config._name_or_path, "task": "math"})
    out = tmp_path / "out"
    assert export(src, "--format", "eagle", "--out", out) == 0
    assert (out / VOCAB_FILE).exists()
    ours = draft_logits(load_head(src, target, expect="eagle"), target, seed=3)
    back = draft_logits(load_eagle_export(out, target), target, seed=3)
    kept = torch.isfinite(ours[0, 0])
    assert int(kept.sum()) == len(range(0, V, 3))
    torch.testing.assert_close(back[..., kept], ours[..., kept], rtol=0, atol=1e-5)
    assert torch.isfinite(back).all()  # the exported head drafts from every token
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["pruned_vocab_dropped"]["size"] == int(kept.sum())
    assert "pruned vocabulary of" in (out / "README.md").read_text()


def test_a_head_without_input_norm_or_fc_bias_exports_as_one_layer_vllm_and_speculators_load(target, tmp_path):
    """input_norm=false, fc_bias=false (the serving layout): head.json keeps both, the state dict has neither
    tensor, and both formats write the one layer as it is (no pass-through), vLLM-loadable, drafting as our head."""
    head = EagleHead(target, input_norm=False, fc_bias=False)
    assert not any("input_layernorm" in k for k in head.state_dict()) and "fc.bias" not in head.state_dict()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    src = tmp_path / "head"
    save_head(head, src, extra={"target_spec": target.config._name_or_path, "task": "math"})
    saved = json.loads((src / "head.json").read_text())
    assert saved["input_norm"] is False and saved["fc_bias"] is False
    back = load_head(src, target, expect="eagle")
    assert back.input_norm is False and back.fc.bias is None
    ours = draft_logits(back, target, seed=2)
    torch.testing.assert_close(ours, draft_logits(head, target, seed=2), rtol=0, atol=0)

    out = tmp_path / "eagle"
    assert export(src, "--format", "eagle", "--out", out) == 0
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["passthrough_first_layer"] is False and meta["fc_bias"] is False and meta["vllm_loadable"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert (out / VLLM_CONFIG).is_file()
    w = load_file(str(out / "model.safetensors"))
    assert "fc.bias" not in w and not any(k.startswith("layers.1.") or "input_layernorm" in k for k in w)
    torch.testing.assert_close(draft_logits(load_eagle_export(out, target), target, seed=2), ours, rtol=0, atol=1e-6)

    spec = tmp_path / "spec"
    assert export(src, "--format", "speculators", "--out", spec) == 0
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle" and cfg["fusion_bias"] is False and cfg["layernorms"] is False
    assert json.loads((spec / EXPORT_META).read_text())["passthrough_first_layer"] is False


def test_the_default_eagle_head_keeps_its_input_norm_and_fc_bias(target, tmp_path):
    head = EagleHead(target)
    assert head.input_norm and head.fc_bias and "fc.bias" in head.state_dict()
    assert any(k.endswith("input_layernorm.weight") for k in head.state_dict())
    save_head(head, tmp_path / "h")
    # a head.json from before the options (no keys) loads as the default head
    meta = json.loads((tmp_path / "h" / "head.json").read_text())
    for k in ("input_norm", "fc_bias"):
        meta.pop(k)
    (tmp_path / "h" / "head.json").write_text(json.dumps(meta))
    assert load_head(tmp_path / "h", target).fc.bias is not None


# --------------------------------------------------------------------------- EAGLE-3 heads → speculators' eagle3

def eagle3_head(target, tmp_path, *, layer="eagle3", vocab=True, name="e3", feature_layers=(1, 2, 3)):
    """A fused head (by default feature layers 1, 2, 3 of a 4-layer target) with a draft vocabulary, away from its
    init."""
    from decode.core.vocab import DraftVocab

    V = target.config.vocab_size
    dv = DraftVocab(torch.arange(5, V, 7), V) if vocab else None
    head = EagleHead(target, feature_layers=feature_layers, layer=layer, draft_vocab=dv)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    folder = tmp_path / name
    save_head(head, folder, extra={"target_spec": target.config._name_or_path, "task": "math"})
    return folder, head.eval()


def eagle3_reference_logits(folder, target, rows, tokens):
    """speculators' Eagle3DraftModel forward (step 0) built from the exported files and HF Llama modules only:
    g = fc(rows); first layer: residual g, attention over cat[input_norm(embed), hidden_norm(g)] with 2d q/k/v;
    MLP; lm_head(norm(h)) over the draft vocabulary, mapped to target ids by target = index + d2t[index]."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cfg_dict = json.loads((folder / "config.json").read_text())
    cfg = LlamaConfig(**cfg_dict["transformer_layer_config"])
    cfg._attn_implementation = "eager"
    w = load_file(str(folder / "model.safetensors"))
    d = cfg.hidden_size
    layer = LlamaDecoderLayer(cfg, 0)
    for name in ("q_proj", "k_proj", "v_proj"):  # speculators' LlamaDecoderEagle3FirstLayer: 2d inputs
        old = getattr(layer.self_attn, name)
        setattr(layer.self_attn, name, torch.nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
    layer.hidden_norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")})
    norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
    norm.load_state_dict({"weight": w["norm.weight"]})
    T = tokens.shape[1]
    pos = torch.arange(T)[None]
    g = rows @ w["fc.weight"].T
    emb = torch.nn.functional.embedding(tokens, w["embed_tokens.weight"])
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)], -1)
    rope = LlamaRotaryEmbedding(cfg)(g, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    a, _ = layer.self_attn(hidden_states=x, attention_mask=mask, position_embeddings=rope)
    h = g + a
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    draft = norm(h) @ w["lm_head.weight"].T
    full = torch.full((*draft.shape[:-1], target.config.vocab_size), float("-inf"))
    full[..., torch.arange(draft.shape[-1]) + w["d2t"]] = draft
    return full


@torch.inference_mode()
def test_eagle3_head_exports_to_speculators_eagle3(target4, tmp_path):
    target = target4
    src, head = eagle3_head(target, tmp_path)
    out = tmp_path / "out"
    assert export(src, "--format", "speculators", "--out", out, "--num-speculative-tokens", 3) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == len(head.draft_vocab) and cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["algorithm"] == "eagle3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    w = load_file(str(out / "model.safetensors"))
    ids = head.draft_vocab.d2t
    assert torch.equal(w["d2t"] + torch.arange(len(ids)), ids) and int(w["t2d"].sum()) == len(ids)
    assert torch.equal(w["t2d"].nonzero().flatten(), ids)
    assert torch.equal(w["lm_head.weight"], target.lm_head.weight[ids])
    assert w["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * target.config.hidden_size
    assert "layers.0.hidden_norm.weight" in w
    assert torch.equal(w["embed_tokens.weight"], target.model.embed_tokens.weight)
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["eagle3"] and meta["vllm_loadable"] and meta["max_abs_logit_diff"] <= 1e-5
    assert "pruned_vocab_dropped" not in meta  # the layout holds the draft vocabulary
    assert json.loads((out / VLLM_CONFIG).read_text())["method"] == "eagle3"
    readme = (out / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in readme and "load_speculators_eagle3_export" in readme
    # an independent forward from the files alone drafts what the head drafts
    tokens = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    states = target(input_ids=tokens, output_hidden_states=True).hidden_states
    rows = torch.cat([states[1], states[2], states[3]], -1)[:, :-1]
    ours = head.draft_logits(head(head.input_features(rows), tokens[:, 1:]))
    ref = eagle3_reference_logits(out, target, rows, tokens[:, 1:])
    kept = torch.isfinite(ours[0, 0])
    assert torch.equal(kept, torch.isfinite(ref[0, 0]))
    torch.testing.assert_close(ref[..., kept], ours[..., kept], rtol=1e-5, atol=1e-5)
    # a wrong d2t convention (absolute ids instead of offsets) would scatter to other columns: the check can fail
    wrong = torch.full_like(ref, float("-inf"))
    wrong[..., torch.clamp(w["d2t"], 0, target.config.vocab_size - 1)] = ref[..., kept]
    assert not torch.equal(torch.isfinite(wrong[0, 0]), kept)


def test_eagle3_export_without_a_draft_vocabulary(target4, tmp_path):
    target = target4
    src, head = eagle3_head(target, tmp_path, vocab=False)
    out = tmp_path / "out"
    assert export(src, "--format", "speculators", "--out", out) == 0
    w = load_file(str(out / "model.safetensors"))
    assert "d2t" not in w and torch.equal(w["lm_head.weight"], target.lm_head.weight)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == target.config.vocab_size


def test_fused_heads_that_speculators_cannot_hold_are_refused(target4, tmp_path, capsys):
    target = target4
    src, _ = eagle3_head(target, tmp_path, layer="eagle1", name="e1layer")
    assert export(src, "--format", "speculators", "--out", tmp_path / "a") == 2
    assert "head.layer=eagle3" in capsys.readouterr().err and not (tmp_path / "a").exists()
    src3, _ = eagle3_head(target, tmp_path, name="e3b")
    assert export(src3, "--format", "eagle", "--out", tmp_path / "b") == 2
    assert "--format speculators" in capsys.readouterr().err and not (tmp_path / "b").exists()


@torch.inference_mode()
def test_eagle3_export_of_a_tied_target_without_a_draft_vocabulary(tied4, tmp_path):
    """A target with tied embeddings (the default target's case) and a head drafting from the whole vocabulary:
    embed_tokens and lm_head are one tensor, which safetensors refuses to write twice; the export writes two
    equal tensors, reads back, and drafts the same logits."""
    from toolkit.export_formats import load_speculators_eagle3_export

    src, head = eagle3_head(tied4, tmp_path, vocab=False, name="tied")
    out = tmp_path / "out"
    assert export(src, "--format", "speculators", "--out", out) == 0
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["embed_tokens.weight"], tied4.model.embed_tokens.weight)
    assert torch.equal(w["lm_head.weight"], tied4.lm_head.weight) and "d2t" not in w
    assert json.loads((out / EXPORT_META).read_text())["max_abs_logit_diff"] <= 1e-5
    back = load_speculators_eagle3_export(out, tied4)
    torch.testing.assert_close(draft_logits(back, tied4, seed=4), draft_logits(head, tied4, seed=4), rtol=0, atol=1e-5)


@torch.inference_mode()
def test_eagle3_export_writes_aux_layers_in_vllms_order(target4, tmp_path):
    """vLLM collects the aux hidden states while running the target's layers, so in ascending layer order
    whatever order eagle_aux_hidden_state_layer_ids lists them in, and feeds their concat to fc. A head whose
    feature layers are distinct but unsorted is written with the ids ascending and fc's input blocks permuted to
    match: the fused feature computed vLLM's way equals ours, and so do the draft logits."""
    layers = (3, 1, 2)
    src, head = eagle3_head(target4, tmp_path, feature_layers=layers, name="unsorted")
    out = tmp_path / "out"
    assert export(src, "--format", "speculators", "--out", out) == 0
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    tokens = torch.randint(0, target4.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    states = target4(input_ids=tokens, output_hidden_states=True).hidden_states
    ours = head.input_features(torch.cat([states[i] for i in layers], -1))
    aux = torch.cat([states[i] for i in sorted(cfg["eagle_aux_hidden_state_layer_ids"])], -1)  # vLLM's order
    torch.testing.assert_close(aux @ w["fc.weight"].T, ours, rtol=1e-5, atol=1e-5)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    rows = aux[:, :-1]
    mine = head.draft_logits(head(head.input_features(torch.cat([states[i] for i in layers], -1)[:, :-1]),
                                  tokens[:, 1:]))
    ref = eagle3_reference_logits(out, target4, rows, tokens[:, 1:])
    kept = torch.isfinite(mine[0, 0])
    torch.testing.assert_close(ref[..., kept], mine[..., kept], rtol=1e-5, atol=1e-5)
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["feature_layers"] == [1, 2, 3] and meta["max_abs_logit_diff"] <= 1e-5


@pytest.mark.parametrize("layers,why", [((1, 2), "exactly 3"), ((1, 2, 3, 0), "exactly 3"), ((1, 1, 2), "once"),
                                        ((-1, 1, 2), "never collect"), ((1, 2, 4), "never collect")])
def test_eagle3_export_refuses_feature_layers_vllm_cannot_read_as_we_do(target4, tmp_path, capsys, layers, why):
    """vLLM's EAGLE-3 fc fuses exactly 3 aux states, collected once each from the inputs of decoder layers
    0..N-1: other counts, duplicates, -1 (post-norm final) and N cannot be written; the export says why and
    writes nothing."""
    src, _ = eagle3_head(target4, tmp_path, feature_layers=layers, name="bad")
    out = tmp_path / "out"
    assert export(src, "--format", "speculators", "--out", out) == 2
    err = capsys.readouterr().err
    assert "eagle_aux_hidden_state_layer_ids" in err and why in err and "head.feature_layers" in err
    assert not out.exists()
