"""Full-information arm selection (ALGORITHMS.md §10, HedgeSpec): every round every arm's reward is
known (decode/choose/feedback.py scores the unplayed arms against the verified tokens), so selection is
prediction with expert advice rather than a bandit.

- ``hedge``: w_j ∝ exp(η_t G_j), G_j = cumulative unit reward, η_t = sqrt(8 ln K / t);
- ``normalhedge`` (Chaudhuri, Freund & Hsu 2009), parameter-free: R_j = Σ_s (r_j,s − r̄_s) with r̄_s the
  weighted mean reward of round s; c_t solves (1/K) Σ_j exp([R_j]_+² / (2c_t)) = e (bisection);
  w_j ∝ ([R_j]_+ / c_t) · exp([R_j]_+² / (2c_t)), uniform while every R_j ≤ 0;
- ``ftl``: follow the leader (the best mean reward so far) with an exploration floor: with probability
  ``floor`` a uniformly random arm. It learns arms that cannot be scored counterfactually from their
  own rounds, so it also runs over pools with neural arms.

``play=sample`` draws the arm from the weights (the algorithms as published); ``play=argmax`` plays the
heaviest arm, which full information allows (feedback no longer depends on the play). Hedge and
NormalHedge need every arm's reward every round (a pool of model-free arms); the engine refuses other
pools with a message naming the arms it cannot score.

Rounds are counted when their vector arrives (a round or two after the round, see decode/choose/feedback.py),
so t in η_t is the number of rounds learnt from.
"""
from __future__ import annotations

import math

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


class _Weighted(Policy):
    """A full-information policy that learns only from complete round vectors and plays from weights."""

    always_fullinfo = True
    needs_every_arm = True

    def __init__(self, n_arms, max_len, seed=0, play: str = "sample", **kw):
        if play not in ("sample", "argmax"):
            raise UserError(f"{self.name}: play must be sample or argmax, got '{play}'")
        self.play = play
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.rounds = 0  # complete reward vectors learnt from

    def weights(self) -> np.ndarray:
        raise NotImplementedError

    def select(self) -> int:
        w = self.weights()
        if self.play == "argmax":
            return int(np.argmax(w))
        return int(self.rng.choice(self.K, p=w))

    def _update(self, arm, value):
        """The played arm's reward arrives again in its round's vector; learning happens there."""

    def update_full(self, played, records, features=None):
        if len(records) != self.K:
            raise ValueError(f"{self.name} needs all {self.K} arms' rewards each round, got {sorted(records)}")
        r = np.array([self.reward.unit(self.reward(records[j])) for j in range(self.K)])
        self.n_obs += 1
        self.n_obs[played] -= 1  # update() already counted the played arm
        self.rounds += 1
        self._learn(r)

    def _learn(self, r: np.ndarray) -> None:
        raise NotImplementedError


@register("hedge")
class Hedge(_Weighted):
    name = "hedge"

    def reset(self):
        super().reset()
        self.G = np.zeros(self.K)

    def weights(self) -> np.ndarray:
        eta = math.sqrt(8 * math.log(self.K) / max(self.rounds, 1))
        z = eta * (self.G - self.G.max())
        w = np.exp(z)
        return w / w.sum()

    def _learn(self, r):
        self.G += r


def normalhedge_scale(R: np.ndarray) -> float:
    """c > 0 with mean_j exp([R_j]_+² / (2c)) = e (the left side decreases in c), by bisection on log c.
    Only called when some R_j > 0."""
    Rp2 = np.maximum(R, 0.0) ** 2

    def excess(log_c: float) -> float:  # log(mean exp(.)) − 1, computed without overflow
        z = Rp2 / (2 * math.exp(log_c))
        m = z.max()
        return m + math.log(np.mean(np.exp(z - m))) - 1.0

    hi = math.log(max(Rp2.max(), 1e-300))  # at c = max R², every term ≤ e^{1/2}: excess < 0
    lo = hi - 1.0
    while excess(lo) < 0:  # walk down until the equation's left side exceeds e
        lo -= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return math.exp(hi)


@register("normalhedge")
class NormalHedge(_Weighted):
    name = "normalhedge"

    def reset(self):
        super().reset()
        self.R = np.zeros(self.K)

    def weights(self) -> np.ndarray:
        Rp = np.maximum(self.R, 0.0)
        if not (Rp > 0).any():
            return np.full(self.K, 1.0 / self.K)
        c = normalhedge_scale(self.R)
        z = Rp ** 2 / (2 * c)
        w = (Rp / c) * np.exp(z - z.max())
        return w / w.sum()

    def _learn(self, r):
        self.R += r - float(self.weights() @ r)


@register("ftl")
class FollowTheLeader(Policy):
    """Best mean reward so far; arms with no reward yet first; ``floor`` = probability of a uniform pick."""

    name = "ftl"
    always_fullinfo = True

    def __init__(self, n_arms, max_len, seed=0, floor: float = 0.02, **kw):
        if not 0 <= floor <= 1:
            raise UserError(f"ftl: floor must be in [0, 1], got {floor}")
        self.floor = float(floor)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.sum_r = np.zeros(self.K)

    def _update(self, arm, value):
        self.sum_r[arm] += self.reward.unit(value)

    def select(self) -> int:
        first = self.first_unobserved()
        if first is not None:
            return first
        if self.floor and self.rng.random() < self.floor:
            return int(self.rng.integers(self.K))
        return int(np.argmax(self.sum_r / self.n_obs))
