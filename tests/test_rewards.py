"""Rewards: exact values on hand-made rounds, ranges, the running-max throughput, and γ-arms."""
import pytest

from decode.arms import ArmEnv, build_arm
from decode.draft import RoundRecord
from decode.engine import SpecEngine
from decode.errors import UserError
from decode.policies import build_policy
from decode.rewards import build_reward, reward_names
from decode.sampling import SamplingConfig
from decode.target import Target
from decode.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama


def rec(accepted, drafted, tv=(), new=None, dt=0.0, vt=1.0):
    return RoundRecord(0, drafted, accepted, accepted + 1 if new is None else new, dt, vt, list(tv), [], drafted)


def test_names_and_unknown():
    assert set(reward_names()) == {"tokens", "be", "bd", "throughput"}
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


def test_block_divergence_is_one_minus_mean_tv():
    r = build_reward("bd", 4)
    assert r(rec(1, 4, tv=[0.1, 0.5])) == pytest.approx(0.7)
    assert r(rec(0, 0, tv=[])) == 0.0
    assert r(rec(0, 1, tv=[1.0])) == 0.0


def test_throughput_normalised_by_running_max():
    r = build_reward("throughput", 4)
    assert r(rec(1, 4, new=2, dt=0.5, vt=0.5)) == 1.0  # 2 tok/s is the max so far
    assert r(rec(0, 0, new=1, dt=0.0, vt=1.0)) == 0.5  # 1 tok/s
    assert r(rec(3, 4, new=4, dt=0.5, vt=0.5)) == 1.0  # new max 4 tok/s
    assert r(rec(1, 4, new=2, dt=0.5, vt=0.5)) == 0.5
    r.reset()
    assert r(rec(0, 0, new=1, dt=0.0, vt=1.0)) == 1.0


def test_policies_use_the_reward_they_name():
    assert build_policy("ucbspec", 2, 4).reward.name == "tokens"
    assert build_policy("exp3spec", 2, 4).reward.name == "tokens"
    for name in ("metasd_ucb", "exp3", "sh", "ducb", "swucb", "thompson"):
        assert build_policy(name, 2, 4).reward.name == "bd", name
    pol = build_policy("metasd_ucb:reward=be", 2, 4)
    pol.update(0, rec(2, 4, tv=[0.9, 0.9, 0.9]))
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
