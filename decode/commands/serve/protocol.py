"""The OpenAI request schema the server accepts, and its error bodies.

Requests are validated strictly (pydantic, ``extra="forbid"``): a field of the wrong type or range, or a field
the OpenAI API does not have, is a 400 naming the field. Fields of the API that would change the output in a
way this server cannot honour (``n`` > 1, log-probabilities, tools, penalties, ``logit_bias``, ``echo`` ...)
are refused by name rather than ignored; bookkeeping fields (``user``, ``metadata``, ``store``,
``service_tier`` ...) are accepted and have no effect. Extensions: ``top_k`` (as vLLM has it) and
``adaspec`` (``arms``: decode this request with a subset of the server's arms; ``return_token_ids``).
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP = 4  # as the OpenAI API


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # extra response headers (e.g. Connection: close on a body left unread)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AdaspecOptions(_Strict):
    arms: list[str] | None = Field(None, min_length=1, description="labels of the server's arms to decode with")
    return_token_ids: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="extension (as vLLM): 0 = off")
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=0, le=2 ** 63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    adaspec: AdaspecOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} sequences, got {len(stops)}", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop: an empty string would stop before the first token", param="stop")
        return stops

    def refuse_unsupported(self) -> None:
        """Fields of the API this server does not implement, when set to anything but their no-op value."""
        checks = [("n", self.n != 1, "only n=1 is served (one completion per request)"),
                  ("frequency_penalty", self.frequency_penalty != 0, "penalties change the target's distribution; "
                                                                      "a lossless decoder serves it unchanged"),
                  ("presence_penalty", self.presence_penalty != 0, "as frequency_penalty"),
                  ("logit_bias", bool(self.logit_bias), "biases change the target's distribution")]
        checks += self._unsupported()
        for param, bad, why in checks:
            if bad:
                raise APIError(400, f"{param} is not supported by this server: {why}", param=param)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return []


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None
    # bookkeeping fields of the API: accepted, no effect here
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def _unsupported(self):
        text_format = (self.response_format or {}).get("type", "text") == "text"
        return [("logprobs", bool(self.logprobs), "log-probabilities are not returned"),
                ("top_logprobs", self.top_logprobs is not None, "log-probabilities are not returned"),
                ("tools", bool(self.tools), "no tool calling"), ("tool_choice", self.tool_choice not in (None, "none"),
                                                                 "no tool calling"),
                ("functions", bool(self.functions), "no function calling"),
                ("function_call", self.function_call not in (None, "none"), "no function calling"),
                ("response_format", not text_format, "only plain text responses")]

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; pass one", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def _unsupported(self):
        return [("echo", self.echo, "the prompt is not echoed"), ("suffix", self.suffix is not None, "no insertion"),
                ("best_of", self.best_of not in (None, 1), "one completion per request"),
                ("logprobs", self.logprobs is not None, "log-probabilities are not returned")]

    def token_limit(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a batch of one is unwrapped; larger batches are refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: a batch of {len(p)} prompts; this server takes one per request",
                               param="prompt")
            p = p[0]
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise APIError(400, "prompt is empty: there is nothing to continue", param="prompt")
        return p


def _shown(x) -> str:
    """``x`` as text that can be sent back (a lone surrogate escaped, never raw)."""
    return str(x).encode("utf-8", "backslashreplace").decode("utf-8")


def check_text(data) -> None:
    """Refuse a lone UTF-16 surrogate (an unpaired ``\\ud800`` escape) in any string or key of the parsed body: it
    is not Unicode text, so no tokenizer can encode it and no answer could echo it. A 400 naming where it is."""
    stack = [((), data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if not _is_text(x):
                _refuse_surrogate(path, x)
        elif isinstance(x, dict):
            for k, v in x.items():
                if not _is_text(k):
                    _refuse_surrogate(path + (k,), k)
                stack.append((path + (k,), v))
        elif isinstance(x, list):
            stack.extend((path + (i,), v) for i, v in enumerate(x))


def _refuse_surrogate(path: tuple, s: str):
    ch = next(c for c in s if 0xD800 <= ord(c) <= 0xDFFF)
    where = ".".join(_shown(p) for p in path) or "body"
    raise APIError(400, f"{where}: a lone UTF-16 surrogate ({_shown(ch)}) is not valid Unicode text; send well-formed "
                        "UTF-8 (a character beyond U+FFFF escaped as a surrogate pair)",
                   param=_shown(path[0]) if path else None)


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _may_hold_surrogates(body: bytes) -> bool:
    """Whether the raw JSON could decode to a surrogate: a \\uD800-\\uDFFF escape, one encoded as UTF-8 bytes
    (json.loads lets those through), or a body in UTF-16/32 (a BOM or NULs up front), checked whole. Most
    bodies are none of these, and skip the walk over every string."""
    if b"\x00" in body[:4] or not body[:1].isascii():
        return True
    return _SURROGATE_SOURCE.search(body) is not None


_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _check_counts(data: dict, context: int) -> None:
    """Lists that cannot fit the context, refused before validation (pydantic takes about a second over 200k
    messages, holding the interpreter)."""
    msgs = data.get("messages")
    if isinstance(msgs, list) and len(msgs) > context:
        raise APIError(400, f"messages: {len(msgs)} messages cannot fit the model's context of {context} tokens "
                            "(each message takes at least one token)", param="messages",
                       code="context_length_exceeded")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > context and isinstance(prompt[0], int):
        raise APIError(400, f"prompt: {len(prompt)} token ids cannot fit the model's context of {context} tokens",
                       param="prompt", code="context_length_exceeded")


def parse_request(body: bytes, model: type[_Common], context: int | None = None) -> _Common:
    """The request object from raw JSON, or an APIError naming what is wrong (never a 500). With ``context``
    (the model's, in tokens), lists longer than it are refused before validation."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad JSON, bad UTF-8, an integer past Python's digit limit; RecursionError: nesting too deep
        why = "nested too deeply" if isinstance(exc, RecursionError) else _shown(exc)
        raise APIError(400, f"the body is not valid JSON ({why})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    if _may_hold_surrogates(body):
        check_text(data)
    if context is not None:
        _check_counts(data, context)
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        what = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise APIError(400, f"{where}: {what}{more}", param=str(err["loc"][0]) if err["loc"] else None) from None
    req.refuse_unsupported()
    return req
