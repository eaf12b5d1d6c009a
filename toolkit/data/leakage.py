"""Leakage check: evaluation questions must never become training prompts.

An :class:`EvalIndex` holds every user turn of the evaluation files (Spec-Bench JSONL: ``turns``;
other JSONL: ``question`` / ``prompt`` / ``text``). Texts are normalised (NFKC, case-folded,
non-alphanumerics → spaces). A training prompt leaks when:

1. its normalised text equals an evaluation text, or
2. it shares a run of ``ngram`` (13, as in GPT-3's contamination study) consecutive words with one, or
3. an evaluation text of 4..ngram-1 words appears in it as a contiguous word sequence.

Each evaluation text is indexed twice: whole, and without a short instruction prefix ending in
``:`` (≤ 6 words, e.g. "Translate German to English:"), so a prompt that wraps the same sentence in
different words is still caught. Evaluation texts under 4 words only match exactly (rule 1).
"""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from decode.common.errors import UserError
from decode.common.io import iter_jsonl

DEFAULT_EVAL_FILES = ("../shared/data/spec_bench/question_dev.jsonl",)
_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
_PREFIX = re.compile(r"^\s*([^:\n]{1,60}):\s*(\S.*)$", re.DOTALL)


def words(text: str) -> list[str]:
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).split()


def normalize(text: str) -> str:
    return " ".join(words(text))


def _eval_texts(path: Path) -> Iterable[str]:
    for lineno, row in iter_jsonl(path, "leakage.eval_files"):
        found = False
        for key in ("turns", "question", "prompt", "text"):
            v = row.get(key)
            for t in (v if isinstance(v, list) else [v]):
                if isinstance(t, str) and t.strip():
                    found = True
                    yield t
        if not found:
            raise UserError(f"leakage.eval_files: {path}:{lineno} has none of the fields turns/question/"
                            f"prompt/text; point leakage.eval_files at evaluation question files")


class EvalIndex:
    def __init__(self, texts: Iterable[str], ngram: int = 13):
        if ngram < 4:
            raise UserError(f"leakage.ngram must be >= 4, got {ngram}")
        self.ngram = ngram
        self.exact: set[str] = set()
        self.grams: set[tuple[str, ...]] = set()
        self.short: dict[int, set[tuple[str, ...]]] = {}
        self.count = 0
        for t in texts:
            self.count += 1
            variants = [t]
            m = _PREFIX.match(t)
            if m and len(m.group(1).split()) <= 6:
                variants.append(m.group(2))
            for v in variants:
                w = words(v)
                if not w:
                    continue
                self.exact.add(" ".join(w))
                if len(w) >= ngram:
                    self.grams.update(tuple(w[i:i + ngram]) for i in range(len(w) - ngram + 1))
                elif len(w) >= 4:
                    self.short.setdefault(len(w), set()).add(tuple(w))

    @classmethod
    def from_files(cls, paths: Iterable[str | Path], ngram: int = 13) -> "EvalIndex":
        from .sources import resolve_input

        texts: list[str] = []
        for i, p in enumerate(paths):
            texts.extend(_eval_texts(resolve_input(str(p), f"leakage.eval_files[{i}]")))
        return cls(texts, ngram)

    def leaks(self, text: str) -> bool:
        w = words(text)
        if " ".join(w) in self.exact:
            return True
        n = self.ngram
        if self.grams and any(tuple(w[i:i + n]) in self.grams for i in range(len(w) - n + 1)):
            return True
        for k, grams in self.short.items():
            if any(tuple(w[i:i + k]) in grams for i in range(len(w) - k + 1)):
                return True
        return False
