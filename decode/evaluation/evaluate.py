"""Evaluate arms and policies against plain HF generate, our own autoregressive loop and peer speculative
decoders (transformers' prompt lookup, assisted generation, early exit), interleaved per prompt on the
same target.

Methods (one decode function each, fed to one loop; the order rotates per prompt so machine noise hits
all alike): ``hf`` (the reference, HF ``generate``), every ``--peers`` spec, ``autoregressive`` (our
engine without speculation), every arm fixed, every policy over the pool, and the per-prompt ``oracle``
(best fixed arm in hindsight, derived from the records at the end). Each finished (method, prompt) record
is appended to records.jsonl beside the report as it completes, so an interrupted run resumes where it
stopped when the same command is run again; report.json and the markdown table are built from the
records at the end (decode/evaluation/report.py, also ``decode report``).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..common import metrics
from ..choose.arms.none import NoSpecArm
from ..common.device import DTYPES
from ..engine.loop import Generation, SpecEngine, build_engine
from ..engine.pools import MODEL_FREE_ARMS
from ..common.errors import UserError
from .eval_config import MAX_SEED, EvalConfig, add_decoding_arguments, check_resume
from ..common.io import JsonlLog, read_jsonl_log
from ..choose.length import LengthController, build_length
from ..core.models import (DEFAULT_TARGET, check_new_tokens, context_overflow, eos_token_ids, load_model,
                           pad_token_id, target_context)
from .peers import HFMethod, build_peers, peers_help
from ..choose.policies import build_policy
from ..choose.policies.simple import Fixed
from ..core.cost import verification_forwards
from .report import AR, FORMAT, build_report, cost_plan_record, figures_note, load_records, rotated, write_report
from ..core.sampling import SamplingConfig
from .suites import BUILTIN, Prompt, encode_prompt, load_jsonl_suite, select
from ..simulation.traces import record_trace, write_traces


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--suite", help="Spec-Bench style JSONL (question_id, category, turns); default: built-in mixed set")
    p.add_argument("--categories", help="comma-separated categories to keep (default: all)")
    p.add_argument("--limit", type=int, help="at most N >= 1 prompts per category")
    p.add_argument("--arms", default=MODEL_FREE_ARMS,
                   help="arm specs separated by ';' (e.g. 'pld:L=4;suffix:L=8;drafter:path=DIR,L=4;none')")
    p.add_argument("--pool", help="pool YAML (recipes/pools/*.yaml); its arms are added to --arms")
    p.add_argument("--policies", default="ucbspec;exp3spec",
                   help="policy specs separated by ';' (e.g. 'ucbspec;ducb:discount=0.9,c=0.1'); ',' separates "
                        "a spec's key=value parameters, and a ',' before a bare name also starts a new spec")
    p.add_argument("--peers", default="",
                   help="peer decoders run in the same loop as every method, specs separated by ';': "
                        + peers_help())
    p.add_argument("--length", help="draft-length controller for every arm and policy run (a fresh one per "
                                    "method; default: the pool's `length`, else fixed): fixed, "
                                    "beta-ts[:alpha=..,beta=..], cali-ts[:predictor=top1|<calibrator folder>], "
                                    "cost[:prior=1] (each arm's L becomes a cap)")
    p.add_argument("--record-traces", metavar="PATH",
                   help="also record counterfactual traces (every arm scored at every position of the "
                        "autoregressive output) for `decode simulate --traces PATH`; an extra pass per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="integer >= 1 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help=f"integer in [0, {MAX_SEED}]")
    add_decoding_arguments(p)
    p.add_argument("--batch", metavar="B,...",
                   help="a batched evaluation instead (speculation under load): for each batch size, HF generate "
                        "batched, our batched rounds without speculation, with each arm fixed, with the first arm "
                        "under --batch-schedule and --batch-ema, and each policy choosing per sequence with lengths "
                        "from the batch's cost; goodput, latency p50/p95, MAT and lossless rows per method and B, and "
                        "a figure of goodput against B. Arms that batch: model-free ones and chains of EAGLE heads, "
                        "drafters and early-exit layers (e.g. --batch 1,2,4,8)")
    p.add_argument("--batch-schedule", default="1-2=4,3-4=2,5-=1",
                   help="the vLLM-style baseline's draft length per batch size range (default: %(default)s)")
    p.add_argument("--batch-ema", default="1,2,4",
                   help="the SGLang-style baseline's draft-length tiers (default: %(default)s)")
    p.add_argument("--batch-repeat", type=int, default=1,
                   help="passes over the suite per batch size, interleaved like its segments: the report gives each "
                        "method's goodput per pass beside the total, so differences can be read against the "
                        "machine's noise (default: %(default)s)")
    p.add_argument("--out",
                   help="report JSON file (the markdown table is written beside it with the suffix .md, the "
                        "records as they finish into records.jsonl, or NAME.records.jsonl for --out NAME.json); "
                        "rerunning with the same --out resumes (default: runs/eval/report.json, with --batch "
                        "runs/eval-batch/report.json)")
    p.add_argument("--fresh", "--overwrite", dest="fresh", action="store_true",
                   help="discard the records an earlier run left at --out and start over (also replaces a "
                        "file at --out or --record-traces that this tool did not write, which is refused otherwise)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true",
                   help="skip the figures (PNG files beside the report, linked from its .md)")


# ---- methods: one decode function each -----------------------------------------------------------------
# hf (HFMethod) and the peers live in decode/evaluation/peers.py; our engine's methods here.

class EngineMethod:
    """Our engine with a fixed arm (``policy_spec`` None) or a policy. Each method owns its length
    controller and its carry=true policy, so nothing learnt under one method leaks into another."""

    def __init__(self, name: str, kind: str, engine: SpecEngine, labels: list[str], *, arm: int = 0,
                 policy_spec: str | None = None, length: LengthController | None = None, seed: int = 0,
                 carry: bool = False):
        self.name, self.kind, self.engine, self.labels = name, kind, engine, labels
        self.arm, self.policy_spec, self.length, self.seed = arm, policy_spec, length, seed
        self.policy_carries = carry
        self.carried = None

    @property
    def stateful(self) -> bool:
        """Learns across prompts (a carry=true policy or length controller): a resumed run replays the
        finished prompts through it, so what it has learnt is what an uninterrupted run's would be."""
        return self.policy_carries or bool(getattr(self.length, "carry", False))

    def _policy(self, pi: int):
        n, max_len = len(self.engine.arms), self.engine.max_len
        if self.policy_spec is None:
            return Fixed(n, max_len, arm=self.arm)
        if self.carried is not None:  # carry=true: one policy learns across the whole suite
            return self.carried
        policy = build_policy(self.policy_spec, n, max_len, seed=self.seed + pi)
        if policy.carry:
            self.carried = policy
        return policy

    def decode(self, ids: list[int], pi: int, max_new_tokens: int) -> dict:
        if self.length is not None:
            self.length.take_plans()  # forget an earlier (warm-up) decode's plans
        g: Generation = self.engine.generate(ids, self._policy(pi), max_new_tokens, length=self.length)
        record = self._record(g)
        record["verify_forwards"] = verification_forwards(len(ids), g.rounds, g.step_times)
        plans = self.length.take_plans() if self.length is not None else []
        if plans:  # the cost controller: what it expected vs what the rounds gave
            record["cost_plan"] = cost_plan_record(plans, g.rounds)
        return record

    def _record(self, g: Generation) -> dict:
        return {"new_tokens": len(g.tokens), "rounds": g.target_forwards,
                "accept_lengths": [r.accepted for r in g.rounds], "drafted": [r.drafted for r in g.rounds],
                "depths": [r.positions for r in g.rounds],  # a tree's depth (drafted counts its nodes)
                "arms": [self.labels[r.arm] for r in g.rounds] if self.kind != "autoregressive" else [],
                "draft_time": sum(r.draft_time for r in g.rounds),
                "verify_time": sum(r.verify_time for r in g.rounds),
                # full-information policies: the other arms' counterfactual proposals (decode/choose/feedback.py)
                "feedback_time": sum(t.feedback for t in g.step_times),
                "wall_time": g.wall_time, "stopped_by": g.stopped_by, "token_ids": g.tokens}


def build_methods(engine: SpecEngine, policy_specs: list[str], length: LengthController, seed: int, hf: HFMethod,
                  peers: list = ()) -> tuple[list, list[str]]:
    """[hf, every peer, autoregressive, every arm of ``engine``, every policy]; arm and policy methods get
    their own copy of ``length`` (a copy, not a rebuild: a trained predictor is loaded once)."""
    arms = engine.arms
    labels = [a.label for a in arms]
    ar_engine = SpecEngine(engine.target, [NoSpecArm()], engine.verifier, engine.eos)
    methods = [hf, *peers, EngineMethod(AR, "autoregressive", ar_engine, labels)]
    methods += [EngineMethod(f"arm:{lab}", "arm", engine, labels, arm=i, length=copy.deepcopy(length))
                for i, lab in enumerate(labels)]
    for spec in policy_specs:
        probe = build_policy(spec, len(arms), engine.max_len)  # validate names/params before any decoding
        methods.append(EngineMethod(f"policy:{spec}", "policy", engine, labels, policy_spec=spec,
                                    length=copy.deepcopy(length), seed=seed, carry=probe.carry))
    names = [m.name for m in methods]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise UserError(f"two methods share the name {clash[0]!r}; their records would merge")
    return methods, labels


# ---- the run -------------------------------------------------------------------------------------------------

def _record_traces(cfg: EvalConfig, methods: list, prompts: list[Prompt], encoded: list[list[int]], gen) -> None:
    """Dense counterfactual traces (decode/simulation/traces.py): for each prompt, the fixed-first-arm output is
    re-scored by every arm at every position; a separate pass so timed runs above stay untouched."""
    engine = next(m.engine for m in methods if m.kind == "arm")
    out = []
    for pi, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="traces", unit="prompt",
                                       disable=cfg.no_progress)):
        gen.manual_seed(cfg.seed * 1_000_003 + pi)
        policy = Fixed(len(engine.arms), engine.max_len, arm=0)
        g = record_trace(engine, ids, policy, cfg.max_new_tokens, "dense")
        g.trace.meta = {"id": p.id, "category": p.category}
        out.append(g.trace)
    write_traces(cfg.record_traces, out)
    print(f"traces: {cfg.record_traces}  (replay: python -m decode simulate --traces {cfg.record_traces})")


def _prompt_keys(prompts: list[Prompt]) -> list[list[str]]:
    """[id, category, digest of the text] per prompt: what a resumed run must find unchanged."""
    return [[p.id, p.category, hashlib.sha256(p.text.encode("utf-8")).hexdigest()[:16]] for p in prompts]


def git_state(where: str | os.PathLike | None = None) -> dict:
    """``{"git_commit": sha, "git_dirty": bool}`` of the checkout holding this code, so a report names the
    code that produced it; ``"unknown"``/None outside a git checkout or without git."""
    where = where or Path(__file__).resolve().parent
    try:
        def git(*a):
            return subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        return {"git_commit": git("rev-parse", "HEAD"),
                "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": None}


def _environment(device: torch.device) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "threads": torch.get_num_threads(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **git_state()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def run(args) -> int:
    cfg = EvalConfig.from_args(args)
    return evaluate(cfg)


def evaluate(cfg: EvalConfig) -> int:
    """Decode every (method, prompt) pair not already in ``cfg.records_path``, appending each record as
    it finishes, then write the report from all records. ``cfg`` comes checked from
    :meth:`EvalConfig.from_args`; what needs files (suite, records) is checked here before a model loads."""
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    length = build_length(cfg.length, cfg.seed)  # validated (and any predictor loaded) before the models
    prompts = load_jsonl_suite(cfg.suite) if cfg.suite else list(BUILTIN)
    prompts = select(prompts, cfg.categories, cfg.limit)
    keys = _prompt_keys(prompts)
    if cfg.batch:
        from .batched import evaluate_batched
        check_new_tokens(cfg.max_new_tokens, target_context(cfg.target, cfg.trust_remote_code), cfg.target)
        return evaluate_batched(cfg, prompts, keys, _environment(torch.device(cfg.device)))

    header, records, good_bytes = None, [], 0
    if not cfg.fresh:  # --fresh: whatever is there is discarded unread
        header, records, good_bytes, notes = load_records(cfg.records_path)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        check_resume(cfg, header, records, keys)
        if header is not None and not records:  # stopped before its first record: nothing to keep
            header = None
    done = {(r["method"], r["prompt_id"]) for r in records}
    if header is not None:
        expected = {(m["name"], p.id) for m in header["methods"] for p in prompts}
        if expected <= done and not cfg.record_traces:  # nothing left to decode: no model needed
            print(f"all {len(expected)} (method, prompt) records are in {cfg.records_path}; rebuilding the report")
            return _finish(cfg, header, records)

    context = target_context(cfg.target, cfg.trust_remote_code)  # its config alone, before the weights load
    check_new_tokens(cfg.max_new_tokens, context, cfg.target)
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)
    model, tok = load_model(cfg.target, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
    encoded = [encode_prompt(tok, p.text) for p in prompts]
    overflow = context_overflow(cfg.max_new_tokens, context, cfg.target, [len(e) for e in encoded])
    if overflow:
        print(f"note: {overflow}", file=sys.stderr)
    gen = torch.Generator().manual_seed(cfg.seed)
    engine = build_engine(model, tok, cfg.arms, sampling, gen, cache=cfg.cache, compile=cfg.compile, linear=cfg.linear,
                          verifier=cfg.verifier, target_name=cfg.target, trust_remote_code=cfg.trust_remote_code,
                          needs_hidden=length.needs_target_hidden, forward=cfg.forward)
    eos = eos_token_ids(model, tok)
    pad = pad_token_id(tok, eos)
    hf = HFMethod(model, sampling, eos, pad)
    peers = build_peers(cfg.peers, model, tok, sampling, eos, pad) if cfg.peers else []
    methods, labels = build_methods(engine, cfg.policies, length, cfg.seed, hf, peers)
    compile_info = _compile(cfg, engine, peers, encoded)

    names = [m.name for m in methods]
    if header is not None and [m["name"] for m in header["methods"]] != names:
        raise UserError(f"--out {cfg.out}: {cfg.records_path} was decoded with the methods "
                        f"{[m['name'] for m in header['methods']]}, this run has {names} (a drafter renamed?); "
                        f"pass another --out, or add --fresh to discard those records")
    if header is None:
        saved = {k: v for k, v in cfg.to_dict().items() if k not in ("fresh", "no_progress", "no_plots")}
        header = {"format": FORMAT, "config": saved, "prompts": keys,
                  "methods": [{"name": m.name, "kind": m.kind} for m in methods], "arm_labels": labels,
                  "peer_settings": {p.name: getattr(p, "settings", {}) for p in peers},
                  "environment": _environment(device), "compile": compile_info,
                  "linear_probe": engine.target.linear_probe, "attention_probe": engine.target.attention_probe,
                  "forward": engine.target.forward_kind, "fused_ops": engine.target.fused_ops}
    log = JsonlLog(cfg.records_path, keep_bytes=good_bytes if records else 0)
    try:
        if not records:
            log.append(header)
        _decode_all(cfg, methods, prompts, encoded, hf, tok, gen, log, records, done)
    except KeyboardInterrupt:  # count what is on disk: Ctrl-C may land between a write and its bookkeeping
        kept = len(read_jsonl_log(cfg.records_path, "--out")[0]) - 1
        print(f"interrupted: {kept} records kept in {cfg.records_path}; run the same command again "
              f"to resume", file=sys.stderr)
        raise
    finally:
        log.close()
    if cfg.record_traces:
        _record_traces(cfg, methods, prompts, encoded, gen)
    return _finish(cfg, header, records)


def _compile(cfg: EvalConfig, engine: SpecEngine, peers: list, encoded: list[list[int]]) -> dict:
    """Pay every compilation before the first timed decode, and say what it cost: our target's graphs
    (``engine.prepare``: one cache shape for the whole suite, every chain size), and each peer that compiles
    (one untimed ``generate`` of the longest prompt for ``max_new_tokens``: transformers keeps the largest static
    cache it allocated, so no timed prompt recompiles). Seconds by method name prefix: ``engine`` for ours."""
    info = {}
    described = engine.prepare([len(e) for e in encoded], cfg.max_new_tokens, show=not cfg.no_progress)
    if described is not None:
        info["engine"] = described
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    for peer in peers:
        if peer.compiles:  # the longest prompt, every token: the largest cache it will need
            t0 = time.perf_counter()
            peer.decode(encoded[longest], longest, cfg.max_new_tokens)
            info[peer.name] = {"seconds": round(time.perf_counter() - t0, 2)}
    return info


def _decode_all(cfg: EvalConfig, methods: list, prompts: list[Prompt], encoded: list[list[int]], hf, tok, gen,
                log: JsonlLog, records: list[dict], done: set) -> None:
    """The one loop: every prompt, every method in the prompt's rotated order; a finished pair is skipped
    (replayed, untimed and unrecorded, when the method learns across prompts)."""
    by_name = {m.name: m for m in methods}
    # a method that learns across prompts replays its finished prompts up to its last unfinished one
    last_todo = {m.name: max((pi for pi, p in enumerate(prompts) if (m.name, p.id) not in done), default=-1)
                 for m in methods}
    if all(v < 0 for v in last_todo.values()):
        return
    replays = [m.name for m in methods if getattr(m, "stateful", False)
               and any((m.name, p.id) in done for p in prompts[:max(last_todo[m.name], 0)])]
    if done:
        print(f"resuming: {len(done)} of {len(prompts) * len(methods)} records already in {cfg.records_path}"
              + (f"; replaying their prompts through {', '.join(replays)} (learnt across prompts)" if replays else ""),
              file=sys.stderr)
    # warm-up so the first timed runs do not pay one-off costs (also on resume); engines directly with a
    # fixed arm and no length controller, so no carried policy or controller learns from it
    warm = min(8, cfg.max_new_tokens)
    hf.decode(encoded[0], 0, warm)
    for m in methods:
        if m.kind == "peer":
            m.decode(encoded[0], 0, warm)
    for engine in {id(m.engine): m.engine for m in methods if hasattr(m, "engine")}.values():
        engine.warm_up(encoded[0], warm)  # with a cost-aware method's probe of the curve, not in its first timed run
    bar = tqdm(total=len(prompts) * len(methods), initial=len(done), desc="eval", unit="run", disable=cfg.no_progress)
    order = [m.name for m in methods]
    for pi, (p, ids) in enumerate(zip(prompts, encoded)):
        for name in rotated(order, pi):  # rotate: noise hits all alike
            m = by_name[name]
            finished = (m.name, p.id) in done
            if finished and not (getattr(m, "stateful", False) and pi < last_todo[name]):
                continue
            seed = cfg.seed * 1_000_003 + pi
            gen.manual_seed(seed)
            torch.manual_seed(seed)  # HF generate samples from the global generator
            fields = m.decode(ids, pi, cfg.max_new_tokens)
            if finished:  # a replay: its state is now where the uninterrupted run's was
                continue
            rec = {"method": m.name, "prompt_id": p.id, "category": p.category, **fields,
                   "text": tok.decode(fields["token_ids"], skip_special_tokens=True)}
            log.append(rec)
            records.append(rec)
            done.add((m.name, p.id))
            tps = metrics.tokens_per_s(fields["new_tokens"], fields["wall_time"])
            bar.set_postfix_str(f"{m.name[:24]} {tps:.1f} tok/s")
            bar.update()
    bar.close()


def _finish(cfg: EvalConfig, header: dict, records: list[dict]) -> int:
    report, table = build_report(header, records)
    out, table_path = write_report(report, table, cfg.report_path, plots=not cfg.no_plots)
    print(table)
    print(f"\nreport: {out}  (table: {table_path}{figures_note(out, not cfg.no_plots)}; records: {cfg.records_path})")
    return 0
