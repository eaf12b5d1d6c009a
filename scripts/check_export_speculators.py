"""Check `--format speculators` against the real `speculators` library, in a separate virtualenv.

Why a separate venv: the last speculators release with an EAGLE-1 model (EagleSpeculator) is 0.4.x; it pins
transformers<=4.57.6 and does not import under this project's transformers 5.23 (pydantic fails on its
config classes: "PydanticUndefinedAnnotation: name 'torch' is not defined"). Releases from 0.5 on hold only
EAGLE-3 and newer drafters. So the check runs speculators 0.4.0.1 with transformers 4.57.6 and the same
torch 2.13 CPU build, installed with --no-deps (its other pins are for training and data generation).

What it checks: a tiny Llama target and an EAGLE-1 head of the shape speculators holds (one decoder layer
whose input is not normalised; our trained heads keep that norm, so the exporter refuses them for this
format: see README "Exporting for vLLM, SGLang and transformers"). The head is written with
toolkit.export_formats.speculators_layout, loaded with EagleSpeculator.from_pretrained, attached to the
same target, and must give the head's draft logits on the same inputs (max |difference| <= 1e-5).

    .venv/bin/python scripts/check_export_speculators.py --setup   # once: builds runs/speculators-venv
    .venv/bin/python scripts/check_export_speculators.py           # the check; exit 0 = same logits
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


def setup(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + PINS, check=True)
    subprocess.run(pip + ["--no-deps", SPECULATORS], check=True)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", type=Path, default=REPO / "runs" / "speculators-venv",
                    help="virtualenv with speculators (default: %(default)s)")
    ap.add_argument("--setup", action="store_true", help=f"create --venv with {SPECULATORS} and its pins, then check")
    args = ap.parse_args(argv)
    if args.setup:
        setup(args.venv)
    python = args.venv / "bin" / "python"
    if not python.is_file():
        print(f"error: {python} not found; run with --setup first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        write_case(Path(tmp))
        return subprocess.run([str(python), "-c", SPECULATORS_SIDE, tmp, str(TOLERANCE)]).returncode


if __name__ == "__main__":
    sys.exit(main())
