"""Prompt suites: Spec-Bench-style JSONL files and a small built-in mixed set.

Spec-Bench JSONL rows: {"question_id": ..., "category": ..., "turns": [first user turn, ...]}.
Evaluation uses the first turn (single-turn); the later ones are kept as ``followups`` (a multi-turn served load:
scripts/bench_serve.py ``--turns``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from ..common.io import iter_jsonl


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    followups: tuple[str, ...] = ()  # the row's later user turns (its non-empty strings), in order


REQUIRED = ("question_id", "category", "turns")


def load_jsonl_suite(path: str | Path) -> list[Prompt]:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--suite {path}: is a folder; pass a Spec-Bench style JSONL file")
    if not p.is_file():
        raise UserError(f"--suite {path}: file not found (expected a Spec-Bench style JSONL)")
    prompts = []
    try:
        for lineno, row in iter_jsonl(p, "--suite"):
            prompts.append(_prompt(row, path, lineno))
    except UnicodeDecodeError:
        raise UserError(f"--suite {path}:{_first_non_utf8_line(p)}: not UTF-8 text; expected a Spec-Bench "
                        f"style JSONL file") from None
    if not prompts:
        raise UserError(f"--suite {path}: no prompts in file")
    return prompts


def _prompt(row, path, lineno: int) -> Prompt:
    """One JSONL row as a Prompt; a malformed row is a UserError naming the file and line."""
    if not isinstance(row, dict):
        raise UserError(f"--suite {path}:{lineno}: expected a JSON object with question_id, category and turns, "
                        f"got {type(row).__name__} {str(row)[:40]}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise UserError(f"--suite {path}:{lineno}: missing field(s) {', '.join(missing)}; each row "
                        f"needs question_id, category and turns (a list of user turns)")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise UserError(f"--suite {path}:{lineno}: 'turns' must be a non-empty list whose first "
                        f"element is a non-empty string")
    later = tuple(t for t in turns[1:] if isinstance(t, str) and t.strip())
    return Prompt(str(row["question_id"]), str(row["category"]), turns[0], later)


def _first_non_utf8_line(p: Path) -> int:
    """Line number (as a text reader counts them) of the first line that is not UTF-8."""
    for lineno, raw in enumerate(p.read_bytes().splitlines(), 1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return lineno
    return 1


def select(prompts: list[Prompt], categories: list[str] | None, limit: int | None) -> list[Prompt]:
    """Filter by category (None = all; an empty list is an error, not "all") and keep at most ``limit``
    prompts per category."""
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be an integer >= 1, got {limit}")
    have = sorted({p.category for p in prompts})
    if categories is not None and not categories:
        raise UserError(f"--categories: no category names given; pass a comma-separated list of: {', '.join(have)}")
    if categories:
        unknown = [c for c in categories if c not in have]
        if unknown:
            raise UserError(f"--categories: {', '.join(unknown)} not in the suite; available: {', '.join(have)}")
    out, count = [], {}
    for p in prompts:
        if categories and p.category not in categories:
            continue
        if limit is not None and count.get(p.category, 0) >= limit:
            continue
        count[p.category] = count.get(p.category, 0) + 1
        out.append(p)
    return out


_PASSAGE = (
    "The city council met on Tuesday to discuss the new public library. The library will open in "
    "March and will have a reading room, a children's corner, and twenty computers for public use. "
    "The council approved a budget of two million dollars for the project. Some residents asked for "
    "longer opening hours on weekends, and the council agreed to keep the library open until eight "
    "in the evening on Saturdays. The head librarian, Maria Lopez, said that the library will also "
    "offer free classes on computer skills for older adults."
)

_CODE = (
    "def total_price(items):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item['price'] * item['quantity']\n"
    "    return total\n"
)

BUILTIN: list[Prompt] = [
    Prompt("builtin-code", "code",
           f"Here is a Python function:\n\n{_CODE}\nRewrite this function so it also applies a discount: "
           "add a parameter discount (a fraction between 0 and 1) and return the discounted total. "
           "Show the full function."),
    Prompt("builtin-chat", "chat", "What are three simple ways to sleep better at night? Answer briefly."),
    Prompt("builtin-math", "math",
           "A shop sells pencils at 3 dollars each. Tom buys 4 pencils and pays with a 20 dollar bill. "
           "How much change does he get? Explain step by step."),
    Prompt("builtin-summarization", "summarization",
           f"Summarize the following news article in two sentences.\n\n{_PASSAGE}"),
    Prompt("builtin-extraction", "extraction",
           f"From the text below, list every number that is mentioned and what it refers to.\n\n{_PASSAGE}"),
    Prompt("builtin-rewriting", "rewriting",
           f"Rewrite the following text in simpler words for a child, keeping all the facts.\n\n{_PASSAGE}"),
]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids for a single user turn, using the model's chat template when it has one."""
    if not text or not text.strip():
        raise UserError("empty prompt: there is nothing to decode from")
    return encode_messages(tokenizer, [{"role": "user", "content": text}])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ready for the assistant's turn: the model's chat template with the
    generation prompt; a tokenizer without a template gets the turns' contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
