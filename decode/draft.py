"""Typed values that flow through one round: Draft → (verify) → Outcome → RoundRecord."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """A proposal for the next tokens.

    tokens: [L] draft token ids (L may be 0 for "no speculation").
    q:      [L, V] draft distributions after the shared logits processing, or None for a
            deterministic arm (treated as one-hot on ``tokens``).
    hidden: optional drafter hidden states [L, d] (for calibration predictors).
    parents: reserved for tree drafts (index of each node's parent, -1 = root); None = a chain.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        if self.q is not None and self.q.shape[0] != self.tokens.numel():
            raise ValueError(f"draft q has {self.q.shape[0]} rows for {self.tokens.numel()} tokens")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def empty() -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long))


@dataclass
class Outcome:
    """What the verifier decided for one draft.

    accepted:      number of leading draft tokens accepted (0..L)
    tokens:        accepted draft tokens followed by the bonus/correction token (len accepted+1)
    accept_prob:   per scored position, the acceptance probability min(1, p/q) (greedy: 1{match})
    tv:            per scored position, TV(target, draft) = ½‖p − q‖₁
    Scored positions are the first min(accepted + 1, L) draft positions.
    """

    accepted: int
    tokens: list[int]
    accept_prob: list[float] = field(default_factory=list)
    tv: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class RoundRecord:
    """One round as the engine saw it (what policies learn from and reports store)."""

    arm: int
    drafted: int
    accepted: int
    new_tokens: int  # tokens appended this round after EOS/budget truncation
    draft_time: float
    verify_time: float
    tv: list[float] = field(default_factory=list)
    accept_prob: list[float] = field(default_factory=list)
    max_len: int = 0  # the arm's speculation length L (for rewards normalised by L)

    @property
    def y(self) -> int:
        """Tokens the round produced before truncation: accepted + 1 (BanditSpec's Y)."""
        return self.accepted + 1

    @property
    def time(self) -> float:
        return self.draft_time + self.verify_time
