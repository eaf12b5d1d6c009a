"""Serve the target behind an OpenAI-compatible HTTP API (chat and text completions, streaming, /v1/models,
/health, /metrics), speculating with an arm pool whose policy keeps learning across requests and across
restarts (its state is saved to --state-file after every request and on shutdown).

Defaults: the trained pool that ships for the default target (recipes/pools/pretrained.yaml) under the
per-round router (router:carry=true); other targets get the model-free arms pld:L=4 and suffix:L=6. Requests
wait in a fair first-come queue. With --max-batch B > 1 up to B of them decode together, continuously batched
(decode/engine/batch.py: model-free arms; chains of EAGLE heads, drafters and early-exit layers, an EAGLE head's
chain with its runner-ups, unions of these); with B = 1 one
at a time.
--max-batch auto measures B at start when the arms and policy batch, else serves one at a time and says why.
Stop with Ctrl-C.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import re
import socket
import sys
from pathlib import Path

import torch

from ...common.errors import UserError
from ...evaluation.eval_config import CACHES
from ...core.lean import FORWARD_KINDS
from ...core.linear import LINEAR_KINDS
from ...core.models import DEFAULT_TARGET, cache_dir
from ...choose.policies import build_policy
from ...choose.length import build_length
from ...core.prefix_cache import DEFAULT_MIB as PREFIX_CACHE_MIB, PrefixCache
from ...engine.pools import DEFAULT_POLICY, MODEL_FREE_ARMS, default_pool
from ...core.sampling import SamplingConfig
from ...evaluation.suites import encode_prompt
from ...engine.loop import reads_cost
from ..generate import load_engine
from .limits import BODY_BYTES_PER_TOKEN, BODY_SLACK, default_max_body_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...common.device import DEVICES, DTYPES
    from ...core.verify import BACKENDS
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--arms", help="arm specs separated by ';' (default: the shipped pool for the default target, "
                                  f"else '{MODEL_FREE_ARMS}')")
    p.add_argument("--pool", help="pool YAML whose arms are added to --arms (pass --arms '' for the pool alone)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help="the policy choosing each round's arm; carry=true keeps learning across requests "
                        "(default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 = any free port (default: %(default)s)")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists (default: --target)")
    p.add_argument("--max-model-len", type=int,
                   help="context length in tokens, prompt + completion (default: the model's max_position_embeddings)")
    p.add_argument("--max-batch", default="auto",
                   help="requests decoded together, continuously batched (1 = one at a time). auto: measured at "
                        "start (the largest batch up to 16 whose one-token forward still gains >= 15%% throughput "
                        "over half as many rows) when the arms batch (model-free arms; chains of EAGLE heads, "
                        "drafters and early-exit layers: the shipped pool does), else 1 (default: %(default)s)")
    p.add_argument("--batch-length", default="cost",
                   help="draft lengths of batched rounds: cost (chosen jointly for the batch from the learnt cost "
                        "of its block: speculation backs off as the batch grows), fixed (each arm's L), "
                        "schedule:<B range>=<K>,... or ema:<tiers> (default: %(default)s)")
    p.add_argument("--length",
                   help="draft-length controller of rounds decoded one request at a time (--max-batch 1), as in "
                        "`decode generate`: fixed, beta-ts, cali-ts, cost (default: the pool's `length`, else fixed; "
                        "batched rounds take --batch-length)")
    p.add_argument("--prefix-cache-mib", type=int, default=PREFIX_CACHE_MIB,
                   help="memory for prompts' and answers' KV kept across requests, so a prompt that starts like one "
                        "seen before (a chat's history, a shared system prompt, a retry) prefills only what is new; "
                        "least recently used evicted; 0 = off (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from a request's arrival to its last token, queueing included (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the engine; more are answered 503 (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int,
                   help="the largest request body read, in bytes; a larger one is answered 413 as soon as its "
                        "Content-Length (or what has arrived) passes it, without reading the rest (default: "
                        f"{BODY_BYTES_PER_TOKEN} bytes per token of the context + {BODY_SLACK // 1024} KiB, "
                        f"e.g. {default_max_body_bytes(8192)} for a context of 8192)")
    p.add_argument("--state-file",
                   help="where the policy's learnt state is kept across restarts (default: one file per target, arms "
                        "and policy under ~/.cache/adaspec/serve/; 'none' = do not keep it)")
    p.add_argument("--seed", type=int, default=0, help="the policy's seed (a request's own 'seed' seeds its sampling)")
    p.add_argument("--verifier", default="auto", choices=BACKENDS)
    p.add_argument("--device", default="auto", help=f"{DEVICES} (auto = cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", help=f"auto|{'|'.join(DTYPES)} (auto = bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--cache", choices=("auto", *CACHES), default="auto",
                   help="KV cache kind (auto: static on CUDA or with --compile, prefix on a CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the verification forward (static cache)")
    p.add_argument("--linear", choices=LINEAR_KINDS, default="auto", help="as in `decode eval` (default: %(default)s)")
    p.add_argument("--forward", choices=FORWARD_KINDS, default="auto",
                   help="as in `decode eval` (default: %(default)s)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def check_args(args) -> None:
    """Everything that needs no model."""
    for flag, v, lo in (("--port", args.port, 0), ("--max-queue", args.max_queue, 1), ("--threads", args.threads, 1),
                        ("--max-model-len", args.max_model_len, 2), ("--seed", args.seed, 0),
                        ("--max-body-bytes", args.max_body_bytes, 1), ("--prefix-cache-mib", args.prefix_cache_mib, 0)):
        if v is not None and v < lo:
            raise UserError(f"{flag} must be an integer >= {lo}, got {v}")
    if args.port > 65535:
        raise UserError(f"--port must be <= 65535, got {args.port}")
    max_batch(args)
    from ...engine.batch import parse_length
    try:
        parse_length(args.batch_length)
    except UserError as exc:
        raise UserError(f"--batch-length: {exc}") from None
    if not args.request_timeout > 0:
        raise UserError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.compile and args.cache == "dynamic":
        raise UserError("--compile needs --cache static (a dynamic cache changes shape every round)")
    try:
        build_policy(args.policy, 2, 1)
    except UserError as exc:
        raise UserError(f"--policy: {exc}") from None
    if args.length is not None:
        try:
            build_length(args.length)
        except UserError as exc:
            raise UserError(f"--length: {exc}") from None
        if (max_batch(args) or 1) > 1:
            raise UserError(f"--length sets the draft lengths of requests decoded one at a time; with --max-batch "
                            f"{args.max_batch} rounds are batched: pass --batch-length instead (or --max-batch 1)")


def max_batch(args) -> int | None:
    """--max-batch as a number, None for auto; a bad value is a UserError naming the flag."""
    if str(args.max_batch).lower() == "auto":
        return None
    try:
        value = int(args.max_batch)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"--max-batch must be auto or an integer >= 1, got {args.max_batch!r}")
    return value


def resolve_batching(args, engine, err) -> tuple[int, str]:
    """(the batch size to serve with, how it was chosen). Batched rounds take model-free arms and chains of EAGLE
    heads, drafters and early-exit layers; --max-batch B > 1 with others is an error saying so, auto serves them
    one at a time (and says why)."""
    from ...engine.batch import check_batchable, probe_batch_size

    asked = max_batch(args)
    if asked == 1:
        return 1, "--max-batch 1"
    try:
        check_batchable(engine.arms)
    except UserError as exc:
        if asked is not None:
            raise UserError(f"--max-batch {asked}: {exc}. Serve arms that batch (e.g. --arms '{MODEL_FREE_ARMS}'), "
                            f"or pass --max-batch 1") from None
        return 1, f"--max-batch auto: 1, one request at a time ({exc}); to batch, serve e.g. --arms '{MODEL_FREE_ARMS}'"
    if asked is not None:
        return asked, f"--max-batch {asked}"
    size, seconds = probe_batch_size(engine.target.model)
    ms = ", ".join(f"{b} rows {1000 * t:.0f} ms" for b, t in seconds.items())
    return size, f"--max-batch auto: {size} (one-token forward: {ms})"


def default_state_file(target: str, labels: list[str], policy: str) -> Path:
    key = hashlib.sha256("\n".join([target, *labels, policy]).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(target).name or target).strip("-") or "target"
    return cache_dir() / "serve" / f"{slug}-{key}.json"


def build_server(args, err=sys.stderr):
    """(app, worker, config) for ``args``: the target loaded, the pool built and warmed up, the state loaded."""
    # the HTTP stack loads here, not at import: every decode subcommand's parser imports this module
    from .app import ServeConfig, create_app
    from .metrics import ServerMetrics
    from .worker import BatchWorker, Worker

    check_args(args)
    pool = default_pool(args.target, args.arms, args.pool, err)
    specs, length = pool.arms, args.length or pool.length or "fixed"
    model, tok, engine, gen = load_engine(args, specs, SamplingConfig(), err,
                                          needs_hidden=build_length(length).needs_target_hidden)
    context = args.max_model_len or int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context < 2:
        raise UserError(f"{args.target} declares no max_position_embeddings; pass --max-model-len")
    labels = [a.label for a in engine.arms]
    # one untimed decode: one-off costs (and compiling, with --compile) before the first request, and the
    # step time the throughput reward uses; a fixed arm, so the policy learns nothing from it
    warm = encode_prompt(tok, "Hello")
    info = engine.prepare([len(warm)], 16, show=True)
    if info is not None:
        err.write(f"compiled {info['graphs']} target graph(s) in {info['seconds']:.0f} s\n")
    engine.warm_up(warm, 8, probe_cost=False)  # probed below where a request will read the curve
    batch_size, batch_note = resolve_batching(args, engine, err)
    state = None if (args.state_file or "").lower() == "none" else (
        Path(args.state_file) if args.state_file else default_state_file(args.target, labels, args.policy))
    name = args.served_model_name or args.target
    common = dict(metrics=ServerMetrics(), max_queue=args.max_queue, state_file=state, target=args.target,
                  seed=args.seed)
    store = PrefixCache(args.prefix_cache_mib * 2 ** 20) if args.prefix_cache_mib else None  # after the warm-ups
    if batch_size > 1:
        batch, make_arms = batch_engine(args, specs, model, tok, engine)
        batch.prefix_cache = store
        worker = BatchWorker(engine, batch, make_arms, tok, gen, args.policy, max_batch=batch_size, **common)
    else:
        worker = Worker(engine, tok, gen, args.policy, length=length, **common)
        if reads_cost(worker.policy, worker.length):  # the verification curve probed now, not while the
            engine.seed_cost(warm)  # first request waits (0.8-1.5 s on a 2-core CPU with the shipped pool)
        engine.target.prefix_cache = store
    cfg = ServeConfig(model_name=name, context=context, request_timeout=args.request_timeout,
                      max_body_bytes=args.max_body_bytes)
    notes = [f"arms: {', '.join(labels)}", f"policy: {args.policy}", batch_note]
    if batch_size == 1:
        notes.append(f"draft lengths: {length}")
    notes.append(f"prefix cache: {args.prefix_cache_mib} MiB" if store is not None else "prefix cache: off")
    if not worker.policy.carry:
        notes.append("the policy learns per request only (add carry=true to learn across requests)")
    elif state is not None:
        notes.append(f"state file: {state}" + (f" ({worker.requests_learnt} requests learnt)"
                                                if worker.requests_learnt else " (new)"))
    err.write("; ".join(notes) + "\n")
    return create_app(worker, tok, cfg), worker, cfg


def batch_engine(args, specs: list[str], model, tok, engine):
    """The batched engine over the serial engine's run model (its linears and attention as measured), and the
    factory of one row's arm instances; one untimed batched decode warms it up."""
    from ...choose.arms.base import ArmEnv, build_arms
    from ...engine.batch import BatchEngine
    from ...core.models import pad_token_id

    env = ArmEnv(model, tok, SamplingConfig(), target_name=args.target)

    def make_arms():
        return build_arms(specs, env)

    batch = BatchEngine(engine.target.model, make_arms,
                        lambda K: build_policy(args.policy, K, engine.max_len, seed=args.seed), engine.verifier,
                        engine.eos, pad_id=pad_token_id(tok, sorted(engine.eos)), length=args.batch_length,
                        stock_model=model, seed=args.seed, forward=engine.target.forward_kind)
    warm = encode_prompt(tok, "Hello")
    batch.generate([warm, warm], 4)
    return batch, make_arms


def run(args) -> int:
    import uvicorn

    app, worker, cfg = build_server(args)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port "
                        "(0 = any free one)") from None
    port = sock.getsockname()[1]
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    worker.start()
    print(f"serving {cfg.model_name!r} at http://{args.host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    # no lifespan events (the worker starts and stops here); uvicorn re-raises the Ctrl-C it shut down on
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="off"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if worker.stop():  # cancels what is queued and running, joins the worker, then saves
            print(f"policy state saved to {worker.state_file} ({worker.requests_learnt} requests learnt)",
                  file=sys.stderr)
    return 0


class RunningServer:
    """A server inside this process on a free loopback port, for tests and benchmarks:
    ``with RunningServer(["--target", ..., "--arms", ...]) as s: s.url, s.model, s.worker``. The target loads in
    the constructor; leaving the block stops uvicorn, then the worker (which saves the policy state)."""

    def __init__(self, argv: list[str]):
        import io
        p = argparse.ArgumentParser(prog="decode serve")
        add_arguments(p)
        args = p.parse_args([*argv, "--host", "127.0.0.1", "--port", "0"])
        self._threads = torch.get_num_threads()
        self.log = io.StringIO()
        self.app, self.worker, self.cfg = build_server(args, err=self.log)
        self.model = self.cfg.model_name
        self.url = None

    def __enter__(self) -> "RunningServer":
        import threading
        import time

        import uvicorn
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.worker.start()
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.stop()
        torch.set_num_threads(self._threads)
