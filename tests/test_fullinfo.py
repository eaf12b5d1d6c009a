"""Full-information arm selection: counterfactual feedback equals playing the arm, the policies' update
rules against hand-computed cases, losslessness unaffected (decode/choose/feedback.py, decode/choose/policies/hedge.py,
decode/choose/policies/router.py)."""
import math

import numpy as np
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.model import DrafterModelArm
from decode.core.draft import RoundRecord
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.feedback import match_length
from decode.choose.policies import build_policy
from decode.choose.policies.hedge import normalhedge_scale
from decode.choose.policies.router import bucket
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
POOL = ("none", "pld:L=4", "suffix:L=6,min_match=1", "pld:L=2,n=1")
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9, 11, 7], [5, 6]]
FULLINFO = ["hedge", "hedge:play=argmax", "normalhedge", "ftl", "router", "ucbspec:fullinfo=true",
            "thompson:fullinfo=true,reward=tokens", "metasd_ucb:fullinfo=true,reward=be"]


def _engine(model, sampling=GREEDY, pool=POOL, eos=()):
    env = ArmEnv(model, TinyTokenizer(64), sampling, generator=torch.Generator().manual_seed(0))
    return SpecEngine(Target(model), [build_arm(s, env) for s in pool],
                      Verifier(sampling, generator=torch.Generator().manual_seed(1)), eos_token_ids=eos, step_time=0.05)


@pytest.fixture(scope="module")
def model():
    # a peaked LM head makes the tiny model repeat itself, so drafts get accepted and matches are long
    return tiny_llama(seed=1, peaked=8.0)


def test_match_length_is_final_only_when_decided():
    assert match_length([1, 2, 3], [1, 2, 9]) == (2, True)  # mismatch seen
    assert match_length([1, 2], [1, 2, 3]) == (2, True)  # every draft token compared
    assert match_length([1, 2, 3], [1, 2]) == (2, False)  # agrees with all emitted so far: wait
    assert match_length([], [4]) == (0, True)


@pytest.mark.parametrize("policy", FULLINFO)
def test_greedy_lossless_with_full_information(model, policy):
    eng = _engine(model)
    for prompt in PROMPTS:
        gen = eng.generate(prompt, build_policy(policy, len(eng.arms), eng.max_len, seed=3), 40)
        assert gen.tokens == plain_greedy(model, prompt, 40)
        assert all(r.feedback is not None and set(r.feedback) == set(range(len(POOL))) for r in gen.rounds)


@pytest.mark.parametrize("eos", [(), (3,)])
def test_counterfactual_equals_playing_the_arm_from_that_prefix(model, eos):
    """Every counterfactual record says what a live round of that arm from the same prefix gives."""
    eng = _engine(model, eos=eos)
    checked = accepted_any = 0
    for prompt in PROMPTS:
        gen = eng.generate(prompt, build_policy("hedge", len(eng.arms), eng.max_len, seed=0), 30)
        start = 0
        for rec in gen.rounds:
            for j, cf in rec.feedback.items():
                if j == rec.arm:
                    assert cf is rec
                    continue
                assert cf.counterfactual and cf.exact and cf.arm == j
                prefix = prompt + gen.tokens[:start]
                state = eng.begin(prefix, build_policy("fixed", len(eng.arms), eng.max_len), 30 - start)
                live = eng.step(state, arm=j).record
                assert (cf.drafted, cf.accepted, cf.new_tokens) == (live.drafted, live.accepted, live.new_tokens), \
                    (j, start)
                checked += 1
                accepted_any += cf.accepted > 0
            start += rec.new_tokens
    assert checked > 20 and accepted_any > 5  # the check covered real, accepted drafts


def test_counterfactuals_under_sampling_are_flagged_estimates(model):
    sampling = SamplingConfig(temperature=1.0)
    eng = _engine(model, sampling)
    gen = eng.generate(PROMPTS[0], build_policy("ucbspec:fullinfo=true", len(eng.arms), eng.max_len), 24)
    cfs = [cf for r in gen.rounds for cf in r.feedback.values() if cf.counterfactual]
    assert cfs and not any(cf.exact for cf in cfs)
    assert all(not r.exact is False for r in gen.rounds)  # live records are what happened


def test_feedback_cost_is_timed_and_only_paid_by_full_information_policies(model):
    eng = _engine(model)
    full = eng.generate(PROMPTS[0], build_policy("hedge", len(eng.arms), eng.max_len), 20)
    bandit = eng.generate(PROMPTS[0], build_policy("ucbspec", len(eng.arms), eng.max_len), 20)
    assert all(t.feedback > 0 for t in full.step_times)
    assert all(t.feedback == 0 for t in bandit.step_times)
    assert all(r.feedback is None for r in bandit.rounds)


def test_hedge_refuses_arms_it_cannot_score_and_ucb_learns_them_from_plays(model):
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    arms = [build_arm("pld:L=3", env), DrafterModelArm(tiny_llama(seed=2), GREEDY, 3)]
    eng = SpecEngine(Target(model), arms, Verifier(GREEDY), step_time=0.05)
    with pytest.raises(UserError, match=r"drafter@3 cannot be scored"):
        eng.generate(PROMPTS[0], build_policy("hedge", 2, eng.max_len), 10)
    gen = eng.generate(PROMPTS[0], build_policy("ucbspec:fullinfo=true", 2, eng.max_len), 16)
    assert gen.tokens == plain_greedy(model, PROMPTS[0], 16)
    assert all(set(r.feedback) == {0, r.arm} for r in gen.rounds)


def test_bandit_only_policies_refuse_fullinfo():
    for spec in ("exp3:fullinfo=true", "exp3spec:fullinfo=true", "sh:fullinfo=true", "ducb:fullinfo=true"):
        with pytest.raises(UserError, match="cannot take full-information feedback"):
            build_policy(spec, 3, 4)
    with pytest.raises(UserError, match="fullinfo=false is not an option"):
        build_policy("hedge:fullinfo=false", 3, 4)


# ---- update rules, hand-computed --------------------------------------------------------------------------

def _rec(arm, new, L=4):
    return RoundRecord(arm, L, new - 1, new, 0.0, 0.05, [], [], L, step_time=0.05)


def _feed(pol, rewards_by_round, played=0):
    """Rounds of full vectors: rewards_by_round[s][j] = tokens arm j yields in round s."""
    for row in rewards_by_round:
        recs = {j: _rec(j, y) for j, y in enumerate(row)}
        pol.update(played, recs[played])
        pol.update_full(played, recs)


def test_hedge_weights_are_exponential_in_cumulative_unit_reward():
    pol = build_policy("hedge", 3, 4)  # tokens reward on [1, 5]: unit = (y − 1) / 4
    _feed(pol, [[5, 1, 3], [3, 1, 3]])
    G = np.array([1.0 + 0.5, 0.0, 0.5 + 0.5])
    eta = math.sqrt(8 * math.log(3) / 2)
    w = np.exp(eta * G) / np.exp(eta * G).sum()
    assert np.allclose(pol.weights(), w)
    assert pol.rounds == 2 and list(pol.n_obs) == [2, 2, 2] and list(pol.pulls) == [2, 0, 0]


def test_normalhedge_scale_solves_its_equation_and_weights_follow():
    R = np.array([0.7, -0.2, 0.3])
    c = normalhedge_scale(R)
    Rp = np.maximum(R, 0)
    assert np.mean(np.exp(Rp ** 2 / (2 * c))) == pytest.approx(math.e, rel=1e-8)
    pol = build_policy("normalhedge", 3, 4)
    assert np.allclose(pol.weights(), 1 / 3)  # no positive regret yet: uniform
    _feed(pol, [[5, 1, 3]])  # unit rewards 1, 0, .5; weighted mean under uniform = .5
    assert np.allclose(pol.R, [0.5, -0.5, 0.0])
    c = normalhedge_scale(pol.R)
    w = np.array([0.5 / c * math.exp(0.25 / (2 * c)), 0, 0])
    assert np.allclose(pol.weights(), w / w.sum())  # only the arm with positive regret has weight
    _feed(pol, [[1, 5, 1]])  # now weights are (1, 0, 0): mean = arm 0's unit reward 0
    assert np.allclose(pol.R, [0.5, 0.5, 0.0])


def test_ftl_follows_the_best_mean_with_a_floor():
    pol = build_policy("ftl:floor=0", 3, 4)
    assert pol.select() == 0  # nothing observed: the first arm
    _feed(pol, [[2, 4, 3], [2, 4, 5]])
    assert pol.select() == 1  # means 1.0 (y) vs 4.0 vs 4.0 → ties by index; arm 1 first
    _feed(pol, [[2, 4, 5]])
    assert pol.select() == 2
    floored = build_policy("ftl:floor=1,seed=5", 3, 4)
    _feed(floored, [[1, 1, 5]])
    picks = {floored.select() for _ in range(50)}
    assert picks == {0, 1, 2}  # floor=1: uniform


def test_router_learns_which_arm_wins_in_which_context():
    pol = build_policy("router:c=0", 2, 4)
    rng = np.random.default_rng(0)
    for _ in range(200):
        long_match = bool(rng.random() < 0.5)
        feats = {0: (4, 3 if long_match else 1), 1: (2, 5)}
        pol.see(feats)
        arm = pol.select()
        # arm 0 (a long pld draft) pays only after a long match; arm 1 is steady
        recs = {0: _rec(0, 5 if long_match else 1), 1: _rec(1, 3)}
        pol.update(arm, recs[arm])
        pol.update_full(arm, recs, feats)
    pol.see({0: (4, 3), 1: (2, 5)})
    assert pol.select() == 0
    pol.see({0: (4, 1), 1: (2, 5)})
    assert pol.select() == 1


def test_cost_aware_router_maximises_expected_tokens_per_step_of_cost():
    """router:cost=true: argmax of E[tokens] / (c(n + 1) + n·d), n = this round's draft length (known for arms that
    proposed) or the preset L, d = the arm's measured drafting cost per token (0 once its draft exists)."""
    curve = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.9, 5: 2.0}
    pol = build_policy("router:c=0,prior=0,cost=true,explore=ucb", 3, 4)  # the estimates, not draws, of arm 2
    pol.use_cost(curve.__getitem__, [4, 4, 2])
    feats = {0: (4, 3), 1: (2, 3)}  # arm 2 (neural) proposes only when played
    for _ in range(20):  # tokens per round: arm 0 3 (a draft of 4), arm 1 2 (of 2), arm 2 3 (of 2)
        pol.see(feats)
        pol.select()
        recs = {0: _rec(0, 3), 1: _rec(1, 2, L=2), 2: _rec(2, 3, L=2)}
        for r, draft_s in zip(recs.values(), (0.001, 0.001, 0.02)):
            r.draft_time, r.step_time = draft_s * r.drafted, 0.05
        pol.update(2, recs[2])
        pol.update_full(2, recs, feats)
    assert pol.draft_steps[2] == pytest.approx(0.4)  # 0.02 s per token / 0.05 s per step
    est = [pol.reward.lo + (pol.reward.hi - pol.reward.lo) * pol.estimate(j) for j in range(3)]
    want = [est[0] / curve[5], est[1] / curve[3], est[2] / (curve[3] + 2 * 0.4)]
    pol.see(feats)
    assert [pol.score(j) for j in range(3)] == pytest.approx(want)
    assert pol.select() == int(np.argmax(want)) == 1  # the shorter draft pays more per step on this curve
    plain = build_policy("router:c=0,prior=0", 3, 4)  # without the curve: the most tokens per round
    for _ in range(20):
        plain.see(feats)
        plain.select()
        plain.update(2, recs[2])
        plain.update_full(2, recs, feats)
    plain.see(feats)
    assert plain.select() == 0  # 3 tokens (tied with arm 2; the first wins)
    with pytest.raises(UserError, match="reward=tokens"):
        build_policy("router:cost=true,reward=be", 3, 4)


def test_cost_aware_router_through_the_engine_is_lossless_and_linked_to_the_curve(model):
    eng = _engine(model)
    pol = build_policy("router:cost=true", len(eng.arms), eng.max_len, seed=1)
    for prompt in PROMPTS:
        gen = eng.generate(prompt, pol, 30)
        assert gen.tokens == plain_greedy(model, prompt, 30)
    assert pol._steps is not None and pol._lengths == [a.L for a in eng.arms] and eng.cost.samples() > 0
    assert eng.round_overhead > 0  # c at the query's context as it grew, plus the rounds' own overhead in steps
    assert pol._steps(3) == pytest.approx(eng.cost.steps(3, len(PROMPTS[-1]) + 30) + eng.round_overhead / eng.step_time)


def _unlucky_start(explore: str, rounds: int = 600) -> list[int]:
    """A router over a scored arm (0: 2 tokens a round, counterfactual every round) and an arm learnt only from its own
    rounds (1: 3 tokens a round, but 1 in each of its first two rounds); returns the arms it played."""
    pol = build_policy(f"router:explore={explore},seed=3", 2, 4)
    played, own = [], 0
    for _ in range(rounds):
        arm = pol.select()
        played.append(arm)
        if arm == 1:
            own += 1
        recs = {0: _rec(0, 2), 1: _rec(1, 1 if own <= 2 else 3)}
        pol.update(arm, recs[arm])
        pol.update_full(arm, {0: recs[0], arm: recs[arm]})  # arm 1 is never scored counterfactually
    return played


def test_router_explores_an_arm_it_learns_only_from_its_own_rounds_by_thompson_sampling():
    """An arm without counterfactual records is valued by a posterior draw: two unlucky first rounds do not lock the
    better arm out, as the bonus c·sqrt(ln t / (n + 1)) with c = 0.1 does (explore=ucb) after one."""
    ucb = _unlucky_start("ucb")
    assert ucb.count(1) == 1  # its first (unlucky) round, then never again
    ts = _unlucky_start("thompson")
    assert ts[-100:].count(1) > 90  # found again and kept: the better arm
    pol = build_policy("router", 2, 4)
    assert pol.explore == "thompson"  # the default
    pol.update(0, _rec(0, 2))
    pol.update_full(0, {0: _rec(0, 2), 1: _rec(1, 3)})
    assert pol.scored(1) and not pol.scored(0)  # an observation beyond its plays: arm 1 was scored
    assert pol.value(1) == pol.estimate(1)  # a scored arm keeps the estimate
    with pytest.raises(UserError, match="explore must be one of thompson, ucb"):
        build_policy("router:explore=greedy", 2, 4)


def test_router_buckets():
    assert [bucket(x) for x in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 100)] == [0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6]


# ---- the EAGLE chain: scored in greedy runs ----------------------------------------------------------------

def _eagle_engine(model, sampling=GREEDY, eos=()):
    from decode.choose.arms.eagle import EagleArm
    from decode.choose.heads import EagleHead

    head = EagleHead(model, init="identity")  # drafts the last token again: the peaked model often repeats
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    target = Target(model, want_hidden=True)
    env = ArmEnv(model, TinyTokenizer(64), sampling, generator=torch.Generator().manual_seed(0), target=target)
    arms = [build_arm("pld:L=4", env), EagleArm(head.eval(), model, sampling, L=3, target=target, counterfactual=True,
                                                generator=torch.Generator().manual_seed(2)), build_arm("none", env)]
    return SpecEngine(target, arms, Verifier(sampling, generator=torch.Generator().manual_seed(1)), eos_token_ids=eos,
                      step_time=0.05)


@pytest.mark.parametrize("eos", [(), (3,)])
def test_eagle_counterfactual_equals_playing_it_from_that_prefix(model, eos):
    """Greedy: the EAGLE chain's would-be draft from every round's prefix is what playing it there gives."""
    eng = _eagle_engine(model, eos=eos)
    assert eng.scorer.scorable == [0, 1, 2]
    checked = accepted = played = 0
    for prompt in PROMPTS:
        gen = eng.generate(prompt, build_policy("hedge", len(eng.arms), eng.max_len, seed=1), 30)
        assert gen.tokens == plain_greedy(model, prompt, 30)[:len(gen.tokens)]
        start = 0
        for rec in gen.rounds:
            played += rec.arm == 1
            cf = rec.feedback[1]
            if rec.arm != 1:
                assert cf.counterfactual and cf.exact
                prefix = prompt + gen.tokens[:start]
                live = eng.step(eng.begin(prefix, build_policy("fixed", 3, eng.max_len), 30 - start), arm=1).record
                assert (cf.drafted, cf.accepted, cf.new_tokens) == (live.drafted, live.accepted, live.new_tokens)
                checked += 1
                accepted += cf.accepted > 0
            start += rec.new_tokens
    assert checked > 10 and accepted >= 3 and played > 0  # accepted: real matches, not only first-token misses


def test_eagle_is_scored_only_in_greedy_runs(model):
    """Sampled EAGLE drafts are random: no counterfactual; hedge refuses, UCBSpec learns EAGLE from its plays."""
    eng = _eagle_engine(model, SamplingConfig(temperature=1.0))
    assert eng.scorer.scorable == [0, 2]
    with pytest.raises(UserError, match="eagle@3 cannot be scored"):
        eng.generate(PROMPTS[0], build_policy("hedge", 3, eng.max_len), 10)
    gen = eng.generate(PROMPTS[0], build_policy("ucbspec:fullinfo=true", 3, eng.max_len), 16)
    assert all(1 not in r.feedback or r.arm == 1 for r in gen.rounds)
    eng.set_sampling(GREEDY)  # a server switching the next request to greedy scores it again
    assert eng.scorer.scorable == [0, 1, 2]


def test_eagle_counterfactual_is_opt_in(model, tmp_path):
    from decode.choose.heads import EagleHead, save_head

    save_head(EagleHead(model), tmp_path / "head")
    target = Target(model)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY, target=target)
    on = build_arm(f"eagle:path={tmp_path / 'head'},L=2,counterfactual=true", env)
    tree = build_arm(f"eagle:path={tmp_path / 'head'},L=2,tree=dynamic,counterfactual=true", env)
    assert on.greedy_counterfactual and not tree.greedy_counterfactual  # a tree is never scored
    arms = [build_arm("pld:L=3", env), build_arm(f"eagle:path={tmp_path / 'head'},L=2", env)]
    eng = SpecEngine(target, arms, Verifier(GREEDY), step_time=0.05)
    assert eng.scorer.scorable == [0]
    gen = eng.generate(PROMPTS[0], build_policy("router", 2, eng.max_len), 16)
    assert gen.tokens == plain_greedy(model, PROMPTS[0], 16)
    assert all(1 not in r.feedback or r.arm == 1 for r in gen.rounds)
