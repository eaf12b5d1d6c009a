"""Prompt templates: a user-turn format plus the target's own chat template (when it has one).

With ``user: "{prompt}"`` and no system prompt the ids equal what ``decode eval`` feeds the target
(:func:`decode.evaluation.suites.encode_prompt`), so distilled data matches the evaluation-time context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from decode.common.errors import UserError

SLOT = "{prompt}"


@dataclass(frozen=True, kw_only=True)
class Template:
    user: str = SLOT  # the user turn; "{prompt}" is replaced by the source text (no other braces parsed)
    system: str | None = None  # None: the chat template's default system prompt (if any)
    chat: Literal["auto", "always", "never"] = "auto"  # use the tokenizer's chat template?

    def __post_init__(self):
        if SLOT not in self.user:
            raise UserError(f"template.user must contain {SLOT} (where the source text goes), "
                            f"got {self.user!r}")

    def user_text(self, prompt: str) -> str:
        return self.user.replace(SLOT, prompt)

    def uses_chat(self, tokenizer) -> bool:
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.chat == "always" and not has:
            raise UserError("template.chat=always but the target's tokenizer has no chat template; "
                            "set template.chat=auto or never")
        return has and self.chat != "never"

    def render(self, tokenizer, prompt: str) -> tuple[str, list[int]]:
        """(exact text the target sees, its token ids)."""
        user = self.user_text(prompt)
        if self.uses_chat(tokenizer):
            messages = ([{"role": "system", "content": self.system}] if self.system is not None else [])
            messages.append({"role": "user", "content": user})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # BatchEncoding in transformers 5
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            text = user if self.system is None else f"{self.system}\n\n{user}"
            ids = list(tokenizer(text)["input_ids"])
        return tokenizer.decode(ids), ids
