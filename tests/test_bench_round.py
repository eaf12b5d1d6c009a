"""bench-round: every phase reported, the parts add up to the round, rounds counted from the real decoding."""
import json

import pytest
import torch

from decode.commands.cli import main

PHASES = ("draft", "target_forward", "verify", "rollback", "bookkeeping", "other")


def _bench(target: str, arms: str, categories: str, tokens: int, out, *extra: str) -> int:
    """`decode bench-round` on the tiny target, one prompt per category, one thread, on the CPU."""
    return main(["bench-round", "--target", target, "--arms", arms, "--limit", "1", "--categories", categories,
                 "--max-new-tokens", str(tokens), "--threads", "1", "--device", "cpu", "--no-progress", *extra,
                 "--out", str(out)])


def test_bench_round_breaks_every_arm_round_into_phases(tiny_target_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "br" / "round.json"
    rc = _bench(tiny_target_dir, "pld:L=4;suffix:L=6;none", "code,chat", 12, out)
    assert rc == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    labels = rep["config"]["arm_labels"]
    assert labels == ["pld@4", "suffix@6", "none"]
    table = out.with_suffix(".md").read_text()
    assert table.strip() == rep["table"] and rep["table"] in printed
    for col in ("draft", "target fwd", "verify", "rollback", "bookkeeping", "other", "outside"):
        assert col in table
    for label in labels:
        b = rep["arms"][label]
        assert f"| {label} |" in table
        assert set(b["phases"]) == set(PHASES)
        parts = sum(b["phases"][k]["ms_per_round"] for k in PHASES)
        assert parts == pytest.approx(b["round_ms"], rel=1e-6)
        assert sum(b["phases"][k]["percent"] for k in PHASES) == pytest.approx(100.0, abs=1e-6)
        assert all(b["phases"][k]["ms_per_round"] >= 0 for k in PHASES if k != "other")
        assert b["phases"]["other"]["ms_per_round"] > -0.05 * b["round_ms"]  # clock jitter only
        outside = sum(b["phases"][k]["percent"] for k in ("verify", "rollback", "bookkeeping", "other"))
        assert b["outside_percent"] == pytest.approx(outside)
        gens = [g for g in rep["generations"] if g["arm"] == label]
        assert len(gens) == 2 and b["rounds"] == sum(g["rounds"] for g in gens)
    assert rep["arms"]["none"]["tokens_per_round"] == 1.0
    assert rep["arms"]["none"]["draft_lengths"] == {"0": rep["arms"]["none"]["rounds"]}
    for label in labels:  # the drafted-length distribution covers every round, within the arm's L
        lengths = rep["arms"][label]["draft_lengths"]
        assert sum(lengths.values()) == rep["arms"][label]["rounds"] and "cost_plan" not in rep["arms"][label]
        assert all(0 <= int(n) <= 6 for n in lengths)
    assert rep["arms"]["none"]["draft_cost"] is None and "drafted token (× step)" in table  # drafts nothing
    for label in ("pld@4", "suffix@6"):
        c = rep["arms"][label]["draft_cost"]
        if c is not None:  # structure only: how large a fraction it is is a timing (benchmarks report it)
            assert c["fraction"] > 0 and c["target_step_ms"] > 0
            assert c["fraction"] == pytest.approx(c["draft_ms_per_token"] / c["target_step_ms"], rel=1e-6)

    # the rounds are the engine's own: a plain generate of the same prompt with the same arm agrees
    from decode.choose.arms import ArmEnv, build_arm
    from decode.engine.loop import SpecEngine
    from decode.core.models import load_model
    from decode.choose.policies.simple import Fixed
    from decode.core.sampling import SamplingConfig
    from decode.evaluation.suites import BUILTIN, encode_prompt
    from decode.core.target import Target
    from decode.core.verify import Verifier
    model, tok = load_model(tiny_target_dir)
    env = ArmEnv(model, tok, SamplingConfig())
    arms = [build_arm(s, env) for s in rep["config"]["arm_specs"]]
    eng = SpecEngine(Target(model, tok), arms, Verifier(SamplingConfig()), [tok.eos_token_id], step_time=1.0)
    prompts = {p.id: p for p in BUILTIN}
    for g in rep["generations"]:
        ids = encode_prompt(tok, prompts[g["prompt_id"]].text)
        gen = eng.generate(ids, Fixed(3, eng.max_len, arm=labels.index(g["arm"])), 12)
        assert (len(gen.rounds), len(gen.tokens)) == (g["rounds"], g["new_tokens"])


def test_bench_round_compares_every_cache_kind_side_by_side(tiny_target_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "all.json"
    rc = _bench(tiny_target_dir, "pld:L=4;none", "code,chat", 10, out, "--cache", "all")
    assert rc == 0
    rep = json.loads(out.read_text())
    kinds = ("dynamic", "static", "prefix")
    assert set(rep["arms"]) == {f"{a} [{c}]" for a in ("pld@4", "none") for c in kinds}
    for label in ("pld@4", "none"):
        d = rep["arms"][f"{label} [dynamic]"]
        for c in ("static", "prefix"):
            s = rep["arms"][f"{label} [{c}]"]
            assert (s["rounds"], s["tokens"]) == (d["rounds"], d["tokens"])  # same decoding, only the cache differs
            assert rep["over_dynamic"][c][label] == pytest.approx(s["tokens_per_s"] / d["tokens_per_s"])
    assert {(g["arm"], g["cache"]) for g in rep["generations"]} == {(a, c) for a in ("pld@4", "none") for c in kinds}
    printed = capsys.readouterr().out
    assert "static ÷ dynamic" in printed and "prefix ÷ dynamic" in printed
    assert main(["bench-round", "--cache", "all", "--compile"]) == 2


def test_bench_round_bad_flags(capsys):
    assert main(["bench-round", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
    assert main(["bench-round", "--arms", " "]) == 2
    assert "no arms" in capsys.readouterr().err


def test_bench_round_with_the_cost_controller_reports_its_lengths_and_plans(tiny_target_dir, tmp_path, one_thread):
    out = tmp_path / "cost.json"
    rc = _bench(tiny_target_dir, "pld:L=6;none", "code", 12, out, "--length", "cost")
    assert rc == 0
    rep = json.loads(out.read_text())
    pld = rep["arms"]["pld@6"]
    plan = pld["cost_plan"]
    assert plan["expected_tokens_per_step"] > 0 and plan["realised_tokens_per_step"] > 0
    assert "tokens/step expected" in rep["table"] and sum(pld["draft_lengths"].values()) == pld["rounds"]
    # the prefix cache (auto on a CPU); the run's verification curve: every round of every arm measured
    curve = rep["cost_curve"]["prefix"]
    assert curve["forwards"] == sum(b["rounds"] for b in rep["arms"].values())
    assert all(row["1"] == 1.0 for row in curve["steps"].values()) and "Verification cost c(n)" in rep["table"]
    assert main(["bench-round", "--length", "costly"]) == 2
