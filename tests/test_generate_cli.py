"""`python -m decode generate`: the streamed greedy text equals plain HF greedy decoding (tiny target and
the real default target), stdin and interactive input, the arm colouring and its legend, incremental
detokenisation, and one-line errors for bad input."""
import io
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

ARMS = "pld:L=2;suffix:L=3;none"
# the tiny random target repeats itself on this prompt, so the arms get drafts accepted
PROMPT = "Hello there, how are you?"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def generate(capsys, *args, stdin=None, monkeypatch=None) -> tuple[int, str, str]:
    """Run the command in-process; returns (exit code, stdout, stderr)."""
    from decode.commands.cli import main
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", stdin)
    code = main(["generate", "--threads", "1", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def reference_text(target: str, prompt: str, n: int) -> str:
    """Plain HF greedy decoding of the chat-templated prompt, detokenised (what stdout must hold)."""
    from helpers import plain_greedy
    from decode.core.models import eos_token_ids, load_model
    from decode.evaluation.peers import truncate_at_eos
    from decode.evaluation.suites import encode_prompt
    model, tok = load_model(target)
    eos = set(eos_token_ids(model, tok))
    tokens, _ = truncate_at_eos(plain_greedy(model, encode_prompt(tok, prompt), n, eos), eos)
    return tok.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stats(err: str) -> dict:
    """The summary's numbers: new tokens, MAT, target forwards, rounds, arm pulls, stop reason."""
    m = re.search(r"(\d+) new tokens in [\d.]+ s \(([\d.]+) tokens/s\) · MAT ([\d.]+) \((\d+) target forwards\) "
                  r"· (\d+) rounds · stopped by (\w+)", err)
    assert m, err
    pulls = re.search(r"arm pulls: (.*)", err).group(1)
    return {"tokens": int(m[1]), "tps": float(m[2]), "mat": float(m[3]), "forwards": int(m[4]), "rounds": int(m[5]),
            "stop": m[6], "pulls": {k: int(v) for k, v in (p.rsplit(" ", 1) for p in pulls.split(", "))}}


@pytest.fixture(scope="module")
def tiny_reference(tiny_target_dir):
    return reference_text(tiny_target_dir, PROMPT, 24)


# ---- output equals plain decoding ------------------------------------------------------------------------

def test_greedy_output_equals_hf_generate_on_tiny_target(tiny_target_dir, tiny_reference, capsys):
    code, out, err = generate(capsys, PROMPT, "--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens", "24",
                              "--compare-hf")
    assert code == 0, err
    assert out == tiny_reference + "\n"  # streamed pieces joined = the final text, nothing else on stdout
    s = stats(err)
    assert s["tokens"] == 24 and s["stop"] == "length"
    assert s["mat"] == pytest.approx(24 / s["forwards"], abs=0.005) and s["tps"] > 0
    assert set(s["pulls"]) == {"pld@2", "suffix@3", "none"} and sum(s["pulls"].values()) == s["rounds"]
    assert "identical output: yes" in err and "speed ratio" in err
    assert "\x1b[" not in out + err  # no colour without --show-arms


def test_show_arms_colours_tokens_and_prints_a_legend(tiny_target_dir, tiny_reference, capsys):
    args = [PROMPT, "--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens", "24", "--show-arms"]
    code, out, err = generate(capsys, *args, "--color", "always")
    assert code == 0, err
    assert ANSI.sub("", out) == tiny_reference + "\n"  # colour changes nothing but the codes
    legend = re.search(r"legend: (.*)", err).group(1)
    kept = [int(k) for k in re.findall(r"\((\d+) drafted tokens kept\)", legend)]
    assert len(kept) == 3 and sum(kept) > 0  # this prompt gets drafts accepted
    assert "\x1b[36mpld@2\x1b[0m" in legend and "\x1b[33msuffix@3\x1b[0m" in legend
    assert f"target (plain: {24 - sum(kept)} bonus/correction tokens)" in legend
    drafted = re.findall(r"\x1b\[(?:36|33|35)m(.*?)\x1b\[0m", out, flags=re.S)
    assert drafted and all(piece and piece in tiny_reference for piece in drafted)
    # not a terminal (captured), colour auto: the same legend, no codes anywhere
    code, out, err = generate(capsys, *args)
    assert code == 0 and "\x1b[" not in out + err
    assert out == tiny_reference + "\n" and "legend: pld@2 (" in err


def test_sampling_runs_and_is_not_compared_token_for_token(tiny_target_dir, capsys):
    code, out, err = generate(capsys, PROMPT, "--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens", "8",
                              "--temperature", "0.8", "--top-k", "20", "--seed", "7", "--compare-hf")
    assert code == 0, err
    assert stats(err)["tokens"] == 8 and "outputs not compared (sampling" in err
    again = generate(capsys, PROMPT, "--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens", "8",
                     "--temperature", "0.8", "--top-k", "20", "--seed", "7")
    assert again[1] == out  # --seed makes a sampled answer reproducible


# ---- input: stdin, interactive --------------------------------------------------------------------------------

def test_prompt_from_stdin_dash_or_piped(tiny_target_dir, tiny_reference, capsys, monkeypatch):
    base = ["--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens", "24"]
    for args in (["-", *base], base):  # '-', or no argument with stdin not a terminal
        code, out, err = generate(capsys, *args, stdin=io.StringIO(PROMPT + "\n"), monkeypatch=monkeypatch)
        assert code == 0, err
        assert out == tiny_reference + "\n"  # the trailing newline of the piped line is not part of the prompt


def test_prompt_piped_into_the_command(tiny_target_dir, tiny_reference):
    """A real pipe into `python -m decode generate`; --show-arms with colour auto stays plain off a terminal."""
    r = subprocess.run([sys.executable, "-m", "decode", "generate", "--target", tiny_target_dir, "--arms", ARMS,
                        "--max-new-tokens", "24", "--threads", "1", "--show-arms"],
                       input=PROMPT + "\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout == tiny_reference + "\n"
    assert "MAT" in r.stderr and "legend: pld@2" in r.stderr and "\x1b[" not in r.stdout + r.stderr


def test_interactive_loop_decodes_each_line_and_ends_on_an_empty_line(tiny_target_dir, tiny_reference, capsys,
                                                                      monkeypatch):
    second = "Tell me a story."
    lines = io.StringIO(f"{PROMPT}\n{second}\n\nnot read\n")
    code, out, err = generate(capsys, "--interactive", "--target", tiny_target_dir, "--arms", ARMS,
                              "--max-new-tokens", "24", stdin=lines, monkeypatch=monkeypatch)
    assert code == 0, err
    assert out == tiny_reference + "\n" + reference_text(tiny_target_dir, second, 24) + "\n"
    assert err.count(">>> ") == 3 and err.count("new tokens in") == 2  # two answers, then the empty line ends it
    assert lines.readline() == "not read\n"


def test_interactive_loop_ends_cleanly_on_eof_and_ctrl_c(tiny_target_dir, capsys, monkeypatch):
    class CtrlC(io.StringIO):
        def readline(self, *a):
            raise KeyboardInterrupt

    for stdin in (io.StringIO(""), CtrlC()):
        code, out, err = generate(capsys, "-i", "--target", tiny_target_dir, "--max-new-tokens", "4",
                                  stdin=stdin, monkeypatch=monkeypatch)
        assert code == 0 and out == "" and "Traceback" not in err and ">>> " in err


def test_interactive_loop_reports_a_bad_prompt_and_goes_on(tiny_target_dir, tiny_reference, capsys, monkeypatch):
    import decode.commands.generate
    from decode.common.errors import UserError
    encode = decode.commands.generate.encode

    def picky(tok, text, raw):
        if text == "bad":
            raise UserError("this prompt is refused")
        return encode(tok, text, raw)
    monkeypatch.setattr(decode.commands.generate, "encode", picky)
    code, out, err = generate(capsys, "-i", "--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens", "24",
                              stdin=io.StringIO(f"bad\n{PROMPT}\n"), monkeypatch=monkeypatch)
    assert code == 0 and "error: this prompt is refused" in err
    assert out == tiny_reference + "\n"


def test_chat_keeps_one_conversation_and_reuses_its_earlier_turns(tiny_target_dir, tiny_reference, capsys,
                                                                    monkeypatch):
    """--chat: the second line is answered with the first turn and its answer as history (equal to plain greedy
    decoding of that conversation), and its prompt takes the first turn's prompt and answer from the prefix cache."""
    from helpers import plain_greedy
    from decode.core.models import eos_token_ids, load_model
    from decode.evaluation.peers import truncate_at_eos
    from decode.evaluation.suites import encode_messages

    second = "Tell me a story."
    code, out, err = generate(capsys, "--chat", "--target", tiny_target_dir, "--arms", ARMS, "--max-new-tokens",
                              "24", stdin=io.StringIO(f"{PROMPT}\n{second}\n\n"), monkeypatch=monkeypatch)
    assert code == 0, err
    model, tok = load_model(tiny_target_dir)
    eos = set(eos_token_ids(model, tok))
    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": tiny_reference},
               {"role": "user", "content": second}]
    ids = encode_messages(tok, history)
    tokens, _ = truncate_at_eos(plain_greedy(model, ids, 24, eos), eos)
    assert out == tiny_reference + "\n" + tok.decode(tokens, skip_special_tokens=True) + "\n"
    turns = re.findall(r"turn (\d): prompt (\d+) tokens, (\d+) of them kept from earlier turns", err)
    first = len(encode_messages(tok, history[:1]))
    assert turns[0] == ("1", str(first), "0") and turns[1][:2] == ("2", str(len(ids)))
    assert int(turns[1][2]) >= first  # the first turn's prompt at least (its answer too, as far as it re-tokenises)


# ---- streaming detokenisation ---------------------------------------------------------------------------------

def test_incremental_text_holds_back_partial_characters(tiny_target_dir):
    """One id at a time, multi-byte characters split over several ids: no piece shows U+FFFD, the pieces
    join to the whole decode, and SentencePiece-style leading spaces survive (whole-ids decoding)."""
    from transformers import AutoTokenizer
    from decode.commands.generate import IncrementalText, decode_text
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    text = "naïve café — 日本語 🙂 ok"
    ids = tok(text)["input_ids"]
    stream = IncrementalText(decode_text(tok))
    pieces = [stream.push([i]) for i in ids]
    assert "" in pieces  # some id ended mid-character (the test exercises the hold-back)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text == stream.text
    # a character the generation never completed: held back while streaming, printed at the end
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    cut = IncrementalText(decode_text(tok))
    piece = cut.push(ids[:k])
    tail = cut.flush()
    assert "\ufffd" not in piece and tail.endswith("\ufffd") and piece + tail == tok.decode(ids[:k])


def test_token_printer_colours_runs_by_arm():
    """Tokens of one arm share one colour code; the target's tokens are plain; every round ends reset."""
    from decode.commands.generate import RESET, TokenPrinter
    out = io.StringIO()
    p = TokenPrinter(lambda ids: "".join("abcdef"[i] for i in ids), out, colours=["36", "33"])
    p.add([0, 1, 2], [0, 0, None])
    p.add([3, 4], [1, None])
    p.add([5], [None])
    p.close()
    assert out.getvalue() == f"\x1b[36mab{RESET}c\x1b[33md{RESET}ef\n"
    plain = io.StringIO()
    p = TokenPrinter(lambda ids: "".join("abcdef"[i] for i in ids), plain)
    p.add([0, 1, 2], [0, 0, None])
    p.close()
    assert plain.getvalue() == "abc\n"


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    import decode.commands.generate

    def refuse(*a, **k):
        raise AssertionError("model loaded before the input was validated")
    monkeypatch.setattr(decode.commands.generate, "load_model", refuse)


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("args,stdin,needle", [
    ([""], None, "empty prompt (the PROMPT argument)"),
    (["  \n "], None, "empty prompt (the PROMPT argument)"),
    (["-"], "\n", "empty prompt (stdin)"),
    ([], "", "empty prompt (stdin)"),
    ([], Terminal(), "no prompt: pass one as an argument"),
    (["hi", "--arms", "bogus:L=2"], None, "--arms: unknown arm 'bogus' in 'bogus:L=2'; known arms:"),
    (["hi", "--arms", ""], None, "no arms: pass --arms"),
    (["hi", "--pool", "/no/such/pool.yaml"], None, "--pool /no/such/pool.yaml: file not found"),
    (["hi", "--policy", "bogus"], None, "--policy: unknown policy 'bogus'; known policies:"),
    (["hi", "--policy", "ucbspec:delta=2"], None, "--policy: ucbspec: delta must be in (0, 1], got 2.0"),
    (["hi", "--policy", "ucbspec;exp3spec"], None, "--policy takes exactly one policy spec"),
    (["hi", "--policy", ""], None, "--policy takes exactly one policy spec"),
    (["hi", "--max-new-tokens", "0"], None, "--max-new-tokens must be an integer >= 1, got 0"),
    (["hi", "--top-p", "0"], None, "--top-p must be in (0, 1], got 0.0"),
    (["hi", "--temperature", "nan"], None, "--temperature must be a finite number >= 0"),
    (["hi", "--threads", "0"], None, "--threads must be an integer >= 1, got 0"),
    (["hi", "--interactive"], None, "--interactive reads its prompts at the '>>>' prompt; drop the PROMPT"),
    (["hi", "--chat"], None, "--chat reads its turns at the '>>>' prompt; drop the PROMPT argument"),
    (["--chat", "--raw"], None, "--chat renders the conversation with the chat template; drop --raw"),
    (["hi", "--compile", "--cache", "dynamic"], None, "--compile needs --cache static"),
    (["hi", "--device", "tpu"], None, "--device must be auto|cpu|cuda[:N]"),
    (["hi", "--length", "warp"], None, "unknown length controller 'warp'"),
])
def test_bad_input_is_a_one_line_error_before_loading(no_model, capsys, monkeypatch, args, stdin, needle):
    if isinstance(stdin, str):
        stdin = io.StringIO(stdin)
    code, out, err = generate(capsys, *args, stdin=stdin, monkeypatch=monkeypatch)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert needle in err, err


def test_bad_arm_parameters_are_a_clear_error(tiny_target_dir, capsys):
    code, out, err = generate(capsys, "hi", "--target", tiny_target_dir, "--arms", "pld:L=2.5")
    assert code == 2 and "L must be an integer" in err and "Traceback" not in err


def test_a_cost_controllers_probe_runs_in_the_untimed_warm_up(tiny_target_dir, capsys, monkeypatch):
    """With cost lengths the verification curve is probed in the warm-up, so the first prompt's summary (its tokens/s)
    does not count the probe, as no later prompt's does."""
    import decode.engine.loop as loop
    from decode.choose.policies.simple import Fixed
    calls = []
    probe, begin = loop.probe, loop.SpecEngine.begin
    monkeypatch.setattr(loop, "probe", lambda *a, **kw: (calls.append("probe"), probe(*a, **kw))[1])
    monkeypatch.setattr(loop.SpecEngine, "begin", lambda self, ids, policy, *a, **kw: (
        calls.append("warm-up" if isinstance(policy, Fixed) else "prompt"), begin(self, ids, policy, *a, **kw))[1])
    code, out, err = generate(capsys, PROMPT, "--target", tiny_target_dir, "--arms", ARMS, "--length", "cost",
                              "--max-new-tokens", "8")
    assert code == 0, err
    assert "probe" in calls and calls.index("prompt") > max(i for i, c in enumerate(calls) if c == "probe"), calls


def test_without_arms_the_default_target_gets_the_shipped_pool_and_others_model_free_arms(tmp_path, monkeypatch):
    """What `decode generate` and `decode serve` run when neither --arms nor --pool is given: the trained pool that
    ships for the default target (with its length controller), model-free arms for any other target; a shipped pool
    that cannot be used (its head missing) is said, and the model-free arms run."""
    import decode.engine.pools as pools
    from decode.core.models import DEFAULT_TARGET
    shipped = pools.load_pool(pools.SHIPPED_POOL)
    assert any(s.startswith("eagle:") for s in shipped.arms) and shipped.length == "cost"
    err = io.StringIO()
    assert pools.default_pool(DEFAULT_TARGET, None, None, err) == shipped and err.getvalue() == ""
    model_free = pools.default_pool("some/other-model", None, None, err)
    assert model_free.arms == pools.MODEL_FREE_ARMS.split(";") and model_free.length is None
    assert pools.default_pool(DEFAULT_TARGET, "pld:L=2", None, err).arms == ["pld:L=2"]  # what is asked, only
    broken = tmp_path / "pool.yaml"
    broken.write_text("target: smollm2-135m-instruct\narms: [eagle:path=no/such/head,L=2, pld:L=4]\nlength: cost\n")
    monkeypatch.setattr(pools, "SHIPPED_POOL", broken)
    assert pools.default_pool(DEFAULT_TARGET, None, None, err) == model_free
    assert err.getvalue().startswith("note: the shipped pool is not usable (") and "no/such/head" in err.getvalue()


# ---- the real default target ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_greedy_output_equals_hf_generate_on_the_default_target(smol_path, capsys):
    prompt = "Name three colours of the rainbow."
    code, out, err = generate(capsys, prompt, "--arms", ARMS, "--max-new-tokens", "24", "--compare-hf",
                              "--device", "cpu")
    assert code == 0, err
    assert out == reference_text(smol_path, prompt, 24) + "\n"
    assert "smollm2-135m-instruct" in err and "identical output: yes" in err
    s = stats(err)
    assert 0 < s["tokens"] <= 24 and s["mat"] >= 1.0 and sum(s["pulls"].values()) == s["rounds"]


@pytest.mark.slow
def test_the_default_target_decodes_with_the_shipped_pool_under_the_router(smol_path, capsys):
    """No --arms: the trained pool (its EAGLE head's tree among its arms) under the router, losslessly."""
    from decode.engine.pools import SHIPPED_POOL, load_pool
    prompt = "Write a Python function that returns the square of a number."
    code, out, err = generate(capsys, prompt, "--max-new-tokens", "24", "--compare-hf", "--device", "cpu")
    assert code == 0, err
    assert out == reference_text(smol_path, prompt, 24) + "\n" and "identical output: yes" in err
    pulls = stats(err)["pulls"]
    assert any(label.startswith("eagle_tree@") for label in pulls), pulls  # the trained head's arm is in the pool
    assert len(pulls) <= len(load_pool(SHIPPED_POOL).arms) and sum(pulls.values()) == stats(err)["rounds"]
