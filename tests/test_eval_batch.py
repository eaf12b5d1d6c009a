"""`decode eval --batch` (issue 32 §3, decode/evaluation/batched.py): every method at every batch size, rows
checked against their plain greedy decoding, a figure, a resumable records file, and what cannot batch refused
before any model loads."""
import json

import pytest

from decode.commands.cli import main
from decode.common.errors import UserError
from decode.evaluation.batched import SEGMENT, build_batch_report


def _eval(tiny_target_dir, out, *extra):
    return main(["eval", "--target", tiny_target_dir, "--batch", "1,3", "--limit", "1", "--max-new-tokens", "10",
                 "--categories", "chat,code,math", "--out", str(out), "--no-progress", *extra])


def test_every_method_at_every_batch_size_with_lossless_rows_and_a_figure(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "r" / "report.json"
    assert _eval(tiny_target_dir, out) == 0
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["1", "3"]
    want = ["hf", "batch:none", "batch:pld:L=4", "batch:suffix:L=6", "batch:pld:L=4+schedule", "batch:pld:L=4+ema",
            "batch:ucbspec+cost", "batch:exp3spec+cost"]
    for B, cells in report["results"].items():
        assert list(cells) == want
        for name, c in cells.items():
            assert c["rows"] == 3 and c["tokens"] > 0 and c["goodput"] > 0 and c["p95"] >= c["p50"] > 0
            assert c["mat"] >= 1.0
            # a row may differ from its plain greedy decoding only where the target itself nearly ties
            assert c["lossless_rows"] + len(c["differs_at"]) == 3
            assert all(d["top2_margin"] is not None and d["top2_margin"] < 1e-3 for d in c["differs_at"]), d
    assert set(report["summary"]["3"]) == {"best_baseline", "batch:ucbspec+cost", "batch:exp3spec+cost"}
    assert (out.parent / "report.goodput_vs_batch.png").stat().st_size > 1000
    md = (out.parent / "report.md").read_text()
    assert md.startswith("| method | B |") and "goodput_vs_batch.png" in md
    # at B = 3 the rows shared rounds: 3 prompts, fewer rounds than at B = 1 for the unspeculated engine
    records = [json.loads(x) for x in (out.parent / "records.jsonl").read_text().splitlines()]
    assert records[0]["format"] == "adaspec-batch-eval-records/1"
    assert records[0]["forward"] == "lean"  # the blocks ran decode/core/lean.py's loop (--forward auto)
    assert sum(r["kind"] == "reference" for r in records[1:] if "kind" in r) == 3


def test_an_interrupted_run_resumes_where_it_stopped(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert _eval(tiny_target_dir, out) == 0
    records = out.with_name("records.jsonl")
    lines = records.read_text().splitlines(keepends=True)
    runs = [x for x in lines if '"segment"' in x]
    keep = lines[:len(lines) - len(runs) // 2]
    records.write_text("".join(keep) + '{"B": 3, "segm')  # killed mid-write
    first = json.loads(out.read_text())
    assert _eval(tiny_target_dir, out) == 0
    again = [json.loads(x) for x in records.read_text().splitlines()]
    assert len([r for r in again if "segment" in r]) == len(runs)  # the missing runs decoded once, nothing twice
    assert {(r["B"], r["segment"], r["method"]) for r in again if "segment" in r} == \
        {(r["B"], r["segment"], r["method"]) for r in map(json.loads, runs)}
    report = json.loads(out.read_text())
    for B in ("1", "3"):
        assert {k: v["lossless_rows"] for k, v in report["results"][B].items()} == \
            {k: v["lossless_rows"] for k, v in first["results"][B].items()}
    # other settings never mix into the same records
    assert main(["eval", "--target", tiny_target_dir, "--batch", "1,3", "--limit", "1", "--max-new-tokens", "11",
                 "--categories", "chat,code,math", "--out", str(out), "--no-progress"]) != 0
    assert "--max-new-tokens (was 10, now 11)" in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["--batch", "0"], "--batch must be distinct integers >= 1"),
    (["--batch", "2,2"], "--batch must be distinct integers >= 1"),
    (["--batch", "two"], "--batch must be distinct integers >= 1"),
    (["--batch", "2", "--arms", "eagle:path=pretrained/smollm2-135m-instruct/eagle,tree=dynamic"], "serially only"),
    (["--batch", "2", "--policies", "nosuch"], "nosuch"),
    (["--batch", "2", "--peers", "hf-pld:n=3"], "--peers is not part of a batched evaluation"),
    (["--batch", "2", "--length", "beta-ts"], "--length is not part of a batched evaluation"),
    (["--batch", "2", "--batch-schedule", "1-2"], "--batch-schedule"),
    (["--batch", "2", "--batch-ema", "a"], "--batch-ema"),
])
def test_what_cannot_batch_is_refused_before_any_model_loads(extra, needle, tmp_path):
    from decode.evaluation.eval_config import EvalConfig
    from decode.evaluation.evaluate import add_arguments
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(UserError, match=needle):
        EvalConfig.from_args(p.parse_args(["--target", str(tmp_path / "no-such-model"), "--out",
                                           str(tmp_path / "r.json"), *extra]))


def test_the_report_compares_the_adaptive_method_with_the_best_baseline():
    header = {"methods": ["hf", "batch:none", "batch:ucbspec+cost"], "config": {}, "prompts": [["a"], ["b"]]}
    rows = lambda n, lat: [{"prompt_id": "a", "token_ids": [1] * n, "latency": lat, "forwards": n},  # noqa: E731
                           {"prompt_id": "b", "token_ids": [2] * n, "latency": 2 * lat, "forwards": n // 2}]
    records = [{"kind": "reference", "prompt_id": "a", "token_ids": [1] * 8},
               {"kind": "reference", "prompt_id": "b", "token_ids": [2] * 7 + [3]},
               {"B": 2, "segment": 0, "method": "hf", "seconds": 2.0, "rows": rows(8, 1.0)},
               {"B": 2, "segment": 0, "method": "batch:none", "seconds": 1.0, "rows": rows(8, 0.5)},
               {"B": 2, "segment": 0, "method": "batch:ucbspec+cost", "seconds": 0.8, "rows": rows(8, 0.4)}]
    r = build_batch_report(header, records, margins={"b@7": 0.0001})
    cells = r["results"]["2"]
    assert cells["hf"]["goodput"] == 8 and cells["batch:none"]["goodput"] == 16
    assert cells["batch:ucbspec+cost"]["goodput"] == 20 and cells["batch:ucbspec+cost"]["mat"] == 16 / 12
    assert cells["batch:none"]["lossless_rows"] == 1
    assert cells["batch:none"]["differs_at"] == [{"prompt_id": "b", "position": 7, "top2_margin": 0.0001}]
    assert r["summary"]["2"]["best_baseline"] == "batch:none"
    assert r["summary"]["2"]["batch:ucbspec+cost"] == {"vs_best_baseline": 1.25, "vs_hf": 2.5,
                                                        "vs_best_baseline_per_pass": [1.25]}
    assert SEGMENT >= 1
    # a second pass over the suite (--batch-repeat 2) in which the machine ran slower for the adaptive method
    records += [{"B": 2, "segment": 1, "pass": 1, "method": "hf", "seconds": 2.0, "rows": rows(8, 1.0)},
                {"B": 2, "segment": 1, "pass": 1, "method": "batch:none", "seconds": 1.0, "rows": rows(8, 0.5)},
                {"B": 2, "segment": 1, "pass": 1, "method": "batch:ucbspec+cost", "seconds": 1.6, "rows": rows(8, 0.8)}]
    r = build_batch_report(header, records)
    cost = r["results"]["2"]["batch:ucbspec+cost"]
    assert cost["goodput_per_pass"] == [20, 10] and cost["goodput"] == pytest.approx(32 / 2.4) and cost["rows"] == 4
    assert r["summary"]["2"]["batch:ucbspec+cost"]["vs_best_baseline_per_pass"] == [1.25, 0.625]


def test_repeated_passes_over_the_suite(tiny_target_dir, tmp_path):
    out = tmp_path / "report.json"
    assert main(["eval", "--target", tiny_target_dir, "--batch", "2", "--batch-repeat", "2", "--limit", "1",
                 "--max-new-tokens", "6", "--categories", "chat,code", "--policies", "ucbspec", "--out", str(out),
                 "--no-progress", "--no-plots"]) == 0
    report = json.loads(out.read_text())
    for c in report["results"]["2"].values():
        assert c["rows"] == 4 and len(c["goodput_per_pass"]) == 2 and all(g > 0 for g in c["goodput_per_pass"])
    assert len(report["summary"]["2"]["batch:ucbspec+cost"]["vs_best_baseline_per_pass"]) == 2
    assert "goodput per pass" in out.with_suffix(".md").read_text()
    records = [json.loads(x) for x in out.with_name("records.jsonl").read_text().splitlines()]
    assert {(r["segment"], r["pass"]) for r in records if "segment" in r} == {(0, 0), (1, 1)}
    with pytest.raises(UserError, match="--batch-repeat must be an integer >= 1"):
        from decode.evaluation.eval_config import EvalConfig
        EvalConfig(batch_repeat=0).check_ranges()


def test_each_method_keeps_one_engine_and_a_carried_policy_serves_every_row(tiny_target_dir, tmp_path, monkeypatch):
    """As a server: each method's engine (what it learnt: block costs, acceptance, a round's own work) lives across
    its segments, and a carry=true policy is one object for all its rows; without carry=true every row gets its
    own."""
    import decode.evaluation.batched as batched
    built, engines = [], []
    real_policy, real_engine = batched.build_policy, batched.BatchEngine
    monkeypatch.setattr(batched, "build_policy", lambda spec, *a, **k: built.append(spec) or real_policy(spec, *a, **k))
    monkeypatch.setattr(batched, "BatchEngine", lambda *a, **k: engines.append(1) or real_engine(*a, **k))
    out = tmp_path / "report.json"
    assert main(["eval", "--target", tiny_target_dir, "--batch", "2", "--batch-repeat", "2", "--limit", "1",
                 "--max-new-tokens", "6", "--categories", "chat,code", "--policies", "ucbspec:carry=true;ucbspec",
                 "--out", str(out), "--no-progress", "--no-plots"]) == 0
    report = json.loads(out.read_text())
    assert all(c["lossless_rows"] == 4 for c in report["results"]["2"].values())
    assert built.count("ucbspec:carry=true") == 1 + 1  # the check before the model loads, then one for every row
    assert built.count("ucbspec") == 1 + 4  # checked, then its own for each of the 2 passes × 2 rows
    methods = len(report["results"]["2"]) - 1  # every method but hf runs our engine
    assert len(engines) == methods + 1  # one each, plus the warm-up's


def test_our_engines_decode_a_segment_in_lockstep_and_hf_alone_by_turns(tiny_target_dir, tmp_path, monkeypatch):
    """Our engines take one round each in turn (the machine's drift meets them alike), each timed on its own clock
    (a row's latency is that clock when it finished: the last row's is the engine's seconds); HF runs alone, before
    them in one segment and after them in the next."""
    import decode.evaluation.batched as batched
    from decode.engine.batch import BatchEngine
    calls = []  # the engines themselves (kept alive, so no two are confused); "hf", "ours": a segment's run begins
    real_step, real_hf, real_lockstep = BatchEngine.step, batched._hf_segment, batched._lockstep
    monkeypatch.setattr(BatchEngine, "step", lambda self: calls.append(self) or real_step(self))
    monkeypatch.setattr(batched, "_hf_segment", lambda *a, **k: calls.append("hf") or real_hf(*a, **k))
    monkeypatch.setattr(batched, "_lockstep", lambda *a, **k: calls.append("ours") or real_lockstep(*a, **k))
    out = tmp_path / "report.json"
    assert main(["eval", "--target", tiny_target_dir, "--batch", "2", "--batch-repeat", "2", "--limit", "1",
                 "--max-new-tokens", "6", "--categories", "chat,code", "--policies", "ucbspec", "--out", str(out),
                 "--no-progress", "--no-plots"]) == 0
    runs = [c for c in calls if isinstance(c, str)]
    assert runs == ["hf", "ours", "ours", "hf"]  # segment 0: HF first; segment 1: HF last
    first, second = calls.index("ours"), calls.index("ours", calls.index("ours") + 1)
    segments = calls[first + 1:second], calls[second + 1:-1]
    engines = set(segments[0])
    assert len(engines) == 6  # none, pld, suffix, schedule, ema, ucbspec: the warm-up's engine ran before
    for seg in segments:
        assert set(seg) == engines
        for i, e in enumerate(seg):  # an engine steps again only after every engine still decoding has stepped
            later = set(seg[i + 1:])
            nxt = seg.index(e, i + 1) if e in later else len(seg)
            assert set(seg[i + 1:nxt]) == later - {e}, i
    records = [json.loads(x) for x in out.with_name("records.jsonl").read_text().splitlines()]
    for r in records:
        if "segment" in r and r["method"] != "hf":
            assert max(x["latency"] for x in r["rows"]) == r["seconds"] > 0
            est = r["estimates"]  # what the engine's choices rested on at the segment's end
            assert set(est) == {"acceptance", "node_ranks", "module_seconds", "calibration", "row_overhead",
                                "counterfactual_seconds"}
            if "ucbspec" in r["method"]:  # its rounds drafted and measured themselves
                assert est["acceptance"] and est["calibration"] and est["row_overhead"]
