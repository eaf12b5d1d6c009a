"""Sliding-window UCB (Garivier & Moulines 2011; MetaSD Alg. 8): statistics over the last
``window`` rounds only; score_i = mean_i + c·sqrt(2·ln(min(t, window))/n_i), where an arm absent
from the window (n_i = 0) is played first (lowest index), which re-explores after a change.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


@register("swucb")
class SlidingWindowUCB(Policy):
    default_reward = "bd"

    def __init__(self, n_arms, max_len, seed=0, window: int = 50, c: float = 0.01, **kw):
        if window < 1:
            raise UserError(f"swucb: window must be >= 1 rounds, got {window}")
        if c < 0:
            raise UserError(f"swucb: c must be >= 0, got {c}")
        self.window, self.c = int(window), float(c)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.hist: deque[tuple[int, float]] = deque()
        self.n = np.zeros(self.K)
        self.s = np.zeros(self.K)

    def _update(self, arm, value):
        r = self.reward.unit(value)
        self.hist.append((arm, r))
        self.n[arm] += 1
        self.s[arm] += r
        if len(self.hist) > self.window:
            old, r_old = self.hist.popleft()
            self.n[old] -= 1
            self.s[old] -= r_old

    def scores(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = self.s / self.n + self.c * np.sqrt(2 * math.log(max(min(self.t, self.window), 1)) / self.n)
        return np.where(self.n > 0, sc, np.inf)

    def select(self) -> int:
        return int(np.argmax(self.scores()))
