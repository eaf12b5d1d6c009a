"""Check `--format speculators` against the real `speculators` library, in a separate virtualenv: EAGLE-1 heads
(speculators 0.4) by default, EAGLE-3 heads (speculators 0.9, `Eagle3DraftModel`) with --eagle3.

Why a separate venv: the last speculators release with an EAGLE-1 model (EagleSpeculator) is 0.4.x; it pins
transformers<=4.57.6 and does not import under this project's transformers 5.23 (pydantic fails on its
config classes: "PydanticUndefinedAnnotation: name 'torch' is not defined"). Releases from 0.5 on hold only
EAGLE-3 and newer drafters. So the check runs speculators 0.4.0.1 with transformers 4.57.6 and the same
torch 2.13 CPU build, installed with --no-deps (its other pins are for training and data generation).

What it checks: a tiny Llama target and an EAGLE-1 head of the shape speculators holds (one decoder layer
whose input is not normalised; our trained heads keep that norm, so the exporter refuses them for this
format: see docs/exporting.md). The head is written with
toolkit.export_formats.speculators_layout, loaded with EagleSpeculator.from_pretrained, attached to the
same target, and must give the head's draft logits on the same inputs (max |difference| <= 1e-5).

    .venv/bin/python scripts/check_export_speculators.py --setup   # once: builds runs/speculators-venv
    .venv/bin/python scripts/check_export_speculators.py           # the check; exit 0 = same logits

EAGLE-3 (--eagle3; venv runs/speculators-eagle3-venv): speculators 0.9.0 pins transformers<=5.19, so its venv
has transformers 5.19.0 and the same torch, speculators installed with --no-deps beside the packages it imports.
The case: a tiny 4-layer Llama target, a fused EagleHead with EAGLE-3's first layer (head.layer=eagle3) and a
draft vocabulary, written by toolkit.export_formats.speculators_eagle3_layout; speculators reads it
with SpeculatorModel.from_pretrained (+ load_verifier_weights) and runs its own Eagle3DraftModel forward (one TTT
step) on the target's fused hidden states: its draft-vocabulary logits must equal the head's (max |difference|
<= 1e-5) and its drafted target ids (index + d2t) the head's.

    .venv/bin/python scripts/check_export_speculators.py --eagle3 --setup
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPECULATORS = "speculators==0.4.0.1"
PINS = ["torch==2.13.0", "transformers==4.57.6", "safetensors", "pydantic>=2", "pydantic-settings", "loguru",
        "numpy<2.5"]
SPECULATORS_EAGLE3 = ["speculators==0.9.0", "hs-connectors==0.9.0"]
PINS_EAGLE3 = ["torch==2.13.0", "transformers==5.19.0", "safetensors", "pydantic>=2", "pydantic-settings", "loguru",
               "typer", "openai", "rich", "tqdm", "httpx", "click", "psutil", "protobuf", "numpy<2.5",
               "datasets<=5.1.0"]
TOLERANCE = 1e-5

# runs inside the speculators venv: argv = folder with spec/, target/, io.safetensors
SPECULATORS_SIDE = r"""
import sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from speculators.models import EagleSpeculator

d = sys.argv[1]
io = load_file(f"{d}/io.safetensors")
verifier = AutoModelForCausalLM.from_pretrained(f"{d}/target").eval()
# load detached, then attach: from_pretrained(verifier=...) re-initialises the "missing" lm_head, which is
# the verifier's own module (speculators 0.4.0.1 with transformers 4.57.6)
spec = EagleSpeculator.from_pretrained(f"{d}/spec", verifier_attachment_mode="detached").eval()
spec.attach_verifier(verifier, mode="full")
with torch.no_grad():
    logits = spec(input_ids=io["tokens"], hidden_states=io["features"], return_dict=True).logits
diff = (logits.reshape(io["logits"].shape).float() - io["logits"]).abs().max().item()
from importlib.metadata import version
print(f"speculators {version('speculators')}: max |logit difference| {diff:.3g}")
sys.exit(0 if diff <= float(sys.argv[2]) else 1)
"""


# runs inside the speculators 0.9 venv: argv = folder with spec/, target/, io.safetensors; tolerance
SPECULATORS_EAGLE3_SIDE = r"""
import sys
import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig

d = sys.argv[1]
io = load_file(f"{d}/io.safetensors")
config = SpeculatorModelConfig.from_pretrained(f"{d}/spec")
config.transformer_layer_config._attn_implementation = "eager"  # flex attention is its GPU default
spec = SpeculatorModel.from_pretrained(f"{d}/spec", config=config).eval()
print(type(spec).__name__, "aux layers", spec.config.eagle_aux_hidden_state_layer_ids)
spec.load_verifier_weights()  # the verifier's LM head for its training targets; embed_tokens/lm_head stay as exported
seen = []
spec.lm_head.register_forward_hook(lambda module, inputs, out: seen.append(out))
T = io["tokens"].shape[1]
with torch.no_grad():
    drafts = spec(hidden_states=io["rows"], input_ids=io["tokens"], document_ids=torch.zeros(1, T, dtype=torch.long),
                  ttt_steps=1)
diff = (seen[0].float() - io["logits"]).abs().max().item()
ids = drafts[0] + spec.d2t[drafts[0]]
same = torch.equal(ids, io["draft_ids"])
from importlib.metadata import version
print(f"speculators {version('speculators')}: max |logit difference| {diff:.3g}; same drafted ids: {same}")
sys.exit(0 if diff <= float(sys.argv[2]) and same else 1)
"""


def setup(venv: Path, eagle3: bool = False) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + (PINS_EAGLE3 if eagle3 else PINS), check=True)
    subprocess.run(pip + ["--no-deps", *(SPECULATORS_EAGLE3 if eagle3 else [SPECULATORS])], check=True)


def write_case(folder: Path) -> None:
    """Tiny target, a norm-free EAGLE-1 head on it, its speculators export and its draft logits."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.choose.heads import EagleHead
    from toolkit.export_formats import speculators_layout, write_layout

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False,  # SmolLM2's rope base, not the default: must reach speculators
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(folder / "target")
    # the verifier is read by transformers 4.57 over there, which knows rope_theta but not rope_parameters
    conf = json.loads((folder / "target" / "config.json").read_text())
    conf["rope_theta"] = conf["rope_parameters"]["rope_theta"]
    (folder / "target" / "config.json").write_text(json.dumps(conf))
    head = EagleHead(target)
    head.model.layers[0].input_layernorm = torch.nn.Identity()  # the EAGLE-1 layer speculators holds
    with torch.no_grad():  # away from the init, and a non-zero fc bias (fusion_bias)
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors, config, _ = speculators_layout(head.state_dict(), target.config, "check", verifier=str(folder / "target"),
                                            num_tokens=3)
    (folder / "spec").mkdir()
    write_layout(folder / "spec", tensors, config)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        features = target.get_decoder()(input_ids=ids[:, :-1]).last_hidden_state
        logits = head.logits(head(features, ids[:, 1:]))
    save_file({"tokens": ids[:, 1:].clone(), "features": features.contiguous(), "logits": logits.float().contiguous()},
              str(folder / "io.safetensors"))


def write_eagle3_case(folder: Path) -> None:
    """Tiny 4-layer target, a fused EAGLE-3-layer head with a draft vocabulary, its export by the real command, and
    the head's draft-vocabulary logits and drafted target ids on the target's fused hidden states."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.choose.heads import EagleHead
    from decode.core.vocab import DraftVocab
    from toolkit.export_formats import speculators_eagle3_layout, write_layout

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(folder / "target")
    head = EagleHead(target, feature_layers=(1, 2, 3), layer="eagle3",
                     draft_vocab=DraftVocab(torch.arange(3, 96, 2), 96))
    with torch.no_grad():  # away from the init, so every tensor matters
        for p in head.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors, config, _ = speculators_eagle3_layout(head, target.config, "check", verifier=str(folder / "target"),
                                                   num_tokens=3)
    (folder / "spec").mkdir()
    write_layout(folder / "spec", tensors, config)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        states = target(input_ids=ids[:, :-1], output_hidden_states=True).hidden_states
        rows = torch.cat([states[i] for i in head.feature_layers], -1)
        logits = head.logits(head(head.input_features(rows), ids[:, 1:]))
    save_file({"tokens": ids[:, 1:].clone(), "rows": rows.contiguous(), "logits": logits.float().contiguous(),
               "draft_ids": head.target_ids(logits.argmax(-1)).contiguous()}, str(folder / "io.safetensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eagle3", action="store_true", help="check the EAGLE-3 export against speculators 0.9")
    ap.add_argument("--venv", type=Path, default=None,
                    help="virtualenv with speculators (default: runs/speculators-venv, with --eagle3 "
                         "runs/speculators-eagle3-venv)")
    ap.add_argument("--setup", action="store_true", help="create --venv with speculators and its pins, then check")
    args = ap.parse_args(argv)
    venv = args.venv or REPO / "runs" / ("speculators-eagle3-venv" if args.eagle3 else "speculators-venv")
    if args.setup:
        setup(venv, args.eagle3)
    python = venv / "bin" / "python"
    if not python.is_file():
        print(f"error: {python} not found; run with --setup first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        (write_eagle3_case if args.eagle3 else write_case)(Path(tmp))
        side = SPECULATORS_EAGLE3_SIDE if args.eagle3 else SPECULATORS_SIDE
        return subprocess.run([str(python), "-c", side, tmp, str(TOLERANCE)]).returncode


if __name__ == "__main__":
    sys.exit(main())
