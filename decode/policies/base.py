"""Arm-selection policy interface and registry.

A policy sees only the history of (arm, observed RoundRecord) through ``update``; ``select`` picks
the next arm. Each policy names the reward it learns from (``reward=`` parameter, see
decode/rewards.py); ``update`` turns the record into that reward before ``_update`` sees it.

Queries: the engine calls ``new_query()`` before each generation. It re-initialises the policy
(MetaSD's per-query reset) unless the policy was built with ``carry=true``, in which case what it
learnt carries over to the next query (build the policy once and reuse it across prompts).
All randomness comes from ``self.rng`` seeded by ``seed``, so runs are reproducible.
"""
from __future__ import annotations

import numpy as np

from ..draft import RoundRecord
from ..errors import UserError
from ..rewards import Reward, build_reward
from ..registry import Registry
from ..specs import parse_spec


class Policy:
    name = "policy"
    default_reward = "tokens"

    def __init__(self, n_arms: int, max_len: int, seed: int = 0, reward: str | None = None, carry: bool = False):
        if n_arms < 1:
            raise UserError("a policy needs at least one arm")
        if seed < 0:
            raise UserError(f"policy {self.name}: seed must be an integer >= 0, got {seed}")
        self.K = n_arms
        self.L = max(int(max_len), 1)  # BanditSpec's L (max speculation length); ≥1 keeps formulas finite
        self.seed = seed
        self.carry = bool(carry)
        self.reward: Reward = build_reward(reward or self.default_reward, self.L)
        self.reset()

    def reset(self) -> None:
        """Forget everything (new query)."""
        self.rng = np.random.default_rng(self.seed)
        self.t = 0  # rounds observed so far
        self.pulls = np.zeros(self.K, dtype=np.int64)
        self.reward.reset()

    def new_query(self) -> None:
        if not self.carry:
            self.reset()

    def select(self) -> int:
        raise NotImplementedError

    def update(self, arm: int, record: RoundRecord) -> None:
        value = self.reward(record)
        self.t += 1
        self.pulls[arm] += 1
        self._update(arm, value)

    def _update(self, arm: int, value: float) -> None:
        """Learn from the raw reward value (``self.reward.unit(value)`` maps it to [0, 1])."""


POLICIES = Registry("policy", "policies")
register = POLICIES.register


def policy_names() -> list[str]:
    return POLICIES.names()


def build_policy(spec: str, n_arms: int, max_len: int, seed: int = 0) -> Policy:
    name, params = parse_spec(spec)
    params.setdefault("seed", seed)
    return POLICIES.build(name, spec, n_arms, max_len, **params)
