"""The evaluation's typed configuration: built once from the ``decode eval`` flags, validated before any
model loads, and saved as the first line of ``records.jsonl`` so a rerun can resume (or refuse to mix
records decoded under different settings) and ``decode report`` can rebuild the report.

Fields hold resolved values (arm and policy spec lists, the device and dtype ``auto`` chose, the cache
kind), so two spellings of the same run compare equal. :data:`NOT_RESULTS` (where outputs go, how
progress shows, the paths of the suite and pool files) never affect a record and are ignored when a run
resumes.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..common.errors import UserError
from ..common.io import check_output_file, is_json_object_with, is_report_json, refuse_foreign, starts_with
from ..core.lean import FORWARD_KINDS
from ..core.linear import LINEAR_KINDS, resolve_linear
from ..core.models import DEFAULT_TARGET
from ..common.specs import parse_spec, split_specs

MAX_SEED = 2**32 - 1
CACHES = ("dynamic", "static", "prefix")
# fields that do not change any record, so a resumed run may differ in them; for --suite and --pool what
# they hold is compared instead of their paths (the prompts' ids and text digests, the arm specs)
NOT_RESULTS = ("out", "record_traces", "no_progress", "no_plots", "fresh", "suite", "pool")
# how a differing field is named to the user
FLAG_NAMES = {"arms": "--arms/--pool (the arm specs)", "prompts": "the prompts (from --suite/--categories/--limit)"}


def is_eval_table(path) -> bool:
    """The markdown table ``decode eval``/``report`` writes beside a report (decode/evaluation/report.py)."""
    return starts_with(path, "| method |")


def is_traces_file(path) -> bool:
    """A ``--record-traces`` file (decode/simulation/traces.py): a JSON object with ``version`` and ``traces``."""
    return is_json_object_with(path, {"version", "traces"})


def flag(name: str) -> str:
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def records_path(report: str | os.PathLike) -> Path:
    """The records file beside a report: ``runs/x/report.json`` → ``runs/x/records.jsonl``; any other
    report name keeps its stem (``runs/a.json`` → ``runs/a.records.jsonl``), so two reports in one folder
    never share records."""
    p = Path(report)
    return p.with_name("records.jsonl" if p.stem == "report" else f"{p.stem}.records.jsonl")


def report_path(records: str | os.PathLike) -> Path:
    """Inverse of :func:`records_path`."""
    p = Path(records)
    stem = p.name.removesuffix(".jsonl").removesuffix(".records") if p.name != "records.jsonl" else "report"
    return p.with_name(f"{stem}.json")


def resolve_cache(spec: str | None, device, compile: bool) -> str:
    """None/auto → decode/core/target.py auto_cache_kind (static on CUDA or with --compile, else prefix)."""
    if spec in (None, "auto"):
        from ..core.target import auto_cache_kind
        return auto_cache_kind(device, compile)
    if spec not in CACHES:
        raise UserError(f"--cache must be one of auto, {', '.join(CACHES)}, got '{spec}'")
    return spec


def add_decoding_arguments(p) -> None:
    """The flags every decoding command shares (eval, generate): sampling, verifier backend and placement.
    Their checks live in :meth:`EvalConfig.check_ranges`."""
    from ..common.device import DEVICES, DTYPES
    from ..core.verify import BACKENDS
    p.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help=">= 0; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--verifier", default="auto", choices=BACKENDS)
    p.add_argument("--device", default="auto", help=f"{DEVICES} (auto = cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", help=f"auto|{'|'.join(DTYPES)} (auto = bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--cache", choices=("auto", *CACHES), default="auto",
                   help="KV cache of the target and of the arms that own one: static (pre-allocated, rollback moves a "
                        "length pointer, attention spans the allocation), prefix (pre-allocated, attention spans the "
                        "filled prefix; eager only), dynamic (grows by concatenation and is cropped), or auto "
                        "(default: static on CUDA or with --compile, prefix on a CPU, where it measured fastest)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's verification forward (needs the static cache)")
    p.add_argument("--linear", choices=LINEAR_KINDS, default="auto",
                   help="how the target's linear layers run in our engine: onednn (weights pre-packed once for "
                        "oneDNN), stream (our CPU kernel reading each float32 weight once for a round's few rows: "
                        "1-10 positions then cost about one step), stock (torch.nn.Linear), or auto (default: on a "
                        "CPU times them on the loaded target and keeps the fastest, else stock). The hf reference "
                        "and peers always run stock")
    p.add_argument("--forward", choices=FORWARD_KINDS, default="auto",
                   help="how the target's eager forwards run: lean (our loop over the model's own modules, without "
                        "transformers' per-call Python: Llama-layout targets, dynamic or prefix cache), hf "
                        "(transformers' forward), or auto (default: lean where it can run, else hf, saying why)")


def _refuse_duplicates(flag: str, specs: list[str]) -> None:
    """The same spec twice would merge two methods' records under one name."""
    seen = {}
    for s in specs:
        name, params = parse_spec(s)
        key = (name, tuple(sorted(params.items())))
        if key in seen:
            raise UserError(f"{flag}: '{s}' duplicates '{seen[key]}'; each is evaluated once")
        seen[key] = s


def parse_policy_specs(text: str) -> list[str]:
    """``--policies`` with the arms' splitting rule (decode/common/specs.py split_specs: ';' between specs,
    ',' between a spec's parameters), so ``ducb:discount=0.9,c=0.1;ucbspec`` is two policies."""
    specs = split_specs(text)
    _refuse_duplicates("--policies", specs)
    return specs


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch 1,2,4,8`` → [1, 2, 4, 8]: distinct integers >= 1, in the order given."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise UserError(f"--batch must be distinct integers >= 1 separated by ',' (e.g. 1,2,4,8), got {text!r}")
    return sizes


def parse_peer_specs(text: str) -> list[str]:
    """``--peers``: ';'-separated specs, checked by decode/evaluation/peers.py before any model loads."""
    specs = split_specs(text or "")
    _refuse_duplicates("--peers", specs)
    if specs:
        from .peers import check_peer_specs
        check_peer_specs(specs)
    return specs


@dataclass
class EvalConfig:
    """What ``decode eval`` decodes and how; see ``decode eval --help`` for each flag."""

    target: str = DEFAULT_TARGET
    trust_remote_code: bool = False
    suite: str | None = None
    categories: list[str] | None = None
    limit: int | None = None
    arms: list[str] = field(default_factory=lambda: ["pld:L=4", "suffix:L=6"])  # --arms + the pool's arms
    pool: str | None = None
    policies: list[str] = field(default_factory=lambda: ["ucbspec", "exp3spec"])
    peers: list[str] = field(default_factory=list)
    length: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    verifier: str = "auto"
    device: str = "cpu"  # resolved (auto → cuda or cpu)
    dtype: str = "float32"  # resolved (auto → bfloat16 on CUDA, float32 on CPU)
    cache: str = "static"  # dynamic | static | prefix
    compile: bool = False
    linear: str = "stock"  # resolved (auto: measured on a CPU, stock elsewhere): decode/core/linear.py
    forward: str = "auto"  # --forward as given (auto: resolved once the model is loaded): decode/core/lean.py
    # --batch: batch sizes of a batched evaluation (decode/evaluation/batched.py); None = one sequence at a time
    batch: list[int] | None = None
    batch_schedule: str = "1-2=4,3-4=2,5-=1"
    batch_ema: str = "1,2,4"
    batch_repeat: int = 1  # passes over the suite per batch size (each a sample of the machine's noise)
    # outputs and presentation (NOT_RESULTS)
    out: str = "runs/eval/report.json"
    record_traces: str | None = None
    no_progress: bool = False
    no_plots: bool = False
    fresh: bool = False

    # ---- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_args(cls, args) -> "EvalConfig":
        """The flags as typed, resolved values; every check runs here, before any model is loaded."""
        from ..common.device import dtype_name, resolve_device, resolve_dtype
        a = vars(args)
        cfg = cls(**{f.name: a[f.name] for f in fields(cls) if f.name in a and f.name not in
                     ("categories", "arms", "policies", "peers", "device", "dtype", "cache", "linear", "batch",
                      "out")})
        cfg.out = a.get("out") or ("runs/eval-batch/report.json" if a.get("batch") else "runs/eval/report.json")
        cfg.check_ranges()
        cfg.check_outputs()
        if a.get("categories") is not None:
            cfg.categories = [c.strip() for c in a["categories"].split(",") if c.strip()]
        from ..engine.pools import MODEL_FREE_ARMS, collect_arms
        collected = collect_arms(a.get("arms"), cfg.pool, MODEL_FREE_ARMS)  # each spec checked
        cfg.arms = collected.arms
        cfg.policies = parse_policy_specs(a.get("policies") or "")
        from ..choose.policies import build_policy
        for spec in cfg.policies:  # names, typed and ranged parameters (the engine's draft length is not known yet)
            build_policy(spec, len(cfg.arms), 1)
        cfg.peers = parse_peer_specs(a.get("peers") or "")
        device = resolve_device(a.get("device") or "auto")
        cfg.device = str(device)
        dtype = resolve_dtype(a.get("dtype") or "auto", device)
        cfg.dtype = dtype_name(dtype)
        cfg.linear = resolve_linear(a.get("linear") or "auto", device, dtype)
        cfg.cache = resolve_cache(a.get("cache"), device, cfg.compile)
        if cfg.compile and cfg.cache != "static":
            raise UserError(f"--compile needs --cache static (a {cfg.cache} cache changes shape every round)")
        if a.get("batch"):
            cfg.batch = parse_batch_sizes(a["batch"])
            cfg.check_batched()
        elif cfg.length is None:  # the pool's controller (batched rounds choose lengths from the batch's cost)
            cfg.length = collected.length
        return cfg

    def check_batched(self) -> None:
        """What a batched evaluation (--batch) takes: arms that batch (model-free; chains of EAGLE heads, drafters and
        early-exit layers), no peers, length controller, traces or compiling, and valid schedule and EMA tiers."""
        from ..engine.batch import parse_length
        for name, on in (("--peers", bool(self.peers)), ("--length", bool(self.length)),
                         ("--record-traces", bool(self.record_traces)), ("--compile", self.compile)):
            if on:
                raise UserError(f"{name} is not part of a batched evaluation (--batch): its methods are HF generate "
                                f"batched and our batched rounds; drop {name} or --batch")
        for flag_name, spec in (("--batch-schedule", f"schedule:{self.batch_schedule}"),
                                ("--batch-ema", f"ema:{self.batch_ema}")):
            try:
                parse_length(spec)
            except UserError as exc:
                raise UserError(f"{flag_name}: {exc}") from None
        from ..engine.batch import check_batch_arm_specs
        check_batch_arm_specs(self.arms)

    def check_ranges(self) -> None:
        """One-line errors naming the flag and its valid range (NaN/inf included)."""
        ints = [("--max-new-tokens", self.max_new_tokens, 1, None), ("--limit", self.limit, 1, None),
                ("--top-k", self.top_k, 0, None), ("--seed", self.seed, 0, MAX_SEED),
                ("--batch-repeat", self.batch_repeat, 1, None)]
        for name, v, lo, hi in ints:
            if v is not None and (v < lo or (hi is not None and v > hi)):
                rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise UserError(f"{name} must be an integer {rng}, got {v}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")

    def check_outputs(self) -> None:
        """Fail before decoding, not after it, on an output path that cannot be written: a folder, a parent
        that is a file, an unwritable folder, or two outputs on the same file; and, without --fresh, on a file
        there that this tool did not write (it would be replaced)."""
        out = Path(self.out)
        if out.suffix == ".md":
            raise UserError(f"--out {out}: the markdown table is written beside the report as .md; "
                            f"name the report e.g. {out.with_suffix('.json')}")
        if out.suffix == ".jsonl":
            raise UserError(f"--out {out}: the records are written beside the report as {records_path(out).name}; "
                            f"name the report e.g. {out.with_suffix('.json')}")
        paths = [("--out", out), ("--out (table)", out.with_suffix(".md")), ("--out (records)", records_path(out))]
        if self.record_traces:
            paths.append(("--record-traces", Path(self.record_traces)))
        seen = {}
        for name, p in paths:
            key = p.resolve()
            if key in seen:
                raise UserError(f"{name} {p}: the same file as {seen[key]}; pass another path")
            seen[key] = name
            check_output_file(p, name)
        # never replace a user's file: the report, its table and the traces only over this tool's own outputs
        # (the records file is checked by its first line when the run resumes)
        own = [(out, "--out", is_report_json), (self.table_path, "--out (table)", is_eval_table)]
        if self.record_traces:
            own.append((Path(self.record_traces), "--record-traces", is_traces_file))
        if not self.fresh:
            for p, name, is_own in own:
                refuse_foreign(p, name, is_own, "--fresh")

    # ---- derived --------------------------------------------------------------------------------------------

    @property
    def report_path(self) -> Path:
        return Path(self.out)

    @property
    def table_path(self) -> Path:
        return Path(self.out).with_suffix(".md")

    @property
    def records_path(self) -> Path:
        return records_path(self.out)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EvalConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def results_view(self) -> dict:
        """The fields that decide what a record holds (everything but NOT_RESULTS)."""
        return {k: v for k, v in self.to_dict().items() if k not in NOT_RESULTS}


def differences(saved: dict, now: dict) -> list[str]:
    """``"--max-new-tokens (was 16, now 12)"`` for every result field that differs (a field missing on one
    side differs too)."""
    out = []
    for k in list(dict.fromkeys([*saved, *now])):
        if saved.get(k, "<unset>") != now.get(k, "<unset>"):
            if k == "prompts":
                was, cur = saved.get(k) or [], now.get(k) or []
                out.append(f"{flag(k)} ({len(was)} prompts before, {len(cur)} now"
                           + (", same ids but other texts" if [p[0] for p in was] == [p[0] for p in cur] else "")
                           + ")")
            else:
                out.append(f"{flag(k)} (was {saved.get(k, '<unset>')!r}, now {now.get(k, '<unset>')!r})")
    return out


def check_resume(cfg: EvalConfig, header: dict | None, records: list[dict], prompt_keys: list) -> None:
    """A records file decoded under other settings is never mixed with this run's: a clear error naming
    every differing field and the ways on."""
    if header is None:
        return
    saved = {**EvalConfig.from_dict(header["config"]).results_view(), "prompts": header["prompts"]}
    now = {**cfg.results_view(), "prompts": prompt_keys}
    diff = differences(saved, now)
    if diff and records:
        raise UserError(f"--out {cfg.out}: {cfg.records_path} holds {len(records)} records decoded with other "
                        f"settings: {'; '.join(diff)}. Rerun with the earlier settings to resume, pass another "
                        f"--out, or add --fresh to discard those records")
