"""Greedy losslessness of every arm and policy, KV-cache rollback, drafter catch-up."""
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.model import DrafterModelArm
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.policies import build_policy, policy_names
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama, tiny_qwen

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5]]


def _engine(model, drafter, vocab=64):
    env = ArmEnv(model, TinyTokenizer(vocab), GREEDY)
    arms = [build_arm(s, env) for s in ("none", "pld:L=4", "suffix:L=6,min_match=1")]
    arms.append(DrafterModelArm(drafter, GREEDY, 3))  # a weak drafter (other weights)
    arms.append(DrafterModelArm(model, GREEDY, 5))  # a perfect drafter (the target itself)
    return SpecEngine(Target(model), arms, Verifier(GREEDY))


@pytest.mark.parametrize("family", ["llama", "qwen"])
@pytest.mark.parametrize("policy", ["fixed:arm=0", "fixed:arm=1", "fixed:arm=2", "fixed:arm=3", "fixed:arm=4",
                                    "random", "ucbspec", "exp3spec"])
def test_greedy_lossless_every_arm_and_policy(family, policy):
    make = tiny_llama if family == "llama" else tiny_qwen
    model, drafter = make(seed=1), make(seed=2)
    eng = _engine(model, drafter)
    for prompt in PROMPTS:
        ref = plain_greedy(model, prompt, 40)
        gen = eng.generate(prompt, build_policy(policy, len(eng.arms), eng.max_len, seed=3), 40)
        assert gen.tokens == ref
        assert sum(r.new_tokens for r in gen.rounds) == 40


def test_every_registered_policy_is_lossless():
    model, drafter = tiny_llama(seed=1), tiny_llama(seed=2)
    eng = _engine(model, drafter)
    ref = plain_greedy(model, PROMPTS[0], 30)
    model_free = SpecEngine(Target(model), eng.arms[:3], Verifier(GREEDY))  # hedge & co. must score every arm
    for name in policy_names():
        spec = "fixed:arm=2" if name == "fixed" else name
        policy = build_policy(spec, len(eng.arms), eng.max_len)
        e = model_free if policy.needs_every_arm else eng
        policy = build_policy(spec, len(e.arms), e.max_len)
        assert e.generate(PROMPTS[0], policy, 30).tokens == ref, name


def test_perfect_drafter_accepts_everything_and_weak_one_does_not():
    model, drafter = tiny_llama(seed=1), tiny_llama(seed=2)
    eng = _engine(model, drafter)
    perfect = eng.generate(PROMPTS[1], build_policy("fixed:arm=4", 5, 6), 36)
    assert all(r.accepted == r.drafted for r in perfect.rounds)
    assert len(perfect.rounds) == 6  # 36 tokens at L+1 = 6 per round
    weak = eng.generate(PROMPTS[1], build_policy("fixed:arm=3", 5, 6), 36)
    assert len(weak.rounds) > len(perfect.rounds)


def test_eos_stops_generation():
    model = tiny_llama(seed=1)
    ref = plain_greedy(model, PROMPTS[0], 30)
    eos = ref[10]
    first = ref.index(eos)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    eng = SpecEngine(Target(model), [build_arm("pld:L=4", env), DrafterModelArm(model, GREEDY, 4)],
                     Verifier(GREEDY), eos_token_ids=[eos])
    gen = eng.generate(PROMPTS[0], build_policy("fixed:arm=1", 2, 4), 30)
    assert gen.tokens == ref[:first + 1] and gen.stopped_by == "eos"


def test_eos_inside_an_accepted_draft_counts_only_the_kept_tokens():
    """Draft tokens the verifier accepted after an EOS are discarded; RoundRecord.accepted must not
    count them (they would inflate the acceptance rate and the rewards)."""
    model = tiny_llama(seed=1)
    prompt = PROMPTS[0]
    ref = plain_greedy(model, prompt, 40)
    # an EOS at its first occurrence that is not the round's bonus token (a perfect L=4 drafter
    # yields 5 tokens a round: positions 5k..5k+3 are draft tokens, 5k+4 the bonus)
    j = next(j for j in range(5, 40) if ref.index(ref[j]) == j and j % 5 != 4)
    eng = SpecEngine(Target(model), [DrafterModelArm(model, GREEDY, 4)], Verifier(GREEDY), eos_token_ids=[ref[j]],
                     step_time=1.0)
    gen = eng.generate(prompt, build_policy("fixed", 1, 4), 40)
    assert gen.tokens == ref[:j + 1] and gen.stopped_by == "eos"
    last = gen.rounds[-1]
    assert last.drafted == 4 and last.accepted == last.new_tokens == last.y == j % 5 + 1
    assert all(r.accepted == r.drafted == 4 and r.y == r.new_tokens == 5 for r in gen.rounds[:-1])


def test_step_time_is_measured_once_or_given_and_carried_by_every_round():
    model = tiny_llama(seed=1)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    eng = SpecEngine(Target(model), [build_arm("pld:L=4", env)], Verifier(GREEDY))
    assert eng.step_time is None
    ref = plain_greedy(model, PROMPTS[0], 12)
    gen = eng.generate(PROMPTS[0], build_policy("fixed", 1, 4), 12)
    st = eng.step_time
    assert gen.tokens == ref and st > 0 and all(r.step_time == st for r in gen.rounds)
    gen = eng.generate(PROMPTS[1], build_policy("fixed", 1, 4), 12)
    assert eng.step_time == st and all(r.step_time == st for r in gen.rounds)  # measured once per engine
    given = SpecEngine(Target(model), [build_arm("pld:L=4", env)], Verifier(GREEDY), step_time=0.5)
    assert all(r.step_time == 0.5 for r in given.generate(PROMPTS[0], build_policy("fixed", 1, 4), 12).rounds)
    with pytest.raises(UserError, match="step_time"):
        SpecEngine(Target(model), [build_arm("pld:L=4", env)], Verifier(GREEDY), step_time=0.0)


def test_round_records_score_every_drafted_position():
    """The verification forward scores all L draft positions; tv/accept_prob cover every one of them."""
    model, drafter = tiny_llama(seed=1), tiny_llama(seed=2)
    eng = _engine(model, drafter)
    gen = eng.generate(PROMPTS[0], build_policy("fixed:arm=3", 5, 6), 30)
    assert any(r.accepted < r.drafted - 1 for r in gen.rounds)  # rejections before the last position happened
    for r in gen.rounds:
        assert len(r.tv) == len(r.accept_prob) == r.drafted
        assert all(p == 1.0 for p in r.accept_prob[:r.accepted])


def test_rollback_after_partial_acceptance_matches_fresh_prefill():
    model = tiny_llama(seed=1)
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = plain_greedy(model, ctx, 6)
    t = Target(model)
    t.prefill(ctx)
    draft = torch.tensor([ref[0], ref[1], (ref[2] + 1) % 64, 7])  # two right, then wrong
    logits = t.score(ctx[-1], draft).logits
    assert logits[:3].argmax(-1).tolist() == ref[:3]
    t.rollback(len(ctx) + 2)
    assert t.cached == len(ctx) + 2
    new_ctx = ctx + ref[:3]
    after = t.score(new_ctx[-1], torch.tensor([], dtype=torch.long)).logits[0]
    with torch.inference_mode():
        fresh = model(torch.tensor([new_ctx])).logits[0, -1]
    torch.testing.assert_close(after, fresh, atol=1e-4, rtol=1e-4)


def test_drafter_catches_up_after_other_arms_played():
    drafter = tiny_llama(seed=2)
    arm = DrafterModelArm(drafter, GREEDY, 3)
    ctx = [1, 2, 3, 4]
    arm.reset(ctx)
    arm.propose(ctx, 3)
    ctx2 = ctx + [9, 8, 7, 6, 5]  # tokens produced while other arms played (and a rejected draft)
    d = arm.propose(ctx2, 3)
    ref = plain_greedy(drafter, ctx2, 3)
    assert d.tokens.tolist() == ref
    assert arm.cache_tokens == ctx2 + ref[:2]
    assert arm.cache.get_seq_length() == len(arm.cache_tokens)


def test_bad_engine_input():
    model = tiny_llama(seed=1)
    eng = _engine(model, model)
    pol = build_policy("ucbspec", len(eng.arms), eng.max_len)
    with pytest.raises(UserError, match="max_new_tokens"):
        eng.generate([1, 2], pol, 0)
    with pytest.raises(UserError, match="empty prompt"):
        eng.generate([], pol, 5)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    with pytest.raises(UserError, match="unknown arm 'nope'"):
        build_arm("nope:L=3", env)
    with pytest.raises(UserError, match="unknown policy 'nope'"):
        build_policy("nope", 2, 4)
    with pytest.raises(UserError, match="key=value"):
        build_arm("pld:4", env)


def test_registry_passes_a_parameter_called_name_through():
    """``name`` is a legitimate spec parameter (pool arms use it); it must not clash with the registry's own."""
    from decode.common.registry import Registry

    reg = Registry("widget")

    @reg.register("w")
    def make(x, name="?"):
        return (x, name)

    assert reg.build("w", "w:name=alpha", 1, name="alpha") == (1, "alpha")
    with pytest.raises(UserError, match=r"unknown widget 'v' in 'v:name=a'; known widgets: w"):
        reg.build("v", "v:name=a", 1)
    with pytest.raises(UserError, match=r"widget 'w:y=1': bad parameters"):
        reg.build("w", "w:y=1", 1, y=1)


def _sampling_engine(sampling: SamplingConfig, seed: int):
    from decode.choose.arms.eagle import EagleArm
    from decode.choose.heads.eagle import EagleHead
    model, drafter = tiny_llama(seed=0), tiny_llama(seed=1)
    gen = torch.Generator().manual_seed(seed)
    target = Target(model, want_hidden=True)
    env = ArmEnv(model, TinyTokenizer(64), sampling, gen, target=target)
    torch.manual_seed(4)
    arms = [build_arm(s, env) for s in ("pld:L=4", "union:arms=pld:L=2+suffix:L=3,nodes=6")]
    arms += [DrafterModelArm(drafter, sampling, 3, gen, K=2), EagleArm(EagleHead(model), model, sampling, 3,
                                                                      generator=gen, target=target)]
    return SpecEngine(target, arms, Verifier(sampling, "torch", gen)), gen


@pytest.mark.parametrize("cfg", [SamplingConfig(0.8, top_p=0.9), SamplingConfig(1.0, top_k=8)])
def test_set_sampling_decodes_as_an_engine_built_with_that_config(cfg):
    """`decode serve` switches one engine between requests' sampling settings: afterwards it must draw exactly
    what an engine built with those settings draws (verifier, every arm's draft distribution, the scorer)."""
    switched, gen_a = _sampling_engine(GREEDY, 0)
    built, gen_b = _sampling_engine(cfg, 0)
    switched.set_sampling(cfg)
    assert switched.scorer.greedy is False and switched.arms[1].greedy is False
    for prompt in PROMPTS:
        for arm in range(len(built.arms)):
            gen_a.manual_seed(11)
            gen_b.manual_seed(11)
            a = switched.generate(prompt, build_policy(f"fixed:arm={arm}", 4, 4), 12)
            b = built.generate(prompt, build_policy(f"fixed:arm={arm}", 4, 4), 12)
            assert a.tokens == b.tokens and [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
    switched.set_sampling(GREEDY)  # and back: greedy again, lossless
    model = switched.target.model
    for arm in range(len(switched.arms)):
        got = switched.generate(PROMPTS[0], build_policy(f"fixed:arm={arm}", 4, 4), 12).tokens
        assert got == plain_greedy(model, PROMPTS[0], 12)
