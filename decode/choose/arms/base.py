"""Arm (proposer) interface and the registry that maps ``name[:key=value,...]`` specs to arms."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ...core.draft import Draft
from ...common.errors import UserError
from ...core.sampling import SamplingConfig
from ...common.registry import Registry
from ...common.specs import parse_spec

if TYPE_CHECKING:
    from ...core.hidden import HiddenStates
    from ...core.target import Target

# keep_going(position i (0-based), drafter's distribution row or None) -> draft another token?
# Draft-length controllers (fixed L, Beta-TS, Cali-TS) plug in here.
KeepGoing = Callable[[int, "torch.Tensor | None"], bool]


@dataclass
class ArmEnv:
    """What an arm may use: the target (read-only), decoding config, randomness."""

    target_model: object
    target_tokenizer: object
    sampling: SamplingConfig
    generator: torch.Generator = field(default_factory=torch.Generator)
    target_name: str = "target"
    trust_remote_code: bool = False
    target: "Target | None" = None  # the verifier wrapper (self-drafting arms read its model/hidden states)
    cache: str = "dynamic"  # KV cache kind of the arms that own one (drafter, early_exit, eagle): dynamic | static
    # modules loaded through this env (heads, drafter models), by what they were loaded from: the arms built from
    # one share it (a batched engine builds an arm instance per row, and drafts the rows of one module together)
    loaded: dict = field(default_factory=dict)

    def once(self, key, load: Callable[[], object], path: str | None = None):
        """``load()`` the first time ``key`` is asked for; the same object after — while the files under ``path``
        (a local folder or file it loads from) are unchanged: a folder rewritten in between is loaded again."""
        key = (key, _stamp(path))
        if key not in self.loaded:
            self.loaded[key] = load()
        return self.loaded[key]


def _stamp(path: str | None) -> tuple | None:
    """When the local files at ``path`` last changed (the folder and the files directly in it); None: not local."""
    from pathlib import Path

    p = Path(path) if path else None
    if p is None or not p.exists():
        return None
    files = [p, *p.iterdir()] if p.is_dir() else [p]
    return str(p.resolve()), max(f.stat().st_mtime_ns for f in files)


class Arm:
    """A proposer. ``propose`` returns at most ``max_len`` tokens continuing ``context``."""

    name: str = "arm"
    uses_target_hidden: bool = False
    target_forwards: int = 0  # target forwards this arm ran itself (counted in MAT by the engine)
    # its draft is a deterministic function of the context (model-free), so what it would have yielded in
    # any round can be scored against the verified tokens without a forward (decode/choose/feedback.py)
    free_counterfactual: bool = False
    # its greedy draft is a deterministic function of the context at a small cost of its own (the EAGLE chain with
    # counterfactual=true: the catch-up head forward it owes anyway, then L-1 head steps): scored in greedy runs
    greedy_counterfactual: bool = False
    last_match: int = 0  # length of the context match behind the last draft (a routing feature; 0 = none)
    width: int = 1  # nodes a depth of its draft holds, for a batched round's cost model (an EAGLE expand=1 tree: topk)

    def __init__(self, L: int):
        if L < 0:
            raise UserError(f"speculation length L must be >= 0, got {L}")
        self.L = int(L)

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new query (per-query state such as indexes and caches)."""

    def propose(self, context: list[int], max_len: int, keep_going: KeepGoing | None = None) -> Draft:
        raise NotImplementedError

    def observe(self, context: list[int], hidden: "HiddenStates | None" = None) -> None:
        """Called after each round with the committed context (and the target's hidden states at the positions
        that produced the new tokens, last row last, if asked: ``uses_target_hidden``)."""

    def set_sampling(self, cfg: SamplingConfig) -> None:
        """Draft under ``cfg`` from the next proposal on (a server changes it per request). Arms that
        sample their drafts keep it as ``self.sampling``; model-free arms draw nothing and ignore it."""
        if hasattr(self, "sampling"):
            self.sampling = cfg

    @property
    def label(self) -> str:
        return f"{self.name}@{self.L}"

    @property
    def parts(self) -> tuple["Arm", ...]:
        """The arms that draft for this one: itself; a union's sub-arms (what packing reaches, what batched rounds
        draft one by one and then :meth:`combine`)."""
        return (self,)

    def chain_tree(self):
        """What a batched drafter grows along this arm's chain instead of the chain itself (an EAGLE ``expand=1``
        tree's ``ChainTree``, decode/choose/arms/eagle/tree.py); None: the chain."""
        return None

    def combine(self, drafts: list[Draft], max_nodes: int | None = None) -> Draft:
        """This arm's draft from its :attr:`parts`' drafts (one each, in order): a single part's as it is.
        ``max_nodes``: a length controller's cut (a module's tree, drafted as deep as the cut, holds more nodes: an
        EAGLE ``expand=1`` tree's runner-ups), its first nodes kept."""
        return drafts[0] if max_nodes is None else drafts[0].prefix(max_nodes)


ARMS = Registry("arm")
register = ARMS.register


def arm_names() -> list[str]:
    return ARMS.names()


def build_arm(spec: str, env: ArmEnv) -> Arm:
    name, params = parse_spec(spec)
    return ARMS.build(name, spec, env, **params)


def check_arm_spec(spec: str) -> None:
    """Every check of an arm spec that needs no model, so a bad one fails before anything loads: the name, each
    parameter's type and range, and what the arm registered to check besides (the folder it names, a union's
    sub-arms)."""
    name, params = parse_spec(spec)
    ARMS.check(name, spec, 1, params)  # every factory takes the ArmEnv first


def build_arms(specs: list[str], env: ArmEnv) -> list[Arm]:
    """A pool: every spec built, labels distinct (records and reports are keyed by label)."""
    arms = [build_arm(s, env) for s in specs]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise UserError(f"duplicate arms in the pool: {labels}; give drafters distinct name=... labels")
    return arms
