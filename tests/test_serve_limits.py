"""`decode serve` under clients that would stall everyone, and its own failures (decode/commands/serve/):
a body past --max-body-bytes is a 413 before it is read, the cheap bounds come before the chat template and the
tokenizer, and the slow work runs off the event loop (/health and a small completion answer meanwhile); a lone
surrogate is a 400 that leaves the keep-alive connection alive; a dead worker fails what waits on it at once and
/health says why; stop() cancels the running request, joins the worker, then saves the state, fsynced.

Nothing here times the machine: "meanwhile" is shown by holding the slow request inside the tokenizer (or the
parser) until /health and a small completion have answered."""
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from decode.commands.serve import app as app_module
from decode.commands.serve.command import RunningServer

from helpers import SERVE_ARMS as ARMS  # noqa: E402
CONTEXT = 512  # the tiny target's max_position_embeddings (tests/helpers.py)


@pytest.fixture(scope="module")
def srv(tiny_server):
    return tiny_server


def _error(resp) -> dict:
    body = resp.json() if hasattr(resp, "json") else resp
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _small(s, **kw) -> dict:
    return {"model": s.model, "prompt": "Name a planet.", "max_tokens": 4, "temperature": 0, **kw}


# ---- raw HTTP/1.1 on one socket: what a client sees before its body is sent, and on a kept-alive connection ----

def _connect(s) -> socket.socket:
    host, port = s.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=20)
    return sock


def _head(path: str, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer (got {buf!r})"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


# ---- the body limit ------------------------------------------------------------------------------------------

def test_a_body_declared_past_the_limit_is_a_413_before_any_of_it_is_sent(srv):
    """A 60 MB Content-Length is answered at once: the client has sent the headers only."""
    with _connect(srv) as sock:
        sock.sendall(_head("/v1/chat/completions", {"Content-Length": 60_000_000}))
        status, headers, body = _read_response(sock)  # before the fix: waits for a body that never comes
    assert status == 413, body
    err = _error(json.loads(body))
    assert err["code"] == "request_too_large" and "60000000" in err["message"] and "--max-body-bytes" in err["message"]
    assert headers.get("connection") == "close"  # the unread rest cannot be the next request
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_streamed_body_is_refused_once_the_bytes_that_arrived_pass_the_limit(srv, monkeypatch):
    """No Content-Length (chunked): refused when what arrived passes the limit, without waiting for the end."""
    monkeypatch.setattr(srv.cfg, "max_body_bytes", 4096, raising=False)
    with _connect(srv) as sock:
        sock.sendall(_head("/v1/completions", {"Transfer-Encoding": "chunked"}))
        for _ in range(5):  # 5 × 1000 bytes > 4096; the terminating chunk is never sent
            sock.sendall(b"3e8\r\n" + b" " * 1000 + b"\r\n")
        status, headers, body = _read_response(sock)
    assert status == 413, body
    assert _error(json.loads(body))["code"] == "request_too_large" and headers.get("connection") == "close"


def test_the_limit_is_exact_and_its_refusal_an_openai_error(srv, monkeypatch):
    monkeypatch.setattr(srv.cfg, "max_body_bytes", 4096, raising=False)
    raw = json.dumps(_small(srv)).encode()
    at_limit = raw[:-1] + b" " * (4096 - len(raw)) + b"}"  # the same request padded to exactly 4096 bytes
    assert len(at_limit) == 4096
    ok = httpx.post(srv.url + "/v1/completions", content=at_limit, headers={"Content-Type": "application/json"},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    over = httpx.post(srv.url + "/v1/completions", content=at_limit + b" ",
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert over.status_code == 413
    err = _error(over)
    assert err["type"] == "invalid_request_error" and "4097 bytes" in err["message"]
    assert "at most 4096 bytes" in err["message"]


def test_the_default_limit_comes_from_the_context_and_the_flag_is_documented(srv):
    import argparse

    from decode.commands.serve.app import default_max_body_bytes
    from decode.commands.serve.command import add_arguments, check_args
    from decode.common.errors import UserError
    assert srv.cfg.max_body_bytes == default_max_body_bytes(CONTEXT)
    # room for a whole context of prompt at 64 bytes a token (escaped JSON), whatever the context
    assert default_max_body_bytes(CONTEXT) >= 64 * CONTEXT and default_max_body_bytes(8192) >= 64 * 8192
    assert default_max_body_bytes(8192) < 60_000_000
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert "--max-body-bytes" in p.format_help() and "413" in p.format_help()
    assert p.parse_args(["--max-body-bytes", "1000"]).max_body_bytes == 1000
    with pytest.raises(UserError, match="--max-body-bytes"):
        check_args(p.parse_args(["--max-body-bytes", "0"]))


# ---- the cheap bounds come before the chat template and the tokenizer --------------------------------------------

@pytest.fixture
def tokenizer_calls(srv, monkeypatch):
    """Every call into the server's tokenizer (text encoding and chat templates), counted."""
    tok = srv.worker.tok
    calls = []
    call, template = type(tok).__call__, tok.apply_chat_template

    def spy_call(self, *a, **k):
        calls.append("encode")
        return call(self, *a, **k)

    def spy_template(*a, **k):
        calls.append("chat_template")
        return template(*a, **k)

    monkeypatch.setattr(type(tok), "__call__", spy_call)
    monkeypatch.setattr(tok, "apply_chat_template", spy_template)
    return calls


def _longest_token(tok) -> int:
    return max(len(t) for t in tok.get_vocab())


def test_a_prompt_too_long_in_characters_is_refused_before_tokenising(srv, monkeypatch, tokenizer_calls):
    """More characters than context × the longest token's cannot fit: refused without the tokenizer (which took
    seconds on the event loop for a 10 MB prompt)."""
    monkeypatch.setattr(srv.cfg, "max_body_bytes", 50_000_000, raising=False)
    huge = "word " * 200_000  # 1 MB
    assert len(huge) > CONTEXT * _longest_token(srv.worker.tok)
    for path, body, param in [
            ("/v1/completions", {"prompt": huge, "max_tokens": 4}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "system", "content": huge[:600_000]},
                                                   {"role": "user", "content": huge[600_000:]}]}, "messages")]:
        r = httpx.post(srv.url + path, json={"model": srv.model, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = _error(r)
        assert err["param"] == param and err["code"] == "context_length_exceeded"
        assert "characters" in err["message"]
    assert tokenizer_calls == []


def test_more_messages_than_the_context_holds_are_refused_before_the_chat_template(srv, tokenizer_calls):
    msgs = [{"role": "user", "content": "a"}] * (CONTEXT + 1)
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": srv.model, "messages": msgs}, timeout=60)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == "messages" and f"{CONTEXT + 1} messages" in err["message"]
    assert tokenizer_calls == []
    # within the bounds, the tokenizer decides as before
    r = httpx.post(srv.url + "/v1/completions", json={"model": srv.model, "prompt": "x " * 600, "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 400 and "context" in _error(r)["message"] and tokenizer_calls == ["encode"]


# ---- the slow work runs off the event loop -----------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["parse_request", "encode_messages"])
def test_health_and_a_small_completion_answer_while_a_big_request_is_prepared(srv, monkeypatch, stage):
    """The big request is held inside JSON parsing/validation or the chat template + tokenizer (as a multi-MB
    body would be for seconds) until /health and a small completion have both answered."""
    inside, release = threading.Event(), threading.Event()
    real = getattr(app_module, stage)

    def held(*args, **kw):
        big = len(args[0]) > 10_000 if stage == "parse_request" else sum(len(m["content"]) for m in args[1]) > 10_000
        if big:
            inside.set()
            release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(app_module, stage, held)
    big = {"model": srv.model, "max_tokens": 4, "temperature": 0,
           "messages": [{"role": "user", "content": "Say hi. " * 2000}]}
    with ThreadPoolExecutor(1) as pool:
        try:
            fut = pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=big, timeout=90)
            assert inside.wait(30), "the big request never reached the held stage"
            health = httpx.get(srv.url + "/health", timeout=10)  # before the fix: the event loop is blocked
            small = httpx.post(srv.url + "/v1/completions", json=_small(srv), timeout=30)
            assert not fut.done()  # both answered while the big one was still being prepared
        finally:
            release.set()
        big_resp = fut.result()
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 4
    assert big_resp.status_code == 400 and _error(big_resp)["code"] == "context_length_exceeded"  # 4000 tokens


# ---- client errors are 4xx and leave the connection alive ---------------------------------------------------------

def test_a_lone_surrogate_is_a_400_and_the_keep_alive_connection_serves_the_next_request(srv):
    cases = [("/v1/completions", {"prompt": "\ud800", "max_tokens": 4}, "prompt"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udc00b"}]}, "messages"),
             ("/v1/completions", {"prompt": "hi", "stop": ["\ud83d"]}, "stop")]
    with _connect(srv) as sock:  # one connection for all: a reset after an error would fail the next request
        for path, body, param in cases:
            raw = json.dumps({"model": srv.model, **body}).encode()  # ASCII: the surrogate as a \\ud800 escape
            sock.sendall(_head(path, {"Content-Length": len(raw)}) + raw)
            status, headers, resp = _read_response(sock)
            assert status == 400, resp
            err = _error(json.loads(resp))
            assert err["param"] == param and "surrogate" in err["message"]
            assert headers.get("connection") != "close"
            ok = json.dumps(_small(srv)).encode()
            sock.sendall(_head("/v1/completions", {"Content-Length": len(ok)}) + ok)
            status, _, resp = _read_response(sock)
            assert status == 200 and json.loads(resp)["usage"]["completion_tokens"] == 4
    # a surrogate pair is one character beyond U+FFFF: fine
    r = httpx.post(srv.url + "/v1/completions", content=json.dumps(_small(srv, prompt="\ud83d\ude00")).encode(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200


# ---- a dead worker -----------------------------------------------------------------------------------------------

class Fatal(BaseException):
    """What no `except Exception` catches: the worker thread dies of it."""


# the worker's promises hold one request at a time and continuously batched (decode/commands/serve/worker.py)
WORKERS = pytest.mark.parametrize("max_batch", ["1", "4"], ids=["serial", "batched"])


def _wrap_round(s, monkeypatch, wrap):
    """Replace the worker's round (the serial engine's ``step(state)``, the batch's ``step()``) by
    ``wrap(real)``; the wrapper takes and passes on ``*args``."""
    owner = getattr(s.worker, "batch", None) or s.worker.engine
    monkeypatch.setattr(owner, "step", wrap(owner.step))


@WORKERS
def test_a_dead_worker_fails_running_and_queued_requests_at_once_and_health_says_why(tiny_target_dir, monkeypatch,
                                                                                     max_batch):
    with RunningServer(["--target", tiny_target_dir, "--arms", ARMS, "--state-file", "none", "--threads", "1",
                        "--max-batch", max_batch]) as s:
        assert s.cfg.request_timeout == 600  # the wait a dead worker used to cost
        inside, release = threading.Event(), threading.Event()

        def dies(real):
            def step(*args):
                inside.set()
                release.wait(30)
                raise Fatal("the accelerator fell off the bus")
            return step

        _wrap_round(s, monkeypatch, dies)
        body = {"model": s.model, "prompt": "Say hi", "max_tokens": 16, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            try:
                running = pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=20)
                assert inside.wait(20)
                queued = pool.submit(httpx.post, s.url + "/v1/completions", json={**body, "stream": True},
                                     timeout=20)
                deadline = time.monotonic() + 20
                while s.worker.queue.qsize() < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert s.worker.queue.qsize() == 1
            finally:
                release.set()
            answers = [running.result(), queued.result()]  # before the fix: both wait out the 600 s timeout
        reason = "Fatal: the accelerator fell off the bus"
        assert answers[0].status_code == 503 and reason in _error(answers[0])["message"]
        streamed = answers[1]  # the stream had begun: its error event names the reason
        assert streamed.status_code == 200 and reason in streamed.text and '"error"' in streamed.text
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 503 and reason in _error(health)["message"]
        again = httpx.post(s.url + "/v1/completions", json=body, timeout=20)
        assert again.status_code == 503 and reason in _error(again)["message"]
        assert s.worker.failure == reason


# ---- stop(): cancel the running request, join, then save (fsynced) -----------------------------------------------

def _sample(s, outcome: str) -> float:
    return s.worker.metrics.registry.get_sample_value("adaspec_requests_total",
                                                      {"endpoint": "completions", "outcome": outcome}) or 0.0


@WORKERS
def test_stop_cancels_the_running_request_joins_the_worker_then_saves_what_it_learnt(tiny_target_dir, tmp_path,
                                                                                      monkeypatch, max_batch):
    from decode.choose.policies.state import policy_state
    state = tmp_path / "state.json"
    with RunningServer(["--target", tiny_target_dir, "--arms", ARMS, "--state-file", str(state),
                        "--threads", "1", "--max-batch", max_batch]) as s:
        rounds, started = [], threading.Event()

        def slowly(real):
            def slow(*args):  # a long request: 400 tokens at a pause per round
                r = real(*args)
                rounds.append(r)
                started.set()
                time.sleep(0.05)
                return r
            return slow

        _wrap_round(s, monkeypatch, slowly)
        events = []

        def client():
            body = {"model": s.model, "prompt": "Write a poem about the sea", "max_tokens": 400, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as resp:
                events.extend(line for line in resp.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(30)
        saved = s.worker.stop()
        played = len(rounds)
        assert not s.worker.alive()
        assert _sample(s, "cancelled") == 1 and _sample(s, "ok") == 0  # before the fix: it ran to the end
        assert s.worker.metrics.registry.get_sample_value("adaspec_generation_tokens_total") < 400
        assert saved is True
        t.join(30)
        assert any("shutting down" in e for e in events), events[-3:]
        saved = json.loads(state.read_text())
        assert saved["requests"] == s.worker.requests_learnt == 1  # the cancelled request's rounds taught it
        assert saved["policy"] == json.loads(json.dumps(policy_state(s.worker.policy)))  # saved after its last round
        time.sleep(0.2)
        assert len(rounds) == played  # no round after stop() returned


@WORKERS
def test_stop_never_saves_while_a_round_is_still_running(tiny_target_dir, tmp_path, monkeypatch, max_batch):
    """A worker stuck in a round past stop's timeout: stop does not read the policy under it (the file keeps the
    last whole request's state); the worker, once the round ends, cancels, saves what it learnt and exits."""
    state = tmp_path / "state.json"
    with RunningServer(["--target", tiny_target_dir, "--arms", ARMS, "--state-file", str(state),
                        "--threads", "1", "--max-batch", max_batch]) as s:
        assert httpx.post(s.url + "/v1/completions", json=_small(s), timeout=30).status_code == 200
        before = state.read_bytes()
        assert json.loads(before)["requests"] == 1
        inside, release = threading.Event(), threading.Event()

        def stuck_in(real):
            def stuck(*args):
                inside.set()
                release.wait(30)
                return real(*args)
            return stuck

        _wrap_round(s, monkeypatch, stuck_in)
        with ThreadPoolExecutor(1) as pool:
            try:
                fut = pool.submit(httpx.post, s.url + "/v1/completions", json=_small(s, max_tokens=50), timeout=60)
                assert inside.wait(20)
                saved = s.worker.stop(timeout=0.3)
                assert s.worker.alive() and state.read_bytes() == before  # not saved: the round is still running
                assert saved is False
            finally:
                release.set()
            resp = fut.result()
        s.worker._thread.join(30)
        assert not s.worker.alive()
        assert resp.status_code == 503 and "shutting down" in _error(resp)["message"]
        assert json.loads(state.read_text())["requests"] == 2  # saved whole, by the worker, after its round


def test_the_state_file_is_fsynced_before_it_is_renamed_in(srv, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name an fsynced file descriptor")
    trail = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        trail.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def spy_replace(src, dst, *a, **k):
        trail.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    srv.worker.save_state()
    target = os.path.realpath(srv.worker.state_file)
    renames = [i for i, e in enumerate(trail) if e[0] == "replace" and e[2] == target]
    assert len(renames) == 1, trail
    tmp = trail[renames[0]][1]
    assert ("fsync", tmp) in trail[:renames[0]], trail  # the data is on disk before the name points at it
    assert ("fsync", os.path.dirname(target)) in trail[renames[0]:], trail  # …and so is the rename
