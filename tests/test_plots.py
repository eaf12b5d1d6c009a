"""decode/evaluation/plots.py and the per-position acceptance metric: each figure draws the series the report holds
(checked on the matplotlib objects), skips with a reason when there is nothing to draw, and ``decode
report`` writes the PNGs beside report.md, links them, draws the same bytes twice and honours --no-plots.
Hand-made records, no model: fast."""
import json

import pytest

from decode.evaluation import plots
from decode.common.metrics import acceptance_per_position
from decode.evaluation.report import AR, FORMAT, HF, build_report

LABELS = ["pld@2", "pld@4", "suffix@3", "none"]
SPECS = ["pld:L=2", "pld", "suffix:L=3", "none"]  # pld without L=: its length is the longest draft it made
PROMPTS = [["p0", "code", "d0"], ["p1", "code", "d1"], ["p2", "chat", "d2"]]


def _rec(method, pid, cat, acc, drafted, arms=(), wall=1.0):
    n = sum(acc) + len(acc)  # every round emits its accepted tokens plus one from the target
    return {"method": method, "prompt_id": pid, "category": cat, "new_tokens": n, "rounds": len(acc),
            "accept_lengths": list(acc), "drafted": list(drafted), "arms": list(arms), "wall_time": wall,
            "token_ids": [7] * n}


def hand_made(policies=("policy:ucbspec", "policy:exp3spec")):
    """(header, records) of a 3-prompt run: 4 fixed arms, the given policies; the token ids all equal, so
    every method is lossless."""
    methods = [{"name": HF, "kind": "hf"}, {"name": AR, "kind": "autoregressive"}]
    methods += [{"name": f"arm:{lab}", "kind": "arm"} for lab in LABELS]
    methods += [{"name": p, "kind": "policy"} for p in policies]
    recs = []
    for i, (pid, cat, _) in enumerate(PROMPTS):
        recs += [_rec(HF, pid, cat, [0] * 8, [0] * 8, wall=2.0), _rec(AR, pid, cat, [0] * 8, [0] * 8, wall=1.9)]
        recs += [_rec("arm:pld@2", pid, cat, [2, 1, 0, 2], [2, 2, 2, 2], ["pld@2"] * 4, wall=1.0),
                 _rec("arm:pld@4", pid, cat, [4, 0, 3], [4, 4, 3 + i % 2], ["pld@4"] * 3, wall=0.9),
                 _rec("arm:suffix@3", pid, cat, [1, 1, 0, 3, 0], [3, 1, 3, 3, 0], ["suffix@3"] * 5, wall=1.2),
                 _rec("arm:none", pid, cat, [0] * 8, [0] * 8, ["none"] * 8, wall=1.9)]
        for p in policies:  # one more round on later prompts: fewer prompts reach the last rounds
            arms = ["pld@2", "suffix@3", "none", "pld@4", "pld@4"][:3 + i]
            recs.append(_rec(p, pid, cat, [1] * len(arms), [1] * len(arms), arms, wall=1.1))
    header = {"format": FORMAT, "config": {"temperature": 0.0, "arms": SPECS, "max_new_tokens": 8},
              "prompts": PROMPTS, "methods": methods, "arm_labels": LABELS}
    return header, recs


@pytest.fixture(scope="module")
def report():
    return build_report(*hand_made())[0]


def test_acceptance_per_position_conditions_on_the_draft_reaching_the_position():
    # position 1: 3 drafts, 2 accepted; position 2: 2 drafts reach it, 1 accepted; position 3: 1, 0
    assert acceptance_per_position([2, 0, 1], [3, 2, 1]) == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert acceptance_per_position([0, 0], [0, 0]) == []
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        acceptance_per_position([3], [2])


def test_summary_names_tau_and_the_per_position_curve(report):
    s = report["summary"]["arm:pld@2"]
    assert report["schema_version"] == "adaspec-eval-report/2"
    assert s["tau"] == s["mat"] == pytest.approx(9 / 4)  # 5 accepted + 4 target tokens in 4 rounds
    assert s["acceptance_per_position"] == pytest.approx([3 / 4, 2 / 4])
    assert s["per_category"]["chat"]["acceptance_per_position"] == pytest.approx([3 / 4, 2 / 4])
    assert report["summary"][HF]["acceptance_per_position"] == []


def test_speedup_bars_one_series_per_method_but_hf(report):
    plot = plots.speedup_by_category(report)
    ax = plot.figure.axes[0]
    methods = [m for m in report["summary"] if m != HF]
    assert plot.series == len(ax.containers) == len(methods) == 8  # ar, 4 arms, 2 policies, oracle
    groups = [t.get_text() for t in ax.get_xticklabels()]
    assert groups == ["chat", "code", "all"]
    for bars, m in zip(ax.containers, methods):
        s = report["summary"][m]
        want = [s["per_category"]["chat"]["speedup_vs_hf"], s["per_category"]["code"]["speedup_vs_hf"],
                s["speedup_vs_hf"]]
        assert [b.get_height() for b in bars] == pytest.approx(want), m


def test_acceptance_curves_per_arm_that_drafted(report):
    plot = plots.acceptance_by_position(report)
    lines = plot.figure.axes[0].get_lines()
    assert plot.series == len(lines) == 3 and "none drafted nothing" in plot.note
    by = {ln.get_label(): ln for ln in lines}
    assert list(by) == ["pld@2", "pld@4", "suffix@3"]
    assert list(by["pld@4"].get_xdata()) == [1, 2, 3, 4]
    assert list(by["pld@4"].get_ydata()) == pytest.approx(report["summary"]["arm:pld@4"]["acceptance_per_position"])


def test_pull_fractions_stack_to_one_among_prompts_still_decoding():
    recs = [{"arms": ["a", "b"]}, {"arms": ["a", "a", "b"]}]
    fractions, running = plots.pull_fractions(recs, ["a", "b"])
    assert fractions == [[1.0, 0.5, 0.0], [0.0, 0.5, 1.0]]
    assert running == [1.0, 1.0, 0.5]


def test_pulls_one_panel_per_policy_one_series_per_arm(report):
    plot = plots.arm_pulls_by_round(report)
    assert plot.panels == 2 and plot.series == len(LABELS)
    axes = plot.figure.axes
    assert [ax.get_title() for ax in axes] == ["policy:ucbspec", "policy:exp3spec"]
    for ax in axes:
        assert len(ax.containers) == len(LABELS)  # one stacked bar series per arm
        assert len(ax.containers[0]) == 5  # the longest query had 5 rounds
        tops = [sum(bars[r].get_height() for bars in ax.containers) for r in range(5)]
        assert tops == pytest.approx([1.0] * 5)
        (running,) = ax.get_lines()
        assert list(running.get_ydata()) == pytest.approx([1, 1, 1, 2 / 3, 1 / 3])


def test_mat_vs_length_one_line_per_arm_kind(report):
    plot = plots.mat_by_draft_length(report)
    lines = {ln.get_label(): ln for ln in plot.figure.axes[0].get_lines() if not ln.get_label().startswith("_")}
    assert plot.series == len(lines) == 3
    assert list(lines["pld"].get_xdata()) == [2, 4]  # pld@4's spec has no L=: its longest draft, 4
    s = report["summary"]
    assert list(lines["pld"].get_ydata()) == pytest.approx([s["arm:pld@2"]["mat"], s["arm:pld@4"]["mat"]])
    assert list(lines["none"].get_xdata()) == [0]


def _write_run(tmp_path, header, recs):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in [header, *recs]))
    return tmp_path


def test_report_command_writes_linked_deterministic_figures(tmp_path, capsys):
    from decode.commands.cli import main
    run = _write_run(tmp_path, *hand_made())
    assert main(["report", str(run)]) == 0
    pngs = {k: run / f"report.{k}.png" for k in plots.KINDS}
    first = {k: p.read_bytes() for k, p in pngs.items()}
    for k, data in first.items():
        assert data.startswith(b"\x89PNG") and len(data) > 5000, k
    md = (run / "report.md").read_text()
    assert "## Figures" in md and md.index("| method |") < md.index("## Figures")
    for k in plots.KINDS:
        assert f"](report.{k}.png)" in md
    assert main(["report", str(run)]) == 0
    assert {k: p.read_bytes() for k, p in pngs.items()} == first  # same records, same bytes

    # --no-plots: no section, no new files
    other = tmp_path / "other.json"
    assert main(["report", str(run), "--out", str(other), "--no-plots"]) == 0
    assert "## Figures" not in other.with_suffix(".md").read_text()
    assert not list(tmp_path.glob("other.*.png"))


def test_without_policies_the_pulls_figure_is_skipped_and_says_why(tmp_path):
    from decode.commands.cli import main
    run = _write_run(tmp_path, *hand_made())
    assert main(["report", str(run)]) == 0 and (run / "report.pulls.png").exists()
    _write_run(tmp_path, *hand_made(policies=()))  # the same folder rerun without policies
    assert main(["report", str(run)]) == 0
    assert not (run / "report.pulls.png").exists()  # the stale figure of the earlier records is gone
    md = (run / "report.md").read_text()
    assert "not drawn (no policies were evaluated" in md and "report.pulls.png" not in md
    assert (run / "report.speedup.png").exists()
