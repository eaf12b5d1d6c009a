"""Rewards: exact values on hand-made rounds, ranges, the fixed-scale throughput, and γ-arms."""
import pytest

from decode.choose.arms import ArmEnv, build_arm
from decode.core.draft import RoundRecord
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.policies import build_policy
from decode.choose.rewards import build_reward, reward_names
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama


def rec(accepted, drafted, tv=(), new=None, dt=0.0, vt=1.0, max_len=None, step_time=1.0):
    return RoundRecord(0, drafted, accepted, accepted + 1 if new is None else new, dt, vt, list(tv), [],
                       drafted if max_len is None else max_len, step_time=step_time)


def test_names_and_unknown():
    assert set(reward_names()) == {"tokens", "be", "bd", "bd_prefix", "throughput"}
    with pytest.raises(UserError, match="known rewards"):
        build_reward("speed", 4)


def test_tokens_per_round_range_and_unit():
    r = build_reward("tokens", 4)
    assert (r.lo, r.hi) == (1.0, 5.0)
    assert r(rec(3, 4)) == 4.0
    assert r.unit(r(rec(0, 4))) == 0.0 and r.unit(r(rec(4, 4))) == 1.0
    assert r.unit(r(rec(2, 4))) == 0.5


def test_block_efficiency_and_empty_draft():
    r = build_reward("be", 4)
    assert r(rec(3, 4)) == 0.75
    assert r(rec(0, 2)) == 0.0
    assert r(rec(0, 0)) == 0.0  # nothing drafted: no speculative gain


def test_block_efficiency_divides_by_the_preset_length():
    """MetaSD: BE = accepted / γ with γ the arm's preset length, so a 1-token PLD match that is
    accepted does not score like a fully accepted 8-token draft."""
    r = build_reward("be", 8)
    assert r(rec(1, 1, max_len=8)) == 0.125
    assert r(rec(8, 8, max_len=8)) == 1.0
    assert r(rec(2, 3, max_len=4)) == 0.5  # a draft cut short (length controller) still divides by γ = 4
    assert r(rec(0, 0, max_len=0)) == 0.0  # γ = 0: plain decoding


def test_block_divergence_is_one_minus_mean_tv():
    r = build_reward("bd", 4)
    assert r(rec(1, 2, tv=[0.1, 0.5])) == pytest.approx(0.7)
    assert r(rec(0, 0, tv=[])) == 0.0
    assert r(rec(0, 1, tv=[1.0])) == 0.0


def test_block_divergence_averages_every_scored_position_and_bd_prefix_stops_at_the_rejection():
    """The target scores all drafted positions; MetaSD's BD averages TV over all of them (N_t).
    ``bd_prefix`` keeps the up-to-the-first-rejection average."""
    tv = [0.1, 0.5, 0.9, 0.9]  # one per drafted position; position 2 was rejected
    assert build_reward("bd", 4)(rec(1, 4, tv=tv)) == pytest.approx(1 - 0.6)
    assert build_reward("bd_prefix", 4)(rec(1, 4, tv=tv)) == pytest.approx(1 - 0.3)
    assert build_reward("bd_prefix", 4)(rec(4, 4, tv=tv)) == pytest.approx(1 - 0.6)  # all accepted
    assert build_reward("bd_prefix", 4)(rec(0, 0)) == 0.0


def test_throughput_is_tokens_per_autoregressive_step_on_a_fixed_scale():
    """Tokens of the round ÷ (round time / one autoregressive step): a fixed scale known before the
    query (no running maximum), clipped to [0, L+1]."""
    r = build_reward("throughput", 4)
    assert (r.lo, r.hi) == (0.0, 5.0)
    slow = rec(1, 4, new=2, dt=0.5, vt=0.5, step_time=0.25)  # 2 tokens in 4 steps' time
    assert r(slow) == pytest.approx(0.5)
    assert r(rec(3, 4, new=4, dt=0.1, vt=0.4, step_time=0.25)) == pytest.approx(2.0)
    assert r(slow) == pytest.approx(0.5)  # unchanged by the faster round in between
    assert r(rec(0, 0, new=1, dt=0.0, vt=0.25, step_time=0.25)) == pytest.approx(1.0)  # plain decoding = 1
    assert r(rec(4, 4, new=5, dt=0.0, vt=0.1, step_time=0.25)) == 5.0  # 12.5 clipped to L+1
    assert r.unit(r(slow)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="step_time"):
        r(rec(1, 4, step_time=0.0))


def test_policies_use_the_reward_they_name():
    assert build_policy("ucbspec", 2, 4).reward.name == "tokens"
    assert build_policy("exp3spec", 2, 4).reward.name == "tokens"
    for name in ("metasd_ucb", "exp3", "sh", "ducb", "swucb", "thompson"):
        assert build_policy(name, 2, 4).reward.name == "bd", name
    pol = build_policy("metasd_ucb:reward=be", 2, 4)
    pol.update(0, rec(2, 4, tv=[0.9, 0.9, 0.9, 0.9]))
    assert pol.sum_r[0] == 0.5  # BE, not BD (which would be 0.1)


def test_speculation_length_arms_with_throughput_are_lossless():
    """γ-arms pld:L=0..4 (L=0 = plain decoding) under a throughput-driven policy."""
    model = tiny_llama(seed=1)
    g = SamplingConfig()
    env = ArmEnv(model, TinyTokenizer(64), g)
    arms = [build_arm(f"pld:L={L}", env) for L in range(5)]
    eng = SpecEngine(Target(model), arms, Verifier(g))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    ref = plain_greedy(model, prompt, 30)
    for spec in ("ucbspec:reward=throughput", "metasd_ucb:reward=throughput", "fixed:arm=0"):
        gen = eng.generate(prompt, build_policy(spec, 5, eng.max_len, seed=0), 30)
        assert gen.tokens == ref, spec
    plain = eng.generate(prompt, build_policy("fixed:arm=0", 5, eng.max_len), 30)
    assert all(r.drafted == 0 and r.new_tokens == 1 for r in plain.rounds) and len(plain.rounds) == 30
