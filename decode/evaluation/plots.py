"""The evaluation report's pictures, drawn from report.json alone (so ``decode eval`` and ``decode report``
draw the same ones): PNG files beside report.md, linked from its "## Figures" section.

- ``speedup``: speed-up vs hf per category and overall, one bar per method (grouped bars);
- ``acceptance``: P(draft token i accepted | drafted) per position i, one curve per fixed arm;
- ``pulls``: which arm each policy played at round r of a query, as the fraction of prompts (stacked per
  arm), with the fraction of prompts still decoding at round r drawn over it (late rounds rest on few
  prompts); one panel per policy;
- ``mat_vs_length``: MAT (τ) against each fixed arm's draft length, one line per arm kind.

Figures are built on a bare ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no global backend
switch, nothing interactive), from sorted inputs and fixed colours, so the same report draws the same
bytes. A figure with nothing to draw (no policies, no arm that drafted) is skipped and says why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..common.io import atomic_path
from ..common.specs import parse_spec

HF = "hf"  # report.HF; not imported, so report.py can import this module lazily without a cycle
KINDS = ("speedup", "acceptance", "pulls", "mat_vs_length")


@dataclass
class Plot:
    """One figure of a report: ``figure`` None when there was nothing to draw (``note`` says why)."""

    kind: str  # one of KINDS; the file is ``<report stem>.<kind>.png``
    title: str
    note: str  # how to read it, or why it was skipped
    series: int = 0  # bars/curves drawn (per panel for ``pulls``)
    panels: int = 0
    figure: object | None = None  # matplotlib.figure.Figure


def _figure(width: float, height: float, panels: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    return fig, list(axes)


def _colour(i: int):
    """The i-th colour of a fixed qualitative palette (tab10, then tab20's lighter half)."""
    from matplotlib import colormaps
    return colormaps["tab10"](i % 10) if i < 10 else colormaps["tab20"]((2 * (i - 10) + 1) % 20)


def _arm_records(report: dict, label: str) -> list[dict]:
    return [r for r in report["records"] if r["method"] == f"arm:{label}"]


# ---- (a) speed-up per category --------------------------------------------------------------------------

def speedup_by_category(report: dict) -> Plot:
    """Grouped bars: x = each category and "all", one bar per method but hf (the 1.0 line)."""
    summary = report["summary"]
    methods = [m for m in summary if m != HF]
    cats = sorted(summary[HF]["per_category"]) if HF in summary else []
    title = "Speed-up vs hf per category"
    if not methods or not cats:
        return Plot("speedup", title, "no method besides hf to compare")
    groups = [*cats, "all"]
    fig, (ax,) = _figure(min(14.0, max(7.0, 1.0 + 0.12 * len(methods) * len(groups))), 5.0)
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        s = summary[m]
        ys = [s["per_category"][c]["speedup_vs_hf"] for c in cats] + [s["speedup_vs_hf"]]
        xs = [g + (j - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, ys, width=width, label=m, color=_colour(j))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    tilt = len(groups) > 6
    ax.set_xticks(range(len(groups)), groups, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.set_ylabel("speed-up vs hf (×, tokens/s ratio)")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return Plot("speedup", title, "bars above the dashed line are faster than plain HF `generate` "
                                  "(the table's MAT / ×hf columns)", len(methods), 1, fig)


# ---- (b) acceptance per position ---------------------------------------------------------------------------

def acceptance_by_position(report: dict) -> Plot:
    """One curve per fixed arm (its ``arm:<label>`` method): P(token i accepted | drafted) against i."""
    labels = report["config"]["arm_labels"]
    title = "Acceptance rate per draft position"
    curves = [(i, lab, report["summary"][f"arm:{lab}"]["acceptance_per_position"]) for i, lab in enumerate(labels)]
    drawn = [c for c in curves if c[2]]
    silent = [lab for _, lab, rates in curves if not rates]
    skipped = f"; {', '.join(silent)} drafted nothing (no curve)" if silent else ""
    if not drawn:
        return Plot("acceptance", title, "no fixed arm drafted a token" + skipped)
    fig, (ax,) = _figure(7.0, 4.5)
    for i, lab, rates in drawn:
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=lab, color=_colour(i))
    longest = max(len(c[2]) for c in drawn)
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylim(0.0, 1.05)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(token i accepted | drafted)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return Plot("acceptance", title, "over every round of each fixed arm: rounds whose accepted prefix reaches "
                                     "position i / rounds whose draft reaches it" + skipped, len(drawn), 1, fig)


# ---- (c) arm pulls over the rounds of a query -----------------------------------------------------------

def pull_fractions(records: list[dict], labels: list[str]) -> tuple[list[list[float]], list[float]]:
    """``(fractions[arm][round], running[round])``: among the prompts still decoding at round r, the share
    that played each arm; and the share of prompts still decoding at round r."""
    rounds = max((len(r["arms"]) for r in records), default=0)
    index = {lab: i for i, lab in enumerate(labels)}
    counts = [[0] * rounds for _ in labels]
    alive = [0] * rounds
    for r in records:
        for k, lab in enumerate(r["arms"]):
            counts[index[lab]][k] += 1
            alive[k] += 1
    fractions = [[c / n for c, n in zip(row, alive)] for row in counts]
    return fractions, [n / len(records) for n in alive] if records else []


def arm_pulls_by_round(report: dict) -> Plot:
    """One panel per policy: stacked shares of the arms played at round r over the prompts."""
    labels = report["config"]["arm_labels"]
    policies = [m for m in report["summary"] if m.startswith("policy:")]
    title = "Arm played at each round of a query"
    if not policies:
        return Plot("pulls", title, "no policies were evaluated, so there are no arm pulls to plot")
    fig, axes = _figure(8.0, 1.0 + 2.6 * len(policies), panels=len(policies))
    for ax, m in zip(axes, policies):
        fractions, running = pull_fractions([r for r in report["records"] if r["method"] == m], labels)
        xs = range(1, len(running) + 1)
        bottom = [0.0] * len(running)
        for i, (lab, ys) in enumerate(zip(labels, fractions)):
            ax.bar(xs, ys, width=1.0, bottom=bottom, color=_colour(i), label=lab, linewidth=0)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.plot(xs, running, color="black", linewidth=1.2, label="prompts still decoding")
        ax.set_xlim(0.5, max(len(running), 1) + 0.5)
        ax.set_ylim(0.0, 1.02)
        ax.set_ylabel("share of prompts")
        ax.set_title(m, fontsize="medium")
    axes[-1].set_xlabel("round of the query (1 = first target forward)")
    axes[0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    return Plot("pulls", title, "per policy, the share of prompts that played each arm at round r (stacked, "
                                "among the prompts still decoding then); the black line is the share still "
                                "decoding, so late rounds rest on few prompts", len(labels), len(policies), fig)


# ---- (d) MAT vs draft length ---------------------------------------------------------------------------------

def arm_lengths(report: dict) -> list[tuple[str, str, int]]:
    """``(label, kind, L)`` per fixed arm: kind = the spec's name (``pld``, ``drafter``; the label's part
    before ``@`` in an early report whose ``config.arms`` is not one spec per label), L = the spec's ``L=``
    when given, else the longest draft the arm made (its default L in practice; 0 for ``none``)."""
    cfg = report["config"]
    labels, specs = cfg["arm_labels"], cfg.get("arms") or []
    out = []
    for i, lab in enumerate(labels):
        kind, params = parse_spec(specs[i]) if len(specs) == len(labels) else (lab.partition("@")[0], {})
        if "L" in params:
            length = int(params["L"])
        else:
            length = max((d for r in _arm_records(report, lab) for d in r["drafted"]), default=0)
        out.append((lab, kind, length))
    return out


def mat_by_draft_length(report: dict) -> Plot:
    """x = draft length L, y = the fixed arm's MAT (τ); arms of one kind joined by a line."""
    title = "MAT (τ) vs draft length per arm"
    arms = arm_lengths(report)
    if not arms:
        return Plot("mat_vs_length", title, "no fixed arms")
    kinds = list(dict.fromkeys(kind for _, kind, _ in arms))
    fig, (ax,) = _figure(7.0, 4.5)
    for j, kind in enumerate(kinds):
        pts = sorted((length, report["summary"][f"arm:{lab}"]["mat"], lab) for lab, k, length in arms if k == kind)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind, color=_colour(j))
        for x, y, lab in pts:
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    ax.margins(x=0.12, y=0.1)  # room for the labels of the outermost points
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("draft length L (the spec's L=, else the longest draft made)")
    ax.set_ylabel("MAT τ (tokens per target forward)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return Plot("mat_vs_length", title, "one point per fixed arm, arms of one kind joined; the dashed line is "
                                        "autoregressive decoding (τ = 1)", len(kinds), 1, fig)


# ---- writing ----------------------------------------------------------------------------------------------------

PLOTTERS = (speedup_by_category, acceptance_by_position, arm_pulls_by_round, mat_by_draft_length)


def figure_path(report_path: str | os.PathLike, kind: str) -> Path:
    """``runs/x/report.json`` → ``runs/x/report.<kind>.png`` (two reports in one folder never collide)."""
    p = Path(report_path)
    return p.with_name(f"{p.stem}.{kind}.png")


def write_figures(report: dict, report_path: str | os.PathLike) -> list[tuple[Plot, Path | None]]:
    """Draw every figure and save it beside the report; a skipped figure's stale file from an earlier run is
    removed (it would describe other records)."""
    out = []
    for plotter in PLOTTERS:
        plot = plotter(report)
        path = figure_path(report_path, plot.kind)
        if plot.figure is None:
            path.unlink(missing_ok=True)
            out.append((plot, None))
            continue
        with atomic_path(path) as tmp:
            plot.figure.savefig(tmp, format="png", metadata={"Software": None})
        out.append((plot, path))
    return out


def figures_markdown(written: list[tuple[Plot, Path | None]]) -> str:
    """The report.md section: each figure linked by its file name (it sits beside report.md) with its
    reading note; a skipped one says why."""
    lines = ["## Figures", ""]
    for plot, path in written:
        if path is None:
            lines += [f"- {plot.title}: not drawn ({plot.note}).", ""]
        else:
            note = plot.note[0].upper() + plot.note[1:]
            lines += [f"### {plot.title}", "", f"![{plot.title}]({quote(path.name)})", "", f"{note}.", ""]
    return "\n".join(lines).rstrip() + "\n"
