"""Draft-length controllers (within a round). The engine asks one for a ``keep_going`` callback
before each draft and reports the verification outcome after it."""
from __future__ import annotations

from .draft import Outcome


class LengthController:
    """Fixed L: draft up to the arm's speculation length (no early stop)."""

    name = "fixed"

    def reset(self) -> None:
        """New query."""

    def keep_going(self):
        """Callback for ``Arm.propose`` (None = never stop early)."""
        return None

    def update(self, drafted: int, outcome: Outcome) -> None:
        """Learn from the round just verified."""
