"""Degenerate-output filters: named rules that mark generated rows unfit for training.

Rows are kept on disk with the name of the first rule that matched in their ``filtered`` column
(empty string = kept), counted in the manifest, and dropped by :func:`toolkit.distill.load_distilled`.

* ``empty``: the response is empty or whitespace only.
* ``truncated_mid_token``: the decoded response ends in U+FFFD, i.e. generation stopped inside a
  multi-byte character whose remaining byte tokens were never produced (not valid text).
* ``repetition_loop``: the response ends in a loop: a unit of ``p <= max_period`` tokens repeated
  back to back at least ``min_repeats`` times, covering at least ``min_tokens`` tokens.
* ``length``: the response hit ``max_new_tokens`` (off by default: cut-off text is still the target's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from decode.common.errors import UserError

RuleName = Literal["empty", "truncated_mid_token", "repetition_loop", "length"]
DEFAULT_RULES: tuple[str, ...] = ("empty", "truncated_mid_token", "repetition_loop")


@dataclass(frozen=True, kw_only=True)
class FilterConfig:
    rules: list[RuleName] = field(default_factory=lambda: list(DEFAULT_RULES))
    min_repeats: int = 3
    min_tokens: int = 24
    max_period: int = 64

    def __post_init__(self):
        if self.min_repeats < 2:
            raise UserError(f"filters.min_repeats must be >= 2, got {self.min_repeats}")
        if self.max_period < 1 or self.min_tokens < 1:
            raise UserError("filters.max_period and filters.min_tokens must be >= 1")


def is_empty(text: str, ids: list[int], finish: str, cfg: FilterConfig) -> bool:
    return not text.strip()


def is_truncated_mid_token(text: str, ids: list[int], finish: str, cfg: FilterConfig) -> bool:
    return text.endswith("\ufffd")


def tail_loop(ids: list[int], max_period: int) -> tuple[int, int]:
    """(period, looped length) of the longest periodic tail: ids[i] == ids[i-p] for the last run."""
    best = (0, 0)
    n = len(ids)
    for p in range(1, min(max_period, n // 2) + 1):
        run = 0
        i = n - 1
        while i - p >= 0 and ids[i] == ids[i - p]:
            run += 1
            i -= 1
        span = run + p  # tokens covered by the repeating unit, first copy included
        if run and span > best[1]:
            best = (p, span)
    return best


def is_repetition_loop(text: str, ids: list[int], finish: str, cfg: FilterConfig) -> bool:
    period, span = tail_loop(ids, cfg.max_period)
    return period > 0 and span >= cfg.min_tokens and span >= cfg.min_repeats * period


def is_length(text: str, ids: list[int], finish: str, cfg: FilterConfig) -> bool:
    return finish == "length"


RULES: dict[str, Callable[[str, list[int], str, FilterConfig], bool]] = {
    "empty": is_empty,
    "truncated_mid_token": is_truncated_mid_token,
    "repetition_loop": is_repetition_loop,
    "length": is_length,
}


def first_match(text: str, ids: list[int], finish: str, cfg: FilterConfig) -> str:
    """Name of the first rule in ``cfg.rules`` that flags this response, or ``""`` if it is kept.

    ``ids`` are the response tokens without the end-of-sequence token.
    """
    for name in cfg.rules:
        if RULES[name](text, ids, finish, cfg):
            return name
    return ""
