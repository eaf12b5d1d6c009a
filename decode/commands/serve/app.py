"""The HTTP face: OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events
when asked), ``/v1/models``, ``/health`` and ``/metrics``, in front of one :class:`~decode.commands.serve.worker.Worker`.

Every failure a client can cause is a 4xx with an OpenAI error body (``protocol.APIError``); a handler never
lets an exception become a bare 500, and none can stop the worker. A client that goes away (a closed stream,
a dropped connection while waiting) cancels its job, so the engine is free within one round.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...core.sampling import SamplingConfig
from ...evaluation.suites import encode_messages
from .protocol import APIError, ChatRequest, CompletionRequest, parse_request
from .worker import Job, Result, Worker

POLL = 0.25  # seconds between checks that a waiting client is still there


@dataclass
class ServeConfig:
    model_name: str  # the id /v1/models lists and requests must name
    context: int  # the target's context length (prompt + completion)
    request_timeout: float = 600.0  # seconds from arrival to the last token


def create_app(worker: Worker, tokenizer, cfg: ServeConfig) -> FastAPI:
    app = FastAPI(title="adaspec", description="adaptive speculative decoding, OpenAI-compatible")
    created = int(time.time())
    metrics = worker.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

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
        if not worker.alive():
            raise APIError(503, "the decoding worker has stopped", type="server_error")
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
            req = parse_request(await request.body(), kind)
            job = _job(req, endpoint)
        except APIError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        job.bind(asyncio.get_running_loop())
        try:
            worker.submit(job)
        except APIError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
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
                raise payload
            if kind_ == "done":
                return _response(payload, rid, endpoint)

    def _job(req, endpoint: str) -> Job:
        if req.model != cfg.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {cfg.model_name!r} "
                                "(GET /v1/models)", type="not_found_error", param="model", code="model_not_found")
        if endpoint == "chat":
            messages = [{"role": mm.role, "content": mm.text()} for mm in req.messages]
            try:
                ids = encode_messages(tokenizer, messages)
            except Exception as exc:  # the target's chat template refused the conversation
                raise APIError(400, f"messages: the chat template cannot render them ({exc})",
                               param="messages") from None
        else:
            prompt = req.single_prompt()
            if isinstance(prompt, str):
                ids = list(tokenizer(prompt)["input_ids"])
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
                                f"context of {cfg.context} tokens; lower max_tokens to at most {cfg.context - len(ids)}",
                           param="max_tokens", code="context_length_exceeded")
        arms = worker.arm_indices(req.adaspec.arms) if req.adaspec and req.adaspec.arms else None
        try:
            sampling = SamplingConfig(req.temperature, req.top_k, req.top_p)
        except Exception as exc:
            raise APIError(400, str(exc)) from None
        return Job(endpoint, ids, limit, sampling, req.seed, req.stops(), arms, cfg.request_timeout,
                   return_token_ids=bool(req.adaspec and req.adaspec.return_token_ids))

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


def _usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens}
