"""Drafter training: SFT features, recipes and their errors, exact resume, export → decode arm, LoRA,
KD loss, pools, and the launcher under DeepSpeed on CPU."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from decode.common.errors import UserError
from decode.core.models import vocab_fingerprint

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def distilled(tmp_path_factory, tiny_target_dir):
    """Two small tasks distilled from the tiny target with the real distillation code (math, code)."""
    from toolkit.data.filters import FilterConfig
    from toolkit.data.sources import JsonlSource
    from toolkit.distill import DistillRecipe, GenerationConfig, LeakageConfig, distill

    root = tmp_path_factory.mktemp("distill")
    for task, topic in (("math", "adding numbers"), ("code", "python lists")):
        src = root / f"{task}.jsonl"
        src.write_text("".join(json.dumps({"prompt": f"Question {i} on {topic}: what is {i} and {3 * i}?"}) + "\n"
                               for i in range(24)))
        distill(DistillRecipe(task=task, target=tiny_target_dir, sources=[JsonlSource(path=str(src))],
                              num_prompts=24, shard_size=16,
                              generation=GenerationConfig(temperatures=[0.0, 1.0], max_new_tokens=16, batch_size=8),
                              filters=FilterConfig(rules=[]), leakage=LeakageConfig(eval_files=[]),
                              out=str(root / task)), progress=False)
    return root


def _recipe(tmp_path, tiny_target_dir, distilled, **sections) -> Path:
    """A tiny drafter recipe file (1 layer, width 32) on the fixture data; sections override keys."""
    rec = {
        "name": "tiny", "target": tiny_target_dir, "out_root": str(tmp_path / "runs"),
        "model": {"hidden": 32, "heads": 4, "layers": 1, "intermediate": 64, "max_positions": 256},
        "data": {"root": str(distilled), "heldout_fraction": 0.2, "heldout_max": 4, "max_length": 96},
        "train": {"max_steps": 6, "batch_size": 4, "lr": 0.01, "logging_steps": 1, "save_steps": 2,
                  "deepspeed": None, "warmup": 0.0},
    }
    for k, v in sections.items():
        rec[k] = {**rec.get(k, {}), **v} if isinstance(v, dict) else v
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(rec))
    return p


def _losses(ckpt: Path) -> dict[int, float]:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return {r["step"]: r["loss"] for r in state["log_history"] if "loss" in r}


# --------------------------------------------------------------------------- data

def test_sft_features_mask_prompt_and_keep_target_tokens(tiny_target_dir):
    from transformers import AutoTokenizer

    from toolkit.train.data import encode_example

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    row = {"prompt": "p", "response": "r", "prompt_ids": [5, 6, 7], "response_ids": [8, 9, tok.eos_token_id]}
    ex = encode_example(tok, row, max_length=64)
    assert ex["input_ids"] == [5, 6, 7, 8, 9, tok.eos_token_id]
    assert ex["labels"] == [-100, -100, -100, 8, 9, tok.eos_token_id]
    cut = encode_example(tok, row, max_length=4)
    assert cut["input_ids"] == [5, 6, 7, 8] and cut["labels"] == [-100, -100, -100, 8]
    # rows without ids: prompt through decode's chat-template encoding, end-of-turn appended only if stopped
    from decode.evaluation.suites import encode_prompt
    text = {"prompt": "What is 2+2?", "response": "4", "finish_reason": "stop"}
    ex = encode_example(tok, text, max_length=512)
    n = len(encode_prompt(tok, "What is 2+2?"))
    assert ex["input_ids"][:n] == encode_prompt(tok, "What is 2+2?") and ex["labels"][:n] == [-100] * n
    assert ex["labels"][-1] == tok.eos_token_id
    ex = encode_example(tok, {**text, "finish_reason": "length"}, max_length=512)
    assert ex["labels"][-1] != tok.eos_token_id


def test_heldout_split_is_by_prompt(distilled):
    from toolkit.train.data import DataSection, load_examples, split_heldout

    sec = DataSection(root=str(distilled), heldout_fraction=0.3, heldout_max=1000)
    ds = load_examples(sec, "math")
    train, held = split_heldout(ds, sec)
    assert len(train) + len(held) == len(ds) and len(held) > 0
    assert not set(train["prompt"]) & set(held["prompt"])  # one prompt's temperatures stay on one side
    both = load_examples(sec, "all")
    assert sorted(set(both["task"])) == ["code", "math"] and len(both) > len(ds)


def test_shipped_answers_extend_the_distilled_rows_once_each(distilled, tmp_path, tiny_target_dir):
    """data.answers: the rows of an answers folder the distilled folders lack are trained on too, after them (so the
    held-out split of the distilled rows stays what it was), each id once, as the same SFT features."""
    from transformers import AutoTokenizer

    from toolkit.answers import export_answers, load_answers
    from toolkit.train.data import DataSection, load_examples, split_heldout, tokenize_sft

    folder = tmp_path / "answers"
    export_answers([distilled / "math", distilled / "code"], folder, eval_files=())
    shipped = {r["id"]: r for r in load_answers(folder)}
    own = load_examples(DataSection(root=str(distilled)), "math")
    only_code = tmp_path / "root"
    only_code.mkdir()
    (only_code / "code").symlink_to(distilled / "code")
    for task, root in (("math", distilled), ("all", only_code)):
        sec = DataSection(root=str(root), answers=str(folder), heldout_fraction=0.3, heldout_max=1000)
        ds = load_examples(sec, task)
        base = load_examples(DataSection(root=str(root)), task)
        assert ds["id"][:len(base)] == base["id"] and len(set(ds["id"])) == len(ds)
        want = {i for i, r in shipped.items() if task == "all" or r["task"] == task} | set(base["id"])
        assert set(ds["id"]) == want
        assert split_heldout(ds, sec)[1]["id"][:1] == split_heldout(base, sec)[1]["id"][:1]
    # a shipped row becomes the features its distilled twin does (training reads the token ids, not the text)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    twin = own.select([0])
    sec = DataSection(root=str(only_code), answers=str(folder))
    extra = load_examples(sec, "all")
    row = extra.select([extra["id"].index(twin["id"][0])])
    assert row["response"] == [""] and tokenize_sft(row, tok, 96)[0] == tokenize_sft(twin, tok, 96)[0]
    with pytest.raises(UserError, match=r"data.answers=.*no translation answers there .it has code, math.*null"):
        load_examples(DataSection(root=str(distilled), path=str(distilled / "math"), answers=str(folder)),
                      "translation")
    with pytest.raises(UserError, match=r"data.answers=.*not an answers folder.*toolkit answers"):
        load_examples(DataSection(root=str(distilled), answers=str(tmp_path)), "math")


# --------------------------------------------------------------------------- recipes and errors

def test_shipped_recipes_parse():
    from toolkit.config import load_recipe
    from toolkit.train.drafter import DrafterRecipe
    from toolkit.train.runtime import deepspeed_config

    names = []
    for p in sorted((REPO / "recipes" / "drafters").glob("*.yaml")):
        r = load_recipe(DrafterRecipe, p)
        names.append(r.name)
        assert deepspeed_config(r.train.deepspeed)["zero_optimization"]["stage"] in (2, 3)
    assert {"metasd-68m", "cpu-small", "cpu-small-ft"} <= set(names)
    assert deepspeed_config("zero3")["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("overrides, needle", [
    (["model.hiden=64"], "did you mean 'hidden'"),
    (["model.hidden=30"], "model.hidden=30 must be divisible by model.heads"),
    (["model.lora.enabled=true"], "model.lora.enabled needs model.source=pretrained"),
    (["model.source=pretrained"], "model.source=pretrained needs model.path"),
    (["train.deepspeed=zero9"], "train.deepspeed='zero9'"),
    (["kd.weight=2"], "kd.weight must be in [0, 1]"),
    (["train.lr=fast"], "'train.lr' must be a number"),
    (["data.root=/nonexistent/distill"], "make distill TASK=math"),
    (["model.init_layers=[0]"], "model.init_layers copies target layers"),
    (["train.device=gpu"], "train.device must be auto|cpu|cuda[:N], got 'gpu'"),
    (["train.dtype=bf16"], "'train.dtype' must be one of 'auto', 'float32', 'bfloat16', 'float16'"),
    (["train.precision=bf16"], "'train.precision' is now 'train.dtype (auto|float32|bfloat16|float16)'"),
])
def test_bad_recipe_fails_fast_with_the_field(tmp_path, tiny_target_dir, distilled, capsys, overrides, needle):
    from toolkit.train.drafter import main

    rec = _recipe(tmp_path, tiny_target_dir, distilled)
    assert main(["--recipe", str(rec), "--task", "math", *overrides]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny" / "math" / "export").exists()


def test_missing_recipe_file(capsys):
    from toolkit.train.drafter import main

    assert main(["--recipe", "recipes/drafters/nope.yaml", "--task", "math"]) == 2
    assert "not found" in capsys.readouterr().err


# --------------------------------------------------------------------------- models and losses

def test_project_embeddings_copy_pca_isometry():
    from toolkit.train.drafter import project_embeddings

    torch.manual_seed(0)
    E = torch.randn(200, 16) @ torch.diag(torch.linspace(3, 0.1, 16))
    assert torch.equal(project_embeddings(E, 16), E)
    wide = project_embeddings(E, 24)  # isometry: inner products preserved
    assert wide.shape == (200, 24) and torch.allclose(wide @ wide.T, E @ E.T, atol=1e-3)
    narrow = project_embeddings(E, 4)  # top principal directions keep most of the centred variance
    Ec = E - E.mean(0)
    kept = (narrow - narrow.mean(0)).pow(2).sum() / Ec.pow(2).sum()
    best = torch.linalg.svdvals(Ec)[:4].pow(2).sum() / Ec.pow(2).sum()
    assert narrow.shape == (200, 4) and torch.isclose(kept, best, atol=1e-4)


def test_kd_loss_mix_and_zero_for_identical_models():
    from helpers import tiny_llama
    from toolkit.train.drafter import KDSection, make_loss

    target, other = tiny_llama(seed=1), tiny_llama(seed=2)
    ids = torch.randint(0, 64, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    for div in ("forward_kl", "jsd"):
        loss, logs = make_loss(KDSection(weight=1.0, divergence=div), target)(target, inputs)
        assert abs(loss.item()) < 1e-5 and logs["sft_loss"] > 0  # the target distils into itself at zero cost
        loss, logs = make_loss(KDSection(weight=0.25, divergence=div), target)(other, inputs)
        assert logs["kd_loss"] > 0
        assert loss.item() == pytest.approx(0.75 * logs["sft_loss"] + 0.25 * logs["kd_loss"], rel=1e-5)
    sft_only, logs = make_loss(KDSection())(other, inputs)
    assert "kd_loss" not in logs and sft_only.item() == pytest.approx(logs["sft_loss"])


def test_heldout_metrics_extremes():
    from toolkit.train.metrics import expected_mat, position_stats

    p = torch.randn(5, 11)
    same = position_stats(p, p.clone())
    assert same["agree"] == 5 and same["overlap"] == pytest.approx(5.0)
    a, b = torch.full((3, 4), -1e4), torch.full((3, 4), -1e4)
    a[:, 0], b[:, 1] = 0.0, 0.0  # disjoint point masses
    assert position_stats(a, b) == {"n": 3, "agree": 0.0, "overlap": pytest.approx(0.0, abs=1e-6)}
    assert expected_mat(0.0, 4) == 1.0 and expected_mat(1.0, 4) == 5.0
    assert expected_mat(0.5, 2) == pytest.approx(1.75)


# --------------------------------------------------------------------------- training runs (in process)

class _Killed(Exception):
    pass


def test_interrupted_run_resumes_exactly_and_exports_for_decode(tmp_path, tiny_target_dir, distilled):
    from transformers import TrainerCallback

    from decode.choose.arms import ArmEnv, build_arm
    from decode.choose.arms.model import DrafterModelArm
    from decode.core.models import load_model
    from decode.core.sampling import SamplingConfig
    from toolkit.config import load_recipe
    from toolkit.export import read_metadata
    from toolkit.train.drafter import DrafterRecipe, train_drafter

    class KillAfterCheckpoint(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 4:  # checkpoint-4 is on disk; die before step 5 completes
                raise _Killed()

    rec = _recipe(tmp_path, tiny_target_dir, distilled)
    full = load_recipe(DrafterRecipe, rec, ["out_dir=" + str(tmp_path / "full")])
    broken = load_recipe(DrafterRecipe, rec, ["out_dir=" + str(tmp_path / "broken")])
    export = train_drafter(full, "math")
    with pytest.raises(_Killed):
        train_drafter(broken, "math", callbacks=[KillAfterCheckpoint()])
    assert not (tmp_path / "broken" / "export").exists()
    resumed = train_drafter(broken, "math")  # same command again: resumes from checkpoint-4

    a, b = _losses(tmp_path / "full" / "checkpoints" / "checkpoint-6"), _losses(
        tmp_path / "broken" / "checkpoints" / "checkpoint-6")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(b[s] == pytest.approx(a[s], rel=1e-5) for s in (5, 6))
    assert json.loads((tmp_path / "broken" / "train_summary.json").read_text())["resumed_from"].endswith("checkpoint-4")
    da, db = load_model(str(export))[0], load_model(str(resumed))[0]
    for (k, va), (_, vb) in zip(da.state_dict().items(), db.state_dict().items()):
        assert torch.allclose(va, vb, atol=1e-6), k

    # export folder: metadata + held-out evaluation, loadable by the drafter arm
    target, ttok = load_model(tiny_target_dir)
    meta = read_metadata(export)
    assert meta["target"] == tiny_target_dir and meta["task"] == "math"
    assert meta["target_vocab_hash"] == vocab_fingerprint(ttok) and meta["recipe"]["name"] == "tiny"
    ev = json.loads((export / "eval.json").read_text())
    assert ev["positions"] > 0 and 0 <= ev["agreement"] <= 1 and 0 < ev["acceptance"] <= 1
    env = ArmEnv(target, ttok, SamplingConfig())
    arm = build_arm(f"drafter:path={export},L=3,name=math,vocab=none", env)
    assert isinstance(arm, DrafterModelArm) and arm.label == "math"
    context = [1, 5, 9, 13, 17]
    draft = arm.propose(context, 3)
    ref = da.generate(torch.tensor([context]), max_new_tokens=3, do_sample=False, min_new_tokens=3,
                      pad_token_id=0)[0, len(context):].tolist()
    assert draft.tokens.tolist() == ref


def test_two_stage_then_lora_on_a_pretrained_model(tmp_path, tiny_target_dir, distilled):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from decode.core.models import load_model
    from helpers import tiny_llama
    from toolkit.config import load_recipe
    from toolkit.export import read_metadata
    from toolkit.train.drafter import DrafterRecipe, train_drafter

    rec = _recipe(tmp_path, tiny_target_dir, distilled, train={"max_steps": 3, "save_steps": 10})
    general = train_drafter(load_recipe(DrafterRecipe, rec), "all")  # stage 1: every task
    assert read_metadata(general)["task"] == "all"
    stage2 = load_recipe(DrafterRecipe, rec, ["name=ft", "model.source=pretrained", f"model.path={general}"])
    special = train_drafter(stage2, "code")
    g, s = load_model(str(general))[0], load_model(str(special))[0]
    assert g.config.hidden_size == s.config.hidden_size == 32
    assert any(not torch.equal(a, b) for a, b in zip(g.state_dict().values(), s.state_dict().values()))

    # LoRA on an existing HF model sharing the target's tokenizer
    base_dir = tmp_path / "base"
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tiny_llama(vocab=len(tok), hidden=32, layers=2, seed=7).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    lora = load_recipe(DrafterRecipe, rec, ["name=lora", "model.source=pretrained", f"model.path={base_dir}",
                                            "model.lora.enabled=true", "model.lora.r=4", "train.lr=0.05"])
    out = train_drafter(lora, "math")
    summary = read_metadata(out)["training"]
    base = load_model(str(base_dir))[0]
    assert summary["trainable_parameters"] < sum(p.numel() for p in base.parameters()) / 10
    weights = load_file(out / "model.safetensors")
    assert not any("lora" in k for k in weights)  # adapters merged: decode loads a plain model
    merged = load_model(str(out))[0]
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(any(m in k for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj")) for k in changed)


# --------------------------------------------------------------------------- pools

def test_pool_file_to_arm_specs(tmp_path, tiny_target_dir):
    from decode.engine.pools import load_pool

    exp = tmp_path / "math" / "export"
    exp.mkdir(parents=True)
    (exp / "config.json").write_text("{}")
    (exp / "drafter.json").write_text(json.dumps({"target": "t1", "task": "math"}))
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"target": "t1", "L": 3, "drafters": [{"name": "math", "path": str(exp)},
                                                                           {"path": str(exp), "L": 5}],
                                    "arms": ["pld:L=4", "suffix:L=6"]}))
    assert load_pool(pool).arms == [f"drafter:path={exp},L=3,name=math", f"drafter:path={exp},L=5,name=math",
                                    "pld:L=4", "suffix:L=6"]
    assert load_pool(pool).length is None  # no `length`: the run's --length decides
    # a union's sub-arms' paths resolve like any arm's (relative to the repository root or the working directory)
    union = "union:arms=eagle:path=pretrained/smollm2-135m-instruct/eagle:L=2+pld:L=4,nodes=6"
    pool.write_text(yaml.safe_dump({"arms": [union]}))
    head = REPO / "pretrained/smollm2-135m-instruct/eagle"
    assert load_pool(pool).arms == [f"union:arms=eagle:path={head}:L=2+pld:L=4,nodes=6"]
    bad = [({"drafters": [{"name": "x", "path": str(tmp_path / "none")}]}, "'x'.*point path at the export/ folder"),
           ({"target": "t2", "drafters": [{"path": str(exp)}]}, "trained for target 't1'"),
           ({"arms": ["warp:L=2"]}, "unknown arm 'warp'"),
           ({"arms": [f"union:arms=eagle:path={tmp_path / 'nohead'}:L=2+pld"]}, "nohead does not exist"),
           ({"arms": ["pld"], "size": 3}, "unknown field"),
           ({"arms": ["pld"], "length": "longest"}, "length 'longest'.*longest"),
           ({"arms": ["pld"], "length": "cost:prior=0"}, "length 'cost:prior=0'.*prior must be > 0"),
           ({"arms": ["pld"], "length": 3}, "length must be a draft-length controller spec"),
           ({}, "names no drafters and no arms")]
    for data, needle in bad:
        pool.write_text(yaml.safe_dump(data))
        with pytest.raises(UserError, match=needle.replace("(", r"\(")):
            load_pool(pool)
    with pytest.raises(UserError, match="not found"):
        load_pool(tmp_path / "missing.yaml")


# --------------------------------------------------------------------------- launcher under DeepSpeed

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_deepspeed_launcher_zero2_resume_and_plain_python_zero3(tmp_path, tiny_target_dir, distilled):
    """`deepspeed scripts/train_drafter.py` on CPU (gloo): a run, a resumed run that must match it; then the
    same script under plain `python` with ZeRO-3 (weights gathered from the shards for the export)."""
    from decode.core.models import load_model

    rec = _recipe(tmp_path, tiny_target_dir, distilled, train={"max_steps": 4, "save_steps": 2})
    # DeepSpeed's CPU comm op compiles once (~2 min) into TORCH_EXTENSIONS_DIR (torch's default:
    # ~/.cache/torch_extensions, shared with `make train-drafter`); later runs load it from there.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    script = ["scripts/train_drafter.py", "--recipe", str(rec), "--task", "math"]

    def launch(*cmd):
        r = subprocess.run([*cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(_free_port())]
    out = tmp_path / "runs" / "tiny" / "math"
    launch(*deepspeed, *script, "train.deepspeed=zero2")
    assert (out / "checkpoints" / "checkpoint-4" / "global_step4").is_dir()  # a DeepSpeed checkpoint
    first = _losses(out / "checkpoints" / "checkpoint-4")
    first_weights = (out / "export" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "checkpoints" / "checkpoint-4")  # as if killed between the two checkpoints
    shutil.rmtree(out / "export")
    r = launch(*deepspeed, *script, "train.deepspeed=zero2")
    assert "resuming from" in r.stdout
    again = _losses(out / "checkpoints" / "checkpoint-4")
    assert again[3] == pytest.approx(first[3], rel=1e-5) and again[4] == pytest.approx(first[4], rel=1e-5)
    assert (out / "export" / "model.safetensors").read_bytes() == first_weights
    assert json.loads((out / "export" / "eval.json").read_text())["positions"] > 0

    launch(sys.executable, *script, "train.deepspeed=zero3", "train.max_steps=2", "eval.enabled=false",
           f"out_dir={tmp_path / 'z3'}")
    z3 = load_model(str(tmp_path / "z3" / "export"))[0]
    stage2 = load_model(str(out / "export"))[0]
    assert z3.config.hidden_size == 32 and all(torch.isfinite(p).all() for p in z3.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(z3.state_dict().values(), stage2.state_dict().values()))


# --------------------------------------------------------------------------- device and dtype

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")


def test_placement_resolves_auto_and_the_fingerprint_keeps_dtype_not_device():
    from toolkit.train.runtime import Placement, TrainSection, placement, train_fingerprint

    cuda = torch.cuda.is_available()
    auto = placement(TrainSection())
    assert auto.device.type == ("cuda" if cuda else "cpu")
    assert auto.dtype == (torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32)
    assert placement(TrainSection(device="cpu", dtype="bfloat16"), deepspeed=False) == Placement(
        torch.device("cpu"), torch.bfloat16)
    cpu32 = Placement(torch.device("cpu"), torch.float32)
    a, b = train_fingerprint(TrainSection(device="cpu"), cpu32), train_fingerprint(TrainSection(), cpu32)
    assert a == b and "device" not in a and a["dtype"] == "float32"  # resolved: auto is per machine
    assert train_fingerprint(TrainSection(), Placement(torch.device("cpu"), torch.bfloat16))["dtype"] == "bfloat16"


@NO_CUDA
@pytest.mark.parametrize("overrides, needle", [
    (["train.device=cuda"], "train.device=cuda: no CUDA device is visible to PyTorch"),
    (["train.device=cuda:1"], "train.device=cuda:1: no CUDA device is visible to PyTorch"),
    (["train.dtype=float16"], "train.dtype=float16 needs a CUDA device"),
])
def test_a_device_or_dtype_this_machine_lacks_is_one_line(tmp_path, tiny_target_dir, distilled, capsys,
                                                         overrides, needle):
    from toolkit.train.drafter import main

    rec = _recipe(tmp_path, tiny_target_dir, distilled)
    assert main(["--recipe", str(rec), "--task", "math", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "runs" / "tiny" / "math").exists()  # nothing loaded, nothing written


def test_launch_check_catches_device_and_dtype_before_deepspeed(tmp_path, tiny_target_dir, distilled):
    """`make train-drafter` runs `--check` first: a misspelt or impossible device is one line, not a launcher log."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_drafter_script", REPO / "scripts" / "train_drafter.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rec = _recipe(tmp_path, tiny_target_dir, distilled)
    cases = [("train.device=gpu", "train.device must be auto|cpu|cuda[:N], got 'gpu'"),
             ("train.dtype=half", "train.dtype must be auto|float32|bfloat16|float16, got 'half'"),
             ("train.precision=bf16", "train.precision is now train.dtype")]
    if not torch.cuda.is_available():
        cases += [("train.device=cuda", "train.device=cuda: no CUDA device is visible"),
                  ("train.dtype=float16", "train.dtype=float16 needs a CUDA device")]
    base = ["--recipe", str(rec), "--task", "math"]
    for item, needle in cases:
        with pytest.raises(UserError) as e:
            script.check_task([*base, item])
        assert needle in str(e.value) and "\n" not in str(e.value), item
    assert script.check_task([*base, "train.device=cpu", "train.dtype=bfloat16"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "scripts/train_drafter.py", "--check", *base, "train.device=gpu"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: train.device"), r.stdout + r.stderr


def test_bfloat16_training_step_on_cpu_exports_a_float32_drafter(tmp_path, tiny_target_dir, distilled):
    """train.dtype=bfloat16 on the CPU: autocast compute, float32 master weights, KD against the frozen target."""
    from decode.core.models import load_model
    from toolkit.config import load_recipe
    from toolkit.train.drafter import DrafterRecipe, train_drafter

    rec = _recipe(tmp_path, tiny_target_dir, distilled, train={"max_steps": 2, "save_steps": 10},
                  kd={"weight": 0.5})
    export = train_drafter(load_recipe(DrafterRecipe, rec, ["train.device=cpu", "train.dtype=bfloat16"]), "math")
    run = json.loads((tmp_path / "runs" / "tiny" / "math" / "run.json").read_text())
    assert run["train"]["dtype"] == "bfloat16" and "device" not in run["train"]
    losses = _losses(tmp_path / "runs" / "tiny" / "math" / "checkpoints" / "checkpoint-2")
    assert sorted(losses) == [1, 2] and all(v == v and v < 1e3 for v in losses.values())
    assert json.loads((export / "eval.json").read_text())["positions"] > 0
    drafter, _ = load_model(str(export))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in drafter.parameters())


@CUDA
def test_drafter_trains_on_cuda_in_bfloat16(tmp_path, tiny_target_dir, distilled):
    from toolkit.config import load_recipe
    from toolkit.train.drafter import DrafterRecipe, train_drafter

    rec = _recipe(tmp_path, tiny_target_dir, distilled, train={"max_steps": 2, "save_steps": 10},
                  kd={"weight": 0.5})
    export = train_drafter(load_recipe(DrafterRecipe, rec, ["train.device=cuda", "train.dtype=auto"]), "math")
    run = json.loads((tmp_path / "runs" / "tiny" / "math" / "run.json").read_text())
    assert run["train"]["dtype"] == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
    assert json.loads((export / "eval.json").read_text())["positions"] > 0
