"""`decode serve --max-batch B` (issue 32 §3): requests decode together, continuously batched, over real HTTP.
Concurrent greedy requests each equal HF generate token for token whatever their batch-mates do; a row's stop
sequence, disconnect or subset of arms is its own; seeded sampling does not depend on the batch-mates; /metrics
reports the batch's size and goodput; the carried policy learns from every row; what cannot batch is refused
with the fix."""
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from decode.commands.serve.command import RunningServer
from decode.common.errors import UserError
from helpers import SERVE_ARMS
from test_serve import PROMPTS, client, reference

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from decode.core.models import load_model
    return load_model(tiny_target_dir)


@pytest.fixture(scope="module")
def server(tiny_target_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("serve_batch") / "state.json"
    with RunningServer(["--target", tiny_target_dir, "--arms", SERVE_ARMS, "--policy", "ucbspec:carry=true",
                        "--max-batch", "4", "--state-file", str(state), "--threads", "1"]) as s:
        yield s


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(r"^%s(?:\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else 0.0


def _concurrently(fn, n):
    """``fn(i)`` for i < n, all started together (a barrier), so they share rounds."""
    gate = threading.Barrier(n)

    def run(i):
        gate.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_concurrent_greedy_requests_share_rounds_and_each_equals_hf_generate(server, target):
    from decode.commands.serve.worker import BatchWorker

    assert isinstance(server.worker, BatchWorker) and server.worker.max_batch == 4
    refs = {p: reference(target, [{"role": "user", "content": p}], 20)[1] for p in PROMPTS}
    rounds0, rows0 = _metric(server, "adaspec_batch_rounds_total"), _metric(server, "adaspec_batch_rows_total")
    prefill0 = _metric(server, "adaspec_prefill_seconds_total")
    learnt0 = server.worker.requests_learnt
    c = client(server, timeout=120)

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        return p, c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": p}],
                                            max_tokens=20, temperature=0,
                                            extra_body={"adaspec": {"return_token_ids": True}})

    results = _concurrently(one, 8)
    for p, r in results:
        assert r.model_extra["adaspec"]["token_ids"] == refs[p], p
    rounds = _metric(server, "adaspec_batch_rounds_total") - rounds0
    rows = _metric(server, "adaspec_batch_rows_total") - rows0
    assert rows / rounds > 1.5  # rounds were shared: one forward advanced several requests
    assert max(r.model_extra["adaspec"]["batch_size_mean"] for _, r in results) > 1
    assert _metric(server, "adaspec_goodput_tokens_per_second") > 0
    assert _metric(server, "adaspec_prefill_seconds_total") > prefill0  # the joins' prefills are counted
    assert server.worker.requests_learnt == learnt0 + 8  # every row's rounds taught the carried policy
    assert _metric(server, "adaspec_running") == 0 and not server.worker.batch.rows  # every row left


def test_a_rows_stop_sequence_and_disconnect_are_its_own(server, target):
    _, tok = target
    c = client(server, timeout=120)
    poem = [{"role": "user", "content": "Write a poem about the sea"}]
    full = c.chat.completions.create(model=server.model, messages=poem, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    refs = {p: reference(target, [{"role": "user", "content": p}], 24)[1] for p in PROMPTS[1:4]}
    cancelled0 = _metric(server, 'adaspec_requests_total{endpoint="completions",outcome="cancelled"}')

    def one(i):
        if i == 0:  # stops at its stop sequence, mid-flight
            r = c.chat.completions.create(model=server.model, messages=poem, max_tokens=24, temperature=0, stop=[stop])
            return r.choices[0].finish_reason, r.choices[0].message.content
        if i == 1:  # hangs up after its first chunk
            body = {"model": server.model, "prompt": "Write a poem about the sea", "max_tokens": 400,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        return "hung up", None
        p = PROMPTS[i]
        r = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": p}], max_tokens=24,
                                      temperature=0, extra_body={"adaspec": {"return_token_ids": True}})
        return p, r.model_extra["adaspec"]["token_ids"]

    out = _concurrently(one, 4)
    assert out[0] == ("stop", text[:text.index(stop)])
    assert out[1][0] == "hung up"
    for p, ids in out[2:]:
        assert ids == refs[p], p
    deadline = time.monotonic() + 20
    while _metric(server, 'adaspec_requests_total{endpoint="completions",outcome="cancelled"}') == cancelled0:
        assert time.monotonic() < deadline, "the hung-up row never left the batch"
        time.sleep(0.05)
    deadline = time.monotonic() + 20
    while server.worker.batch.rows:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_seeded_sampling_does_not_depend_on_the_batch_mates(server):
    c = client(server, timeout=120)
    kw = dict(model=server.model, prompt="Write a poem about the sea", max_tokens=16, temperature=0.9, top_p=0.95,
              seed=11, extra_body={"adaspec": {"return_token_ids": True}})
    alone = c.completions.create(**kw).model_extra["adaspec"]["token_ids"]

    def one(i):
        if i == 0:
            return c.completions.create(**kw).model_extra["adaspec"]["token_ids"]
        return c.completions.create(model=server.model, prompt=PROMPTS[i], max_tokens=16, temperature=0.7,
                                    seed=i).usage.completion_tokens

    got = _concurrently(one, 4)
    assert got[0] == alone


def test_a_request_may_name_its_own_arms_in_the_batch(server):
    before = server.worker.requests_learnt
    r = client(server).chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hi"}],
                                               max_tokens=10, temperature=0,
                                               extra_body={"adaspec": {"arms": ["suffix@6"]}})
    info = r.model_extra["adaspec"]
    assert info["arm_set"] == ["suffix@6"] and set(info["arms_played"]) == {"suffix@6"} and info["policy"] == "fixed"
    assert server.worker.requests_learnt == before


def test_eagle_heads_batch_and_stay_lossless_and_seeded(tiny_target_dir, target, tmp_path):
    """A pool with an EAGLE head and a union of it with prompt lookup (the shipped pool's kinds) batches: the rows that
    play the head (alone or in the union's tree) draft in one head forward per position; greedy rows equal HF
    generate, and a seeded sampled row (its EAGLE drafts sampled from its own generator) draws the same tokens alone
    and among batch-mates — with fixed lengths: a joint length (``cost``) depends on the batch, and another draft
    length consumes other random numbers (the same distribution)."""
    from decode.choose.heads import EagleHead, save_head
    from decode.commands.serve.worker import BatchWorker

    model, _ = target
    head = tmp_path / "eagle"
    save_head(EagleHead(model, init="last_layer"), head)
    arms = f"eagle:path={head},L=2;pld:L=4;union:arms=eagle:path={head}:L=2+pld:L=4,nodes=5"
    with RunningServer(["--target", tiny_target_dir, "--arms", arms, "--policy", "random", "--max-batch", "4",
                        "--batch-length", "fixed", "--state-file", "none", "--threads", "1"]) as s:
        assert isinstance(s.worker, BatchWorker)
        refs = {p: reference(target, [{"role": "user", "content": p}], 20)[1] for p in PROMPTS[:4]}
        c = client(s, timeout=120)

        def greedy(i):
            p = PROMPTS[i % 4]
            r = c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": p}], max_tokens=20,
                                          temperature=0, extra_body={"adaspec": {"return_token_ids": True}})
            return p, r.model_extra["adaspec"]

        out = _concurrently(greedy, 6)
        for p, info in out:
            assert info["token_ids"] == refs[p], p
        assert any("eagle@2" in info["arms_played"] for _, info in out)
        assert any(any(a.startswith("union") for a in info["arms_played"]) for _, info in out)  # trees batch too
        assert max(info["batch_size_mean"] for _, info in out) > 1
        kw = dict(model=s.model, prompt="Write a poem about the sea", max_tokens=16, temperature=0.9, seed=7,
                  extra_body={"adaspec": {"return_token_ids": True}})
        alone = c.completions.create(**kw).model_extra["adaspec"]["token_ids"]
        got = _concurrently(lambda i: c.completions.create(**kw).model_extra["adaspec"]["token_ids"] if i == 0 else
                            c.completions.create(model=s.model, prompt=PROMPTS[i], max_tokens=16, temperature=0.7,
                                                 seed=i).usage.completion_tokens, 3)
        assert got[0] == alone


def test_what_cannot_batch_is_refused_or_served_one_at_a_time(tiny_target_dir):
    drafter = f"{SERVE_ARMS};drafter:path={tiny_target_dir},L=2,K=2"  # K sampled chains: serial only
    with pytest.raises(UserError, match="--max-batch 2: .*model-free arms.*--max-batch 1"):
        RunningServer(["--target", tiny_target_dir, "--arms", drafter, "--max-batch", "2", "--state-file", "none",
                       "--threads", "1"])
    with RunningServer(["--target", tiny_target_dir, "--arms", drafter, "--state-file", "none", "--threads",
                        "1"]) as s:
        assert "--max-batch auto: 1, one request at a time" in s.log.getvalue()
    for bad in ("0", "many"):
        with pytest.raises(UserError, match="--max-batch must be auto or an integer >= 1"):
            RunningServer(["--target", tiny_target_dir, "--max-batch", bad])
    with pytest.raises(UserError, match="--batch-length"):
        RunningServer(["--target", tiny_target_dir, "--batch-length", "sometimes"])


def test_auto_measures_the_batch_size_and_the_router_batches(tiny_target_dir, target):
    """The default policy (the router, learning from every arm's counterfactual reward) under --max-batch auto.
    Fixed lengths: under cost lengths whether a round speculates (and so makes counterfactual drafts) is the tiny
    model's timing, which the assertion on counterfactual rewards must not depend on."""
    from decode.commands.serve.worker import BatchWorker

    with RunningServer(["--target", tiny_target_dir, "--arms", SERVE_ARMS, "--state-file", "none",
                        "--threads", "1", "--batch-length", "fixed"]) as s:
        note = re.search(r"--max-batch auto: (\d+) \(one-token forward: 1 rows [0-9]+ ms", s.log.getvalue())
        assert note, s.log.getvalue()
        size = int(note.group(1))
        assert size in (1, 2, 4, 8, 16)
        assert isinstance(s.worker, BatchWorker) == (size > 1)
        c = client(s, timeout=120)
        refs = {p: reference(target, [{"role": "user", "content": p}], 16)[1] for p in PROMPTS[:4]}
        out = _concurrently(lambda i: c.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=16, temperature=0,
            extra_body={"adaspec": {"return_token_ids": True}}), 4)
        for i, r in enumerate(out):
            assert r.model_extra["adaspec"]["token_ids"] == refs[PROMPTS[i]]
        policy = s.worker.policy
        assert policy.name == "router" and policy.n_obs.sum() > sum(len(r.model_extra["adaspec"]["arms_played"])
                                                                     for r in out)  # counterfactual rewards too


def test_a_failed_batched_round_answers_its_rows_500_and_the_server_goes_on(server, monkeypatch):
    real, calls = server.worker.batch.step, []

    def failing():
        calls.append(len(server.worker.batch.rows))
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real()

    monkeypatch.setattr(server.worker.batch, "step", failing)
    c = client(server, timeout=60)

    def one(i):
        try:
            c.completions.create(model=server.model, prompt=PROMPTS[i], max_tokens=30, temperature=0)
            return "ok"
        except openai.InternalServerError as exc:
            return str(exc)

    out = _concurrently(one, 3)
    assert any("internal error while decoding: RuntimeError: injected" in o for o in out), out
    assert not server.worker.batch.rows and not server.worker.flights
    r = c.completions.create(model=server.model, prompt="Name a planet.", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
