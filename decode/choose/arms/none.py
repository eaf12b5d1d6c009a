"""The "no speculation" arm: an empty draft, so the round is one plain decoding step."""
from __future__ import annotations

from ...core.draft import Draft
from .base import Arm, ArmEnv, register


class NoSpecArm(Arm):
    name = "none"
    free_counterfactual = True

    def __init__(self):
        super().__init__(0)

    def propose(self, context, max_len, keep_going=None) -> Draft:
        return Draft.empty()

    @property
    def label(self) -> str:
        return "none"


@register("none")
def _make(env: ArmEnv) -> NoSpecArm:
    return NoSpecArm()
