"""UCBSpec and EXP3Spec against hand-computed values (BanditSpec Alg. 4/5)."""
import math

import numpy as np

from decode.draft import RoundRecord
from decode.policies import build_policy
from decode.policies.ucbspec import ucbspec_radius


def rec(arm, accepted, L=4):
    return RoundRecord(arm=arm, drafted=L, accepted=accepted, new_tokens=accepted + 1, draft_time=0.0,
                       verify_time=0.0, max_len=L)


def test_ucbspec_radius_hand_computed():
    # L=4, n=2, t=5, K=3, δ=0.5: 2·sqrt(3/4·(1 + 2·ln(3·25·sqrt(3)/0.5)))
    # ln(259.8076) = 5.55999; 1 + 11.11998 = 12.11998; ·0.75 = 9.08999; sqrt = 3.01496; ·2 = 6.02992
    assert abs(ucbspec_radius(4, 2, 5, 3, 0.5) - 6.02992) < 1e-4


def test_ucbspec_round_robin_then_argmax():
    pol = build_policy("ucbspec", 3, 4)
    assert [pol.select() for _ in range(1)] == [0]
    for i, acc in enumerate([1, 4, 0]):
        assert pol.select() == i
        pol.update(i, rec(i, acc))
    # all n=1: equal radii, so the highest mean Y (arm 1: Y=5) wins
    assert pol.select() == 1
    s = pol.scores()
    r = ucbspec_radius(4, 1, 3, 3, 0.5)
    np.testing.assert_allclose(s, [2 + r, 5 + r, 1 + r])


def test_exp3spec_probabilities_hand_computed():
    pol = build_policy("exp3spec", 2, 4)
    np.testing.assert_allclose(pol.probabilities(), [0.5, 0.5])
    pol.last_p = np.array([0.5, 0.5])
    pol.update(0, rec(0, 2))  # Y=3: Ẑ = (4+1-3)/(4·0.5) = 1
    eta = math.sqrt(math.log(2) / (2 * 2))  # t = 2
    p0 = math.exp(-eta) / (math.exp(-eta) + 1)  # ≈ 0.39741
    np.testing.assert_allclose(pol.probabilities(), [p0, 1 - p0], rtol=1e-9)
    assert abs(p0 - 0.39741) < 1e-5


def test_exp3spec_never_zero_probability():
    pol = build_policy("exp3spec", 3, 4, seed=1)
    for _ in range(3000):
        i = pol.select()
        pol.update(i, rec(i, 0 if i else 4))
    assert (pol.probabilities() > 0).all()


def test_ucbspec_concentrates_on_best_arm():
    rng = np.random.default_rng(0)
    accept = [0.3, 0.8, 0.5]  # per-token acceptance; truncated geometric Y
    pol = build_policy("ucbspec", 3, 4)
    for _ in range(3000):
        i = pol.select()
        a = 0
        while a < 4 and rng.random() < accept[i]:
            a += 1
        pol.update(i, rec(i, a))
    assert pol.pulls[1] / pol.pulls.sum() > 0.8
