"""Verification: turns target logits + a draft into an Outcome. ``Verifier`` dispatches backends."""
from __future__ import annotations

import os

import torch

from ..draft import Draft, Outcome
from ...common.errors import UserError
from ..sampling import SamplingConfig
from .reference import VerifyResult, input_status, raise_for_status, verify_reference
from .tree import verify_tree

BACKENDS = ("auto", "torch", "triton")


def _fused_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from . import fused  # noqa: F401
    except ImportError:
        return False
    return True


class Verifier:
    """Lossless verification of a draft against target logits.

    backend: "auto" (fused Triton kernel on CUDA, PyTorch reference elsewhere), "torch", "triton"
    (on CPU only through Triton's interpreter: TRITON_INTERPRET=1 set before Python starts).
    """

    def __init__(self, cfg: SamplingConfig, backend: str = "auto", generator: torch.Generator | None = None):
        if backend not in BACKENDS:
            raise UserError(f"--verifier must be one of {', '.join(BACKENDS)}, got '{backend}'")
        self.cfg = cfg
        self.backend = backend
        self.generator = generator

    def _fn(self, device: torch.device):
        use_fused = self.backend == "triton" or (self.backend == "auto" and _fused_available(device))
        if use_fused:
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise UserError(f"--verifier triton needs a CUDA device (tensors are on {device.type}); use --verifier "
                                "auto/torch, or set TRITON_INTERPRET=1 before starting Python to run the kernel in "
                                "Triton's CPU interpreter (slow; for tests)")
            try:
                from .fused import verify_fused
            except ImportError as exc:
                raise UserError(f"--verifier triton needs the triton package ({exc}); use --verifier torch") from exc
            return verify_fused
        return verify_reference

    def verify_batch(self, target_logits, draft_tokens, draft_probs, uniforms=None, check: bool = True) -> VerifyResult:
        """check=False: invalid inputs are only reported in ``status`` (no host sync here)."""
        if uniforms is None and not self.cfg.greedy:
            B, L1 = target_logits.shape[:2]
            uniforms = torch.rand(B, L1, generator=self.generator).to(target_logits.device)
        return self._fn(target_logits.device)(target_logits, draft_tokens, draft_probs, self.cfg, uniforms,
                                              check=check)

    @property
    def tree_note(self) -> str:
        """One line on how tree drafts are verified with this backend (for reports)."""
        fused = self.backend == "triton" or (self.backend == "auto" and torch.cuda.is_available()
                                              and _fused_available(torch.device("cuda")))
        return ("tree drafts: PyTorch reference verifier (the fused Triton kernel verifies chains only)" if fused
                else "tree drafts: PyTorch reference verifier")

    def verify(self, target_logits: torch.Tensor, draft: Draft) -> Outcome:
        """One sequence: target_logits [L+1, V] at [last token] + draft (for a tree: at [last token] +
        every node, from ``Target.score_tree``).

        Trees, and sampled i.i.d. chains (``draft.chain_ends``, k-Seq, even when they all coincide),
        go to the PyTorch reference in decode/core/verify/tree.py whatever the backend; the Outcome's
        ``path`` and ``note`` say so. Chains take the path below.

        ``tv`` and ``accept_prob`` cover all L drafted positions (the target scored them all); the
        positions the acceptance test reached are the first min(accepted + 1, L).

        Host transfer: exactly one per call, of 3 + 3L numbers (accepted, next token, input-error
        status, accept_prob[L], tv[L], the draft ids[L]) packed into one float64 vector on the logits'
        device (float64 holds every token id exactly); nothing of size V leaves the device. Input
        errors are raised from that same read.
        """
        if draft.is_tree or (draft.chain_ends is not None and not self.cfg.greedy):
            out = verify_tree(target_logits, draft, self.cfg, self.generator)
            out.note = self.tree_note
            return out
        dev = target_logits.device
        tokens = draft.tokens.to(dev)
        res = self.verify_batch(target_logits.unsqueeze(0), tokens.unsqueeze(0),
                                None if draft.q is None else draft.q.unsqueeze(0), check=False)
        L = len(draft)
        f64 = torch.float64
        flat = torch.cat([res.accepted.to(f64).reshape(1), res.next_token.to(f64).reshape(1),
                          res.status.to(f64).reshape(1), res.accept_prob[0].to(f64), res.tv[0].to(f64),
                          tokens.to(f64)]).tolist()
        if flat[2]:
            raise_for_status(res.status, target_logits.shape[-1], draft.tokens)
        a, nxt = int(flat[0]), int(flat[1])
        ids = [int(t) for t in flat[3 + 2 * L:3 + 2 * L + a]]
        return Outcome(a, ids + [nxt], flat[3:3 + L], flat[3 + L:3 + 2 * L])


def greedy_next(logits: torch.Tensor) -> list[int]:
    """The target's greedy token after each row's context (``logits`` [B, V], each row's first scored position):
    what :meth:`Verifier.verify` returns for an empty draft under greedy decoding (no draft position, so no
    ``tv`` or ``accept_prob``), for a whole batch in one argmax and one host read, with the same input check
    (NaN or +inf logits raise). A batched round's rows that drafted nothing take it instead of a verification
    each (a softmax over the vocabulary and a host read per row: ~0.2 ms a row, 3 ms a round at 16 rows)."""
    status = input_status(logits[:, None], logits.new_zeros(logits.shape[0], 0, dtype=torch.long), None)
    raise_for_status(status, logits.shape[-1])
    return logits.argmax(-1).tolist()


__all__ = ["Verifier", "greedy_next", "VerifyResult", "verify_reference", "verify_tree", "BACKENDS"]
