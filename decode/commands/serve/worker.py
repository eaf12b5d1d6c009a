"""The one thread that owns the engine: :class:`Worker` decodes queued requests one at a time, in arrival order;
:class:`BatchWorker` (``--max-batch`` > 1) decodes up to that many at once, continuously batched: a request joins
the batch between rounds as soon as a place is free, and leaves it when it ends (EOS, its budget, a stop string,
its client gone, its deadline).

A request (``Job``) carries everything its decode needs (prompt ids, token budget, sampling, seed, stop
strings, an optional arm subset) and a thread-safe event channel back to the HTTP handler waiting on it:
``("text", piece)`` as rounds accept tokens, then ``("done", Result)`` or ``("error", APIError)``. Between
rounds the worker checks every running job's cancel flag (a client that disconnected) and deadline, so a row
leaves the engine within one round.

If the thread dies (an error no request can be answered for, e.g. a fatal ``BaseException``), the request it
was decoding and every queued one fail at once with a 503 naming the reason, new ones are refused with it, and
``down()`` (what ``/health`` reports) says why. ``stop`` refuses new requests, cancels the queued ones and the
running one (it ends at its next round boundary), waits for the thread to end and only then saves the policy
state, so no save ever reads the policy while a round updates it.

Learning across requests: the server's policy is built once (``carry=true`` keeps what it learnt from one
request to the next) and its state is written to the state file after every request and on shutdown, and read
back at start. A request that names its own arm subset gets a fresh policy of the same spec over that subset
(its rounds do not teach the pool's policy, whose arms differ). Batched, the carried policy is one object that
every row's rounds select from and update (what request N learnt steers request N + 1 and its batch-mates).
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...common import metrics as m
from ...core.verify import Verifier
from ...engine.batch import BatchEngine, Row
from ...engine.loop import SpecEngine
from ...common.errors import UserError
from ..generate import IncrementalText, decode_text, decoding_seconds
from ...common.io import atomic_write_json
from ...choose.length import build_length
from ...choose.policies import build_policy
from ...choose.policies.simple import Fixed
from ...choose.policies.state import load_policy_state, policy_state
from ...core.sampling import SamplingConfig
from .metrics import ServerMetrics
from .protocol import APIError

log = logging.getLogger("decode.commands.serve")
STATE_FORMAT = "adaspec-serve-state/1"


@dataclass
class Result:
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    text: str
    token_ids: list[int]
    prompt_tokens: int
    info: dict  # the response's ``adaspec`` field
    cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache held (usage.prompt_tokens_details)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Job:
    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    stops: list[str]
    arms: tuple[int, ...] | None  # indices into the server's arms; None = the whole pool under its policy
    timeout: float
    return_token_ids: bool = False
    arrival: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def deadline(self) -> float:
        return self.arrival + self.timeout

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.events = loop, asyncio.Queue()

    def emit(self, kind: str, payload) -> None:
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop closed in between (server shutting down): nobody is listening
                pass


class StopText:
    """Text handed out so that no stop sequence ever shows: the tail that could still begin one is held back
    until the next piece decides it."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str | None]:
        """(text safe to hand out, the stop sequence found or None); after a stop, nothing more is handed out."""
        buf = self.held + piece
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, stop = min(hits)
            self.held = ""
            return buf[:at], stop
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Reply:
    """One job's text on its way to its client: ids detokenised as they arrive, a stop sequence's possible
    beginning held back, the time of the first piece handed out."""

    def __init__(self, job: Job, decode):
        self.job = job
        self.text, self.stops = IncrementalText(decode), StopText(job.stops)
        self.sent = ""
        self.stop_hit: str | None = None
        self.first: float | None = None

    def push(self, tokens: list[int]) -> bool:
        """Hand out what ``tokens`` complete; whether a stop sequence ended the reply."""
        piece, self.stop_hit = self.stops.feed(self.text.push(tokens))
        self._send(piece)
        return self.stop_hit is not None

    def end(self) -> None:
        """The decoding ended by itself: hand out what was held back for a stop that never came."""
        piece, self.stop_hit = self.stops.feed(self.text.flush())
        self._send(piece + ("" if self.stop_hit is not None else self.stops.flush()))

    def _send(self, piece: str) -> None:
        if piece:
            self.first = self.first or time.monotonic()
            self.sent += piece
            self.job.emit("text", piece)


class Worker:
    """The engine's owner. ``submit`` queues a job (503 when the queue is full, the server is stopping or the
    thread has died); ``start``/``stop`` run the thread; ``stop`` cancels every job, joins, then saves the
    policy state."""

    def __init__(self, engine: SpecEngine, tokenizer, generator: torch.Generator, policy_spec: str, *,
                 metrics: ServerMetrics, max_queue: int = 64, state_file: str | Path | None = None,
                 target: str = "target", seed: int = 0, length: str = "fixed"):
        self.engine, self.tok, self.gen = engine, tokenizer, generator
        # the draft-length controller of the pool's requests, learning across them like a carried policy;
        # a request naming its own arms gets a fresh one (its statistics are per arm)
        self.length_spec = length
        self.length = build_length(length, seed)
        self.labels = [a.label for a in engine.arms]
        self.policy_spec = policy_spec
        self.policy = build_policy(policy_spec, len(self.labels), engine.max_len, seed=seed)
        self.policy_seed = seed
        self.metrics = metrics
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.state_file = Path(state_file) if state_file else None
        self.target = target
        self.requests_learnt = 0
        self._rng = random.Random()
        self._subsets: dict[tuple[int, ...], SpecEngine] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one state write at a time (worker thread vs shutdown)
        # submit vs stop/death: once either has emptied the queue, no job can enter it unanswered
        self._gate = threading.Lock()
        self._active: list[Job] = []  # the jobs being decoded
        self._stopping = False
        self.failure: str | None = None  # why the thread died ("ExceptionType: message"); None while it lives
        self._decode_text = decode_text(tokenizer)
        if self.state_file is not None and self.state_file.exists():
            self._load_state()

    # ---- policy state ----------------------------------------------------------------------------------

    def _state_header(self) -> dict:
        return {"format": STATE_FORMAT, "target": self.target, "arms": self.labels, "policy_spec": self.policy_spec}

    def _load_state(self) -> None:
        path = self.state_file
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"--state-file {path}: unreadable ({exc}); delete it to start learning afresh") from None
        want = self._state_header()
        for key in ("format", "target", "arms", "policy_spec"):
            if saved.get(key) != want[key]:
                raise UserError(f"--state-file {path} was saved with {key} = {saved.get(key)!r}; this server has "
                                f"{want[key]!r}. Pass the same {key.replace('_', ' ')}, another --state-file, or "
                                f"delete the file to start learning afresh")
        load_policy_state(self.policy, saved["policy"], f"--state-file {path}")
        self.requests_learnt = int(saved.get("requests", 0))
        log.info("policy state loaded from %s (%d requests learnt)", path, self.requests_learnt)

    def save_state(self) -> bool:
        """Write the policy's state (atomically and fsynced: a crash mid-write leaves the previous file);
        whether there was a state to write."""
        if self.state_file is None or not self.policy.carry:
            return False
        with self._lock:
            state = {**self._state_header(), "requests": self.requests_learnt, "saved_unix": time.time(),
                     "policy": policy_state(self.policy)}
            atomic_write_json(self.state_file, state)  # fsynced, then renamed in
        return True

    # ---- the queue ---------------------------------------------------------------------------------------

    def arm_indices(self, labels: list[str]) -> tuple[int, ...]:
        unknown = [x for x in labels if x not in self.labels]
        if unknown:
            raise APIError(400, f"adaspec.arms: unknown arm {unknown[0]!r}; this server's arms are "
                                f"{', '.join(self.labels)}", param="adaspec")
        if len(set(labels)) != len(labels):
            raise APIError(400, "adaspec.arms: an arm is named twice", param="adaspec")
        return tuple(sorted(self.labels.index(x) for x in labels))

    def down(self) -> str | None:
        """Why no request can be decoded now (the thread died, the server is stopping, the thread is not
        running), or None while the worker serves."""
        if self.failure is not None:
            return f"the decoding worker died ({self.failure}); restart the server"
        if self._stopping:
            return "the server is shutting down"
        if not self.alive():
            return "the decoding worker is not running"
        return None

    def submit(self, job: Job) -> None:
        with self._gate:
            down = self.down()
            if down is not None:
                raise APIError(503, down, type="server_error", code="worker_unavailable")
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                raise APIError(503, f"the server is busy: {self.queue.maxsize} requests are already waiting; retry "
                                    "later", type="server_error", code="queue_full") from None
        self.metrics.queue.set(self.queue.qsize())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="adaspec-decoder", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _take_all(self) -> list[Job]:
        """Empty the queue (under ``_gate``): the jobs that were waiting."""
        jobs = []
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                jobs.append(job)
        self.metrics.queue.set(0)
        return jobs

    def _fail(self, jobs: list[Job], err: APIError) -> None:
        for job in jobs:
            job.cancelled.set()
            self.metrics.requests.labels(job.endpoint, str(err.status)).inc()
            job.emit("error", err)

    def stop(self, timeout: float = 30.0) -> bool:
        """Refuse new requests, answer the queued ones 503, cancel the running one (it ends at its next round
        boundary, learning what its rounds taught), wait up to ``timeout`` s for the thread to end, then save
        the policy state. The state is not saved while the thread is still running (a round may be updating
        the policy) nor after it died (it may have died mid-update): the file then keeps the last state saved
        after a whole request. Returns whether the state was saved."""
        err = _shutting_down()
        with self._gate:
            self._stopping = True
            queued = self._take_all()
            running = list(self._active)
        self._fail(queued, err)
        for job in running:  # the worker sees it between rounds, counts it cancelled and answers the 503
            job.cancelled.set()
        if self._thread is not None and self._thread.is_alive():
            self.queue.put(None)  # wakes a worker waiting on an empty queue
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the decoding worker did not stop within %g s; the policy state is not saved now "
                            "(the file keeps the state after the last whole request)", timeout)
                return False
        if self.failure is not None:
            log.warning("the decoding worker died (%s); the policy state is not saved (the file keeps the state "
                        "after the last whole request)", self.failure)
            return False
        return self.save_state()

    def _run(self) -> None:
        try:
            self._serve_queue()
        except BaseException as exc:  # the thread is dying: nobody will decode what waits, so answer it now
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        log.critical("the decoding worker died:\n%s", traceback.format_exc())
        reason = type(exc).__name__ + (f": {exc}" if str(exc) else "")
        with self._gate:
            self.failure = reason
            jobs = self._active + self._take_all()
            self._active = []
        self.metrics.running.set(0)
        self._fail(jobs, APIError(503, self.down(), type="server_error", code="worker_unavailable"))

    def _admit(self, job: Job) -> bool:
        """Whether a job taken from the queue is still to be decoded (else it is answered or counted here)."""
        if self._stopping:  # taken after stop emptied the queue
            self._fail([job], _shutting_down())
            return False
        if job.cancelled.is_set():  # its client left while it waited
            self.metrics.requests.labels(job.endpoint, "cancelled").inc()
            return False
        if time.monotonic() > job.deadline:
            self.metrics.requests.labels(job.endpoint, "timeout").inc()
            job.emit("error", _timeout(job))
            return False
        return True

    def _interrupted(self, job: Job) -> str | None:
        """Between rounds: "cancelled" (its client left, or the server stops), "timeout", or None to go on."""
        if job.cancelled.is_set() or self._stopping:
            return "cancelled"
        if time.monotonic() > job.deadline:
            return "timeout"
        return None

    def _answer_failure(self, job: Job, exc: Exception) -> None:
        """A bug must not kill the server: the job gets a 500 (or the APIError it raised) and decoding goes on."""
        if not isinstance(exc, APIError):
            log.error("decoding failed:\n%s", traceback.format_exc())
            exc = APIError(500, f"internal error while decoding: {type(exc).__name__}: {exc}", type="server_error")
        self.metrics.requests.labels(job.endpoint, str(exc.status)).inc()
        job.emit("error", exc)

    def _serve_queue(self) -> None:
        while True:
            job = self.queue.get()
            self.metrics.queue.set(self.queue.qsize())
            if job is None:
                return
            if not self._admit(job):
                continue
            self.metrics.running.set(1)
            self._active = [job]
            try:
                self._decode(job)
            except Exception as exc:
                self._answer_failure(job, exc)
            self._active = []  # not on a BaseException: _die answers the job it was decoding
            self.metrics.running.set(0)

    # ---- one request -------------------------------------------------------------------------------------

    def _engine_for(self, job: Job):
        if job.arms is None:
            return self.engine, self.policy, self.policy_spec
        eng = self._subsets.get(job.arms)
        if eng is None:
            base = self.engine
            eng = SpecEngine(base.target, [base.arms[i] for i in job.arms], base.verifier, base.eos,
                             step_time=base.step_time)
            self._subsets[job.arms] = eng
        return (eng, *self._subset_policy(len(job.arms), eng.max_len))

    def _subset_policy(self, n: int, max_len: int):
        """(policy, its spec) for a request naming its own ``n`` arms: that arm fixed, or a fresh policy of the
        server's spec over them (their rounds do not teach the pool's policy)."""
        if n == 1:
            return Fixed(1, max_len), "fixed"
        return build_policy(self.policy_spec, n, max_len, seed=0), self.policy_spec

    def _decode(self, job: Job) -> None:
        engine, policy, spec = self._engine_for(job)
        labels = [a.label for a in engine.arms]
        engine.set_sampling(job.sampling)
        self.gen.manual_seed(self._seed(job))
        start = time.monotonic()
        length = self.length if job.arms is None else build_length(self.length_spec, self.policy_seed)
        t = time.perf_counter()
        state = engine.begin(job.prompt_ids, policy, job.max_tokens, length)
        self.metrics.prefill(time.perf_counter() - t, engine.target.prefix_reused)
        reply = Reply(job, self._decode_text)
        outcome = None
        while not state.done:
            outcome = self._interrupted(job)
            if outcome is not None:
                break
            t = time.perf_counter()
            r = engine.step(state)
            self.metrics.round(r.record, labels[r.arm])
            self.metrics.batch_round(1, len(r.tokens), time.perf_counter() - t)
            if reply.push(r.tokens):
                break
        g = engine.finish(state)
        self._conclude(reply, list(g.tokens), outcome, g.stopped_by, g.rounds, labels, spec,
                       seconds=decoding_seconds(g), start=start, learnt=job.arms is None and policy.carry,
                       cached=engine.target.prefix_reused)

    def _seed(self, job: Job) -> int:
        return job.seed if job.seed is not None else self._rng.getrandbits(63)

    def _conclude(self, reply: Reply, tokens: list[int], outcome: str | None, stopped_by: str, rounds: list,
                  labels: list[str], spec: str, *, seconds: float, start: float, learnt: bool,
                  cached: int = 0, extra: dict | None = None) -> None:
        """A job's decoding ended (``outcome`` None: by itself or a stop sequence; "cancelled"; "timeout"): count
        it, save what the carried policy learnt, and answer its client."""
        job = reply.job
        if outcome is None and reply.stop_hit is None:
            reply.end()
        generated = len(tokens)
        if reply.stop_hit is not None:  # the tokens that made the text up to the end of the stop sequence
            tokens = self._tokens_through(tokens, len(reply.sent) + len(reply.stop_hit))
        forwards = len(rounds) + sum(r.extra_target_forwards for r in rounds)
        self.metrics.generation(len(job.prompt_ids), generated, forwards, seconds)
        if learnt:
            self.requests_learnt += 1
            self.save_state()
        if outcome == "timeout":
            job.emit("error", _timeout(job))
            self.metrics.requests.labels(job.endpoint, "timeout").inc()
            return
        if outcome == "cancelled":
            self.metrics.requests.labels(job.endpoint, "cancelled").inc()
            if self._stopping:  # cancelled by stop(): its client (if still there) hears why
                job.emit("error", _shutting_down())
            return
        end = time.monotonic()
        self.metrics.latency.observe(end - job.arrival)
        self.metrics.first_token.observe((reply.first or end) - job.arrival)
        reason = "stop" if reply.stop_hit is not None or stopped_by == "eos" else "length"
        pulls = m.pull_counts([r.arm for r in rounds], labels)
        info = {"mat": round(m.mat(generated, forwards), 4), "target_forwards": forwards,
                "rounds": len(rounds), "policy": spec, "arm_set": labels,
                "arms": {k: v for k, v in pulls.items() if v}, "arms_played": [labels[r.arm] for r in rounds],
                "decode_seconds": round(seconds, 4), "tokens_per_s": round(m.tokens_per_s(generated, seconds), 2),
                "queue_seconds": round(start - job.arrival, 4), **(extra or {})}
        if job.return_token_ids:
            info["token_ids"] = tokens
        self.metrics.requests.labels(job.endpoint, "ok").inc()
        job.emit("done", Result(reason, reply.sent, tokens, len(job.prompt_ids), info, cached))

    def _tokens_through(self, tokens: list[int], chars: int) -> list[int]:
        """The shortest prefix of ``tokens`` whose text reaches ``chars`` characters (a longer prefix's text
        extends a shorter one's, so its length grows with the prefix: bisect)."""
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode_text(tokens[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return tokens[:lo]


@dataclass
class Flight:
    """A job decoding in the batch: its row, its reply, and what its answer reports."""

    job: Job
    row: Row
    reply: Reply
    labels: list[str]
    spec: str
    learns: bool  # its rounds teach the server's carried policy
    start: float  # time.monotonic() when it joined the batch
    rows_seen: int = 0  # Σ over its rounds of the batch's rows (its mean batch size = rows_seen / rounds)
    cached: int = 0  # prompt tokens its join took from the prefix cache


class BatchWorker(Worker):
    """Continuous batching (``decode serve --max-batch B``): up to B requests decode together, one target forward
    per round for all of them (decode/engine/batch.py). Between rounds the worker admits waiting requests into
    free places (each is prefilled as it joins), drops rows whose client left, whose deadline passed or whose
    text reached a stop sequence, and answers the rows that ended. Every row has its own arm instances (model-free
    arms keep per-sequence state; EAGLE arms share their head, drafted batched), its own verifier (the request's
    sampling, a generator seeded by the request's seed that its sampled drafts draw from too, so with its own draft
    lengths its tokens do not depend on its batch-mates; a joint length does) and either the server's carried
    policy or a fresh one (a request naming its own arm subset, or a policy without carry=true)."""

    def __init__(self, engine: SpecEngine, batch: BatchEngine, make_arms, tokenizer, generator: torch.Generator,
                 policy_spec: str, *, max_batch: int, **kw):
        super().__init__(engine, tokenizer, generator, policy_spec, **kw)
        if max_batch < 1:
            raise UserError(f"--max-batch must be >= 1, got {max_batch}")
        self.batch, self.make_arms, self.max_batch = batch, make_arms, max_batch
        self.flights: dict[int, Flight] = {}

    def _serve_queue(self) -> None:
        closing = False
        while True:
            t0 = time.perf_counter()
            while not closing and len(self.flights) < self.max_batch:
                try:  # wait for work only when nothing is decoding
                    job = self.queue.get(block=not self.flights)
                except queue.Empty:
                    break
                self.metrics.queue.set(self.queue.qsize())
                if job is None:  # stop(): the running rows were cancelled and end at the checks below
                    closing = True
                elif self._admit(job):
                    self._join(job)
            if closing and not self.flights:
                return
            for rid, f in list(self.flights.items()):
                outcome = self._interrupted(f.job)
                if outcome is not None:
                    self.batch.remove(rid)
                    self._land(rid, outcome)
            if not self.flights:
                continue
            rows = list(self.batch.rows)
            try:
                finished = {r.rid for r in self.batch.step()}
            except Exception as exc:  # the batch's state is unknown now: it is emptied, then every row in it answered
                failed = list(self.flights.values())
                for r in list(self.batch.rows):
                    self.batch.remove(r.rid)
                self.flights.clear()
                self._set_active()
                for f in failed:
                    self._answer_failure(f.job, exc)
                continue
            self.metrics.batch_round(len(rows), sum(len(r.last) for r in rows), time.perf_counter() - t0)
            for r in rows:
                f = self.flights[r.rid]
                f.rows_seen += len(rows)
                self.metrics.round(r.rounds[-1], f.labels[r.rounds[-1].arm])
                if f.reply.push(r.last) and r.rid not in finished:  # a stop sequence: the row leaves now
                    self.batch.remove(r.rid, remember=True)
                    finished.add(r.rid)
                if r.rid in finished:
                    self._land(r.rid, None)

    def _set_active(self) -> None:
        self._active = [f.job for f in self.flights.values()]
        self.metrics.running.set(len(self.flights))

    def _join(self, job: Job) -> None:
        """Prefill the job's row and put it in the batch (a failure is the job's alone)."""
        try:
            arms = self.make_arms()
            if job.arms is None:
                labels, spec, learns = self.labels, self.policy_spec, self.policy.carry
                policy = self.policy if self.policy.carry else build_policy(self.policy_spec, len(arms),
                                                                            self.engine.max_len, seed=self.policy_seed)
            else:
                arms = [arms[i] for i in job.arms]
                labels, learns = [a.label for a in arms], False
                policy, spec = self._subset_policy(len(arms), max(a.L for a in arms))
            gen = torch.Generator().manual_seed(self._seed(job))  # the verifier draws its uniforms on the CPU
            for a in arms:
                a.set_sampling(job.sampling)
                for part in a.parts:  # an arm that samples its drafts (EAGLE; a union's) draws from the row's own too
                    if hasattr(part, "generator"):
                        part.generator = gen
            verifier = Verifier(job.sampling, self.engine.verifier.backend, gen)
            t = time.perf_counter()
            rid = self.batch.add(job.prompt_ids, job.max_tokens, arms=arms, policy=policy, verifier=verifier)
            self.metrics.prefill(time.perf_counter() - t, self.batch.prefix_reused)
        except Exception as exc:
            self._answer_failure(job, exc)
            return
        row = self.batch.rows[-1]
        self.flights[rid] = Flight(job, row, Reply(job, self._decode_text), labels, spec, learns, time.monotonic(),
                                   cached=self.batch.prefix_reused)
        self._set_active()

    def _land(self, rid: int, outcome: str | None) -> None:
        """The row ``rid`` has left the batch: answer its job."""
        f = self.flights.pop(rid)
        self._set_active()
        r = f.row
        rounds = len(r.rounds)
        self._conclude(f.reply, list(r.tokens), outcome, r.stopped_by, r.rounds, f.labels, f.spec,
                       seconds=r.finished - r.joined, start=f.start, learnt=f.learns, cached=f.cached,
                       extra={"batch_size_mean": round(f.rows_seen / rounds, 3) if rounds else 0.0})


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


def _timeout(job: Job) -> APIError:
    return APIError(504, f"the request took longer than the server's --request-timeout of {job.timeout:g} s",
                    type="timeout_error", code="timeout")
