"""Prompt selection: sources → dedup → leakage check → caller's checks → the first ``n`` prompts.

Dedup key: the normalised text (case, punctuation and whitespace ignored), across all sources.
Every dropped prompt is counted by reason so the manifest can say where the data came from.
"""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decode.common.errors import UserError

from .leakage import EvalIndex, normalize
from .sources import Prompt, Source, iter_source


@dataclass
class Selection:
    prompts: list[Prompt]
    stats: dict = field(default_factory=dict)  # read / dropped_by_reason / per_source kept counts


def select_prompts(sources: Sequence[Source], n: int | None, *, eval_index: EvalIndex | None = None,
                   check: Callable[[Prompt], str | None] | None = None, shuffle: bool = False,
                   seed: int = 0) -> Selection:
    """Choose up to ``n`` distinct, non-leaking prompts (all when ``n`` is None).

    ``check`` returns a reason string to reject a prompt (e.g. "too_long"). With ``shuffle`` all
    sources are read and the order is a seeded permutation; otherwise sources are read in order and
    reading stops as soon as ``n`` prompts are kept.
    """
    if n is not None and n <= 0:
        raise UserError(f"num_prompts must be > 0 or null (all), got {n}")
    if not sources:
        raise UserError("sources is empty; list at least one prompt source (see recipes/tasks/*.yaml)")
    read, dropped, kept_by_source = Counter(), Counter(), Counter()
    seen: set[str] = set()
    out: list[Prompt] = []

    def stream():
        for i, src in enumerate(sources):
            for p in iter_source(src, f"sources[{i}]"):
                read[p.source] += 1
                yield p

    candidates = stream()
    if shuffle:
        pool = list(candidates)
        random.Random(seed).shuffle(pool)
        candidates = iter(pool)
    for p in candidates:
        if n is not None and len(out) >= n:
            break
        if not p.text.strip():
            dropped["empty_prompt"] += 1
            continue
        key = normalize(p.text)
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        if eval_index is not None and eval_index.leaks(p.text):
            dropped["leakage"] += 1
            continue
        reason = check(p) if check else None
        if reason:
            dropped[reason] += 1
            continue
        out.append(p)
        kept_by_source[p.source] += 1
    if not out:
        raise UserError(f"no prompts left after selection (read {dict(read)}, dropped {dict(dropped)}); "
                        f"check the recipe's sources")
    return Selection(out, {"read": dict(read), "dropped": dict(dropped), "kept": dict(kept_by_source),
                           "requested": n, "selected": len(out)})
