"""Simulate arm-selection policies without models: stopping-time regret vs the best fixed arm.

Two kinds of instances:
- synthetic (default): arm i yields Y ~ truncated geometric on [1, L_i+1] with acceptance
  probability p_i (BanditSpec eq. 10), optionally switching to other p's after ``--switch-at``
  tokens (non-stationary). Each draft position is accepted with probability α ~ Beta(κp, κ(1−p))
  (mean p, so Y is exactly eq. 10) and reports TV = 1 − α, which gives the BD reward a realistic
  spread; κ = 0 means α = p exactly. Round time = 1 + verify_cost·drafted + draft_cost·drafted.
- replay (``--traces FILE`` from ``decode eval --record-traces``): every prompt's counterfactual
  trace is an instance; from position m arm i yields the recorded Y (see decode/simulation/traces.py).

Full information (hedge, normalhedge, ftl, router, ``fullinfo=true``): after each round the policy also
gets every other arm's record from the same position (synthetic: that arm's next draw; replay: its
recorded entry), as the engine's counterfactual scoring gives it (decode/choose/feedback.py). A router sees
each arm's draft length before choosing. ``round-oracle`` — the per-round oracle, which plays the arm
with the most tokens (``--measure time``: tokens per second) in each round with the round's outcomes
in view — bounds every policy, and the table reports regret against it too.

Policies are anytime (none knows the length), so one run to the longest length gives the stopping
time ST(n) for every shorter length n as well. Regret(n) = mean ST_policy(n) − min_i mean ST_i(n)
(fixed arm i, same random streams). The 95% interval is mean ± 1.96·sd/sqrt(runs) of the paired
per-run differences. Best-arm ratio = share of rounds that played the best fixed arm in hindsight.
Writes JSON, a markdown table and a regret-vs-length PNG (log x).
One module (~450 lines) because instances, the paired-run loop and the table share one record shape.
"""
from __future__ import annotations

import argparse
import bisect
import math
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..common import metrics
from ..core.draft import RoundRecord
from ..common.errors import UserError
from ..common.io import (atomic_path, atomic_write_json, atomic_write_text, check_output_file, is_report_json,
                         refuse_foreign, starts_with)
from ..choose.policies import build_policy, policy_names
from ..choose.policies.simple import Fixed
from ..common.specs import split_specs
from .traces import Trace, load_traces


def _floats(text: str, field: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(";", ",").split(",") if x.strip()]
    except ValueError as exc:
        raise UserError(f"{field}: expected comma-separated numbers, got '{text}'") from exc


class SyntheticInstance:
    """Per-arm random streams drawn up front (the k-th pull of arm i always gets the same draw), so
    every method sees the same randomness for a seed (common random numbers)."""

    def __init__(self, p: list[float], L: list[int], n_max: int, seed: int, kappa: float = 4.0,
                 switch_at: int | None = None, p_after: list[float] | None = None,
                 draft_cost: float = 0.0, verify_cost: float = 0.0):
        self.K, self.L, self.n_max = len(p), L, n_max
        self.switch_at = switch_at
        self.draft_cost, self.verify_cost = draft_cost, verify_cost
        rng = np.random.default_rng(seed)
        regimes = [p] + ([p_after] if p_after is not None and switch_at is not None else [])
        self.streams = []  # [regime][arm] -> (y [n], alpha [n, L])
        for probs in regimes:
            per_arm = []
            for i in range(self.K):
                Li = L[i]
                u = rng.random((n_max, Li))
                if kappa > 0 and 0 < probs[i] < 1:
                    alpha = rng.beta(kappa * probs[i], kappa * (1 - probs[i]), size=(n_max, Li))
                else:
                    alpha = np.full((n_max, Li), probs[i])
                ok = u < alpha
                acc = np.cumprod(ok, axis=1).sum(axis=1) if Li else np.zeros(n_max, dtype=np.int64)
                per_arm.append((acc.astype(np.int64), alpha))
            self.streams.append(per_arm)

    @property
    def length(self) -> int:
        return self.n_max

    def step(self, arm: int, pos: int, pull: int, remaining: int) -> RoundRecord:
        regime = 1 if len(self.streams) > 1 and pos >= self.switch_at else 0
        acc_arr, alpha = self.streams[regime][arm]
        a = int(acc_arr[pull])
        Li = self.L[arm]
        new = min(a + 1, remaining)
        tv = (1.0 - alpha[pull, :Li]).tolist()  # the target scores every drafted position
        # time unit = one verification = one autoregressive step
        return RoundRecord(arm, Li, min(a, new), new, self.draft_cost * Li, 1.0 + self.verify_cost * Li,
                           tv, [], Li, step_time=1.0)


class ReplayInstance:
    """One recorded prompt: from position m, arm i yields the Y recorded at m (dense traces record
    every m; round traces only the live rounds' starts — other positions use the nearest earlier
    recorded one, counted in ``approx``)."""

    def __init__(self, trace: Trace):
        if not trace.steps:
            raise UserError("a trace without steps cannot be replayed (the generation was empty)")
        self.trace = trace
        self.K = len(trace.arm_labels)
        self.L = trace.arm_L
        self.pos = [s.pos for s in trace.steps]
        self.approx = 0
        # traces recorded before step_time existed: the fastest recorded verification approximates it
        self.step_time = trace.step_time or min(
            (a.verify_time for s in trace.steps for a in s.arms if a is not None and a.verify_time > 0), default=1.0)

    @property
    def length(self) -> int:
        return self.trace.n_tokens

    def step(self, arm: int, pos: int, pull: int, remaining: int) -> RoundRecord:
        k = bisect.bisect_right(self.pos, pos) - 1
        if k < 0:
            k = 0
        if self.pos[k] != pos:
            self.approx += 1
        s = self.trace.steps[k].arms[arm]
        if s is None:
            raise UserError(f"trace step at position {self.pos[k]} has no entry for arm {arm}")
        new = min(s.y, remaining)
        return RoundRecord(arm, s.drafted, min(s.accepted, new), new, s.draft_time, s.verify_time,
                           s.tv, s.accept_prob, self.L[arm], step_time=self.step_time)


ROUND_ORACLE = "round-oracle"


class RoundOracle:
    """The per-round oracle: every round, the arm whose outcome in THIS round is best (most tokens, or
    most tokens per second with ``by_time``), chosen with the outcomes in view. Not a policy: it
    cheats, which is what makes it an upper bound for per-round routing."""

    fullinfo = True
    lookahead = True

    def __init__(self, n_arms: int, by_time: bool = False):
        self.K, self.by_time = n_arms, by_time
        self.records = {}

    def new_query(self):
        self.records = {}

    def see_outcomes(self, records):
        self.records = records

    def select(self) -> int:
        def score(r):
            return r.new_tokens / max(r.time, 1e-12) if self.by_time else r.new_tokens
        return max(range(self.K), key=lambda j: (score(self.records[j]), -j))

    def update(self, arm, record):
        pass

    def update_full(self, played, records, features=None):
        pass


def run_policy(policy, inst) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Play one query to the instance's length. Returns (arm per round, cumulative tokens, cumulative
    time: drafting + verification of every round so far). A full-information policy gets every arm's
    record of the round (``update_full``); arm j's k-th observation, played or not, is its k-th draw."""
    policy.new_query()
    n_max = inst.length
    obs = [0] * inst.K
    pos = 0
    arms, news, times = [], [], []
    full = getattr(policy, "fullinfo", False)
    while pos < n_max:
        if full:
            recs = {j: inst.step(j, pos, obs[j], n_max - pos) for j in range(inst.K)}
            for j in range(inst.K):
                obs[j] += 1
            if getattr(policy, "lookahead", False):
                policy.see_outcomes(recs)
            features = {j: (r.drafted, 0) for j, r in recs.items()}  # a trace records no match lengths
            if hasattr(policy, "see"):
                policy.see(features)
            i = policy.select()
            rec = recs[i]
            for j, r in recs.items():
                r.counterfactual = j != i
            policy.update(i, rec)
            policy.update_full(i, recs, features)
        else:
            i = policy.select()
            rec = inst.step(i, pos, obs[i], n_max - pos)
            obs[i] += 1
            policy.update(i, rec)
        pos += rec.new_tokens
        arms.append(i)
        news.append(rec.new_tokens)
        times.append(rec.draft_time + rec.verify_time)
    return np.asarray(arms), np.cumsum(news), np.cumsum(times)


def stopping_times(cum: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """ST(n) = rounds until at least n tokens exist, for each n (n ≤ cum[-1])."""
    return np.searchsorted(cum, lengths, side="left") + 1


def _ci(x: np.ndarray) -> float:
    return float(1.96 * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def simulate(instances_by_seed, policy_specs: list[str], n_arms: int, max_len: int, lengths: np.ndarray,
             progress: bool = True, measure: str = "rounds") -> dict:
    """instances_by_seed = (makers, seeds): one callable seed → instance per instance.

    measure: "rounds" (stopping time = target forwards) or "time" (the modelled/recorded drafting +
    verification time until n tokens exist, so drafting and switching costs count).

    Returns per-method stopping times [instance, seed, length], best-arm ratios and the number of
    replayed rounds that started at unrecorded positions."""
    make, seeds = instances_by_seed
    methods = [f"fixed:arm={i}" for i in range(n_arms)] + [ROUND_ORACLE] + policy_specs
    st = {m: [] for m in methods}
    best_ratio = {m: [] for m in policy_specs}
    approx = 0
    total = len(make) * len(seeds) * len(methods)
    bar = tqdm(total=total, desc="simulate", unit="run", disable=not progress)
    for mk in make:
        per_inst = {m: [] for m in methods}
        chosen = {m: [] for m in policy_specs}
        for s in seeds:
            inst = mk(s)  # instances are read-only during a run: every method replays the same draws
            for m in methods:
                inst.approx = 0
                if m == ROUND_ORACLE:
                    pol = RoundOracle(n_arms, by_time=measure == "time")
                elif m.startswith("fixed:"):
                    pol = Fixed(n_arms, max_len, seed=s, arm=int(m.split("=")[1]))
                else:
                    pol = build_policy(m, n_arms, max_len, seed=s)
                arms, cum, cum_time = run_policy(pol, inst)
                approx += getattr(inst, "approx", 0)
                ls = lengths[lengths <= cum[-1]]
                row = np.full(len(lengths) + 1, np.nan)  # the grid, then the instance's full length
                idx = stopping_times(cum, ls)
                row[:len(ls)] = idx if measure == "rounds" else cum_time[idx - 1]
                row[-1] = len(arms) if measure == "rounds" else cum_time[-1]
                per_inst[m].append(row)
                if m in chosen:
                    chosen[m].append(arms)
                bar.update()
        fixed_mean = np.stack([np.mean(per_inst[f"fixed:arm={i}"], axis=0) for i in range(n_arms)])  # [K, lengths]
        best_final = int(np.nanargmin(fixed_mean[:, _last_valid(fixed_mean)]))
        for m in policy_specs:
            best_ratio[m].extend(metrics.best_arm_ratio(a.tolist(), best_final) for a in chosen[m])
        for m in methods:
            st[m].append(np.stack(per_inst[m]))
    bar.close()
    return {"st": {m: np.stack(v) for m, v in st.items()}, "best_ratio": best_ratio, "approx_steps": approx,
            "full_lengths": [int(mk(seeds[0]).length) for mk in make]}


def _last_valid(mat: np.ndarray) -> int:
    ok = ~np.isnan(mat).any(axis=0)
    return int(np.nonzero(ok)[0][-1])


def summarize(res: dict, policy_specs: list[str], n_arms: int, lengths: np.ndarray, labels: list[str]) -> dict:
    st = res["st"]  # method -> [instances, seeds, lengths]
    fixed = np.stack([st[f"fixed:arm={i}"] for i in range(n_arms)])  # [K, I, S, G]
    fixed_mean = np.nanmean(fixed, axis=2)  # [K, I, G]
    best = np.argmin(np.where(np.isnan(fixed_mean), np.inf, fixed_mean), axis=0)  # [I, G]
    I, S, G = st[policy_specs[0]].shape if policy_specs else fixed.shape[1:]
    # every per-length list has one entry per grid length, then one at each instance's full length
    out = {"lengths": lengths.tolist(), "full_lengths": res.get("full_lengths", []), "policies": {}, "fixed": {}}
    for i in range(n_arms):
        out["fixed"][labels[i]] = {"mean_st": np.nanmean(fixed[i], axis=(0, 1)).tolist()}
    out["round_oracle"] = {"mean_st": np.nanmean(st[ROUND_ORACLE], axis=(0, 1)).tolist()}
    for m in policy_specs:
        diffs = np.full((I, S, G), np.nan)
        for ii in range(I):
            for g in range(G):
                diffs[ii, :, g] = st[m][ii, :, g] - fixed[best[ii, g], ii, :, g]
        reg, ci, mst, reg_oracle = [], [], [], []
        for g in range(G):
            reg_oracle.append(float(np.nanmean(st[m][:, :, g] - st[ROUND_ORACLE][:, :, g])))
            per_inst = [metrics.stopping_time_regret(float(np.mean(st[m][ii, :, g])), fixed_mean[:, ii, g].tolist())
                        for ii in range(I) if not np.isnan(st[m][ii, :, g]).any()]
            d = diffs[:, :, g].ravel()
            d = d[~np.isnan(d)]
            reg.append(float(np.mean(per_inst)) if per_inst else float("nan"))
            ci.append(_ci(d) if len(d) else float("nan"))
            mst.append(float(np.nanmean(st[m][:, :, g])))
        out["policies"][m] = {"mean_st": mst, "regret": reg, "regret_ci95": ci, "regret_vs_round_oracle": reg_oracle,
                              "best_arm_ratio": float(np.mean(res["best_ratio"][m])),
                              "best_arm_ratio_ci95": _ci(np.asarray(res["best_ratio"][m]))}
    out["best_fixed_arm"] = [labels[b] for b in best[:, -1]] if best.size else []
    return out


def markdown_table(summary: dict, g: int = -1) -> str:
    full = sorted(set(summary.get("full_lengths") or []))
    n = (f"the full generation ({full[0]} tokens)" if len(full) == 1 else
         f"each instance's full generation ({full[0]}–{full[-1]} tokens)") if g == -1 and full else \
        f"{summary['lengths'][g]} tokens"
    unit = summary.get("measure", "rounds")
    lines = [f"Stopping time ({unit}) at {n}; regret vs the best fixed arm in hindsight (95% interval) and vs "
             f"the per-round oracle.", "",
             "| method | mean ST | regret | 95% CI | regret vs round-oracle | best-arm ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, d in summary["fixed"].items():
        lines.append(f"| fixed {name} | {d['mean_st'][g]:.1f} | | | | |")
    if "round_oracle" in summary:
        lines.append(f"| per-round oracle | {summary['round_oracle']['mean_st'][g]:.1f} | | | | |")
    for name, d in sorted(summary["policies"].items(), key=lambda kv: kv[1]["regret"][g]):
        lines.append(f"| {name} | {d['mean_st'][g]:.1f} | {d['regret'][g]:.1f} | ±{d['regret_ci95'][g]:.1f} | "
                     f"{d.get('regret_vs_round_oracle', [float('nan')] * (g + 1 if g >= 0 else 1))[g]:.1f} | "
                     f"{d['best_arm_ratio']:.3f} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = np.asarray(summary["lengths"], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, d in summary["policies"].items():
        y, c = np.asarray(d["regret"][:len(x)]), np.asarray(d["regret_ci95"][:len(x)])
        ax.plot(x, y, marker="o", ms=3, label=name)
        ax.fill_between(x, y - c, y + c, alpha=0.15)
    ax.set_xscale("log")
    ax.set_xlabel("generation length (tokens)")
    ax.set_ylabel(f"stopping-time regret ({summary.get('measure', 'rounds')})")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", help="replay counterfactual traces (JSON from `decode eval --record-traces`)")
    p.add_argument("--p", default="0.3,0.5,0.6,0.7,0.8", help="synthetic: per-arm acceptance probabilities")
    p.add_argument("--L", default="4", help="synthetic: speculation length, one value or one per arm")
    p.add_argument("--switch-at", type=int, help="synthetic: after this many tokens the arms use --p-after")
    p.add_argument("--p-after", help="synthetic: acceptance probabilities after the switch")
    p.add_argument("--concentration", type=float, default=4.0,
                   help="synthetic: κ of the per-position acceptance α ~ Beta(κp, κ(1-p)); 0 = α = p")
    p.add_argument("--draft-cost", type=float, default=0.0,
                   help="synthetic: time per drafted token (1 = one verification)")
    p.add_argument("--verify-cost", type=float, default=0.0,
                   help="synthetic: extra verification time per drafted token")
    p.add_argument("--length", type=int, default=10000, help="synthetic: generation length in tokens")
    p.add_argument("--points", type=int, default=9, help="lengths on the log grid of the regret curve")
    p.add_argument("--measure", choices=("rounds", "time"), default="rounds",
                   help="stopping time in target forwards, or in time (synthetic: 1 per verification + "
                        "--draft-cost/--verify-cost per drafted token; replay: recorded seconds)")
    p.add_argument("--seeds", type=int, default=20, help="runs per method (synthetic) or per trace (replay)")
    p.add_argument("--policies", help="policy specs separated by ';' or spaces (default: every registered policy "
                   "but fixed, with default parameters)")
    p.add_argument("--out", default="runs/simulate/report.json", help="JSON report (.md and .png beside it)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--force", action="store_true",
                   help="replace a file at --out (or its .md/.png) that this tool did not write (refused otherwise)")


def _own_png(path: Path) -> bool:
    """A figure matplotlib wrote (its PNG names the software in a text chunk near the start)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(512)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"Matplotlib" in head


def check_outputs(out: Path, plot: bool, force: bool = False) -> None:
    """Before simulating: every output (report, table, plot) can be written, and none replaces a file this tool
    did not write (unless ``force``)."""
    if out.suffix in (".md", ".png"):
        raise UserError(f"--out {out}: the report is JSON, with its table (.md) and plot (.png) beside it; name the "
                        f"report e.g. {out.with_suffix('.json')}")
    outputs = [("--out", out, is_report_json),
               ("--out (table)", out.with_suffix(".md"), lambda p: starts_with(p, "# synthetic", "# replay"))]
    if plot:
        outputs.append(("--out (plot)", out.with_suffix(".png"), _own_png))
    for name, p, is_own in outputs:
        check_output_file(p, name)
        if not force:
            refuse_foreign(p, name, is_own, "--force")


def _grid(lo: int, hi: int, points: int) -> np.ndarray:
    return np.unique(np.round(np.logspace(math.log10(max(lo, 1)), math.log10(hi), max(points, 1))).astype(int))


def run(args) -> int:
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    if args.points < 1:
        raise UserError(f"--points must be >= 1, got {args.points}")
    check_outputs(Path(args.out), not args.no_plot, getattr(args, "force", False))
    specs = split_specs(args.policies) if args.policies else [n for n in policy_names() if n != "fixed"]
    if any(s.startswith("fixed") for s in specs):
        raise UserError("--policies: fixed arms are always simulated; list only adaptive policies")
    seeds = list(range(args.seeds))
    t0 = time.perf_counter()
    if args.traces:
        traces = load_traces(args.traces)
        labels, Ls = traces[0].arm_labels, traces[0].arm_L
        for t in traces:
            if t.arm_labels != labels:
                raise UserError(f"--traces: all traces must use the same arms; got {t.arm_labels} and {labels}")
        n_arms, max_len = len(labels), max(max(Ls), 1)
        lengths = _grid(min(4, min(t.n_tokens for t in traces)), min(t.n_tokens for t in traces), args.points)
        make = [(lambda s, t=t: ReplayInstance(t)) for t in traces]
        title = f"replay of {len(traces)} traces ({traces[0].mode})"
        config = {"mode": "replay", "traces": args.traces, "n_traces": len(traces), "trace_mode": traces[0].mode}
    else:
        p = _floats(args.p, "--p")
        if len(p) < 2 or not all(0 < x < 1 for x in p):
            raise UserError(f"--p: need at least two acceptance probabilities, each in (0, 1), got {args.p}")
        try:
            Ls = [int(x) for x in args.L.replace(";", ",").split(",") if x.strip()]
        except ValueError:
            Ls = []
        if len(Ls) == 1:
            Ls = Ls * len(p)
        if len(Ls) != len(p) or min(Ls) < 1:
            raise UserError(f"--L must be one integer >= 1 or one per arm ({len(p)} arms), got '{args.L}'")
        for flag, v in (("--concentration", args.concentration), ("--draft-cost", args.draft_cost),
                        ("--verify-cost", args.verify_cost)):
            if not (math.isfinite(v) and v >= 0):
                raise UserError(f"{flag} must be a finite number >= 0, got {v}")
        p_after = None
        if args.switch_at is not None or args.p_after:
            if args.switch_at is None or not args.p_after:
                raise UserError("--switch-at and --p-after go together "
                                "(e.g. --switch-at 2000 --p-after 0.8,0.7,0.6,0.5,0.3)")
            p_after = _floats(args.p_after, "--p-after")
            if len(p_after) != len(p) or not all(0 < x < 1 for x in p_after):
                raise UserError(f"--p-after: need {len(p)} probabilities, each in (0, 1), got {args.p_after}")
        if args.length < 2:
            raise UserError(f"--length must be >= 2 tokens, got {args.length}")
        if p_after is not None and not 1 <= args.switch_at < args.length:
            raise UserError(f"--switch-at must be a position in [1, {args.length - 1}] (inside --length "
                            f"{args.length}), got {args.switch_at}")
        n_arms, max_len = len(p), max(max(Ls), 1)
        labels = [f"p={pi:g},L={Li}" for pi, Li in zip(p, Ls)]
        lengths = _grid(min(100, args.length), args.length, args.points)
        make = [lambda s: SyntheticInstance(p, Ls, args.length, 1_000_003 * s + 17, args.concentration,
                                            args.switch_at, p_after, args.draft_cost, args.verify_cost)]
        title = f"synthetic {n_arms} arms, p={args.p}" + (f" → {args.p_after} at {args.switch_at}" if p_after else "")
        config = {"mode": "synthetic", "p": p, "L": Ls, "length": args.length, "switch_at": args.switch_at,
                  "p_after": p_after, "concentration": args.concentration, "draft_cost": args.draft_cost,
                  "verify_cost": args.verify_cost}
    for s in specs:  # fail fast on bad names/params
        build_policy(s, n_arms, max_len)
    res = simulate((make, seeds), specs, n_arms, max_len, lengths, progress=not args.no_progress,
                   measure=args.measure)
    summary = summarize(res, specs, n_arms, lengths, labels)
    summary["measure"] = args.measure
    summary["approx_steps"] = res["approx_steps"]
    elapsed = time.perf_counter() - t0
    config.update({"measure": args.measure, "policies": specs, "seeds": args.seeds, "arm_labels": labels,
                   "seconds": round(elapsed, 2)})
    out = Path(args.out)
    atomic_write_json(out, {"config": config, "summary": summary})
    table = markdown_table(summary)
    md = out.with_suffix(".md")
    atomic_write_text(md, f"# {title}\n\n{table}\n")
    if not args.no_plot:
        plot(summary, out.with_suffix(".png"), title)
    print(table)
    if res["approx_steps"]:
        print(f"\nnote: {res['approx_steps']} replayed rounds started at positions the trace did not record "
              "(round-mode trace); record with dense traces for exact replays")
    print(f"\nreport: {out}  table: {md}" + ("" if args.no_plot else f"  plot: {out.with_suffix('.png')}")
          + f"  ({elapsed:.1f} s)")
    return 0
