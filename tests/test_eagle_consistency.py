"""Issue 31: the EAGLE head's training-time held-out agreement and its agreement in the decode path must be the
same computation. Reference answers are teacher-forced through the engine (decode/choose/arms/eagle/teacher.py:
prefill, rounds, the engine's own feature path, the draft-vocabulary mapping) and through the toolkit's held-out
evaluation (toolkit/train/eagle.py ``heldout_agreement``); every position's drafted token must agree. A
deliberately misaligned decode path (features or tokens off by one) must fail the same comparison, so the test
cannot pass vacuously."""
import pytest
import torch

from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.eagle.teacher import ReferenceVerifier, teacher_forced_agreement
from decode.choose.heads import EagleHead
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from decode.core.vocab import DraftVocab
from decode.engine.loop import SpecEngine
from helpers import plain_greedy, tiny_llama, train_eagle_briefly
from toolkit.train.eagle import EagleTrainModule, heldout_agreement

GREEDY = SamplingConfig()
V = 64


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _examples(model, n_greedy=3, n_random=2, seed=0):
    """(prompt, answer) pairs: the target's greedy answers (what decoding sees) and random token answers (any
    text: sampled distillation rows are not the target's argmax)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_greedy + n_random):
        prompt = torch.randint(1, V, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        if i < n_greedy:
            answer = plain_greedy(model, prompt, 20 + 3 * i)
        else:
            answer = torch.randint(1, V, (15 + i,), generator=g).tolist()
        out.append((prompt, answer))
    return out


def _as_rows(pairs):
    return [{"input_ids": p + a, "attention_mask": [1] * (len(p) + len(a)), "labels": [-100] * len(p) + a}
            for p, a in pairs]


def _perturbed_head(model, seed=0, vocab=None, scale=0.5):
    head = EagleHead(model, draft_vocab=vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * (p.abs().mean() + 1e-3))
    return head.eval()


def _engine(model, head, cache="prefix", arm_cls=EagleArm, L=1):
    target = Target(model, want_hidden=True, cache=cache)
    arm = arm_cls(head, model, GREEDY, L=L, target=target, cache=cache)
    return SpecEngine(target, [arm], Verifier(GREEDY), step_time=1.0)


def _training_side(model, head, pairs):
    return heldout_agreement(EagleTrainModule(model, head), _as_rows(pairs), progress=False, per_example=True)


def _assert_same(decode, train):
    assert decode.positions == train["positions"]
    for d, t in zip(decode.examples, train["per_example"]):
        assert d.reference == t["reference"]
        assert d.target == t["target"]
        assert d.drafts == t["drafts"]
    assert decode.agree_target / decode.positions == pytest.approx(train["top1_agreement"])
    assert decode.agree_reference / decode.positions == pytest.approx(train["reference_agreement"])


@pytest.mark.parametrize("cache", ["dynamic", "prefix", "static"])
def test_decode_path_drafts_what_training_scores(cache):
    model = tiny_llama(layers=2, seed=1)
    head = _perturbed_head(model)
    pairs = _examples(model)
    decode = teacher_forced_agreement(_engine(model, head, cache), pairs)
    assert decode.positions == sum(len(a) for _, a in pairs)  # every answer token, the first one included
    _assert_same(decode, _training_side(model, head, pairs))


def test_draft_vocabulary_mapping_is_the_same_on_both_sides():
    model = tiny_llama(layers=2, seed=2)
    vocab = DraftVocab(torch.arange(0, V, 2), V)  # even ids only: odd target tokens cannot be drafted
    head = _perturbed_head(model, seed=1, vocab=vocab)
    pairs = _examples(model, seed=1)
    decode = teacher_forced_agreement(_engine(model, head), pairs)
    assert all(d % 2 == 0 for e in decode.examples for d in e.drafts)
    _assert_same(decode, _training_side(model, head, pairs))


@pytest.fixture(scope="module")
def trained(one_thread):
    """A tiny target, a head trained on its greedy text, and held-out greedy answers."""
    model = tiny_llama(layers=2, seed=5, peaked=3.0)
    for p in model.parameters():
        p.requires_grad_(False)
    head = train_eagle_briefly(model, EagleHead(model))
    # greedy answers, and random ones: on greedy text x_{t+1} is a function of f_t, so only other text shows
    # whether the head reads the right token
    return model, head, _examples(model, n_greedy=3, n_random=2, seed=11)


def test_a_trained_head_agrees_as_much_in_decoding_as_in_training(trained):
    model, head, pairs = trained
    train = _training_side(model, head, pairs)
    decode = teacher_forced_agreement(_engine(model, head), pairs)
    _assert_same(decode, train)
    assert train["top1_agreement"] > 0.3  # well above chance (1/64): the comparison below has something to lose


class _LaggedFeatures(EagleArm):
    """A misaligned decode path: head entry j reads the feature of position j-1 (the pairing off by one)."""

    def _true_step(self, context):
        m = len(context)
        self._fill_missing(context)
        self.cache.crop(0)
        f = self.feats[:m - 1]
        lagged = torch.cat([f[:1], f[:-1]])
        out = self._step(self.head.input_features(lagged), context[1:m])
        self.entries, self.tokens, self.after = m - 1, list(context), out
        return out


class _LaggedTokens(EagleArm):
    """Another misalignment: head entry j reads x_j with f_j instead of x_{j+1}."""

    def _true_step(self, context):
        m = len(context)
        self._fill_missing(context)
        self.cache.crop(0)
        out = self._step(self.head.input_features(self.feats[:m - 1]), context[:m - 1])
        self.entries, self.tokens, self.after = m - 1, list(context), out
        return out


@pytest.mark.parametrize("arm_cls", [_LaggedFeatures, _LaggedTokens])
def test_a_misaligned_decode_path_fails_the_comparison(trained, arm_cls):
    model, head, pairs = trained
    train = _training_side(model, head, pairs)
    good = teacher_forced_agreement(_engine(model, head), pairs)
    bad = teacher_forced_agreement(_engine(model, head, arm_cls=arm_cls), pairs)
    assert bad.positions == good.positions
    with pytest.raises(AssertionError):
        _assert_same(bad, train)
    differ = sum(a != b for e, f in zip(good.examples, bad.examples) for a, b in zip(e.drafts, f.drafts))
    assert differ > bad.positions // 4
    assert bad.agree_target < good.agree_target  # the count itself drops


def test_match_mode_replays_greedy_decoding(trained):
    """advance=match on the target's own greedy answers is greedy decoding: the same rounds, the same accepts."""
    model, head, pairs = trained
    pairs = pairs[:3]  # the greedy answers
    forced = teacher_forced_agreement(_engine(model, head, L=3), pairs, depth=3, advance="match")
    real, rounds = _engine(model, head, L=3), []
    for prompt, answer in pairs:
        gen = real.generate(prompt, build_policy("fixed", 1, 3), len(answer) + 1)
        assert gen.tokens[:len(answer)] == answer
        starts, k = [], 0
        for r in gen.rounds:
            if k >= len(answer):
                break
            starts.append(k)
            rounds.append(r.accepted)
            k += r.new_tokens
    got = [p for e in forced.examples for p in e.positions]
    assert len(got) == len(rounds)
    reached = forced.by_depth[0][0]
    assert reached == len(rounds) and forced.by_depth[0][1] == sum(a >= 1 for a in rounds)
    assert forced.by_depth[1][1] == sum(a >= 2 for a in rounds)
    assert forced.by_depth == forced.by_depth_target  # greedy answers: the answer is the target's argmax


def test_reference_verifier_keeps_the_matching_prefix_then_the_answer():
    from decode.core.draft import Draft
    v = ReferenceVerifier("match")
    v.start([5, 6, 7, 8])
    logits = torch.zeros(3, V)
    out = v.verify(logits, Draft(torch.tensor([5, 9])))
    assert out.accepted == 1 and out.tokens == [5, 6]
    v.pos = 2
    out = v.verify(logits, Draft(torch.tensor([7, 8])))  # drafts to the answer's end: the last becomes the bonus
    assert out.accepted == 1 and out.tokens == [7, 8]
    one = ReferenceVerifier("one")
    one.start([5, 6])
    assert one.verify(logits, Draft(torch.tensor([5, 6]))).tokens == [5]
    with pytest.raises(ValueError):
        ReferenceVerifier("all")


def test_eval_report_puts_decode_acceptance_by_category_beside_the_training_figure(tmp_path):
    """decode report: an eagle arm's own method gives acceptance per draft position per category, next to the
    held-out top-1 of the head's run record (eval.json), in the JSON and under the table."""
    import json

    from decode.evaluation.report import AR, FORMAT, HF, build_report

    head = tmp_path / "head"
    head.mkdir()
    (head / "eval.json").write_text(json.dumps({"heldout": {"top1_agreement": 0.5, "positions": 100, "examples": 4}}))
    labels, specs = ["eagle@2", "pld@2"], [f"eagle:path={head},L=2", "pld:L=2"]
    prompts = [["p0", "code", "d0"], ["p1", "chat", "d1"]]
    methods = [{"name": HF, "kind": "hf"}, {"name": AR, "kind": "autoregressive"}]
    methods += [{"name": f"arm:{lab}", "kind": "arm"} for lab in labels]

    def rec(method, pid, cat, acc, drafted):
        n = sum(acc) + len(acc)
        return {"method": method, "prompt_id": pid, "category": cat, "new_tokens": n, "rounds": len(acc),
                "accept_lengths": acc, "drafted": drafted, "arms": [], "wall_time": 1.0, "token_ids": [7] * n}

    recs = []
    for pid, cat, _ in prompts:
        recs += [rec(HF, pid, cat, [0] * 4, [0] * 4), rec(AR, pid, cat, [0] * 4, [0] * 4),
                 rec("arm:pld@2", pid, cat, [1, 0], [2, 2])]
    recs += [rec("arm:eagle@2", "p0", "code", [2, 0, 1, 0], [2, 2, 2, 2]),
             rec("arm:eagle@2", "p1", "chat", [0, 0, 1], [2, 2, 1])]
    header = {"format": FORMAT, "config": {"temperature": 0.0, "arms": specs, "max_new_tokens": 8},
              "prompts": prompts, "methods": methods, "arm_labels": labels}
    report, table = build_report(header, recs)
    h = report["eagle_heads"]
    assert list(h) == ["eagle@2"] and h["eagle@2"]["training_heldout"]["top1_agreement"] == 0.5
    assert h["eagle@2"]["per_category"]["code"]["positions"] == [[4, 2], [4, 1]]
    assert h["eagle@2"]["per_category"]["chat"]["positions"] == [[3, 1], [2, 0]]
    assert h["eagle@2"]["all"]["acceptance_per_position"] == pytest.approx(
        report["summary"]["arm:eagle@2"]["acceptance_per_position"])
    assert "EAGLE head eagle@2" in table and "0.500 (100 positions, 4 answers)" in table
    assert "| code | 4 | 0.500 (4) | 0.250 (4) |" in table
