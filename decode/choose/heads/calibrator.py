"""Cali-TS calibration predictor (ALGORITHMS.md §4, EESD Eq. 5):

    θ_M^{t+i} = Sigmoid(MLP([W^{min(i,10)} H_t^(T), H_{t+i}^(D)]))

H_t^(T): the target's final-layer (post-norm) hidden state at the last verified position — the
state whose LM-head output produced the last committed token. H_{t+i}^(D): the drafter's last
hidden state from which its i-th draft token (i = 1, 2, ...) was predicted. W^1..W^P ∈ R^{d×d}
(P = 10) start as identities. ``mlp_hidden = 0`` gives the paper's single linear layer W_p
(2 logits with softmax ≡ 1 logit with sigmoid); the default is a one-hidden-layer MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from ...common.errors import UserError
from .common import Head


class CalibrationPredictor(Head):
    kind = "calibrator"

    def __init__(self, d_target: int, d_draft: int, mlp_hidden: int = 256, max_pos: int = 10):
        super().__init__()
        if max_pos < 1 or mlp_hidden < 0:
            raise UserError(f"calibrator: need max_pos >= 1 and mlp_hidden >= 0, got {max_pos}, {mlp_hidden}")
        self.d_target, self.d_draft, self.mlp_hidden, self.max_pos = d_target, d_draft, mlp_hidden, max_pos
        self.W = nn.Parameter(torch.eye(d_target).repeat(max_pos, 1, 1))
        if mlp_hidden:
            self.mlp = nn.Sequential(nn.Linear(d_target + d_draft, mlp_hidden), nn.SiLU(), nn.Linear(mlp_hidden, 1))
        else:
            self.mlp = nn.Linear(d_target + d_draft, 1)

    def forward(self, h_target: torch.Tensor, h_draft: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits of "draft token i is accepted". h_target [B, d_T], h_draft [B, d_D], pos [B] (1-based)."""
        pos = torch.as_tensor(pos, device=h_target.device).long()
        if (pos < 1).any():
            raise ValueError("draft positions are 1-based")
        W = self.W[pos.clamp(max=self.max_pos) - 1]  # [B, d, d]
        z = torch.bmm(W, h_target.to(W.dtype).unsqueeze(-1)).squeeze(-1)
        return self.mlp(torch.cat([z, h_draft.to(z.dtype)], dim=-1)).squeeze(-1)

    @torch.no_grad()
    def theta(self, h_target: torch.Tensor, h_draft: torch.Tensor, pos: int) -> float:
        """θ_M for one draft position (decode time)."""
        p = torch.tensor([pos])
        return float(torch.sigmoid(self(h_target.reshape(1, -1), h_draft.reshape(1, -1), p))[0])

    # -- head folder protocol (the rest: Head) ----------------------------------------------------
    def head_config(self) -> dict:
        return {"d_target": self.d_target, "d_draft": self.d_draft, "mlp_hidden": self.mlp_hidden,
                "max_pos": self.max_pos}

    @classmethod
    def from_head_config(cls, meta: dict, target=None) -> "CalibrationPredictor":
        if target is not None and target.config.hidden_size != meta["d_target"]:
            raise UserError(f"calibrator was trained for target hidden size {meta['d_target']}, "
                            f"the target has {target.config.hidden_size}; retrain it for this target")
        return cls(meta["d_target"], meta["d_draft"], meta["mlp_hidden"], meta["max_pos"])


class TrainedThetaM:
    """θ_M for :class:`decode.choose.length.CaliTS` from a trained predictor: called with a ``CaliContext``
    (i = 1-based index of the token just drafted, its drafter hidden state, the target's hidden
    state at the last verified position). Returns None (→ θ̂_0) while either state is missing,
    e.g. in the first round of a query or with an arm that exposes no hidden states."""

    needs_target_hidden = True  # CaliTS hands this on so the evaluator turns the target's hidden states on

    def __init__(self, predictor: CalibrationPredictor):
        self.predictor = predictor.eval()

    def __call__(self, ctx) -> float | None:
        if ctx.target_hidden is None or ctx.draft_hidden is None:
            return None
        return self.predictor.theta(ctx.target_hidden.float(), ctx.draft_hidden.float(), max(1, int(ctx.i)))


def load_predictor(path) -> TrainedThetaM:
    """A saved calibrator folder (``make train-calibrator``) as a Cali-TS θ_M callable."""
    from .common import load_head
    return TrainedThetaM(load_head(path, expect="calibrator"))
