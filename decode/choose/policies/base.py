"""Arm-selection policy interface and registry.

A policy sees only the history of (arm, observed RoundRecord) through ``update``; ``select`` picks
the next arm. Each policy names the reward it learns from (``reward=`` parameter, see
decode/choose/rewards.py); ``update`` turns the record into that reward before ``_update`` sees it.

Queries: the engine calls ``new_query()`` before each generation. It re-initialises the policy
(MetaSD's per-query reset) unless the policy was built with ``carry=true``, in which case what it
learnt carries over to the next query (build the policy once and reuse it across prompts).
All randomness comes from ``self.rng`` seeded by ``seed``, so runs are reproducible.

Full information (ALGORITHMS.md §10, decode/choose/feedback.py): a policy with ``fullinfo`` True also learns
from what the arms it did NOT play would have yielded in the same round (``update_full``, a round or two
after the round, once the verified tokens decide it). Built-in full-information policies (hedge,
normalhedge, ftl, router) always are; ``ucbspec``, ``metasd_ucb`` and ``thompson`` accept
``fullinfo=true`` (each counterfactual record is one more observation of that arm). Policies whose
update needs the probability the arm was played with (exp3, exp3spec), a play schedule (sh) or a
discount/window over plays (ducb, swucb) refuse it.
"""
from __future__ import annotations

import numpy as np

from ...core.draft import RoundRecord
from ...common.errors import UserError
from ..rewards import Reward, build_reward
from ...common.registry import Registry
from ...common.specs import parse_spec


class Policy:
    name = "policy"
    default_reward = "tokens"
    supports_fullinfo = False  # may take counterfactual records of unplayed arms (``fullinfo=true``)
    always_fullinfo = False  # a full-information algorithm (hedge, ...): fullinfo is always on
    needs_every_arm = False  # its update needs every arm's reward in every round (no unscored arms)
    uses_cost = False  # wants the engine's verification cost curve (``use_cost``, called by the engine per query)

    def __init__(self, n_arms: int, max_len: int, seed: int = 0, reward: str | None = None, carry: bool = False,
                 fullinfo: bool | None = None):
        if n_arms < 1:
            raise UserError("a policy needs at least one arm")
        if seed < 0:
            raise UserError(f"policy {self.name}: seed must be an integer >= 0, got {seed}")
        if fullinfo and not self.supports_fullinfo:
            raise UserError(f"policy {self.name} cannot take full-information feedback (fullinfo=true): its update "
                            "needs the probability or the schedule of the arm it played; use hedge, normalhedge, "
                            "ftl, router, or ucbspec/metasd_ucb/thompson with fullinfo=true")
        if fullinfo is False and self.always_fullinfo:
            raise UserError(f"policy {self.name} is a full-information algorithm; fullinfo=false is not an option")
        self.fullinfo = bool(fullinfo) or self.always_fullinfo
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
        self.pulls = np.zeros(self.K, dtype=np.int64)  # rounds each arm was played
        self.n_obs = np.zeros(self.K, dtype=np.int64)  # rewards seen per arm: plays + counterfactual records
        self.reward.reset()

    def new_query(self) -> None:
        if not self.carry:
            self.reset()

    def use_cost(self, steps, lengths: list[int]) -> None:
        """For policies with ``uses_cost``: ``steps(n)`` = c(n), the cost of scoring n positions at the query's
        current context in one-token steps (decode/core/cost.py); ``lengths`` = every arm's preset L. Runtime
        links, not learnt state: kept in ``_``-attributes, which a saved policy state leaves out."""
        self._steps, self._lengths = steps, list(lengths)

    def select(self) -> int:
        raise NotImplementedError

    def update(self, arm: int, record: RoundRecord) -> None:
        value = self.reward(record)
        self.t += 1
        self.pulls[arm] += 1
        self.n_obs[arm] += 1
        self._update(arm, value)

    def update_full(self, played: int, records: dict[int, RoundRecord], features: dict | None = None) -> None:
        """A finished round's full-information vector (arm → record; the played arm's record is the one
        ``update`` already had). The default learns each unplayed arm's reward as one more observation;
        ``features``: what ``see`` was shown before that round (routers)."""
        if not self.fullinfo:
            return
        for j, rec in records.items():
            if j != played:
                self.n_obs[j] += 1
                self._update(j, self.reward(rec))

    def first_unobserved(self) -> int | None:
        """The lowest-index arm with no reward yet (the round-robin start of index policies), or None."""
        idx = np.flatnonzero(self.n_obs == 0)
        return int(idx[0]) if len(idx) else None

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
