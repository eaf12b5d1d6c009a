"""`decode compare` on two real (tiny-model) evaluations, the run record every eval folder keeps (config,
versions, git commit, figures), and docs/report_schema.md against a real report.json in both directions."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from decode.commands.cli import main
from decode.core.linear import onednn_usable

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["eval", "--no-progress", "--policies", "ucbspec", "--categories", "code,summarization"]


@pytest.fixture(scope="module")
def runs(tiny_target_dir, tmp_path_factory, one_thread):
    """A: four arms (two pld lengths), a peer, 12 tokens; B: two of those arms, no peer, 8 tokens."""
    base = tmp_path_factory.mktemp("compare")
    a, b = base / "a", base / "b" / "short.json"
    assert main([*COMMON, "--target", tiny_target_dir, "--arms", "pld:L=2;pld:L=3;suffix:L=4;none",
                 "--peers", "hf-pld:L=2", "--max-new-tokens", "12", "--out", str(a / "report.json")]) == 0
    assert main([*COMMON, "--target", tiny_target_dir, "--arms", "pld:L=2;suffix:L=4", "--max-new-tokens", "8",
                 "--out", str(b)]) == 0
    return a, b


def test_an_eval_folder_records_config_versions_commit_and_figures(runs):
    a, _ = runs
    rep = json.loads((a / "report.json").read_text())
    cfg = rep["config"]
    assert rep["schema_version"] == "adaspec-eval-report/2"
    assert cfg["max_new_tokens"] == 12 and cfg["arms"] == ["pld:L=2", "pld:L=3", "suffix:L=4", "none"]
    assert {"torch", "transformers", "python", "platform", "threads", "time"} <= cfg.keys()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert cfg["git_commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert isinstance(cfg["git_dirty"], bool) or cfg["git_commit"] == "unknown"
    md = (a / "report.md").read_text()
    for kind in ("speedup", "acceptance", "pulls", "mat_vs_length"):
        png = a / f"report.{kind}.png"
        assert png.read_bytes().startswith(b"\x89PNG"), kind
        assert f"](report.{kind}.png)" in md
    header = json.loads((a / "records.jsonl").read_text().splitlines()[0])
    assert header["environment"]["git_commit"] == cfg["git_commit"]


def test_git_state_outside_a_checkout_is_unknown(tmp_path):
    from decode.evaluation.evaluate import git_state
    assert git_state(tmp_path) == {"git_commit": "unknown", "git_dirty": None}


# ---- the schema document ---------------------------------------------------------------------------------

DYNAMIC = {"summary": "<method>", "per_category": "<category>", "arm_pulls": "<arm>", "peer_settings": "<peer>",
           "draft_lengths": "<arm>"}
FREE_FORM = ("config.peer_settings.<peer>", "summary.<method>.draft_lengths.<arm>", "cost_curve.steps",
             "cost_curve.one_token_ms", "config.linear_probe.ms", "config.attention_probe.ms")


def field_paths(obj, prefix="", placeholder=None, out=None) -> set[str]:
    """Every field of a report as the schema names it (``records[].x``, ``summary.<method>.mat``): the keys
    under a DYNAMIC field become its placeholder; a peer's settings and a length histogram are free-form, so
    not descended."""
    out = set() if out is None else out
    if isinstance(obj, list):
        for x in obj:
            field_paths(x, prefix + "[]", None, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}.{placeholder or k}" if prefix else k
            out.add(path)
            if path not in FREE_FORM:
                field_paths(v, path, DYNAMIC.get(k) if placeholder is None else None, out)
    return out


def documented() -> dict[str, str]:
    """``{field path: present column}`` from the tables of docs/report_schema.md."""
    text = (ROOT / "docs" / "report_schema.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", text, flags=re.M)
    return {path: present.strip() for path, present in rows}


def test_every_report_field_is_documented_and_every_documented_one_present(runs):
    a, _ = runs
    rep = json.loads((a / "report.json").read_text())
    actual, doc = field_paths(rep), documented()
    assert "summary.<method>.per_category.<category>.tau" in actual and "config.peer_settings.<peer>" in actual
    undocumented = sorted(actual - doc.keys())
    assert not undocumented, f"fields of report.json missing from docs/report_schema.md: {undocumented}"
    # run A has peers, policies and an oracle: only the CUDA-only field and compile information (run A
    # compiles nothing and uses no cost controller; tests/test_evaluate.py checks a compiled run's fields) may be absent
    # on this CPU
    packs = onednn_usable("cpu", torch.float32) is None  # --linear auto measures only where packing runs
    expected = {p for p, present in doc.items()
                if present not in ("on CUDA", "when anything compiled") and "--length cost" not in present
                and (packs or "oneDNN packing is usable" not in present)}
    assert not expected - actual, f"documented but absent from a real report: {sorted(expected - actual)}"
    assert rep["schema_version"] in (ROOT / "docs" / "report_schema.md").read_text().splitlines()[0]


# ---- decode compare --------------------------------------------------------------------------------------------

def test_compare_prints_per_method_differences_and_warns_on_config(runs, capsys):
    a, b = runs
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning: the runs differ in"))
    assert "--max-new-tokens (12 vs 8)" in warning and "--arms/--pool" in warning
    assert "only in A: hf-pld:L=2, arm:pld@3, arm:none" in out and "only in B" not in out
    ra = json.loads((a / "report.json").read_text())["summary"]["arm:pld@2"]
    rb = json.loads(b.read_text())["summary"]["arm:pld@2"]
    row = next(line for line in out.splitlines() if line.startswith("| arm:pld@2 |"))
    assert f"{ra['mat']:.2f} → {rb['mat']:.2f}" in row and row.endswith("| yes / yes |")


def test_compare_json_holds_deltas_for_the_methods_in_both(runs, capsys):
    a, b = runs
    assert main(["compare", str(a / "records.jsonl"), str(b), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    sa = json.loads((a / "report.json").read_text())["summary"]
    sb = json.loads(b.read_text())["summary"]
    assert list(res["methods"]) == [m for m in sa if m in sb]
    assert {d["field"] for d in res["config_differences"]} == {"max_new_tokens", "arms"}
    for m, row in res["methods"].items():
        assert row["mat"]["delta"] == pytest.approx(sb[m]["mat"] - sa[m]["mat"]), m
        assert row["tokens_per_s"]["delta"] == pytest.approx(sb[m]["tokens_per_s"] / sa[m]["tokens_per_s"] - 1), m
        assert row["lossless"] == {"a": sa[m]["lossless"], "b": sb[m]["lossless"]}
    assert res["b"]["source"].endswith("short.records.jsonl")


def test_compare_a_run_with_itself_and_a_report_kept_without_records(runs, tmp_path, capsys):
    a, _ = runs
    assert main(["compare", str(a), str(a / "report.json"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config_differences"] == [] and res["only_in_a"] == res["only_in_b"] == []
    assert all(row["mat"]["delta"] == 0 for row in res["methods"].values())

    old = json.loads((a / "report.json").read_text())  # an older run: no records file, fewer config fields
    for s in old["summary"].values():
        del s["acceptance_rate"]
    del old["config"]["git_commit"], old["config"]["threads"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["compare", str(tmp_path / "old.json"), str(a)]) == 0
    out = capsys.readouterr().out
    assert "A: " + str(tmp_path / "old.json") + "  (commit not recorded" in out
    assert "config.threads (not recorded vs 1)" in out
    assert re.search(r"\| — → \d+\.\d\d \|", out)  # the missing acceptance rate shows as —


def test_compare_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nowhere.json"), str(tmp_path / "nowhere.json")]) == 2
    assert "no records file" in capsys.readouterr().err
    bad = tmp_path / "x.json"
    bad.write_text('{"a": 1}')
    assert main(["compare", str(bad), str(bad)]) == 2
    assert "not a `decode eval` report" in capsys.readouterr().err
