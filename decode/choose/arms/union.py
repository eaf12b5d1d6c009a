"""Union arm: several arms' drafts merged into one prefix tree and verified in one target forward, so
model-free and neural drafts no longer compete for the round (ALGORITHMS.md §7).

Spec: ``union:arms=SUB+SUB+...,nodes=N`` where each SUB is an arm spec whose own parameters are
separated by ':' instead of ',' (a ',' would end the union's parameter), e.g.
``union:arms=pld:L=2:n=3+suffix:L=3,nodes=8``. The tree is truncated breadth-first to ``nodes`` nodes
(decode/core/tree.py ``merge_chains``); its depth is at most the largest sub-arm L (the union's L).

Merging: in greedy mode draft distributions are dropped (greedy verification ignores them) so every
shared prefix merges; in sampling mode a sampled node keeps its own branch (see ``merge_chains``) and
the verifier runs recursive rejection sampling over siblings, in sub-arm order. A sub-arm that
returns a tree contributes its root-to-leaf chains.
"""
from __future__ import annotations

from typing import Annotated

from ...core.draft import Draft
from ...common.errors import UserError
from ...common.specs import Range
from ...core.tree import leaf_chains, merge_chains
from .base import Arm, ArmEnv, build_arm, check_arm_spec, register


def sub_specs(text: str) -> list[str]:
    """``"pld:L=2:n=3+suffix"`` → ["pld:L=2,n=3", "suffix"]."""
    out = []
    for part in text.split("+"):
        name, sep, rest = part.strip().partition(":")
        if not name:
            raise UserError(f"union: empty arm in arms='{text}'; write e.g. arms=pld:L=2+suffix:L=3")
        out.append(f"{name}:{rest.replace(':', ',')}" if sep else name)
    return out


class UnionArm(Arm):
    name = "union"

    def __init__(self, arms: list[Arm], nodes: int = 16, greedy: bool = True, label: str | None = None):
        if not arms:
            raise UserError("union: give at least one arm, e.g. union:arms=pld:L=2+suffix:L=3")
        super().__init__(max(a.L for a in arms))
        self.arms = arms
        self.nodes = int(nodes)
        self.greedy = greedy
        self.uses_target_hidden = any(a.uses_target_hidden for a in arms)
        self._label = label

    def set_sampling(self, cfg) -> None:
        self.greedy = cfg.greedy
        for a in self.arms:
            a.set_sampling(cfg)

    @property
    def label(self) -> str:
        return self._label or f"union[{'+'.join(a.label for a in self.arms)}]@{self.nodes}nodes"

    @property
    def parts(self) -> tuple[Arm, ...]:
        return tuple(p for a in self.arms for p in a.parts)

    @property
    def max_nodes(self) -> int:
        """The most nodes one draft has (the target scores max_nodes + 1 positions)."""
        return self.nodes

    @property
    def target_forwards(self) -> int:
        return sum(getattr(a, "target_forwards", 0) for a in self.arms)

    @property
    def last_match(self) -> int:
        return max(int(getattr(a, "last_match", 0)) for a in self.arms)

    def reset(self, prompt_ids):
        for a in self.arms:
            a.reset(prompt_ids)

    def observe(self, context, hidden=None):
        for a in self.arms:
            a.observe(context, hidden if a.uses_target_hidden else None)

    def propose(self, context, max_len, keep_going=None) -> Draft:
        return self.combine([a.propose(context, min(a.L, max_len), keep_going) for a in self.arms])

    def combine(self, drafts: list[Draft], max_nodes: int | None = None) -> Draft:
        """The sub-arms' drafts merged into one tree of at most ``nodes`` (and ``max_nodes``) nodes."""
        chains = [Draft(c.tokens) if self.greedy else c for d in drafts for c in leaf_chains(d)]
        if not chains:
            return Draft.empty()
        return merge_chains(chains, max_nodes=self.nodes if max_nodes is None else min(self.nodes, max_nodes))


def _check(typed: dict) -> None:
    """The sub-arms' specs, checked like any arm's before a model loads."""
    for sub in sub_specs(str(typed["arms"])):
        check_arm_spec(sub)


@register("union", check=_check)
def _make(env: ArmEnv, arms: str, nodes: Annotated[int, Range(1)] = 16, name: str | None = None):
    specs = sub_specs(arms)
    if any(s.partition(":")[0] == "union" for s in specs):
        raise UserError(f"union: arms='{arms}' contains another union; list its arms directly")
    built = []
    for s in specs:
        try:
            built.append(build_arm(s, env))
        except UserError as exc:
            raise UserError(f"union: {exc}") from None
    return UnionArm(built, nodes, env.sampling.greedy, label=name)
