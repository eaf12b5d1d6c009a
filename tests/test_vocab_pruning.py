"""Vocabulary-pruned draft heads (decode/core/vocab.py, FR-Spec): choosing the subset, saving it with a head,
drafting from it, and exactness of the arms that draft from it (greedy and sampling), with mutants
that the checks must reject."""
import json

import numpy as np
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.early_exit import EarlyExitArm
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.heads import EagleHead, EarlyExitDrafter, load_head, save_head
from decode.choose.policies import build_policy
from decode.choose.policies.simple import Fixed
from decode.core.sampling import SamplingConfig, choose_token
from decode.core.target import Target
from decode.core.verify import Verifier
from decode.core.vocab import VOCAB_FILE, DraftVocab, count_tokens, expand_logits, select_draft_vocab
from helpers import plain_greedy, tiny_llama
from test_sampling_lossless import _chi2_ok, _exact_two_token_dist

GREEDY = SamplingConfig()


# --------------------------------------------------------------------------- choosing the subset

def test_count_tokens_skips_prompt_labels_and_rejects_foreign_ids():
    counts = count_tokens([[-100, -100, 3, 3, 1], [1, 3, -100]], vocab_size=5)
    assert counts.tolist() == [0, 2, 0, 3, 0]
    assert torch.equal(count_tokens([[-100, -100, 3, 3, 1], [1, 3, -100]], vocab_size=5, chunk=2), counts)
    with pytest.raises(UserError, match="outside the target vocabulary"):
        count_tokens([[7]], vocab_size=5)


def test_select_by_coverage_is_the_smallest_top_n_plus_specials():
    counts = torch.tensor([0, 50, 5, 30, 10, 5, 0, 0])  # 100 tokens; order 1, 3, 4, 2, 5 (ties: lower id)
    v = select_draft_vocab(counts, coverage=0.9, special_ids=[7])
    assert v.d2t.tolist() == [1, 3, 4, 7]  # 50+30+10 = 90% needs 3 frequent tokens, + the special token
    assert v.info["frequent"] == 3 and v.info["special"] == 1 and v.info["coverage"] == pytest.approx(0.9)
    assert v.info["coverage_target"] == 0.9 and v.info["size"] == 4 and v.info["vocab_size"] == 8
    v = select_draft_vocab(counts, coverage=0.91)  # just above: one more token (the lower id of a tie)
    assert v.d2t.tolist() == [1, 2, 3, 4] and v.info["coverage"] == pytest.approx(0.95)
    v = select_draft_vocab(counts, size=2, special_ids=[3, None, 99])  # a special already frequent; junk ids dropped
    assert v.d2t.tolist() == [1, 3] and v.info["coverage"] == pytest.approx(0.8)
    assert v.t2d.tolist() == [-1, 0, -1, 1, -1, -1, -1, -1]
    with pytest.raises(UserError, match="draft_vocab.size"):
        select_draft_vocab(counts, size=9)
    with pytest.raises(UserError, match="draft_vocab.coverage"):
        select_draft_vocab(counts, coverage=0.0)
    with pytest.raises(UserError, match="no output tokens"):
        select_draft_vocab(torch.zeros(8, dtype=torch.long), coverage=0.9)
    with pytest.raises(UserError, match="sorted and distinct"):
        DraftVocab(torch.tensor([3, 1]), 8)


@pytest.mark.parametrize("cfg", [GREEDY, SamplingConfig(1.0), SamplingConfig(0.7, top_k=3),
                                 SamplingConfig(1.0, top_k=50), SamplingConfig(0.9, top_p=0.6)])
def test_choosing_over_expanded_logits_is_choosing_a_draft_index_then_mapping_it(cfg):
    """What the heads do (expand the subset's logits with -inf, then choose over the target vocabulary)
    equals sampling a draft index over the subset with the same settings and mapping it through d2t."""
    d2t = torch.tensor([0, 2, 3, 7, 8, 11])
    sub = torch.randn(40, len(d2t), generator=torch.Generator().manual_seed(1)) * 2
    tok, q = choose_token(expand_logits(sub, d2t, 12), cfg, torch.Generator().manual_seed(5))
    idx, q_sub = choose_token(sub, cfg, torch.Generator().manual_seed(5))
    assert torch.equal(tok, d2t[idx])
    assert torch.allclose(q[:, d2t], q_sub) and q.sum(-1).allclose(torch.ones(40))
    outside = torch.ones(12, dtype=torch.bool)
    outside[d2t] = False
    assert (q[:, outside] == 0).all()


# --------------------------------------------------------------------------- saving and loading

def _vocab(ids, V=64):
    return DraftVocab(torch.tensor(sorted(ids)), V, {"coverage": 0.5})


def test_pruned_heads_round_trip_and_old_heads_still_load(tmp_path):
    model = tiny_llama(layers=3, seed=1)
    vocab = _vocab(range(0, 64, 3))
    for head, kind in ((EarlyExitDrafter(model, 1, draft_vocab=vocab), "early_exit"),
                       (EagleHead(model, draft_vocab=vocab), "eagle")):
        save_head(head, tmp_path / kind)
        meta = json.loads((tmp_path / kind / "head.json").read_text())
        assert meta["draft_vocab"]["size"] == len(vocab) and meta["draft_vocab"]["coverage"] == 0.5
        back = load_head(tmp_path / kind, model, expect=kind)
        assert torch.equal(back.draft_vocab.d2t, vocab.d2t) and torch.equal(back.draft_ids, vocab.d2t)
        for k, v in head.trainable_state_dict().items():
            assert torch.equal(v, back.trainable_state_dict()[k]), k
        x = torch.randn(2, 32)
        assert torch.equal(back.logits(x) if kind == "eagle" else back.lm_head(x),
                           x @ model.lm_head.weight[vocab.d2t].T)  # the target's rows, in d2t order
        with pytest.raises(UserError, match="vocabulary of 64 tokens but the target has 65"):
            DraftVocab.load(tmp_path / kind, 65)
    assert back.draft_weight.shape == (len(vocab), 32) and "draft_weight" not in back.trainable_state_dict()
    ee = load_head(tmp_path / "early_exit", model)
    assert ee.lm_head.weight.shape == (len(vocab), 32)  # the trainable head is pruned too: smaller file
    # a head without a draft vocabulary written into the same folder drops the stale vocabulary file
    save_head(EagleHead(model), tmp_path / "eagle")
    assert not (tmp_path / "eagle" / VOCAB_FILE).exists() and load_head(tmp_path / "eagle", model).draft_vocab is None
    (tmp_path / "early_exit" / VOCAB_FILE).unlink()
    with pytest.raises(UserError, match="is missing"):
        load_head(tmp_path / "early_exit", model)
    with pytest.raises(UserError, match="indexes 50 tokens"):
        EagleHead(model, draft_vocab=_vocab(range(10), V=50))


# --------------------------------------------------------------------------- greedy

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9]]


def _excluding_half_of_greedy(model, prompt, n):
    """A vocabulary that leaves out every other distinct token of the target's own greedy output."""
    used = sorted(set(plain_greedy(model, prompt, n)))
    return _vocab(set(range(64)) - set(used[::2])), used[::2]


def _decode(model, arm, prompt, n, policy="fixed:arm=0"):
    target = Target(model, want_hidden=True)
    arm.target = target
    arms = [arm, build_arm("pld:L=2", ArmEnv(model, None, GREEDY))]
    eng = SpecEngine(target, arms, Verifier(GREEDY))
    drafted = []
    propose = arm.propose

    def spy(*a, **k):
        d = propose(*a, **k)
        drafted.extend(d.tokens.tolist())
        return d
    arm.propose = spy
    return eng.generate(prompt, build_policy(policy, 2, eng.max_len, seed=0), n), drafted


@pytest.mark.parametrize("kind", ["early_exit", "eagle"])
def test_pruned_arms_are_greedy_lossless_and_draft_only_subset_tokens(kind):
    model = tiny_llama(layers=3, seed=1)
    for prompt in PROMPTS:
        vocab, excluded = _excluding_half_of_greedy(model, prompt, 30)
        if kind == "early_exit":  # first 2 of 3 layers + a copy of the last: the target itself, pruned
            arm = EarlyExitArm(EarlyExitDrafter(model, 2, draft_vocab=vocab), GREEDY, L=4)
        else:
            arm = EagleArm(EagleHead(model, init="last_layer", draft_vocab=vocab), model, GREEDY, L=4)
        gen, drafted = _decode(model, arm, prompt, 30, "random")
        assert gen.tokens == plain_greedy(model, prompt, 30)
        assert drafted and set(drafted) <= set(vocab.d2t.tolist())
        assert not set(drafted) & set(excluded)
    if kind == "early_exit":  # the drafter is the target: only excluded tokens can be rejected
        assert any(r.accepted < r.drafted for r in gen.rounds if r.arm == 0)


@pytest.mark.parametrize("kind", ["early_exit", "eagle"])
def test_pruned_draft_is_the_best_subset_token_of_the_full_head(kind):
    """Drafting from the subset = the full-vocabulary head's logits restricted to the subset; a draft
    index that is not mapped back to its target id fails this."""
    model = tiny_llama(layers=3, seed=2)
    ctx = PROMPTS[1]
    if kind == "early_exit":
        full = EarlyExitDrafter(model, 1)
        logits = full(input_ids=torch.tensor([ctx])).logits[0, -1]
    else:
        full = EagleHead(model, init="last_layer")
        f = model(torch.tensor([ctx]), output_hidden_states=True).hidden_states[-1]
        logits = full.logits(full(f[:, :-1], torch.tensor([ctx[1:]]))[0, -1])
    vocab = _vocab(set(range(5, 64, 2)) - {int(logits.argmax())})  # the full head's draft is excluded
    if kind == "early_exit":
        pruned = EarlyExitDrafter(model, 1, draft_vocab=vocab)
        pruned.load_state_dict(full.state_dict() | {"lm_head.weight": full.lm_head.weight[vocab.d2t]})
        arm = EarlyExitArm(pruned, GREEDY, L=1)
    else:
        pruned = EagleHead(model, init="last_layer", draft_vocab=vocab)
        pruned.load_state_dict(full.state_dict())
        arm = EagleArm(pruned, model, GREEDY, L=1)
    d = arm.propose(ctx, 1)
    assert d.tokens.tolist() == [int(vocab.d2t[logits[vocab.d2t].argmax()])]


# --------------------------------------------------------------------------- sampling

V = 6
PROMPT = (0, 2, 4)


def _sampling_setup(kind, seed=1):
    """Tiny V=6 target; the draft vocabulary leaves out the target's two most likely first tokens."""
    cfg = SamplingConfig(1.0)
    target = tiny_llama(vocab=V, hidden=16, layers=3, seed=4, peaked=4.0)
    with torch.inference_mode():
        top2 = target(torch.tensor([PROMPT])).logits[0, -1].topk(2).indices.tolist()
    vocab = DraftVocab(torch.tensor(sorted(set(range(V)) - set(top2))), V)
    gen = torch.Generator().manual_seed(seed)
    wrapped = Target(target, want_hidden=True)
    if kind == "early_exit":
        arm = EarlyExitArm(EarlyExitDrafter(target, 1, draft_vocab=vocab), cfg, L=2, generator=gen, target=wrapped)
    else:
        arm = EagleArm(EagleHead(target, init="last_layer", draft_vocab=vocab), target, cfg, L=2, generator=gen,
                       target=wrapped)
    eng = SpecEngine(wrapped, [arm], Verifier(cfg, generator=gen))
    return eng, target, cfg, vocab


def _first_two_tokens_pvalue(eng, target, cfg, n=2000):
    counts = np.zeros(V * V)
    for _ in range(n):
        toks = eng.generate(list(PROMPT), Fixed(1, 2), 2).tokens
        counts[toks[0] * V + toks[1]] += 1
    return _chi2_ok(counts, _exact_two_token_dist(target, list(PROMPT), cfg), n)


@pytest.mark.parametrize("kind", ["early_exit", "eagle"])
def test_pruned_arms_sample_the_targets_distribution(kind):
    """T=1, a vocabulary without the two likeliest tokens: the first two emitted tokens still follow the
    target's exact joint law (chi-square), and every draft carries q = 0 outside the subset."""
    eng, target, cfg, vocab = _sampling_setup(kind)
    d = eng.arms[0].propose(list(PROMPT), 2)
    outside = [t for t in range(V) if t not in vocab.d2t.tolist()]
    assert (d.q[:, outside] == 0).all() and torch.allclose(d.q.sum(-1), torch.ones(len(d)))
    eng.arms[0].reset(list(PROMPT))
    assert _first_two_tokens_pvalue(eng, target, cfg) > 1e-3


def _mutant_q_unmapped(tok, q, vocab):
    """q's draft-index order left unmapped: the subset's mass sits on target ids 0..N-1."""
    bad = torch.zeros_like(q)
    bad[..., :len(vocab)] = q[..., vocab.d2t]
    return tok, bad


def _mutant_q_unnormalised(tok, q, vocab):
    """q not renormalised over the subset (as if its mass were counted against the full vocabulary)."""
    return tok, q * 0.5


@pytest.mark.parametrize("mutant", [_mutant_q_unmapped, _mutant_q_unnormalised])
def test_sampling_check_rejects_a_wrong_q(monkeypatch, mutant):
    """The chi-square check above has power against the two ways a pruned q goes wrong."""
    import decode.choose.arms.eagle.chain as eagle_arm

    eng, target, cfg, vocab = _sampling_setup("eagle")
    real = eagle_arm.choose_token
    monkeypatch.setattr(eagle_arm, "choose_token", lambda *a: mutant(*real(*a), vocab))
    assert _first_two_tokens_pvalue(eng, target, cfg) < 1e-3


# --------------------------------------------------------------------------- drafting cost

def test_draft_token_cost_divides_draft_time_per_token_by_the_target_step():
    from types import SimpleNamespace as NS

    from decode.bench.draft_cost import draft_token_cost

    def gen(rounds):  # (drafted, draft seconds, verification-forward seconds) per round; one step = 8 ms
        return NS(rounds=[NS(drafted=n, step_time=0.008) for n, _, _ in rounds],
                  step_times=[NS(draft=d, score=s) for _, d, s in rounds])
    cost = draft_token_cost([gen([(4, 0.004, 0.010), (2, 0.002, 0.012)]), gen([(0, 0.0, 0.011)])])
    assert cost["drafted_tokens"] == 6 and cost["rounds"] == 3
    assert cost["draft_ms_per_token"] == pytest.approx(1.0) and cost["target_step_ms"] == pytest.approx(8.0)
    assert cost["fraction"] == pytest.approx(0.125) and cost["verify_forward_ms"] == pytest.approx(11.0)
    with pytest.raises(UserError, match="no drafted tokens"):
        draft_token_cost([gen([(0, 0.001, 0.01)])])


def test_heldout_nll_is_over_the_labels_a_pruned_drafter_can_draft():
    """Labels outside the draft vocabulary have q = 0: the NLL skips them and says how many there were."""
    import math
    from types import SimpleNamespace

    from helpers import tiny_llama
    from toolkit.train.metrics import heldout_agreement
    target = tiny_llama(seed=1)
    allowed = torch.zeros(64, dtype=torch.bool)
    allowed[::2] = True

    class Pruned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_llama(seed=2)

        def forward(self, input_ids):
            logits = self.inner(input_ids=input_ids).logits.masked_fill(~allowed, float("-inf"))
            return SimpleNamespace(logits=logits)

    ids = list(range(1, 21))
    ex = {"input_ids": ids, "labels": [-100] * 4 + ids[4:]}
    res = heldout_agreement(Pruned(), target, [ex], progress=False)
    labels = torch.tensor(ids[4:])  # the positions after the prompt part (labels are shifted by one)
    assert math.isfinite(res["drafter_nll"])
    assert res["labels_outside_vocab"] == pytest.approx(float((~allowed[labels]).float().mean()))
    full = heldout_agreement(tiny_llama(seed=2), target, [ex], progress=False)
    assert full["labels_outside_vocab"] == 0.0
