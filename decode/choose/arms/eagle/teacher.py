"""Teacher-forced agreement of an EAGLE arm through the decode path (issue 31: training vs decoding consistency).

:func:`teacher_forced_agreement` runs reference answers through a :class:`~decode.engine.loop.SpecEngine` exactly
as decoding runs a query — ``begin`` (the arm's reset, the target's prefill and its prompt features), then
``step`` rounds: the arm proposes from the engine's own feature path (``Target.prefill_hidden`` + every
verification forward's hidden states via ``observe``), the target scores ``[last token] + draft`` in one forward,
the cache is rolled back and the arm observes the kept rows — with one change: the verifier is
:class:`ReferenceVerifier`, which makes the "target" emit the reference answer instead of its own choice. So the
context always advances along the reference, and the arm's draft at every answer position is what it would have
drafted there in a live run.

``advance="one"`` (default): every round keeps no draft token and emits the answer's next token (a rejected
round, as decoding has them), so the arm drafts from every answer position: its first draft token there is
compared with the answer's token (``agree_reference``) and with the target's argmax after the same context, row 0
of the very verification forward (``agree_target``: what a greedy verifier accepts, and what the toolkit's
held-out ``top1_agreement`` counts). Those positions are the ones the training-side held-out figure counts (every
answer token, the first one included: the prefill caches the prompt but its last token, so round 1 drafts it),
so the two are comparable example by example.

``advance="match"``: a round keeps the leading draft tokens that equal the answer (then the answer's next
token), as a greedy run whose target wrote the answer would: decoding's own per-position acceptance on these
contexts.

With ``depth`` > 1 the arm drafts that many tokens a round; ``by_depth`` gives, per draft position i,
(reached, accepted) against the answer (reached = positions 0..i-1 all matched) and the same against the target's
argmax rows (the greedy verifier's rule; equal when the answer is the target's greedy text).

Nothing here imports the toolkit; ``toolkit/train/eagle.py`` ``heldout_agreement(..., per_example=True)`` is the
training-side computation to compare with (scripts/bench_eagle_consistency.py, tests/test_eagle_consistency.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from ....core.draft import Draft, Outcome
from ....core.sampling import SamplingConfig

ADVANCE = ("one", "match")


@dataclass
class ForcedExample:
    """One answer, position by position (index k = answer token k)."""

    drafts: list[int] = field(default_factory=list)  # the arm's first draft token there (-1: it drafted none)
    target: list[int] = field(default_factory=list)  # the target's argmax after the same context
    reference: list[int] = field(default_factory=list)  # the answer's token there
    positions: list[int] = field(default_factory=list)  # answer positions where a round started (all with "one")

    @property
    def agree_reference(self) -> int:
        return sum(d == r for d, r in zip(self.drafts, self.reference))

    @property
    def agree_target(self) -> int:
        return sum(d == t for d, t in zip(self.drafts, self.target))


@dataclass
class ForcedAgreement:
    """Totals over the examples; ``by_depth[i]`` = [reached, accepted] vs the answer, ``by_depth_target[i]`` the
    same vs the target's argmax rows."""

    examples: list[ForcedExample]
    advance: str
    depth: int
    by_depth: list[list[int]]
    by_depth_target: list[list[int]]

    @property
    def positions(self) -> int:
        return sum(len(e.drafts) for e in self.examples)

    @property
    def agree_reference(self) -> int:
        return sum(e.agree_reference for e in self.examples)

    @property
    def agree_target(self) -> int:
        return sum(e.agree_target for e in self.examples)

    def summary(self) -> dict:
        n = max(self.positions, 1)
        return {"examples": len(self.examples), "positions": self.positions, "advance": self.advance,
                "depth": self.depth, "agree_target": self.agree_target, "agree_reference": self.agree_reference,
                "top1_agreement": self.agree_target / n, "reference_agreement": self.agree_reference / n,
                "acceptance_per_position": [a / r if r else None for r, a in self.by_depth],
                "acceptance_per_position_target": [a / r if r else None for r, a in self.by_depth_target],
                "by_depth": self.by_depth, "by_depth_target": self.by_depth_target}


class ReferenceVerifier:
    """A verifier whose "target" writes the reference answer (module docstring). Greedy config, so the engine's
    counterfactual scorer and the arms behave as in a greedy run. ``start(answer)`` before each query; the driver
    sets ``pos`` (answer tokens committed so far) after each round."""

    def __init__(self, advance: str = "one"):
        if advance not in ADVANCE:
            raise ValueError(f"advance must be one of {ADVANCE}, got {advance!r}")
        self.cfg = SamplingConfig()
        self.advance = advance
        self.start([])

    def start(self, answer: Sequence[int], record: ForcedExample | None = None,
              depth_stats: tuple[list[list[int]], list[list[int]]] | None = None) -> None:
        self.answer = [int(t) for t in answer]
        self.pos = 0
        self.record = record if record is not None else ForcedExample()
        self.depth_stats = depth_stats

    def verify(self, target_logits: torch.Tensor, draft: Draft) -> Outcome:
        if draft.is_tree:
            raise ValueError("teacher forcing compares chains: use a chain arm (no tree=, K=)")
        drafted = [int(t) for t in draft.tokens.tolist()]
        argmax = [int(t) for t in target_logits.argmax(-1).tolist()]  # row i: after the context + drafted[:i]
        ref = self.answer[self.pos:self.pos + len(drafted) + 1]
        rec = self.record
        rec.positions.append(self.pos)
        rec.drafts.append(drafted[0] if drafted else -1)
        rec.target.append(argmax[0])
        rec.reference.append(ref[0])
        if self.depth_stats is not None:
            for stats, truth in zip(self.depth_stats, (ref, argmax)):
                for i, tok in enumerate(drafted[:len(truth)]):
                    stats[i][0] += 1
                    if tok != truth[i]:
                        break
                    stats[i][1] += 1
        match = 0
        while match < min(len(drafted), len(ref)) and drafted[match] == ref[match]:
            match += 1
        accepted = 0 if self.advance == "one" else min(match, len(ref) - 1)  # the bonus must exist
        flags = [1.0 if i < match else 0.0 for i in range(len(drafted))]
        return Outcome(accepted, ref[:accepted + 1], flags, [0.0] * len(drafted))


def teacher_forced_agreement(engine, examples: Iterable[tuple[Sequence[int], Sequence[int]]], *, arm: int = 0,
                             depth: int | None = 1, advance: str = "one",
                             progress: Callable[[int, ForcedExample], None] | None = None) -> ForcedAgreement:
    """Force each (prompt_ids, answer_ids) through ``engine`` (arm ``arm``, a chain arm: an ``EagleArm``) and
    record the arm's drafts at every round (module docstring). ``depth``: draft length per round (None = the
    arm's own L). The engine's verifier, EOS ids and (if unset) step time are swapped for the run and restored;
    ``progress(i, example)`` is called after each answer."""
    from ...policies import build_policy

    a = engine.arms[arm]
    depth = a.L if depth is None else int(depth)
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    verifier = ReferenceVerifier(advance)
    saved = engine.verifier, engine.eos, engine.step_time, a.L
    by_depth = [[0, 0] for _ in range(depth)]
    by_depth_target = [[0, 0] for _ in range(depth)]
    out: list[ForcedExample] = []
    engine.verifier, engine.eos, a.L = verifier, set(), depth  # the whole answer is forced, EOS included
    engine.step_time = engine.step_time or 1.0  # a policy reward unit only; skips the step-time probe
    try:
        policy = build_policy(f"fixed:arm={arm}", len(engine.arms), max(engine.max_len, depth))
        for i, (prompt, answer) in enumerate(examples):
            prompt, answer = [int(t) for t in prompt], [int(t) for t in answer]
            rec = ForcedExample()
            verifier.start(answer, rec, (by_depth, by_depth_target))
            if answer:
                # one token of budget beyond the answer: the round at the last answer token still drafts it
                state = engine.begin(prompt, policy, len(answer) + 1)
                while verifier.pos < len(answer):
                    engine.step(state, arm)
                    verifier.pos = len(state.tokens)
                if state.tokens != answer:
                    raise RuntimeError(f"teacher forcing drifted off the answer at example {i}")
            out.append(rec)
            if progress is not None:
                progress(i, rec)
    finally:
        engine.verifier, engine.eos, engine.step_time, a.L = saved
    return ForcedAgreement(out, advance, depth, by_depth, by_depth_target)
