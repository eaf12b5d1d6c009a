"""Every arm-selection policy against hand-computed values, plus regret behaviour on synthetic arms."""
import math

import numpy as np
import pytest

from decode.core.draft import RoundRecord
from decode.common.errors import UserError
from decode.choose.policies import build_policy, policy_names
from decode.choose.policies.ucbspec import ucbspec_radius
from decode.simulation.simulate import SyntheticInstance, run_policy, simulate, summarize


def rec(arm=0, accepted=0, drafted=4, tv=None, new=None, dt=0.0, vt=1.0):
    """A RoundRecord with Y = accepted + 1; BD = 1 − mean(tv)."""
    tv = [0.5] * min(accepted + 1, drafted) if tv is None else tv
    return RoundRecord(arm, drafted, accepted, accepted + 1 if new is None else new, dt, vt, tv, [], drafted)


def test_registry_lists_every_policy_and_rejects_unknown():
    assert set(policy_names()) >= {"fixed", "random", "ucbspec", "exp3spec", "metasd_ucb", "exp3", "sh",
                                   "ducb", "swucb", "thompson"}
    with pytest.raises(UserError, match="unknown policy"):
        build_policy("nope", 3, 4)
    with pytest.raises(UserError, match="bad parameters"):
        build_policy("ucbspec:bogus=1", 3, 4)
    with pytest.raises(UserError, match="unknown reward"):
        build_policy("metasd_ucb:reward=speed", 3, 4)


def test_ucbspec_radius_and_selection_by_hand():
    # (L/2)·sqrt((1+n)/n²·(1 + 2·log(K·t²·sqrt(1+n)/δ))) with L=4, n=2, t=5, K=3, δ=1/2
    assert ucbspec_radius(4, 2, 5, 3, 0.5) == pytest.approx(6.029896237132267, rel=1e-12)
    pol = build_policy("ucbspec", 3, 4)
    for arm, y in [(0, 1), (1, 5), (2, 3)]:  # round robin: each arm once
        assert pol.select() == arm
        pol.update(arm, rec(arm, accepted=y - 1))
    # t = 3, every n = 1: equal radii, so the best mean (arm 1, Y = 5) wins
    r = 2 * math.sqrt(2 / 1 * (1 + 2 * math.log(3 * 9 * math.sqrt(2) / 0.5)))
    np.testing.assert_allclose(pol.scores(), [1 + r, 5 + r, 3 + r], rtol=1e-12)
    assert pol.select() == 1


def test_exp3spec_probabilities_by_hand_and_never_zero():
    pol = build_policy("exp3spec", 3, 4, seed=0)
    np.testing.assert_allclose(pol.probabilities(), [1 / 3] * 3)
    arm = pol.select()
    pol.update(arm, rec(arm, accepted=1))  # Y = 2: loss (5 − 2)/(4·1/3) = 2.25
    eta = math.sqrt(math.log(3) / 6)
    w = np.ones(3)
    w[arm] = math.exp(-eta * 2.25)
    np.testing.assert_allclose(pol.probabilities(), w / w.sum(), rtol=1e-12)
    # adversarial extreme: one arm always yields 1 token for thousands of rounds
    pol = build_policy("exp3spec", 3, 8, seed=1)
    for _ in range(5000):
        a = pol.select()
        pol.update(a, rec(a, accepted=0 if a == 0 else 8, drafted=8))
        assert (pol.probabilities() > 0).all()


def test_exp3spec_follows_the_update_rule_over_several_rounds():
    """η_t = sqrt(ln K/(t·K)) with t the 1-based round; p ∝ exp(−η_t·cumulative Ẑ);
    Ẑ = (L+1−Y)/(L·p_{I}) for the played arm only (ALGORITHMS.md §2)."""
    K, L = 3, 4
    pol = build_policy("exp3spec", K, L, seed=2)
    cum = np.zeros(K)
    ys = [1, 3, 5]
    for t in range(1, 9):
        eta = math.sqrt(math.log(K) / (t * K))
        w = np.exp(-eta * cum)
        p = w / w.sum()
        np.testing.assert_allclose(pol.probabilities(), p, rtol=1e-12)
        a = pol.select()
        pol.update(a, rec(a, accepted=ys[a] - 1))
        cum[a] += (L + 1 - ys[a]) / (L * p[a])
    assert len(set(np.round(cum, 6))) > 1  # several arms were played


def test_metasd_ucb_scores_by_hand():
    pol = build_policy("metasd_ucb", 2, 4)  # c = 0.01, reward BD
    assert pol.c == 0.01 and pol.reward.name == "bd"
    pol.update(pol.select(), rec(0, accepted=0, tv=[0.6]))  # BD 0.4
    pol.update(pol.select(), rec(1, accepted=1, tv=[0.1, 0.3]))  # BD 0.8
    pol.update(0, rec(0, accepted=0, tv=[0.2]))  # BD 0.8 → arm 0 mean 0.6
    expected = [0.6 + 0.01 * math.sqrt(2 * math.log(3) / 2), 0.8 + 0.01 * math.sqrt(2 * math.log(3) / 1)]
    np.testing.assert_allclose(pol.scores(), expected, rtol=1e-12)
    assert pol.select() == 1


def test_exp3_mixing_by_hand():
    pol = build_policy("exp3:reward=be", 2, 4, seed=0)  # γ = 0.4
    np.testing.assert_allclose(pol.probabilities(), [0.5, 0.5])
    a = pol.select()
    pol.update(a, rec(a, accepted=2, drafted=4))  # BE 0.5, p = 0.5 → x̂ = 1, log w += 0.4·1/2
    w = np.ones(2)
    w[a] = math.exp(0.2)
    np.testing.assert_allclose(pol.probabilities(), 0.6 * w / w.sum() + 0.2, rtol=1e-12)
    assert pol.probabilities().min() >= 0.2 - 1e-12


def test_sequential_halving_phase_lengths_follow_karnin():
    """t_r = floor(budget / (|S_r|·ceil(log2 K))) pulls per surviving arm, ceil(|S_r|/2) survive."""
    pol = build_policy("sh:budget=30,reward=be", 5, 4)  # R = 3 phases
    plays = []
    for _ in range(31):
        a = pol.select()
        plays.append(a)
        pol.update(a, rec(a, accepted=[1, 4, 2, 3, 0][a], drafted=4))  # BE 0.25, 1, 0.5, 0.75, 0
    # 30//(5·3) = 2 each; keep 3 → 30//(3·3) = 3 each; keep 2 → 30//(2·3) = 5 each; then commit
    assert plays == [0, 1, 2, 3, 4] * 2 + [1, 2, 3] * 3 + [1, 3] * 5 + [1, 1]


@pytest.mark.parametrize("option,winner", [("", 3), (",rank=phase", 3), (",rank=cumulative", 1)])
def test_sequential_halving_ranks_on_the_current_phase(option, winner):
    """Karnin et al. rank each phase on that phase's samples only; ``rank=cumulative`` uses every pull."""
    pol = build_policy(f"sh:budget=8,reward=be{option}", 4, 4)
    # BE per pull (accepted/4): arm 1 starts at 1.0 then drops to 0.5; arm 3 starts at 0.25 then 0.75
    seq = {0: [0], 1: [4, 2, 2], 2: [0], 3: [1, 3, 3]}
    plays = []
    for _ in range(12):
        a = pol.select()
        plays.append(a)
        pol.update(a, rec(a, accepted=seq[a][min(plays.count(a) - 1, len(seq[a]) - 1)], drafted=4))
    # phase 2 means: arm 1 0.5 vs arm 3 0.75; over all pulls: arm 1 2/3 vs arm 3 7/12
    assert plays == [0, 1, 2, 3, 1, 3, 1, 3] + [winner] * 4


def test_sequential_halving_explores_then_commits():
    pol = build_policy("sh:budget=8,reward=be", 4, 4)  # R = 2; phase 1: 8//(4·2) = 1 pull each
    plays = []
    bes = {0: 0.25, 1: 1.0, 2: 0.5, 3: 0.75}
    for _ in range(12):
        a = pol.select()
        plays.append(a)
        pol.update(a, rec(a, accepted=int(bes[a] * 4), drafted=4))
    # phase 1: 0,1,2,3; keep {1, 3}; phase 2: 8//(2·2) = 2 rounds each → 1,3,1,3; then commit to 1
    assert plays == [0, 1, 2, 3, 1, 3, 1, 3, 1, 1, 1, 1]


def test_discounted_ucb_by_hand():
    pol = build_policy("ducb:discount=0.5,c=0.1,reward=be", 2, 4)
    pol.update(pol.select(), rec(0, accepted=4, drafted=4))  # r = 1
    pol.update(pol.select(), rec(1, accepted=0, drafted=4))  # r = 0
    pol.update(1, rec(1, accepted=2, drafted=4))  # r = 0.5
    # N0 = 0.25, S0 = 0.25; N1 = 0.5·1 + 1 = 1.5, S1 = 0.5·0 + 0.5 = 0.5
    np.testing.assert_allclose(pol.N, [0.25, 1.5])
    np.testing.assert_allclose(pol.S, [0.25, 0.5])
    n = 1.75
    expected = [1 + 0.1 * math.sqrt(2 * math.log(n) / 0.25), 0.5 / 1.5 + 0.1 * math.sqrt(2 * math.log(n) / 1.5)]
    np.testing.assert_allclose(pol.scores(), expected, rtol=1e-12)


def test_discounted_ucb_survives_20k_rounds_and_re_explores_a_forgotten_arm():
    """0.95^t underflows after ~14k rounds: an arm whose discounted count vanished must get an
    infinite score and be played again, never a NaN score."""
    pol = build_policy("ducb:discount=0.95,c=0,reward=be", 2, 4)
    plays = []
    for _ in range(20_000):
        a = pol.select()
        if pol.t >= 2:  # after the round robin
            assert not np.isnan(pol.scores()).any(), pol.t
        plays.append(a)
        pol.update(a, rec(a, accepted=4 if a == 0 else 2))  # BE 1.0 vs 0.5: greedy keeps arm 0
    late = [t for t, a in enumerate(plays) if a == 1 and t > 1]
    # forgotten once 0.95^k drops below the smallest normal double (k ≈ 13.8k)
    assert len(late) == 1 and 13_000 < late[0] < 14_600, late
    assert pol.N.min() > 0 and np.isfinite(pol.scores()).all()


def test_sliding_window_ucb_scores_by_hand_with_exploration():
    """score_i = mean_i + c·sqrt(2·ln(min(t, window))/n_i) over the last ``window`` rounds."""
    pol = build_policy("swucb:window=3,c=0.5,reward=be", 2, 4)
    for a, acc in [(0, 4), (1, 2), (0, 1)]:  # BE 1.0, 0.5, 0.25
        pol.update(a, rec(a, accepted=acc))
    b = 0.5 * math.sqrt(2 * math.log(3))
    np.testing.assert_allclose(pol.scores(), [1.25 / 2 + b / math.sqrt(2), 0.5 + b], rtol=1e-12)
    pol.update(1, rec(1, accepted=3))  # BE 0.75; the first round (arm 0, 1.0) leaves the window
    np.testing.assert_allclose(pol.n, [1, 2])
    np.testing.assert_allclose(pol.scores(), [0.25 + b, 1.25 / 2 + b / math.sqrt(2)], rtol=1e-12)
    assert pol.select() == 1  # 0.991 vs 1.149
    pol.update(1, rec(1, accepted=3))
    pol.update(1, rec(1, accepted=3))  # arm 0's last round leaves the window: n_0 = 0 → played next
    np.testing.assert_allclose(pol.n, [0, 3])
    assert pol.scores()[0] == np.inf and pol.select() == 0


def test_sliding_window_ucb_forgets_old_rounds():
    pol = build_policy("swucb:window=2,c=0,reward=be", 2, 4)
    assert pol.select() == 0  # nothing in the window: arm 0 first
    pol.update(0, rec(0, accepted=4, drafted=4))
    assert pol.select() == 1
    pol.update(1, rec(1, accepted=2, drafted=4))
    assert pol.select() == 0  # means 1.0 vs 0.5
    pol.update(0, rec(0, accepted=0, drafted=4))  # window now: (1, 0.5), (0, 0.0); the 1.0 dropped
    np.testing.assert_allclose(pol.n, [1, 1])
    np.testing.assert_allclose(pol.scores(), [0.0, 0.5])
    assert pol.select() == 1


def test_thompson_posterior_counts_and_determinism():
    pol = build_policy("thompson:reward=be", 2, 4, seed=5)
    pol.update(0, rec(0, accepted=4, drafted=4))  # r = 1 → always a success
    pol.update(1, rec(1, accepted=0, drafted=4))  # r = 0 → always a failure
    np.testing.assert_allclose(pol.succ, [1, 0])
    np.testing.assert_allclose(pol.fail, [0, 1])
    rng = np.random.default_rng(5)
    rng.random(), rng.random()  # the two Bernoulli-trick draws
    assert pol.select() == int(np.argmax(rng.beta([2, 1], [1, 2])))
    a = build_policy("thompson", 3, 4, seed=9)
    b = build_policy("thompson", 3, 4, seed=9)
    for k in range(30):
        x, y = a.select(), b.select()
        assert x == y
        a.update(x, rec(x, accepted=k % 5, tv=[0.3]))
        b.update(y, rec(y, accepted=k % 5, tv=[0.3]))


def test_random_and_fixed():
    f = build_policy("fixed:arm=2", 3, 4)
    assert {f.select() for _ in range(10)} == {2}
    with pytest.raises(UserError, match="out of range"):
        build_policy("fixed:arm=3", 3, 4)
    r1, r2 = build_policy("random", 4, 4, seed=3), build_policy("random", 4, 4, seed=3)
    s1 = [r1.select() for _ in range(50)]
    assert s1 == [r2.select() for _ in range(50)] and set(s1) == {0, 1, 2, 3}


def test_state_resets_per_query_unless_carry():
    for spec, carry in [("ucbspec", False), ("ucbspec:carry=true", True)]:
        pol = build_policy(spec, 2, 4)
        for a in (0, 1, 1):
            pol.update(a, rec(a, accepted=1))
        pol.new_query()
        assert (pol.t, list(pol.pulls)) == ((3, [1, 2]) if carry else (0, [0, 0]))


def test_ucbspec_pulls_of_a_suboptimal_arm_match_its_radius():
    """Two truncated-geometric arms (p = 0.5, 0.8; L = 4), 150 seeded runs of 5000 tokens. Mean pulls
    of the worse arm: 49.8 with the §2 radius. Measured mutants (same runs): L instead of L/2 → 141,
    t instead of t² → 32, sqrt(1+n) dropped from the log → 46, sqrt(1+n)/n → 1/n → 9; other seed sets
    put the correct radius at 49.2–49.8 and that smallest mutant at 45.6–46.1."""
    subs = []
    for s in range(150):
        inst = SyntheticInstance([0.5, 0.8], [4, 4], 5000, 1000 + s, kappa=0.0)
        arms, _, _ = run_policy(build_policy("ucbspec", 2, 4, seed=s), inst)
        subs.append(int((arms == 0).sum()))
    assert 47.5 <= np.mean(subs) <= 52.0, np.mean(subs)


def _regret(policies, p, n_max, seeds, kappa=20.0):
    lengths = np.array([100, 1000, n_max])
    make = [lambda s: SyntheticInstance(p, [4] * len(p), n_max, 1000 + s, kappa)]
    res = simulate((make, list(range(seeds))), policies, len(p), 4, lengths, progress=False)
    return summarize(res, policies, len(p), lengths, [str(x) for x in p])


def test_regret_is_sublinear_and_ucbspec_concentrates_on_the_best_arm():
    s = _regret(["ucbspec", "metasd_ucb"], [0.3, 0.5, 0.85], 10_000, seeds=6)
    for name in ("ucbspec", "metasd_ucb"):
        reg = s["policies"][name]["regret"]
        # length grows 100×; linear regret would grow ~100× too
        assert reg[-1] / max(reg[0], 1.0) < 15, (name, reg)
    assert s["policies"]["ucbspec"]["best_arm_ratio"] > 0.9
    # a non-learning policy has linear regret on the same instance
    r = _regret(["random"], [0.3, 0.5, 0.85], 10_000, seeds=2)["policies"]["random"]["regret"]
    assert r[-1] / r[0] > 50
