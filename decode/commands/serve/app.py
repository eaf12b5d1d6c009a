"""The HTTP face: OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events
when asked), ``/v1/models``, ``/health`` and ``/metrics``, in front of one
:class:`~decode.commands.serve.worker.Worker`.

Every failure a client can cause is a 4xx with an OpenAI error body (``protocol.APIError``); a handler never
lets an exception become a bare 500, and none can stop the worker. A client that goes away (a closed stream,
a dropped connection while waiting) cancels its job, so the engine is free within one round.

No client can stall the others: a body past ``--max-body-bytes`` is refused (413) as soon as its
Content-Length or its streamed bytes pass the limit, before it is read; the cheap bounds (messages per request,
characters per prompt) are checked before the chat template and the tokenizer; and JSON parsing, validation,
the chat template and tokenisation run in a thread, off the event loop that answers everyone else. A worker
that died fails what waits on it at once (503 naming the reason), and ``/health`` says why.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ...core.sampling import SamplingConfig
from ...evaluation.suites import encode_messages
from .limits import BODY_BYTES_PER_TOKEN, BODY_SLACK, default_max_body_bytes  # noqa: F401 (re-exported)
from .protocol import APIError, ChatRequest, CompletionRequest, parse_request
from .worker import Job, Result, Worker

log = logging.getLogger("decode.commands.serve")
POLL = 0.25  # seconds between checks that a waiting client is still there


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for (its longest vocabulary entry, special
    tokens included; a byte-level entry has at least as many characters as the text it decodes to), so a text
    of more than context × this characters cannot fit the context whatever it encodes to. 1024 when the
    tokenizer has no vocabulary to read."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return 1024
    return max((len(t) for t in vocab if isinstance(t, str)), default=1024) or 1


@dataclass
class ServeConfig:
    model_name: str  # the id /v1/models lists and requests must name
    context: int  # the target's context length (prompt + completion)
    request_timeout: float = 600.0  # seconds from arrival to the last token
    max_body_bytes: int | None = None  # largest request body read; None = default_max_body_bytes(context)


def encode_text(tokenizer, text: str) -> list[int]:
    """A completion prompt's token ids (a module function so that it can be watched in tests)."""
    return list(tokenizer(text)["input_ids"])


def create_app(worker: Worker, tokenizer, cfg: ServeConfig) -> FastAPI:
    app = FastAPI(title="adaspec", description="adaptive speculative decoding, OpenAI-compatible")
    created = int(time.time())
    metrics = worker.metrics
    if cfg.max_body_bytes is None:
        cfg.max_body_bytes = default_max_body_bytes(cfg.context)
    token_chars = longest_token_chars(tokenizer)
    max_chars = cfg.context * token_chars  # more characters than this cannot fit the context

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown routes, wrong methods
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).body()
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        down = worker.down()
        if down is not None:
            raise APIError(503, down, type="server_error", code="worker_unavailable")
        return {"status": "ok", "queue": worker.queue.qsize()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": created,
                                            "owned_by": "adaspec", "max_model_len": cfg.context,
                                            "arms": worker.labels, "policy": worker.policy_spec}]}

    @app.get("/metrics")
    async def prometheus():
        metrics.queue.set(worker.queue.qsize())
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _serve(request, ChatRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest, "completions")

    async def _serve(request: Request, kind, endpoint: str):
        try:
            body = await _read_body(request)
            # parsing, validation, the chat template and the tokenizer: off the event loop that answers everyone
            req, job = await asyncio.to_thread(_prepare, body, kind, endpoint)
            job.bind(asyncio.get_running_loop())
            worker.submit(job)
        except ClientDisconnect:  # the client left while sending its body: nobody reads an answer
            return Response(status_code=499)
        except APIError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            return _error_response(exc)
        except Exception as exc:  # a bug, not the client's doing: answered here, so the connection lives on
            log.exception("preparing a request failed")
            metrics.requests.labels(endpoint, "500").inc()
            return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                            type="server_error"))
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(request, job, rid, endpoint, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        while True:
            ev = await _next_event(request, job)
            if ev is None:  # the client went away: the job is cancelled, nobody reads an answer
                return Response(status_code=499)
            kind_, payload = ev
            if kind_ == "error":
                return _error_response(payload)
            if kind_ == "done":
                return _response(payload, rid, endpoint)

    async def _read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as its declared length or the bytes streamed so far pass
        --max-body-bytes: what is past the limit is never read (the connection is closed after the answer)."""
        limit = cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise _too_large(f"the request body is {int(declared)} bytes", limit)
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise _too_large(f"the request body passed {limit} bytes", limit)
        return bytes(buf)

    def _prepare(body: bytes, kind, endpoint: str):
        """(request, job) from the raw body; runs in a worker thread of the event loop's executor."""
        req = parse_request(body, kind, context=cfg.context)  # refuses more messages than the context holds
        return req, _job(req, endpoint)

    def _job(req, endpoint: str) -> Job:
        if req.model != cfg.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {cfg.model_name!r} "
                                "(GET /v1/models)", type="not_found_error", param="model", code="model_not_found")
        if endpoint == "chat":
            # the cheap bound first (the count of messages was checked while parsing): the chat template and the
            # tokenizer would take seconds over a huge request
            messages = [{"role": mm.role, "content": mm.text()} for mm in req.messages]
            _check_chars(sum(len(mm["content"]) for mm in messages), "messages")
            try:
                ids = encode_messages(tokenizer, messages)
            except Exception as exc:  # the target's chat template refused the conversation
                raise APIError(400, f"messages: the chat template cannot render them ({exc})",
                               param="messages") from None
        else:
            prompt = req.single_prompt()
            if isinstance(prompt, str):
                _check_chars(len(prompt), "prompt")
                ids = encode_text(tokenizer, prompt)
            else:
                vocab = len(tokenizer)
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                   param="prompt")
                ids = list(prompt)
            if not ids:
                raise APIError(400, "prompt encodes to no tokens", param="prompt")
        if len(ids) >= cfg.context:
            raise APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {cfg.context} tokens "
                                "(prompt + completion)", param="messages" if endpoint == "chat" else "prompt",
                           code="context_length_exceeded")
        limit = req.token_limit()
        if limit is None:
            limit = cfg.context - len(ids)
        if limit < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {limit}", param="max_tokens")
        if len(ids) + limit > cfg.context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({limit}) exceed the model's "
                                f"context of {cfg.context} tokens; lower max_tokens to at most "
                               f"{cfg.context - len(ids)}",
                           param="max_tokens", code="context_length_exceeded")
        arms = worker.arm_indices(req.adaspec.arms) if req.adaspec and req.adaspec.arms else None
        try:
            sampling = SamplingConfig(req.temperature, req.top_k, req.top_p)
        except Exception as exc:
            raise APIError(400, str(exc)) from None
        return Job(endpoint, ids, limit, sampling, req.seed, req.stops(), arms, cfg.request_timeout,
                   return_token_ids=bool(req.adaspec and req.adaspec.return_token_ids))

    def _check_chars(chars: int, param: str) -> None:
        if chars > max_chars:
            raise APIError(400, f"{param}: {chars} characters cannot fit the model's context of {cfg.context} tokens "
                                f"(a token of this tokenizer stands for at most {token_chars} characters, so at most "
                                f"{max_chars} fit)", param=param, code="context_length_exceeded")

    async def _next_event(request: Request, job: Job):
        """The job's next event; None once the client has disconnected (the job is then cancelled). Past
        the deadline (a job stuck behind a long one in the queue), a timeout error."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()  # the worker counts it when it drops the job
                    return None
                down = worker.down()
                if down is not None:  # nobody will decode it: say why now, not at the deadline
                    job.cancelled.set()
                    return "error", APIError(503, down, type="server_error", code="worker_unavailable")
                if time.monotonic() > job.deadline + 5 * POLL:
                    job.cancelled.set()
                    return "error", APIError(504, f"the request waited past the server's --request-timeout of "
                                                  f"{job.timeout:g} s", type="timeout_error", code="timeout")

    def _response(res: Result, rid: str, endpoint: str) -> dict:
        usage = _usage(res)
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": res.text},
                      "logprobs": None, "finish_reason": res.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": cfg.model_name,
                "choices": [choice], "usage": usage, "adaspec": res.info}

    async def _stream(request: Request, job: Job, rid: str, endpoint: str, include_usage: bool):
        created = int(time.time())
        chat_ = endpoint == "chat"
        obj = "chat.completion.chunk" if chat_ else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, role: bool = False, **extra) -> str:
            if chat_:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": cfg.model_name, "choices": [choice], **extra}
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat_:
                yield chunk(None, role=True)
            while True:
                ev = await _next_event(request, job)
                if ev is None:
                    return
                kind_, payload = ev
                if kind_ == "text":
                    yield chunk(payload)
                elif kind_ == "error":
                    yield f"data: {json.dumps(payload.body())}\n\n"
                    finished = True
                    return
                else:
                    yield chunk(None, payload.finish_reason, adaspec=payload.info)
                    if include_usage:  # OpenAI's usage chunk: no choices
                        body = {"id": rid, "object": obj, "created": created, "model": cfg.model_name,
                                "choices": [], "usage": _usage(payload)}
                        yield f"data: {json.dumps(body)}\n\n"
                    yield "data: [DONE]\n\n"
                    finished = True
                    return
        finally:
            if not finished:  # the client closed the stream (or the server is stopping): free the engine
                job.cancelled.set()

    return app


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"{what}; this server reads at most {limit} bytes per request (--max-body-bytes)",
                    code="request_too_large", headers={"Connection": "close"})


def _usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}
