"""`decode serve` over real HTTP on loopback: the official openai client, streaming and not, greedy output equal
to HF generate token for token, every bad input answered 4xx (never a 500, never a dead server), a client that
disconnects mid-stream freeing the engine, a bounded concurrent load, timeouts, per-request arm subsets, and
the policy's state surviving a restart (decode/commands/serve/)."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from decode.core.models import load_model
from decode.evaluation.peers import hf_generate
from decode.core.sampling import SamplingConfig
from decode.commands.serve.command import RunningServer
from decode.evaluation.suites import encode_messages

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Say hi", "Write a poem about the sea", "def add(a, b):", "List three colours.", "What is 2 + 2?",
           "Translate 'cat' to French.", "Summarise: the cat sat on the mat.", "Name a planet."]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    model, tok = load_model(tiny_target_dir)
    return model, tok


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def reference(target, messages, n):
    model, tok = target
    ids = encode_messages(tok, messages)
    tokens, _, stopped = hf_generate(model, ids, n, SamplingConfig(), [tok.eos_token_id], tok.eos_token_id)
    return ids, tokens


def test_chat_and_completion_greedy_equal_hf_generate(server, target):
    _, tok = target
    c = client(server)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    ids, ref = reference(target, msgs, 20)
    r = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=20, temperature=0,
                                  extra_body={"adaspec": {"return_token_ids": True}})
    info = r.model_extra["adaspec"]
    assert info["token_ids"] == ref
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    assert r.usage.total_tokens == len(ids) + len(ref) and r.object == "chat.completion"
    assert info["rounds"] == len(info["arms_played"]) and set(info["arms"]) <= {"pld@4", "suffix@6"}
    assert info["mat"] == pytest.approx(len(ref) / info["target_forwards"], abs=1e-3)

    # streamed: the deltas concatenate to the same text; the usage chunk comes last
    chunks = list(c.chat.completions.create(model=server.model, messages=msgs, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)

    # text completions: a string prompt is the tokenizer's ids; token-id prompts are taken as they are
    prompt_ids = tok("def add(a, b):")["input_ids"]
    model = target[0]
    ref2, _, _ = hf_generate(model, prompt_ids, 12, SamplingConfig(), [tok.eos_token_id], tok.eos_token_id)
    for prompt in ("def add(a, b):", prompt_ids):
        r2 = c.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"adaspec": {"return_token_ids": True}})
        assert r2.model_extra["adaspec"]["token_ids"] == ref2 and r2.object == "text_completion"
        assert r2.choices[0].text == tok.decode(ref2, skip_special_tokens=True)
    pieces = list(c.completions.create(model=server.model, prompt="def add(a, b):", max_tokens=12, temperature=0,
                                       stream=True))
    assert "".join(p.choices[0].text for p in pieces) == r2.choices[0].text
    assert len(pieces) > 2  # chunk by chunk as rounds accept tokens, not one blob at the end


def test_stop_sequences_cut_the_text_and_count_tokens_through_the_stop(server, target):
    _, tok = target
    c = client(server)
    full = c.completions.create(model=server.model, prompt="Write a poem about the sea", max_tokens=24,
                                temperature=0, extra_body={"adaspec": {"return_token_ids": True}})
    text, ids = full.choices[0].text, full.model_extra["adaspec"]["token_ids"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop in text
    for stream in (False, True):
        kw = dict(model=server.model, prompt="Write a poem about the sea", max_tokens=24, temperature=0, stop=[stop],
                  extra_body={"adaspec": {"return_token_ids": True}})
        if stream:
            got = "".join(p.choices[0].text for p in c.completions.create(stream=True, **kw))
        else:
            r = c.completions.create(**kw)
            got = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
            kept = r.model_extra["adaspec"]["token_ids"]
            assert kept == ids[:len(kept)] and stop in tok.decode(kept, skip_special_tokens=True)
            assert stop not in tok.decode(kept[:-1], skip_special_tokens=True)
            assert r.usage.completion_tokens == len(kept)
        assert got == text[:text.index(stop)]


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6},
     400, "context"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400,
     "temperature"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "bogus": 1}, 400,
     "bogus: unknown field"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n is not"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi"}],
                              "adaspec": {"arms": ["eagle@9"]}}, 400, "unknown arm"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "nope"),
    ("/v1/completions", {"model": "M", "prompt": "x " * 600, "max_tokens": 4}, 400, "context"),
    ("/v1/completions", {"model": "M", "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": "M", "prompt": [10 ** 7]}, 400, "vocabulary"),
    ("/v1/completions", {"model": "M", "prompt": ["a", "b"]}, 400, "batch"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/nothing", {}, 404, "Not Found"),
    # what json.loads raises besides JSONDecodeError, and strings that are not Unicode text: 400s, never a 500
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "not valid JSON"),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
    ("/v1/completions", {"model": "M", "prompt": "\ud800"}, 400, "prompt: a lone UTF-16 surrogate"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "\udfff"}]}, 400,
     "messages.0.content: a lone UTF-16 surrogate"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "\ud800": 1}, 400, "surrogate"),
])
def test_bad_input_is_a_4xx_with_an_openai_error_body(server, path, body, status, needle):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": server.model}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    assert needle in _error(resp)["message"]
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"  # still serving


def test_a_client_that_disconnects_mid_stream_frees_the_engine(server):
    def count(outcome):
        text = httpx.get(server.url + "/metrics", timeout=10).text
        m = re.search(r'adaspec_requests_total\{endpoint="completions",outcome="%s"\} ([0-9.]+)' % outcome, text)
        return float(m.group(1)) if m else 0.0

    before = count("cancelled")
    body = {"model": server.model, "prompt": "Write a poem about the sea", "max_tokens": 480, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 20
    while count("cancelled") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count("cancelled") == before + 1
    r = client(server).completions.create(model=server.model, prompt="Name a planet.", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4  # the engine is free and answers


def test_bounded_load_50_requests_from_8_clients(server, target):
    """No error, no lost or duplicated request, every greedy output equal to HF generate's."""
    refs = {p: reference(target, [{"role": "user", "content": p}], 16)[1] for p in PROMPTS}
    c = client(server, timeout=120)
    latencies = []

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        t0 = time.perf_counter()
        r = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": p}], max_tokens=16,
                                      temperature=0, user=f"req-{i}",
                                      extra_body={"adaspec": {"return_token_ids": True}})
        latencies.append(time.perf_counter() - t0)
        return i, p, r

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(50)))
    assert sorted(i for i, _, _ in results) == list(range(50))
    assert len({r.id for _, _, r in results}) == 50
    for i, p, r in results:
        assert r.model_extra["adaspec"]["token_ids"] == refs[p], (i, p)
    q = statistics.quantiles(latencies, n=20)
    print(f"\n50 requests, 8 clients: p50 {statistics.median(latencies):.3f} s, p95 {q[18]:.3f} s")


def test_a_request_may_name_its_own_arms(server):
    before = server.worker.requests_learnt
    r = client(server).chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hi"}],
                                               max_tokens=10, temperature=0,
                                               extra_body={"adaspec": {"arms": ["suffix@6"]}})
    info = r.model_extra["adaspec"]
    assert info["arm_set"] == ["suffix@6"] and set(info["arms_played"]) == {"suffix@6"} and info["policy"] == "fixed"
    assert server.worker.requests_learnt == before  # a subset request does not teach the pool's policy


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    kw = dict(model=server.model, prompt="Write a poem about the sea", max_tokens=16, temperature=0.9, top_p=0.95,
              extra_body={"adaspec": {"arms": ["pld@4"], "return_token_ids": True}})
    a, b = (c.completions.create(seed=7, **kw) for _ in range(2))
    assert a.model_extra["adaspec"]["token_ids"] == b.model_extra["adaspec"]["token_ids"]


def test_metrics_and_models(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    client(server).completions.create(model=server.model, prompt="Say hi", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("adaspec_requests_total", "adaspec_generation_tokens_total", "adaspec_mean_accepted_tokens",
                 "adaspec_acceptance_rate", "adaspec_arm_pulls_total", "adaspec_tokens_per_second",
                 "adaspec_queue_length"):
        assert name in text, name
    assert float(re.search(r"^adaspec_prefill_seconds_total ([0-9.e+-]+)$", text, re.M).group(1)) > 0


def test_a_request_past_the_timeout_is_a_504_and_the_server_goes_on(tiny_target_dir):
    with RunningServer(["--target", tiny_target_dir, "--arms", "pld:L=4", "--state-file", "none",
                        "--request-timeout", "0.05", "--threads", "1"]) as s:
        resp = httpx.post(s.url + "/v1/completions", json={"model": s.model, "prompt": "Say hi", "max_tokens": 480,
                                                           "temperature": 0}, timeout=30)
        assert resp.status_code == 504 and _error(resp)["code"] == "timeout"
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


# ---- learning across requests and restarts ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo_target_dir(tmp_path_factory, smol_path):
    """A tiny model that repeats its last token: prompt lookup's drafts are accepted, an empty draft never is, so
    the better arm is known and a router's choices are deterministic."""
    from transformers import AutoTokenizer
    from helpers import tiny_llama
    d = tmp_path_factory.mktemp("echo_target")
    tok = AutoTokenizer.from_pretrained(smol_path)
    m = tiny_llama(vocab=len(tok), hidden=64, layers=2, seed=5)
    with torch.no_grad():
        for layer in m.model.layers:  # no attention or MLP output: the next token depends on the last one only
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(m.model.embed_tokens.weight * 10)  # …and is (nearly always) that same token
    m.config.eos_token_id = tok.eos_token_id
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _first_rounds(s, prompt="Say hi", n=4):
    r = client(s).chat.completions.create(model=s.model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=24, temperature=0)
    return r.model_extra["adaspec"]["arms_played"][:n]


def test_policy_state_survives_a_restart_and_steers_the_next_request(echo_target_dir, tmp_path):
    state = tmp_path / "state.json"
    # --batch-length fixed: the rounds play what the policy chose; with the cost length, the engine's own per-process
    # learning (block costs and their correction from wall-clock rounds, Thompson draws of acceptance: not in the
    # state file) may make a round plain in one server and not in the other
    args = ["--target", echo_target_dir, "--arms", "none;pld:L=4", "--policy", "router:carry=true", "--threads", "1",
            "--batch-length", "fixed"]
    with RunningServer(args + ["--state-file", str(state)]) as a:
        first = _first_rounds(a)
        assert first[0] == "none"  # nothing learnt yet: the router tries arm 0 first
        for p in PROMPTS[:3]:
            _first_rounds(a, p)
        learnt = json.loads(state.read_text())  # written after every request
        assert learnt["requests"] == 4
        after = _first_rounds(a)  # request N + 1 on the running server
    assert json.loads(state.read_text())["requests"] == 5
    state.write_text(json.dumps(learnt))  # back to what requests 1..N taught
    with RunningServer(args + ["--state-file", str(state)]) as b:
        assert b.worker.requests_learnt == 4
        assert _first_rounds(b) == after  # the restarted server chooses as the one that never stopped
    assert after[0] == "pld@4"  # …which is what requests 1..N taught: prompt lookup pays here
    with RunningServer(args + ["--state-file", "none"]) as fresh:
        assert _first_rounds(fresh) == first  # without the state: back to trying arm 0
    # a state file from another pool is refused with the fix, before the server starts
    from decode.common.errors import UserError
    with pytest.raises(UserError, match="arms"):
        RunningServer(["--target", echo_target_dir, "--arms", "pld:L=4;none", "--state-file", str(state)]).__enter__()


def test_the_cli_serves_and_saves_its_state_on_ctrl_c(echo_target_dir, tmp_path):
    """`python -m decode serve` as a user starts it: listens, answers, and on SIGINT exits 0 with the state saved."""
    state = tmp_path / "s.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "decode", "serve", "--target", echo_target_dir, "--arms",
                             "none;pld:L=4", "--port", "0", "--state-file", str(state), "--threads", "1",
                             "--log-level", "warning"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"at (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said where it listens"
        body = {"model": echo_target_dir, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(30) == 0, rest
        assert "policy state saved" in rest and json.loads(state.read_text())["requests"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_metrics_count_a_tree_rounds_positions_along_its_depth_not_its_nodes():
    """A fully accepted tree of 6 nodes and depth 3 reached positions 1..3, all accepted; nothing at 4..6."""
    from prometheus_client import generate_latest
    from decode.commands.serve.metrics import ServerMetrics
    from decode.core.draft import RoundRecord
    m = ServerMetrics()
    m.round(RoundRecord(arm=0, drafted=6, accepted=3, new_tokens=4, draft_time=0.0, verify_time=0.0, depth=3), "t")
    m.round(RoundRecord(arm=0, drafted=2, accepted=1, new_tokens=2, draft_time=0.0, verify_time=0.0), "chain")
    text = generate_latest(m.registry).decode()
    drafted = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("adaspec_drafted_at_position_total{")}
    rate = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("adaspec_acceptance_rate{")}
    assert drafted == {"1": 2.0, "2": 2.0, "3": 1.0}
    assert rate == {"1": 1.0, "2": 0.5, "3": 1.0}


def test_one_at_a_time_rounds_take_the_pools_length_controller(tiny_target_dir, target, tmp_path):
    """A pool that names `length: cost` is decoded with it at --max-batch 1 (as `decode generate` does), the
    controller learning across requests; --length overrides it; a bad or misplaced --length is refused."""
    from decode.choose.length import CostAware, LengthController
    from decode.common.errors import UserError

    pool = tmp_path / "pool.yaml"
    pool.write_text("length: cost\narms:\n  - pld:L=4\n  - suffix:L=6\n")
    msgs = [{"role": "user", "content": "Write a poem about the sea"}]
    ids, ref = reference(target, msgs, 24)
    with RunningServer(["--target", tiny_target_dir, "--arms", "", "--pool", str(pool), "--state-file", "none",
                        "--max-batch", "1", "--threads", "1"]) as s:
        assert isinstance(s.worker.length, CostAware) and "draft lengths: cost" in s.log.getvalue()
        # its verification curve was probed at start, before any request: no request waits for the probe
        assert set(range(1, s.worker.engine.max_len + 2)) <= s.worker.engine.cost.sizes()
        for _ in range(2):
            r = client(s).chat.completions.create(model=s.model, messages=msgs, max_tokens=24, temperature=0,
                                                  extra_body={"adaspec": {"return_token_ids": True}})
            assert r.model_extra["adaspec"]["token_ids"] == ref
        assert s.worker.length.curve is s.worker.engine.cost and s.worker.engine.cost.samples()
    with RunningServer(["--target", tiny_target_dir, "--arms", "", "--pool", str(pool), "--state-file", "none",
                        "--max-batch", "1", "--threads", "1", "--length", "fixed"]) as s:
        assert type(s.worker.length) is LengthController
    with pytest.raises(UserError, match="--length: .*sometimes"):
        RunningServer(["--target", tiny_target_dir, "--length", "sometimes"])
    with pytest.raises(UserError, match="--length .*--max-batch 2.*--batch-length"):
        RunningServer(["--target", tiny_target_dir, "--length", "cost", "--max-batch", "2"])
