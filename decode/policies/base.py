"""Arm-selection policy interface and registry.

A policy sees only the history of (arm, observed RoundRecord) through ``update``; ``select`` picks
the next arm. Policies are re-initialised per query (``reset``) unless the engine is told to carry
state across queries.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..draft import RoundRecord
from ..errors import UserError
from ..specs import parse_spec


class Policy:
    name = "policy"

    def __init__(self, n_arms: int, max_len: int, seed: int = 0):
        if n_arms < 1:
            raise UserError("a policy needs at least one arm")
        self.K = n_arms
        self.L = max(int(max_len), 1)  # BanditSpec's L (max speculation length); ≥1 keeps formulas finite
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """Forget everything (new query)."""
        self.rng = np.random.default_rng(self.seed)
        self.t = 0  # rounds observed so far
        self.pulls = np.zeros(self.K, dtype=np.int64)

    def select(self) -> int:
        raise NotImplementedError

    def update(self, arm: int, record: RoundRecord) -> None:
        self.t += 1
        self.pulls[arm] += 1
        self._update(arm, record)

    def _update(self, arm: int, record: RoundRecord) -> None:
        pass


_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls
    return deco


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def build_policy(spec: str, n_arms: int, max_len: int, seed: int = 0) -> Policy:
    name, params = parse_spec(spec)
    if name not in _REGISTRY:
        raise UserError(f"unknown policy '{name}' in '{spec}'; known policies: {', '.join(policy_names())}")
    try:
        return _REGISTRY[name](n_arms, max_len, seed=seed, **params)
    except TypeError as exc:
        raise UserError(f"policy '{spec}': bad parameters ({exc})") from exc
