"""EESD early-exit arm: drafts with the target's first N layers + a trained exit layer/norm/head.

KV cache: the drafting path keeps its OWN cache (N shared target layers + the exit layer, cache
slots 0..N), fed with the committed text and the draft; before each draft it is cropped to the
longest common prefix with the committed context (rejected draft tokens roll back, accepted ones
are kept) — the same bookkeeping as the independent-drafter arm, inherited from it. The target's
verification forward recomputes layers 0..N-1 for the draft positions instead of reusing the
drafting path's entries: reusing them would need a target forward that starts at layer N, which
HF's model forward does not offer without copying its decoder loop. The price is N/num_layers
(≈10%) of one verification forward per round plus a duplicate of N layers of KV memory; the
drafter never recomputes the prompt or accepted tokens.

A head saved with a draft vocabulary (decode/core/vocab.py) has an [N, d] LM head; its forward returns
target-vocabulary logits with ``-inf`` outside the subset, so the inherited drafting loop samples
only subset tokens and hands the verifier a q that is zero outside it.
"""
from __future__ import annotations

from typing import Annotated

import torch

from ...core.draft import Draft
from ...common.errors import UserError
from ..heads import EarlyExitDrafter, load_head
from ..heads.common import check_head_folder
from ...core.sampling import SamplingConfig
from ...common.specs import Range
from .base import ArmEnv, register
from .model import DrafterBatch, DrafterModelArm


class EarlyExitArm(DrafterModelArm):
    name = "early_exit"
    uses_target_hidden = True  # H_t^(T) for a Cali-TS calibration predictor

    def __init__(self, head: EarlyExitDrafter, sampling: SamplingConfig, L: int = 4,
                 generator: torch.Generator | None = None, label: str | None = None, target=None,
                 cache: str = "dynamic"):
        super().__init__(head, sampling, L, generator, label=label or f"early_exit[N={head.n_layers}]@{L}",
                         cache=cache)
        self.target = target
        self.draft_hidden: list[torch.Tensor] = []
        self.target_hidden: torch.Tensor | None = None

    def reset(self, prompt_ids):
        super().reset(prompt_ids)
        self.draft_hidden = []
        self.target_hidden = None

    def _feed(self, ids: list[int]) -> torch.Tensor:
        out = self._run(ids)
        self.draft_hidden.append(out.hidden_states[-1][0, -1].float())
        return out.logits[0, -1].float()

    def propose(self, context, max_len, keep_going=None) -> Draft:
        self.draft_hidden = []
        if self.target_hidden is None and self.target is not None and self.target.prefill_hidden is not None:
            self.target_hidden = self.target.prefill_hidden.final[-1].float()
        def with_hidden(i, row=None):  # hand the controller the hidden state behind token i-1 (Cali-TS)
            return keep_going(i, row, hidden=self.draft_hidden[i - 1])
        draft = super().propose(context, max_len, None if keep_going is None else with_hidden)
        if len(draft):
            draft.hidden = torch.stack(self.draft_hidden[:len(draft)])
        return draft

    def observe(self, context, hidden=None):
        if hidden is not None and len(hidden):
            self.target_hidden = hidden.final[-1].float()

    def batch_drafter(self, rows: int, compact_slack: int):
        return EarlyExitBatch(self.model, rows, compact_slack)

    def calibration_features(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(H_t^(T), H_{t+i}^(D)) for the i-th (1-based) token of the draft being built."""
        if self.target_hidden is None:
            raise UserError("Cali-TS needs the target's hidden states: build the Target with want_hidden=True "
                            "and pass it to the arm environment (ArmEnv.target)")
        return self.target_hidden, self.draft_hidden[i - 1]


class EarlyExitBatch(DrafterBatch):
    """The early-exit path drafted for every row of a batched engine (decode/choose/arms/batched.py): the head's
    stack (the target's first N layers + the exit layer + its norm) holds each row's committed tokens; logits from
    its own LM head (over its draft vocabulary, if it has one)."""

    def __init__(self, head: EarlyExitDrafter, rows: int = 0, compact_slack: int = 32):
        super().__init__(head, None, rows, compact_slack)

    def _logits(self, out):
        return self.model.full_logits(self.model.lm_head(out))


@register("early_exit", check=lambda typed: check_head_folder(typed["path"], expect="early_exit"))
def _make(env: ArmEnv, path: str, L: Annotated[int, Range(1)] = 4, name: str | None = None):
    head = env.once(("early_exit", path), lambda: load_head(path, env.target_model, expect="early_exit"), path=path)
    if env.target is not None:
        env.target.want_hidden = True
    return EarlyExitArm(head, env.sampling, L, env.generator, label=name, target=env.target, cache=env.cache)
