"""decode/evaluation/peers.py: the hf reference and the transformers peers (prompt lookup, assisted generation with one
of our drafters, early-exit self-speculation) — greedy outputs equal plain generate token for token, target
forwards are counted (verifications only), and bad specs are one-line errors before anything loads."""
import copy

import pytest
import torch

from decode.evaluation import peers as P
from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig
from decode.evaluation.suites import encode_prompt

GREEDY = SamplingConfig()
COPY_TEXT = ("The quarterly report lists revenue of 4.2 million dollars, costs of 3.1 million dollars, "
             "and a net margin of 26 percent for the northern region.")
COPY_PROMPT = f"Repeat the following text exactly, word for word:\n\n{COPY_TEXT}"


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from decode.core.models import load_model
    return load_model(tiny_target_dir)


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory, tiny):
    """A 1-layer random Llama with the target's tokenizer: a valid (if poor) drafter for hf-assisted."""
    from helpers import tiny_llama
    _, tok = tiny
    d = tmp_path_factory.mktemp("tiny_drafter")
    m = tiny_llama(vocab=len(tok), hidden=32, layers=1, seed=5)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _eos(tok):
    return [tok.eos_token_id]


def _check_record(r: dict, ref: dict):
    assert r["token_ids"] == ref["token_ids"], "greedy peer output differs from plain generate"
    assert r["stopped_by"] == ref["stopped_by"] and r["new_tokens"] == len(r["token_ids"])
    assert r["rounds_exact"] is True
    assert 1 <= r["rounds"] <= r["new_tokens"]
    # one target forward per round: every round keeps its accepted draft tokens + one from the target
    assert len(r["accept_lengths"]) == len(r["drafted"]) == r["rounds"]
    assert sum(r["accept_lengths"]) + r["rounds"] == r["new_tokens"]
    assert all(0 <= a <= d for a, d in zip(r["accept_lengths"], r["drafted"]))
    assert 0 <= r["draft_time"] <= r["wall_time"] and r["verify_time"] >= 0
    assert set(ref) <= set(r)


def test_peers_greedy_equal_plain_generate_on_tiny_target(tiny, tiny_drafter_dir, one_thread):
    model, tok = tiny
    ids = encode_prompt(tok, COPY_PROMPT)
    ref = P.HFMethod(model, GREEDY, _eos(tok), 0).decode(ids, 0, 40)
    assert ref["rounds"] == ref["new_tokens"] > 0
    specs = ["hf-pld:L=4", "hf-pld:L=2,n=1", f"hf-assisted:path={tiny_drafter_dir}",
             f"hf-assisted:path={tiny_drafter_dir},schedule=heuristic,L=3", "hf-early-exit:layers=1",
             "hf-early-exit:layers=1,schedule=constant,L=3"]
    peers = P.build_peers(specs, model, tok, GREEDY, _eos(tok), 0)
    assert [p.name for p in peers] == specs and all(p.kind == "peer" for p in peers)
    for p in peers:
        _check_record(p.decode(ids, 0, 40), ref)
    # the schedules reach transformers as documented
    assisted, heuristic, early, constant = peers[2], peers[3], peers[4], peers[5]
    assert assisted.drafter.generation_config.assistant_confidence_threshold == 0.4
    assert assisted.drafter.generation_config.num_assistant_tokens == 20
    assert heuristic.drafter.generation_config.num_assistant_tokens_schedule == "heuristic_transient"
    assert early.settings["assistant_early_exit"] == 1 and constant.settings["num_assistant_tokens"] == 3
    # early exit drafts through the target itself: those calls are not target forwards (rounds)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        r = constant.decode(ids, 0, 40)
    finally:
        handle.remove()
    assert max(r["drafted"]) <= 3  # constant L=3: never more than 3 drafted tokens
    assert len(calls) == r["rounds"] + sum(r["drafted"])  # one draft pass per drafted token
    assert model.config.num_hidden_layers == 2  # restored after the draft passes


def test_peers_stop_at_the_first_eos_like_hf(tiny, tiny_drafter_dir, one_thread):
    model, tok = tiny
    ids = encode_prompt(tok, COPY_PROMPT)
    free = P.HFMethod(model, GREEDY, [], 0).decode(ids, 0, 24)
    eos = [free["token_ids"][6]]
    ref = P.HFMethod(model, GREEDY, eos, 0).decode(ids, 0, 24)
    assert ref["stopped_by"] == "eos" and ref["token_ids"][-1] == eos[0]
    for p in P.build_peers(["hf-pld:L=4", f"hf-assisted:path={tiny_drafter_dir}", "hf-early-exit:layers=1"],
                           model, tok, GREEDY, eos, 0):
        _check_record(p.decode(ids, 0, 24), ref)


def test_hf_generate_ignores_and_restores_the_checkpoint_generation_config(tiny, one_thread):
    model, tok = tiny
    ids = encode_prompt(tok, COPY_PROMPT)
    plain = P.hf_generate(model, ids, 12, GREEDY, [], 0)[0]
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.suppress_tokens = [plain[0]]
    marker = model.generation_config
    try:
        peer = P.build_peers(["hf-pld:L=3"], model, tok, GREEDY, [], 0)[0]
        assert peer.decode(ids, 0, 12)["token_ids"] == plain
        tokens, seconds, stopped = P.hf_generate(model, ids, 12, GREEDY, [], 0, prompt_lookup_num_tokens=3)
        assert tokens == plain and stopped == "length" and seconds > 0
        assert model.generation_config is marker  # the checkpoint's config is back
        assert "_get_candidate_generator" not in vars(model)  # the instrumentation is gone
    finally:
        model.generation_config = saved
    torch.manual_seed(0)
    sampled = P.build_peers(["hf-pld:L=3"], model, tok, SamplingConfig(0.8, 20, 0.9), [], 0)[0].decode(ids, 0, 6)
    assert sampled["new_tokens"] == 6 and sampled["rounds_exact"]


def test_truncate_at_eos():
    assert P.truncate_at_eos([4, 2, 9, 2], {2}) == ([4, 2], "eos")
    assert P.truncate_at_eos([4, 5], {2}) == ([4, 5], "length")


@pytest.mark.parametrize("spec, words", [
    ("hf-nope:L=3", ["unknown peer 'hf-nope'", "hf-assisted", "hf-early-exit", "hf-pld"]),
    ("hf-pld:L=0", ["hf-pld:L=0", "L must be an integer >= 1", "'0'"]),
    ("hf-pld:L=2.5", ["L must be an integer >= 1", "'2.5'"]),
    ("hf-pld:n=0", ["n must be an integer >= 1"]),
    ("hf-pld:nn=2", ["unknown parameter 'nn'", "did you mean 'n'"]),
    ("hf-early-exit", ["missing required parameter 'layers'"]),
    ("hf-early-exit:layers=2", ["hf-early-exit:layers=2", "layers must be an integer in [1, 1]", "2 layers"]),
    ("hf-early-exit:layers=1,schedule=fast", ["schedule must be one of dsl, heuristic, constant", "'fast'"]),
    ("hf-assisted", ["missing required parameter 'path'"]),
    ("hf-assisted:path=/no/such/drafter", ["hf-assisted:path=/no/such/drafter", "unknown model"]),
    ("hf-assisted:path=x,L=-1", ["L must be an integer >= 1"]),
])
def test_bad_peer_specs_are_one_line_errors(tiny, spec, words):
    model, tok = tiny
    with pytest.raises(UserError) as exc:
        P.build_peers([spec], model, tok, GREEDY, [], 0)
    msg = str(exc.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_every_spec_is_checked_before_a_drafter_loads(tiny, tiny_drafter_dir, monkeypatch):
    model, tok = tiny
    import decode.core.models

    def boom(*a, **k):
        raise AssertionError("a drafter was loaded before every spec was checked")

    monkeypatch.setattr(decode.core.models, "load_model", boom)
    with pytest.raises(UserError, match="L must be an integer >= 1"):
        P.build_peers([f"hf-assisted:path={tiny_drafter_dir}", "hf-pld:L=0"], model, tok, GREEDY, [], 0)
    with pytest.raises(UserError, match="duplicates"):
        P.build_peers([f"hf-assisted:path={tiny_drafter_dir}", "hf-pld:L=4", "hf-pld: L=4"], model, tok, GREEDY, [], 0)
    assert P.peer_names() == ["hf-assisted", "hf-early-exit", "hf-pld", "hf-static"]


def test_hf_assisted_refuses_a_drafter_with_another_vocabulary(tiny, tmp_path):
    from helpers import tiny_llama
    model, tok = tiny
    m = tiny_llama(vocab=len(tok) - 8, hidden=16, layers=1, seed=1)
    m.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="output vocabulary"):
        P.build_peers([f"hf-assisted:path={tmp_path}"], model, tok, GREEDY, [], 0)


@pytest.mark.slow
def test_peers_on_the_default_target(smol, tiny_drafter_dir, one_thread):
    """Real SmolLM2: every peer's greedy output equals plain generate; prompt lookup on a copy prompt
    keeps several tokens per target forward (MAT > 1)."""
    from decode.core.models import eos_token_ids
    model, tok = smol
    eos = eos_token_ids(model, tok)
    ids = encode_prompt(tok, COPY_PROMPT)
    ref = P.HFMethod(model, GREEDY, eos, 0).decode(ids, 0, 40)
    assert ref["new_tokens"] >= 20
    specs = ["hf-pld:L=4", "hf-early-exit:layers=4", f"hf-assisted:path={tiny_drafter_dir}"]
    pld, early, assisted = P.build_peers(specs, model, tok, GREEDY, eos, 0)
    for p in (pld, early, assisted):
        r = p.decode(ids, 0, 40)
        _check_record(r, ref)
        if p is pld:
            assert r["new_tokens"] / r["rounds"] > 1.5


@pytest.mark.parametrize("compile", [False, True])
def test_hf_static_equals_plain_generate(tiny, one_thread, compile):
    """The savvy-user baseline: a static cache (compiled or eager) changes the speed, never the tokens."""
    model, tok = tiny
    ids = encode_prompt(tok, COPY_PROMPT)
    ref = P.HFMethod(model, GREEDY, _eos(tok), 0).decode(ids, 0, 20)
    peer = P.build_peers([f"hf-static:compile={str(compile).lower()}"], model, tok, GREEDY, _eos(tok), 0)[0]
    assert peer.compiles is compile and peer.settings == {"cache_implementation": "static", "compile": compile}
    first = peer.decode(ids, 0, 20)
    assert first["token_ids"] == ref["token_ids"] and first["stopped_by"] == ref["stopped_by"]
    # a shorter prompt reuses the (larger) cache transformers kept: same tokens again
    short = ids[: len(ids) // 2]
    reference = P.HFMethod(model, GREEDY, _eos(tok), 0).decode(short, 1, 20)
    assert peer.decode(short, 1, 20)["token_ids"] == reference["token_ids"]
