"""decode/evaluation/evaluate.py and decode/evaluation/report.py: summaries on hand-made records, policy-spec parsing,
the hf reference against our engine, and per-method state (length controllers) in a real run on the tiny target."""
import copy
import json

import pytest
import torch

from decode.evaluation import report as ev
from decode.common.errors import UserError
from decode.evaluation.eval_config import parse_policy_specs
from decode.evaluation.peers import hf_generate


def rec(method, pid, toks, fwd, wall, ids, cat="code", **kw):
    return {"method": method, "prompt_id": pid, "category": cat, "new_tokens": toks, "rounds": fwd,
            "accept_lengths": kw.get("acc", [0] * fwd), "drafted": kw.get("drafted", [0] * fwd),
            "arms": kw.get("arms", []), "wall_time": wall, "token_ids": ids}


def hand_made():
    """Two prompts; hf and the arm emit the same ids, our autoregressive loop (say, a bug) does not."""
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    return [
        rec(ev.HF, "p1", 4, 4, 1.0, a), rec(ev.HF, "p2", 4, 4, 1.0, b, cat="chat"),
        rec(ev.AR, "p1", 4, 4, 0.5, a), rec(ev.AR, "p2", 4, 4, 0.5, [5, 6, 7, 9], cat="chat"),
        rec("arm:x", "p1", 4, 2, 0.25, a, acc=[1, 1], drafted=[2, 2], arms=["x", "x"]),
        rec("arm:x", "p2", 4, 2, 0.5, b, cat="chat", acc=[1, 1], drafted=[2, 2], arms=["x", "x"]),
    ]


def test_summary_reports_speedup_vs_hf_and_vs_autoregressive_and_lossless_vs_hf():
    s = ev.summarize(hand_made(), [ev.HF, ev.AR, "arm:x"], ["x"], greedy=True)
    assert s[ev.HF]["mat"] == 1.0 and s[ev.HF]["speedup_vs_hf"] == 1.0
    assert s[ev.HF]["speedup"] == pytest.approx(0.5)  # hf 4 tok/s, our loop 8 tok/s
    assert s[ev.AR]["speedup_vs_hf"] == pytest.approx(2.0)
    x = s["arm:x"]
    assert x["mat"] == 2.0 and x["tokens_per_s"] == pytest.approx(8 / 0.75)
    assert x["speedup_vs_hf"] == pytest.approx((8 / 0.75) / 4) and x["speedup"] == pytest.approx((8 / 0.75) / 8)
    assert x["per_category"]["code"]["speedup_vs_hf"] == pytest.approx(4.0)
    assert x["per_category"]["chat"]["speedup"] == pytest.approx(1.0)
    assert x["acceptance_rate"] == 0.5
    # losslessness is judged against hf, not against our own loop
    assert x["lossless"] is True and s[ev.AR]["lossless"] is False and s[ev.HF]["lossless"] is True
    sampled = ev.summarize(hand_made(), [ev.HF, ev.AR, "arm:x"], ["x"], greedy=False)
    assert all(v["lossless"] is None for v in sampled.values())


def test_markdown_table_shows_both_speedups_and_the_warnings():
    recs = hand_made()
    s = ev.summarize(recs, [ev.HF, ev.AR, "arm:x"], ["x"], greedy=True)
    warnings = ev.timing_warnings(recs, s)
    assert any("only 8 tokens" in w for w in warnings)  # 2 prompts × 4 tokens: far too short
    table = ev.markdown_table(s, ["chat", "code"], warnings)
    head = table.splitlines()[0]
    assert "× vs hf" in head and "× vs autoregressive" in head and "code MAT / ×hf" in head
    row = next(line for line in table.splitlines() if line.startswith("| arm:x |"))
    assert "| 2.00 | 2.67 | 1.33 | yes |" in row
    assert "meaningless" in table and "- the reference decoded only 8 tokens" in table
    assert "Warning" not in ev.markdown_table(s, ["chat", "code"], [])


def test_timing_warnings_flag_a_speedup_beyond_mat():
    """17× at MAT 2 is timer noise: flagged per method and per category cell."""
    recs = [rec(ev.HF, f"p{i}", 200, 200, 10.0, [1]) for i in range(3)]
    recs += [rec(ev.AR, f"p{i}", 200, 200, 10.0, [1]) for i in range(3)]
    recs += [rec("arm:x", f"p{i}", 200, 100, 10.0 / 17, [1]) for i in range(3)]
    s = ev.summarize(recs, [ev.HF, ev.AR, "arm:x"], ["x"], greedy=True)
    w = ev.timing_warnings(recs, s)
    assert len(w) == 1 and w[0].startswith("arm:x: speed-up 17.00×")


def test_policies_split_on_semicolons_and_keep_parameters_together():
    from decode.choose.policies import build_policy
    for text in ("ducb:discount=0.9,c=0.1,ucbspec", "ducb:discount=0.9,c=0.1;ucbspec",
                 "ducb:discount=0.9, c=0.1; ucbspec"):
        assert parse_policy_specs(text) == ["ducb:discount=0.9,c=0.1", "ucbspec"], text
    p = build_policy("ducb:discount=0.9,c=0.1", 2, 4)
    assert (p.discount, p.c) == (0.9, 0.1)


@pytest.mark.parametrize("text", ["ucbspec,ucbspec", "ducb:discount=0.9,c=0.1;ducb:c=0.1,discount=0.9"])
def test_duplicate_policies_are_refused(text):
    """Two identical policies would merge their records under one method name."""
    with pytest.raises(UserError, match="duplicates"):
        parse_policy_specs(text)


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from decode.core.models import load_model
    return load_model(tiny_target_dir)


def _engine_greedy(model, tok, ids, n, eos):
    from decode.choose.arms.none import NoSpecArm
    from decode.engine.loop import SpecEngine
    from decode.choose.policies.simple import Fixed
    from decode.core.sampling import SamplingConfig
    from decode.core.target import Target
    from decode.core.verify import Verifier
    engine = SpecEngine(Target(model, tok), [NoSpecArm()], Verifier(SamplingConfig(), "torch", None), eos)
    return engine.generate(ids, Fixed(1, 0), n)


def test_hf_reference_equals_the_engine_and_stops_at_eos_like_it(tiny_model, one_thread):
    """Same ids as our autoregressive loop, including where EOS stops it (the EOS token is kept, nothing
    after it), even when the checkpoint's generation_config asks for penalties."""
    from decode.core.sampling import SamplingConfig
    from decode.evaluation.suites import BUILTIN, encode_prompt
    model, tok = tiny_model
    ids = encode_prompt(tok, BUILTIN[0].text)
    free = _engine_greedy(model, tok, ids, 16, [])
    eos = [free.tokens[5]]
    stop = free.tokens.index(eos[0])
    g = _engine_greedy(model, tok, ids, 16, eos)
    assert g.stopped_by == "eos" and g.tokens == free.tokens[:stop + 1]
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.suppress_tokens = [free.tokens[0]]  # plain generate would never emit it
    try:
        tokens, seconds, stopped_by = hf_generate(model, ids, 16, SamplingConfig(), eos, 0)
        assert model.generation_config.suppress_tokens == [free.tokens[0]]  # restored after the call
    finally:
        model.generation_config = saved
    assert tokens == g.tokens and stopped_by == "eos" and seconds > 0
    tokens, _, stopped_by = hf_generate(model, ids, 16, SamplingConfig(), [], 0)
    assert tokens == free.tokens and stopped_by == "length"
    torch.manual_seed(0)
    sampled, _, _ = hf_generate(model, ids, 6, SamplingConfig(0.8, 20, 0.9), [], 0)
    assert len(sampled) == 6


def test_each_method_learns_its_own_length_controller(tiny_target_dir, tmp_path, one_thread):
    """A carried Beta-TS posterior must not leak from one method into the next: the fixed arm and the
    `fixed` policy playing the same arm draft exactly alike on every prompt."""
    from decode.commands.cli import main
    out = tmp_path / "r.json"
    code = main(["eval", "--no-progress", "--target", tiny_target_dir, "--arms", "pld:L=3",
                 "--policies", "fixed:arm=0", "--length", "beta-ts:carry=true", "--max-new-tokens", "16",
                 "--categories", "code,summarization,rewriting", "--out", str(out)])
    assert code == 0
    rep = json.loads(out.read_text())
    by = {(r["method"], r["prompt_id"]): r for r in rep["records"]}
    pids = [r["prompt_id"] for r in rep["records"] if r["method"] == "arm:pld@3"]
    assert len(pids) == 3
    for pid in pids:
        assert by[("arm:pld@3", pid)]["drafted"] == by[("policy:fixed:arm=0", pid)]["drafted"], pid
    assert rep["summary"]["hf"]["mat"] == 1.0 and all(s["lossless"] for s in rep["summary"].values())


def test_a_compiled_run_reports_compile_seconds_apart_from_speed(tiny_target_dir, tmp_path, one_thread):
    """`--compile` with the cost-aware controller and the hf-static peer: compiling is paid before the first
    timed decode and reported per method (a column in the table), every method stays lossless vs hf."""
    from decode.commands.cli import main
    out = tmp_path / "r.json"
    code = main(["eval", "--no-progress", "--target", tiny_target_dir, "--arms", "pld:L=2", "--compile",
                 "--length", "cost", "--policies", "ucbspec", "--peers", "hf-static", "--max-new-tokens", "10",
                 "--categories", "code,summarization", "--out", str(out)])
    assert code == 0
    rep = json.loads(out.read_text())
    info = rep["config"]["compile_info"]
    assert info["engine"]["graphs"] == 3 and info["engine"]["seconds"] > 0  # 1, 2, 3 scored positions
    assert info["hf-static"]["seconds"] > 0
    s = rep["summary"]
    assert s["arm:pld@2"]["compile_seconds"] == s["autoregressive"]["compile_seconds"] == info["engine"]["seconds"]
    assert s["hf-static"]["compile_seconds"] == info["hf-static"]["seconds"] and s["hf"]["compile_seconds"] is None
    assert all(v["lossless"] for v in s.values())
    # the cost controller's plans against what the rounds realised, per record and per method
    plan = s["arm:pld@2"]["cost_plan"]
    assert plan["expected_tokens_per_step"] > 0 and plan["realised_tokens_per_step"] > 0
    recs = [r for r in rep["records"] if r["method"] == "arm:pld@2"]
    assert all(r["cost_plan"]["expected_tokens"] >= len(r["drafted"]) for r in recs)  # ≥ 1 token per round
    assert "cost_plan" not in s["autoregressive"] and "cost_plan" not in s["hf"]
    assert set(s["arm:pld@2"]["draft_lengths"]) == {"pld@2"}
    # the device's verification curve over the run, rebuilt from the engine methods' rounds
    ours = [r for r in rep["records"] if r["method"] in ("arm:pld@2", "policy:ucbspec", "autoregressive")]
    assert all(len(r["verify_forwards"]) == len(r["drafted"]) for r in ours)
    assert all(f[0] == d + 1 for r in ours for f, d in zip(r["verify_forwards"], r["drafted"]))
    assert "verify_forwards" not in next(r for r in rep["records"] if r["method"] == "hf")
    assert rep["cost_curve"]["forwards"] == sum(len(r["drafted"]) for r in ours)
    table = (tmp_path / "r.md").read_text() if (tmp_path / "r.md").exists() else ""
    assert "compile s" in ev.markdown_table(s, ["code", "summarization"]) and ("compile s" in table or not table)


def test_tree_rounds_count_positions_along_their_depth_not_their_nodes():
    """A tree round of 6 nodes and depth 3, fully accepted, reached positions 1..3 (records' ``depths``); the
    per-position curve has nothing at 4..6. Records without ``depths`` (peers, older runs) are chains."""
    a = [1, 2, 3, 4]
    recs = [rec(ev.HF, "p1", 4, 4, 1.0, a), rec(ev.AR, "p1", 4, 4, 0.5, a),
            dict(rec("arm:t", "p1", 4, 1, 0.25, a, acc=[3], drafted=[6], arms=["t"]), depths=[3]),
            rec("arm:c", "p1", 4, 2, 0.25, a, acc=[1, 0], drafted=[2, 2], arms=["c", "c"])]
    s = ev.summarize(recs, [ev.HF, ev.AR, "arm:t", "arm:c"], ["t", "c"], greedy=True)
    assert s["arm:t"]["acceptance_per_position"] == [1.0, 1.0, 1.0]
    assert s["arm:t"]["acceptance_rate"] == 0.5  # 3 of the 6 drafted nodes
    assert s["arm:c"]["acceptance_per_position"] == [0.5, 0.0]


def test_engine_records_a_tree_rounds_depth(one_thread):
    """What evaluate stores as ``depths``: RoundRecord.positions, the depth for a tree, the length for a chain."""
    from decode.choose.arms.union import UnionArm
    from decode.choose.arms.ngram import PromptLookupArm
    from decode.choose.arms.suffix import SuffixArm
    from decode.choose.policies.simple import Fixed
    from decode.core.sampling import SamplingConfig
    from decode.core.target import Target
    from decode.core.verify import Verifier
    from decode.engine.loop import SpecEngine
    from helpers import tiny_llama
    cfg = SamplingConfig(0.0)
    model = tiny_llama(vocab=16, seed=2)
    union = UnionArm([PromptLookupArm(L=2, max_ngram=1), SuffixArm(L=3, min_match=1)], 8, True)
    eng = SpecEngine(Target(model), [union], Verifier(cfg))
    g = eng.generate([1, 2, 3, 1, 4, 5, 1, 2, 6, 1], Fixed(1, 0), 12)
    trees = [r for r in g.rounds if r.drafted > 3]
    assert trees  # the two chains diverged: more nodes than positions
    assert all(r.positions <= 3 and r.depth is not None for r in trees)
    assert all(r.positions == r.drafted for r in g.rounds if r.depth is None)
