"""Self-drafting heads (EAGLE, EESD early exit, Cali-TS predictor): losslessness of their arms,
KV rollback, feature bookkeeping, the predictor formula, save/load and small training runs."""
import math

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.early_exit import EarlyExitArm
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.heads import CalibrationPredictor, EagleHead, EarlyExitDrafter, load_head, save_head
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama, tiny_qwen

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5]]
FAMILIES = {"llama": tiny_llama, "qwen": tiny_qwen}


def _perturb(module, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * p.abs().mean())


def _generate(model, arms, prompt, n, policy="fixed:arm=0", cache="dynamic"):
    target = Target(model, want_hidden=True, cache=cache)
    for a in arms:
        if hasattr(a, "target"):
            a.target = target
    eng = SpecEngine(target, arms, Verifier(GREEDY))
    return eng.generate(prompt, build_policy(policy, len(arms), eng.max_len, seed=0), n)


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_early_exit_full_depth_copy_accepts_everything(family):
    """N = all layers but the last, exit layer = copy of the last: the drafter IS the target, so
    every draft token must be accepted — any KV-cache slip in the drafting path breaks this."""
    model = FAMILIES[family](layers=3, seed=1)
    head = EarlyExitDrafter(model, n_layers=2)
    arm = EarlyExitArm(head, GREEDY, L=4)
    for prompt in PROMPTS[:2]:
        gen = _generate(model, [arm], prompt, 30)
        assert gen.tokens == plain_greedy(model, prompt, 30)
        assert all(r.accepted == r.drafted == 4 for r in gen.rounds[:-1])


@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
@pytest.mark.parametrize("family", ["llama", "qwen"])
@pytest.mark.parametrize("n_layers", [1, 2])
def test_early_exit_greedy_lossless_with_rejections(family, n_layers, cache):
    model = FAMILIES[family](layers=3, seed=1)
    head = EarlyExitDrafter(model, n_layers=n_layers)
    _perturb(head, 0.3)
    arm = EarlyExitArm(head, GREEDY, L=5, cache=cache)
    rounds = []
    for prompt in PROMPTS:
        gen = _generate(model, [arm, build_arm("pld:L=3", ArmEnv(model, None, GREEDY))], prompt, 40, "random",
                        cache=cache)
        assert gen.tokens == plain_greedy(model, prompt, 40)
        rounds += [r for r in gen.rounds if r.arm == 0]
    assert any(r.accepted < r.drafted for r in rounds)  # rejections happened and were rolled back
    assert any(r.accepted > 0 for r in rounds)


@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
def test_early_exit_rolled_back_cache_equals_fresh_draft(cache):
    """After rejected rounds (and rounds played by another arm), a draft from the kept cache must
    equal a draft computed from scratch on the committed context."""
    model = tiny_llama(layers=4, seed=3)
    head = EarlyExitDrafter(model, n_layers=1)
    _perturb(head, 0.3, seed=1)
    arm = EarlyExitArm(head, GREEDY, L=4, cache=cache)
    gen = _generate(model, [arm, build_arm("pld:L=2", ArmEnv(model, None, GREEDY))], PROMPTS[0], 25, "random",
                    cache=cache)
    ctx = PROMPTS[0] + gen.tokens
    fresh = EarlyExitArm(head, GREEDY, L=4)
    fresh.reset(ctx)
    a, b = arm.propose(ctx, 4), fresh.propose(ctx, 4)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert torch.allclose(a.q, b.q, atol=1e-5) and torch.allclose(a.hidden, b.hidden, atol=1e-4)
    assert arm.cache.get_seq_length() == len(ctx) + 3  # context + all draft tokens but the last


def test_early_exit_defaults_and_trainable_split():
    model = tiny_llama(layers=20)
    head = EarlyExitDrafter(model)
    assert head.n_layers == 2  # ≈10% of the layers
    head.freeze_shared()
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.2.", "model.norm.", "lm_head.")) for n in trainable)
    assert head.model.layers[0] is model.model.layers[0]  # shared, not copied
    assert torch.equal(head.model.layers[2].mlp.up_proj.weight, model.model.layers[-1].mlp.up_proj.weight)
    with pytest.raises(UserError, match="n_layers"):
        EarlyExitDrafter(model, n_layers=20)


@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_eagle_greedy_lossless(family, cache):
    model = FAMILIES[family](layers=2, seed=1)
    head = EagleHead(model)
    arm = EagleArm(head, model, GREEDY, L=4, cache=cache)
    for prompt in PROMPTS[1:]:
        gen = _generate(model, [arm, build_arm("suffix:L=3,min_match=1", ArmEnv(model, None, GREEDY))],
                        prompt, 30, "random", cache=cache)
        assert gen.tokens == plain_greedy(model, prompt, 30)


@pytest.mark.parametrize("min_rows", [None, 2])  # 2: the feature buffer regrows several times in one query
@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
def test_eagle_features_are_the_targets_and_head_cache_is_true_only(cache, min_rows, monkeypatch):
    if min_rows:
        monkeypatch.setattr(EagleArm, "FEATS_MIN_ROWS", min_rows)
    model = tiny_llama(layers=2, seed=4)
    arm = EagleArm(EagleHead(model), model, GREEDY, L=3, cache=cache)
    gen = _generate(model, [arm, build_arm("pld:L=2", ArmEnv(model, None, GREEDY))], PROMPTS[0], 20, "random",
                    cache=cache)
    ctx = PROMPTS[0] + gen.tokens
    with torch.no_grad():
        ref = model(torch.tensor([ctx]), output_hidden_states=True).hidden_states[-1][0]
    n = arm.feats.shape[0]
    assert n >= len(ctx) - 2
    assert torch.allclose(arm.feats, ref[:n], atol=1e-4)
    # after a draft the head cache holds only entries built from true features (positions 0..m-2)
    arm.propose(ctx, 3)
    assert arm.cache.get_seq_length() == len(ctx) - 1 == arm.entries


def test_eagle_without_engine_hidden_states_computes_prompt_features():
    model = tiny_llama(layers=2, seed=4)
    arm = EagleArm(EagleHead(model), model, GREEDY, L=3)
    arm.reset(PROMPTS[0])
    d = arm.propose(PROMPTS[0], 3)
    assert len(d) == 3 and d.hidden.shape == (3, 32)
    with pytest.raises(UserError, match="want_hidden"):
        arm.observe(PROMPTS[0] + [1], None)


def test_eagle_fallback_target_forwards_count_as_target_forwards():
    """Without the prompt's features from the engine, the EAGLE arm runs the target itself once;
    that forward counts in Generation.target_forwards (the denominator of MAT) like every other."""
    model = tiny_llama(layers=2, seed=4)
    arm = EagleArm(EagleHead(model), model, GREEDY, L=3)  # not linked to the Target: no prefill features
    eng = SpecEngine(Target(model, want_hidden=True), [arm], Verifier(GREEDY), step_time=1.0)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        gen = eng.generate(PROMPTS[0], build_policy("fixed", 1, 3), 20)
    finally:
        hook.remove()
    assert gen.tokens == plain_greedy(model, PROMPTS[0], 20)
    assert [r.extra_target_forwards for r in gen.rounds] == [1] + [0] * (len(gen.rounds) - 1)
    assert gen.target_forwards == len(gen.rounds) + 1 == len(calls) - 1  # every forward but the prefill


def test_sampled_decoding_with_heads_runs_and_reports_q():
    model = tiny_llama(layers=3, seed=1)
    cfg = SamplingConfig(temperature=0.8)
    arm = EarlyExitArm(EarlyExitDrafter(model, 1), cfg, L=3, generator=torch.Generator().manual_seed(0))
    d = arm.propose(PROMPTS[1], 3)
    assert d.q.shape == (3, 64) and torch.allclose(d.q.sum(-1), torch.ones(3))


def test_head_folders_round_trip_and_reject_other_targets(tmp_path):
    model = tiny_llama(layers=3, seed=1)
    for head, kind in ((EarlyExitDrafter(model, 1), "early_exit"), (EagleHead(model), "eagle")):
        _perturb(head, 0.1)
        save_head(head, tmp_path / kind)
        back = load_head(tmp_path / kind, model, expect=kind)
        for k, v in head.trainable_state_dict().items():
            assert torch.equal(v, back.trainable_state_dict()[k]), k
        with pytest.raises(UserError, match="hidden_size"):
            load_head(tmp_path / kind, tiny_llama(hidden=48, layers=3))
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    assert isinstance(build_arm(f"early_exit:path={tmp_path / 'early_exit'},L=3", env), EarlyExitArm)
    assert isinstance(build_arm(f"eagle:path={tmp_path / 'eagle'},L=3", env), EagleArm)
    with pytest.raises(UserError, match="expected 'eagle'"):
        build_arm(f"eagle:path={tmp_path / 'early_exit'}", env)
    with pytest.raises(UserError, match="no head.json"):
        build_arm(f"eagle:path={tmp_path / 'missing'}", env)


def test_calibrator_matches_formula():
    torch.manual_seed(0)
    c = CalibrationPredictor(8, 6, mlp_hidden=5, max_pos=10)
    with torch.no_grad():
        c.W.normal_()
    ht, hd = torch.randn(8), torch.randn(6)
    for i in (1, 4, 10, 17):
        w = c.W[min(i, 10) - 1]
        expect = torch.sigmoid(c.mlp(torch.cat([w @ ht, hd])))[0]
        assert math.isclose(c.theta(ht, hd, i), float(expect.detach()), rel_tol=1e-5)
    out = c(torch.randn(7, 8), torch.randn(7, 6), torch.tensor([1, 2, 3, 10, 11, 12, 50]))
    assert out.shape == (7,)
    lin = CalibrationPredictor(8, 6, mlp_hidden=0)  # the paper's single linear layer W_p
    assert isinstance(lin.mlp, torch.nn.Linear)
    with pytest.raises(ValueError):
        c(torch.randn(1, 8), torch.randn(1, 6), torch.tensor([0]))


def test_auroc_and_ece_match_definitions():
    from scipy.stats import mannwhitneyu

    from toolkit.train.calibrator import auroc, ece

    g = torch.Generator().manual_seed(0)
    y = (torch.rand(300, generator=g) < 0.4).float()
    s = (y * 0.5 + torch.rand(300, generator=g)).round(decimals=1)  # informative, with ties
    u = float(mannwhitneyu(s[y == 1].double().numpy(), s[y == 0].double().numpy()).statistic)
    assert math.isclose(auroc(s, y), u / (int(y.sum()) * int((1 - y).sum())), rel_tol=1e-9)
    assert auroc(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, 0.0, 1.0])) == 1.0
    # two bins: p=0.25 (4 rows, 1 positive) is calibrated, p=0.95 (4 rows, 2 positive) is off by 0.45
    p = torch.tensor([0.25] * 4 + [0.95] * 4)
    lab = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float)
    assert math.isclose(ece(p, lab), 0.5 * 0.45, rel_tol=1e-6)


# --------------------------------------------------------------------------- training smoke runs

@pytest.fixture(scope="module")
def tiny_distilled(tmp_path_factory, tiny_target_dir):
    """A tiny random target with the real tokenizer and a 10-prompt distilled math set."""
    from toolkit.distill import distill, load_distill_recipe

    d = tmp_path_factory.mktemp("heads")
    r = load_distill_recipe(task="math", overrides=[
        f"target={tiny_target_dir}", "num_prompts=10", "generation.max_new_tokens=20", "generation.temperatures=[0.0]",
        "generation.batch_size=10", f"out={d}/distill/math", "shard_size=10", "leakage.eval_files=[]",
        "filters.rules=[]"])
    distill(r, progress=False)
    common = [f"target={tiny_target_dir}", f"data.root={d}/distill", "data.heldout_fraction=0.3", "train.max_steps=3",
              "train.batch_size=2", "train.save_steps=2", "progress=false"]
    return d, tiny_target_dir, common


def test_train_heads_smoke_then_decode_losslessly(tiny_distilled):
    import json

    from decode.core.models import load_model
    from toolkit.train import calibrator, eagle, early_exit

    d, tiny, common = tiny_distilled
    target, _ = load_model(tiny)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    assert early_exit.main(common + [f"out_dir={d}/ee", "head.n_layers=1", "open_text.fraction=0.3"]) == 0
    assert eagle.main(common + [f"out_dir={d}/eagle"]) == 0
    assert calibrator.main(common + [f"out_dir={d}/cal", f"collect.drafter={d}/ee", "collect.prompts=6",
                                     "collect.max_new_tokens=12", "collect.heldout_fraction=0.5", "collect.L=4"]) == 0
    ee_eval = json.loads((d / "ee" / "eval.json").read_text())
    assert ee_eval["train_examples"]["open_text"] > 0 and 0 <= ee_eval["heldout"]["agreement"] <= 1
    assert json.loads((d / "eagle" / "eval.json").read_text())["trainable_params"] > 0
    cal = json.loads((d / "cal" / "eval.json").read_text())
    assert cal["heldout"]["rows"] > 0 and "auroc" in cal["heldout"]["top1_baseline"]
    assert (d / "ee" / "checkpoints").is_dir()  # resumable

    ee = load_head(d / "ee", target)
    after = {k: v for k, v in target.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)  # the target stayed frozen
    assert not torch.equal(ee.model.layers[1].mlp.up_proj.weight, target.model.layers[-1].mlp.up_proj.weight)

    env = ArmEnv(target, TinyTokenizer(target.config.vocab_size), GREEDY)
    arms = [build_arm(f"early_exit:path={d / 'ee'},L=4", env), build_arm(f"eagle:path={d / 'eagle'},L=3", env)]
    from decode.choose.heads.calibrator import TrainedThetaM
    from decode.choose.length import build_length
    ctl = build_length(f"cali-ts:predictor={d / 'cal'}")  # as `decode eval --length` builds it
    assert isinstance(ctl.predictor, TrainedThetaM) and ctl.needs_target_hidden
    target_w = Target(target, want_hidden=True)
    for a in arms:
        a.target = target_w
    eng = SpecEngine(target_w, arms, Verifier(GREEDY))
    prompt = [1, 5, 9, 5, 1, 5]
    gen = eng.generate(prompt, build_policy("random", 2, eng.max_len, seed=1), 30, length=ctl)
    assert gen.tokens == plain_greedy(target, prompt, 30)


def test_heads_train_with_a_draft_vocabulary_and_record_its_coverage(tiny_distilled):
    """Default recipes draft from the tokens covering 95% of the target's distilled outputs: the subset is
    saved with the head, its coverage lands in head.json and eval.json, and decoding stays lossless;
    ``draft_vocab=null`` keeps the full vocabulary."""
    import json

    from decode.core.models import load_model
    from decode.core.vocab import VOCAB_FILE
    from toolkit.train import eagle, early_exit

    d, tiny, common = tiny_distilled
    quick = common + ["train.max_steps=1"]
    assert early_exit.main(quick + [f"out_dir={d}/ee_dv", "head.n_layers=1", "open_text.fraction=0"]) == 0
    assert eagle.main(quick + [f"out_dir={d}/eagle_dv", "draft_vocab.size=40", "open_text.fraction=0"]) == 0
    assert eagle.main(quick + [f"out_dir={d}/eagle_full", "draft_vocab=null", "open_text.fraction=0"]) == 0
    target, tok = load_model(tiny)
    V = target.config.vocab_size
    ee_meta = json.loads((d / "ee_dv" / "head.json").read_text())["draft_vocab"]
    ee_eval = json.loads((d / "ee_dv" / "eval.json").read_text())["draft_vocab"]
    assert ee_meta == ee_eval | {"file": VOCAB_FILE}
    assert ee_meta["coverage"] >= 0.95 and ee_meta["coverage_target"] == 0.95 and ee_meta["size"] < V
    assert set(tok.all_special_ids) <= set(load_head(d / "ee_dv", target).draft_vocab.d2t.tolist())
    eg = load_head(d / "eagle_dv", target)
    assert eg.draft_vocab.info["frequent"] == 40 and eg.draft_weight.shape[0] == len(eg.draft_vocab) >= 40
    run = json.loads((d / "eagle_dv" / "run.json").read_text())
    assert run["draft_vocab"]["size"] == 40  # part of the resume fingerprint
    assert load_head(d / "eagle_full", target).draft_vocab is None and not (d / "eagle_full" / VOCAB_FILE).exists()
    env = ArmEnv(target, TinyTokenizer(V), GREEDY)
    arms = [build_arm(f"early_exit:path={d / 'ee_dv'},L=4", env), build_arm(f"eagle:path={d / 'eagle_dv'},L=3", env)]
    prompt = [1, 5, 9, 5, 1, 5]
    gen = _generate(target, arms, prompt, 24, "random")
    assert gen.tokens == plain_greedy(target, prompt, 24)


def test_head_recipes_fail_fast_on_bad_fields(tiny_distilled):
    from toolkit.train import early_exit

    d, tiny, common = tiny_distilled
    assert early_exit.main(common + ["open_text.fraction=1.5"]) == 2
    assert early_exit.main(common + ["head.n_layer=2"]) == 2
    assert early_exit.main(common + ["draft_vocab.coverage=1.5"]) == 2
    assert early_exit.main(common + ["draft_vocab.size=0"]) == 2
    assert early_exit.main([f"target={tiny}", f"data.root={d}/nowhere"]) == 2


# --------------------------------------------------------------------------- device and dtype

def test_heads_train_in_bfloat16_on_cpu(tiny_distilled):
    """train.dtype=bfloat16 on the CPU: every head trains under autocast with float32 master weights (the
    frozen target stays float32), records the resolved dtype, and saves float32 weights."""
    import json

    from safetensors.torch import load_file

    from toolkit.train import calibrator, eagle, early_exit

    d, tiny, common = tiny_distilled
    bf16 = common + ["train.device=cpu", "train.dtype=bfloat16", "train.max_steps=2"]
    assert early_exit.main(bf16 + [f"out_dir={d}/ee16", "head.n_layers=1", "open_text.fraction=0.3"]) == 0
    assert eagle.main(bf16 + [f"out_dir={d}/eagle16"]) == 0
    assert calibrator.main(bf16 + [f"out_dir={d}/cal16", f"collect.drafter={d}/ee16", "collect.prompts=6",
                                   "collect.max_new_tokens=8", "collect.heldout_fraction=0.5", "collect.L=3"]) == 0
    for name in ("ee16", "eagle16", "cal16"):
        run = json.loads((d / name / "run.json").read_text())
        assert run["train"]["dtype"] == "bfloat16" and "device" not in run["train"], name
        assert all(v.dtype == torch.float32 for v in load_file(str(d / name / "head.safetensors")).values()), name
    assert 0 <= json.loads((d / "ee16" / "eval.json").read_text())["heldout"]["agreement"] <= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors on a machine without a GPU")
def test_head_recipes_reject_a_device_or_dtype_this_machine_lacks(tiny_distilled, capsys):
    from toolkit.train import eagle

    d, tiny, common = tiny_distilled
    for item, needle in (("train.device=cuda", "train.device=cuda: no CUDA device is visible"),
                         ("train.dtype=float16", "train.dtype=float16 needs a CUDA device"),
                         ("train.device=gpu", "train.device must be auto|cpu|cuda[:N]")):
        assert eagle.main(common + [f"out_dir={d}/never", item]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], item
    assert not (d / "never").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_heads_train_on_cuda(tiny_distilled):
    import json

    from toolkit.train import calibrator, early_exit

    d, tiny, common = tiny_distilled
    gpu = common + ["train.device=cuda", "train.dtype=auto", "train.max_steps=2"]
    assert early_exit.main(gpu + [f"out_dir={d}/ee_cuda", "head.n_layers=1"]) == 0
    assert calibrator.main(gpu + [f"out_dir={d}/cal_cuda", f"collect.drafter={d}/ee_cuda", "collect.prompts=6",
                                  "collect.max_new_tokens=8", "collect.heldout_fraction=0.5", "collect.L=3"]) == 0
    dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    assert json.loads((d / "ee_cuda" / "run.json").read_text())["train"]["dtype"] == dtype
    assert json.loads((d / "cal_cuda" / "eval.json").read_text())["heldout"]["rows"] > 0


def test_eagle_warm_starts_from_a_trained_head(tiny_distilled, capsys):
    """head.init_from: training starts from that head's weights and draft vocabulary (with a vanishing lr the result
    is the source head), and a source of another layout is refused naming the field."""
    import json

    from decode.core.models import load_model
    from toolkit.train import eagle

    d, tiny, common = tiny_distilled
    quick = common + ["train.max_steps=2", "open_text.fraction=0"]
    assert eagle.main(quick + [f"out_dir={d}/warm_src", "draft_vocab.size=40"]) == 0
    # the recipe asks for another vocabulary size: the source's is kept (its LM head rows index it)
    assert eagle.main(quick + [f"out_dir={d}/warm_lr0", f"head.init_from={d}/warm_src", "train.lr=1e-30",
                               "draft_vocab.size=60"]) == 0
    target, _ = load_model(tiny)
    src, same = load_head(d / "warm_src", target), load_head(d / "warm_lr0", target)
    assert torch.equal(src.draft_vocab.d2t, same.draft_vocab.d2t)
    a, b = src.trainable_state_dict(), same.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-20) for k in a)
    # the warm start is scored on the same held-out rows before training: unchanged weights, the same figures
    report = json.loads((d / "warm_lr0" / "eval.json").read_text())
    assert report["heldout_init"]["positions"] > 0 and report["heldout_init"] == report["heldout"]
    assert "heldout_init" not in json.loads((d / "warm_src" / "eval.json").read_text())
    assert eagle.main(quick + [f"out_dir={d}/warm_lr", f"head.init_from={d}/warm_src", "train.lr=0.05"]) == 0
    moved = load_head(d / "warm_lr", target).trainable_state_dict()
    assert any(not torch.equal(a[k], moved[k]) for k in a)
    assert json.loads((d / "warm_lr" / "run.json").read_text())["head"]["init_from"] == f"{d}/warm_src"
    # another layout (the source has an fc bias and an input norm; the recipe asks for neither)
    capsys.readouterr()
    assert eagle.main(quick + [f"out_dir={d}/warm_bad", f"head.init_from={d}/warm_src", "head.fc_bias=false"]) == 2
    assert "head.fc_bias=False here, True there" in capsys.readouterr().err
    assert eagle.main(quick + [f"out_dir={d}/warm_none", f"head.init_from={d}/nowhere"]) == 2
