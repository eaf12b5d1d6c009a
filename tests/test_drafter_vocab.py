"""Draft vocabulary of independent drafter models (issue 13, FR-Spec): the pruned forward, exactness of the
``drafter`` arm drafting from a subset (greedy and sampling), and the trainer saving the subset that the
arm then picks up."""
import json

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.model import DrafterModelArm, DraftVocabLM, load_drafter_vocab
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from decode.core.vocab import VOCAB_FILE, DraftVocab, count_tokens
from helpers import plain_greedy, tiny_llama
from test_vocab_pruning import PROMPT, PROMPTS, V, _decode, _excluding_half_of_greedy, _first_two_tokens_pvalue

GREEDY = SamplingConfig()
pytestmark = pytest.mark.usefixtures("one_thread")


def _vocab(ids, vocab_size=64):
    return DraftVocab(torch.tensor(sorted(ids)), vocab_size, {"coverage": 0.5})


def _greedy_over_subset(model, context, n, d2t):
    """Reference: the full model's logits, argmax over the subset's columns, n times (no cache)."""
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([context + out])).logits[0, -1]
            out.append(int(d2t[logits[d2t].argmax()]))
    return out


# --------------------------------------------------------------------------- the pruned forward

def test_pruned_forward_is_the_models_logits_on_the_subset_and_minus_inf_elsewhere():
    model = tiny_llama(layers=2, seed=3)
    vocab = _vocab(range(1, 64, 3))
    lm = DraftVocabLM(model, vocab)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.inference_mode():
        full = model(ids).logits
        pruned = lm(input_ids=ids).logits
        last = lm(input_ids=ids, logits_to_keep=1).logits
    assert pruned.shape == full.shape and last.shape == (1, 1, 64)
    assert torch.allclose(pruned[..., vocab.d2t], full[..., vocab.d2t], atol=1e-5)
    outside = torch.ones(64, dtype=torch.bool)
    outside[vocab.d2t] = False
    assert torch.isinf(pruned[..., outside]).all() and (pruned[..., outside] < 0).all()
    assert torch.allclose(last[0, -1], pruned[0, -1], atol=1e-6)  # same values (GEMM shape aside)
    assert lm.rows.shape == (len(vocab), 32)  # the [N, d] rows, cached once
    with pytest.raises(UserError, match="indexes 50 tokens but the drafter has 64"):
        DraftVocabLM(model, _vocab(range(10), vocab_size=50))
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(UserError, match="final_logit_softcapping.*vocab=none"):
        DraftVocabLM(model, vocab)


# --------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
def test_pruned_drafter_arm_is_greedy_lossless_and_drafts_only_subset_tokens(cache):
    """Drafter = the target itself, its vocabulary without every other token of the target's greedy output:
    the output is still the target's greedy text, only subset tokens are drafted, and the excluded ones are
    exactly where drafts get rejected (the arm's own KV cache of either kind rolls back as usual)."""
    model = tiny_llama(layers=3, seed=1)
    for prompt in PROMPTS:
        vocab, excluded = _excluding_half_of_greedy(model, prompt, 30)
        arm = DrafterModelArm(model, GREEDY, L=4, vocab=vocab, cache=cache)
        gen, drafted = _decode(model, arm, prompt, 30, "random")
        assert gen.tokens == plain_greedy(model, prompt, 30)
        assert drafted and set(drafted) <= set(vocab.d2t.tolist()) and not set(drafted) & set(excluded)
        assert any(r.accepted < r.drafted for r in gen.rounds if r.arm == 0)


def test_pruned_draft_is_the_best_subset_token_of_the_full_drafter_across_rounds():
    """A drafter unlike the target, whose own first choice is outside the subset: each draft token is the
    full drafter's argmax over the subset (catch-up, cache rollback and later rounds included); a draft
    index not mapped back through d2t, or a stale cache, fails this."""
    target, drafter = tiny_llama(layers=2, seed=1), tiny_llama(layers=1, seed=5)
    ctx = list(PROMPTS[0])
    with torch.inference_mode():
        first = int(drafter(torch.tensor([ctx])).logits[0, -1].argmax())
    vocab = _vocab(set(range(0, 64, 2)) - {first})
    arm = DrafterModelArm(drafter, GREEDY, L=3, vocab=vocab)
    arm.reset(ctx)
    for extra in ([], [7, 7], [9]):  # the committed text grows by tokens the arm did not draft
        ctx = ctx + extra
        d = arm.propose(ctx, 3)
        assert d.tokens.tolist() == _greedy_over_subset(drafter, ctx, 3, vocab.d2t)
    assert first not in arm.propose(ctx, 3).tokens.tolist()
    gen, _ = _decode(target, DrafterModelArm(drafter, GREEDY, L=3, vocab=vocab), PROMPTS[1], 20)
    assert gen.tokens == plain_greedy(target, PROMPTS[1], 20)


# --------------------------------------------------------------------------- sampling

def _sampling_setup(K=1, seed=1):
    """The tiny V=6 target of test_vocab_pruning; a different drafter drafting without the target's two
    likeliest first tokens."""
    cfg = SamplingConfig(1.0)
    target = tiny_llama(vocab=V, hidden=16, layers=3, seed=4, peaked=4.0)
    drafter = tiny_llama(vocab=V, hidden=16, layers=1, seed=6, peaked=2.0)
    with torch.inference_mode():
        top2 = target(torch.tensor([PROMPT])).logits[0, -1].topk(2).indices.tolist()
    vocab = DraftVocab(torch.tensor(sorted(set(range(V)) - set(top2))), V)
    gen = torch.Generator().manual_seed(seed)
    arm = DrafterModelArm(drafter, cfg, L=2, generator=gen, K=K, vocab=vocab)
    return SpecEngine(Target(target), [arm], Verifier(cfg, generator=gen)), target, cfg, vocab


@pytest.mark.parametrize("K", [1, 2])
def test_pruned_drafter_q_is_zero_outside_the_subset(K):
    eng, _, _, vocab = _sampling_setup(K)
    arm = eng.arms[0]
    arm.reset(list(PROMPT))
    outside = [t for t in range(V) if t not in vocab.d2t.tolist()]
    for _ in range(5):
        d = arm.propose(list(PROMPT), 2)  # K = 2: the chains' nodes merged into one tree
        assert d.is_tree == (K > 1) and len(d) >= 2
        assert (d.q[:, outside] == 0).all() and torch.allclose(d.q.sum(-1), torch.ones(len(d)))
        assert set(d.tokens.tolist()) <= set(vocab.d2t.tolist())


def test_pruned_drafter_arm_samples_the_targets_distribution():
    """T=1, a subset without the target's two likeliest tokens: the first two emitted tokens still follow
    the target's exact joint law (the chi-square check of test_vocab_pruning, which rejects a wrong q)."""
    eng, target, cfg, _ = _sampling_setup()
    eng.arms[0].reset(list(PROMPT))
    assert _first_two_tokens_pvalue(eng, target, cfg) > 1e-3


def test_sampling_check_rejects_a_q_that_is_not_the_drafted_tokens_law(monkeypatch):
    """Power of the check above on this arm: q's subset mass moved to the wrong ids after the draw."""
    import decode.choose.arms.model as model_arm
    from test_vocab_pruning import _mutant_q_unmapped

    eng, target, cfg, vocab = _sampling_setup()
    real = model_arm.choose_token
    monkeypatch.setattr(model_arm, "choose_token", lambda *a: _mutant_q_unmapped(*real(*a), vocab))
    eng.arms[0].reset(list(PROMPT))
    assert _first_two_tokens_pvalue(eng, target, cfg) < 1e-3


# --------------------------------------------------------------------------- training → arm

def test_vocab_option_resolution(tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    assert load_drafter_vocab(folder, 64, "auto") is None  # no file: the full vocabulary
    _vocab(range(5)).save(folder)
    assert load_drafter_vocab(folder, 64, "auto").d2t.tolist() == [0, 1, 2, 3, 4]
    assert load_drafter_vocab(folder, 64, "none") is None
    assert len(load_drafter_vocab(tmp_path / "x", 64, str(folder / VOCAB_FILE))) == 5  # the file itself
    with pytest.raises(UserError, match=f"vocab={tmp_path}: no {VOCAB_FILE} there"):
        load_drafter_vocab(folder, 64, str(tmp_path))
    with pytest.raises(UserError, match="indexes a vocabulary of 64 tokens but the target has 65.*vocab=none"):
        load_drafter_vocab(folder, 65, "auto")


from test_train_drafter import _recipe, distilled  # noqa: E402,F401  (the tiny distilled tasks fixture)


def test_trained_drafter_saves_its_vocabulary_and_the_arm_drafts_from_it(tmp_path, tiny_target_dir, distilled):
    from decode.core.models import load_model
    from toolkit.config import load_recipe
    from toolkit.export import read_metadata
    from toolkit.train.data import split_heldout, tokenize_sft
    from toolkit.train.drafter import DrafterRecipe, train_drafter

    rec = _recipe(tmp_path, tiny_target_dir, distilled, train={"max_steps": 2, "save_steps": 10})
    recipe = load_recipe(DrafterRecipe, rec, ["draft_vocab.coverage=0.9"])
    export = train_drafter(recipe, "math")
    target, ttok = load_model(tiny_target_dir)
    Vt = target.get_output_embeddings().weight.shape[0]
    vocab = DraftVocab.load(export, Vt)
    # the subset is the training split's response tokens: recount them independently
    from toolkit.train.data import load_examples
    train_raw, _ = split_heldout(load_examples(recipe.data, "math"), recipe.data)
    counts = count_tokens(tokenize_sft(train_raw, ttok, recipe.data.max_length)["labels"], Vt)
    coverage = int(counts[vocab.d2t].sum()) / int(counts.sum())
    assert vocab.info["coverage"] == pytest.approx(coverage) and coverage >= 0.9
    assert len(vocab) < int((counts > 0).sum()) + 5 and ttok.eos_token_id in vocab.d2t.tolist()
    ev = json.loads((export / "eval.json").read_text())
    assert ev["draft_vocab"]["size"] == len(vocab) and ev["draft_vocab"]["coverage"] == pytest.approx(coverage)
    assert read_metadata(export)["draft_vocab"]["size"] == len(vocab)
    assert set(ev["full_vocab"]) >= {"agreement", "acceptance"} and 0 <= ev["labels_outside_vocab"] <= 1

    env = ArmEnv(target, ttok, GREEDY)
    arm = build_arm(f"drafter:path={export},L=3", env)
    assert torch.equal(arm.draft_vocab.d2t, vocab.d2t)
    drafter = load_model(str(export))[0]
    context = [1, 5, 9, 13, 17]
    assert arm.propose(context, 3).tokens.tolist() == _greedy_over_subset(drafter, context, 3, vocab.d2t)
    assert build_arm(f"drafter:path={export},vocab=none", env).draft_vocab is None

    other = tmp_path / "other_vocab"
    other.mkdir()
    DraftVocab(torch.arange(10), Vt + 1).save(other)
    with pytest.raises(UserError, match=f"arm drafter:path={export}: .*indexes a vocabulary of {Vt + 1} tokens"):
        build_arm(f"drafter:path={export},vocab={other}", env)

    # draft_vocab: null exports a full-vocabulary drafter (the same checkpoints: the subset is not trained on)
    full = train_drafter(load_recipe(DrafterRecipe, rec, ["draft_vocab=null"]), "math")
    assert not (full / VOCAB_FILE).exists() and json.loads((full / "eval.json").read_text())["draft_vocab"] is None
    assert build_arm(f"drafter:path={full}", env).draft_vocab is None
