"""Typed values that flow through one round: Draft → (verify) → Outcome → RoundRecord, and what
``SpecEngine.step`` returns about the round (StepResult with its StepTimes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .hidden import HiddenStates


@dataclass
class Draft:
    """A proposal for the next tokens: a chain, or a token tree (decode/core/tree.py).

    tokens: [L] draft token ids (L may be 0 for "no speculation"); for a tree, one per node.
    q:      [L, V] draft distributions after the shared logits processing, or None for a
            deterministic arm (treated as one-hot on ``tokens``). For a tree, row n is the
            distribution node n was drawn from given its earlier siblings (one-hot for a
            deterministic choice), which is what recursive rejection sampling needs to be exact.
    hidden: optional drafter hidden states [L, d] (for calibration predictors).
    parents: tree drafts: [L] parent index of each node (-1 = child of the last context token;
            parents[n] < n, so nodes are in topological order; siblings are tried in index order).
            None = a chain (as is parents = [-1, 0, 1, ...]).
    chain_ends: K i.i.d. sampled chains (SpecTr's setting) merged into the tree: [K] node where
            each chain ends, in sampling order (its tokens are the root path to that node). Set, the
            sampling verifier uses k-Seq instead of recursive rejection sampling; needs ``q``.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    chain_ends: torch.Tensor | None = None

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        n = self.tokens.numel()
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"draft q has {self.q.shape[0]} rows for {n} tokens")
        if self.parents is not None:
            self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1).cpu()
            if self.parents.numel() != n:
                raise ValueError(f"draft parents has {self.parents.numel()} entries for {n} tokens")
            bad = (self.parents < -1) | (self.parents >= torch.arange(n))
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise ValueError(f"draft parents[{i}] = {int(self.parents[i])}: a node's parent must be -1 "
                                 f"(the last context token) or an earlier node (0..{i - 1})")
        if self.chain_ends is not None:
            self.chain_ends = torch.as_tensor(self.chain_ends, dtype=torch.long).reshape(-1).cpu()
            if self.q is None:
                raise ValueError("draft chain_ends (i.i.d. sampled chains) needs the draft distributions q")
            if self.chain_ends.numel() and not bool(((self.chain_ends >= 0) & (self.chain_ends < n)).all()):
                raise ValueError(f"draft chain_ends {self.chain_ends.tolist()} must be node indices in [0, {n})")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_tree(self) -> bool:
        """True when ``parents`` branches somewhere (a chain given with parents is not a tree)."""
        if self.parents is None:
            return False
        return not torch.equal(self.parents, torch.arange(-1, len(self) - 1))

    @staticmethod
    def empty() -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long))

    def prefix(self, k: int) -> "Draft":
        """A chain's first ``k`` tokens (what a deterministic arm proposes with ``max_len = k``); a tree's first
        ``k`` nodes (a tree still: nodes come after their parents); the draft itself when it holds at most ``k``."""
        if len(self) <= k:
            return self
        return Draft(self.tokens[:k], None if self.q is None else self.q[:k],
                     None if self.hidden is None else self.hidden[:k],
                     parents=None if self.parents is None else self.parents[:k])


@dataclass
class Outcome:
    """What the verifier decided for one draft of L tokens.

    accepted:      number of leading draft tokens accepted (0..L)
    tokens:        accepted draft tokens followed by the bonus/correction token (len accepted+1)
    accept_prob:   per draft position, the acceptance probability min(1, p/q) (greedy: 1{match})
    tv:            per draft position, TV(target, draft) = ½‖p − q‖₁
    The one verification forward scores every draft position, so accept_prob and tv have L entries,
    also past the first rejection. Consumers that want the positions up to the first rejection slice
    ``[:min(accepted + 1, L)]``.
    Tree drafts: accept_prob and tv follow the root path the verifier walked (the accepted nodes,
    then the first child it tested where it stopped, if any), each against the target's distribution
    at the node's parent; so ``[:accepted + 1]`` still means "up to the first rejection".
    path:          tree drafts: the accepted node indices, root first (the target keeps only their
                   KV entries); None for a chain.
    note:          a one-line remark on how the draft was verified (e.g. the tree fallback from the
                   fused kernel), "" when there is nothing to say.
    """

    accepted: int
    tokens: list[int]
    accept_prob: list[float] = field(default_factory=list)
    tv: list[float] = field(default_factory=list)
    path: list[int] | None = None
    note: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class RoundRecord:
    """One round as the engine saw it (what policies learn from and reports store).

    When EOS or the token budget cuts the round short, ``new_tokens`` counts the tokens kept and
    ``accepted`` only the accepted draft tokens among them, so rates and rewards never count tokens
    that were thrown away; the verifier's own count is in the trace/length-controller Outcome.
    """

    arm: int
    drafted: int
    accepted: int  # accepted draft tokens that were kept (≤ new_tokens)
    new_tokens: int  # tokens appended this round after EOS/budget truncation
    draft_time: float
    verify_time: float
    tv: list[float] = field(default_factory=list)  # per drafted position (all of them, see Outcome)
    accept_prob: list[float] = field(default_factory=list)  # per drafted position
    max_len: int = 0  # the arm's preset speculation length γ = L (BE divides by it)
    step_time: float = 0.0  # seconds of one autoregressive step (one-token target forward): the throughput unit
    extra_target_forwards: int = 0  # target forwards an arm ran itself this round (beyond the verification)
    # draft positions along the longest root path: a tree's or K chains' depth (``drafted`` counts its nodes);
    # None for a chain, whose depth is ``drafted``
    depth: int | None = None
    # counterfactual records (decode/choose/feedback.py): ``counterfactual`` marks a record of an arm that was NOT
    # played (scored against the verified tokens, no target forward); ``exact`` is False when its accepted
    # count is an estimate (sampling) rather than what playing it would have given (greedy).
    counterfactual: bool = False
    exact: bool = True
    # the played round's full-information vector, arm -> record (the played arm's is this record), filled
    # in once every scored arm's outcome is known (a round or two later); None when nothing was scored
    feedback: "dict[int, RoundRecord] | None" = None

    @property
    def positions(self) -> int:
        """Draft positions a path of this round reached (what per-position acceptance conditions on)."""
        return self.drafted if self.depth is None else self.depth

    @property
    def y(self) -> int:
        """Tokens the round produced (BanditSpec's Y): accepted + 1, or fewer when EOS/the budget cut
        the round; always equal to ``new_tokens``."""
        return self.new_tokens

    @property
    def time(self) -> float:
        return self.draft_time + self.verify_time


@dataclass
class StepTimes:
    """Seconds spent in each phase of one round (each read after a device synchronisation).

    select: the policy's choice; draft: ``Arm.propose``; score: the target's verification forward;
    verify: the verifier (including its one host read); rollback: the target cache rollback; update:
    committing the tokens, every arm's ``observe``, the record, ``Policy.update`` and the length
    controller (and resolving counterfactual feedback); feedback: the other arms' counterfactual
    proposals (decode/choose/feedback.py); total: the whole ``step`` call (``other`` = what no phase covers)."""

    select: float = 0.0
    draft: float = 0.0
    score: float = 0.0
    verify: float = 0.0
    rollback: float = 0.0
    update: float = 0.0
    feedback: float = 0.0  # counterfactual proposals of the other arms (full-information policies only)
    total: float = 0.0

    @property
    def bookkeeping(self) -> float:
        return self.select + self.update

    @property
    def other(self) -> float:
        return self.total - (self.select + self.draft + self.score + self.verify + self.rollback + self.update
                             + self.feedback)


@dataclass
class StepResult:
    """What one round did. A counterfactual step (``SpecEngine.step(..., counterfactual=True)``) has
    ``tokens == []`` and ``record is None``: it changed nothing but the arms' own caches."""

    arm: int
    draft: Draft
    outcome: Outcome  # the verifier's, before any EOS/budget truncation
    tokens: list[int]  # the tokens appended to the context this round (after EOS/budget truncation)
    record: RoundRecord | None
    times: StepTimes
    hidden: "HiddenStates | None" = None  # the target's at [last token] + accepted drafts, when computed
