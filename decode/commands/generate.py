"""Decode one prompt (or a loop of prompts) and watch it happen: the text is printed as each round
accepts it, optionally coloured by the arm that drafted each token, and a summary follows (MAT,
tokens/s, rounds, arm pulls, why it stopped). The quickest way to see the system work; ``decode eval``
is the command that measures.

stdout carries the generated text only (and a final newline); the summary, the legend and the
interactive ``>>>`` prompt go to stderr, so ``decode generate "..." > out.txt`` keeps just the text.
The prompt is rendered with the target's chat template exactly as ``decode eval`` renders its prompts
(``--raw`` feeds the text as it is). ``--chat`` is the interactive loop as one conversation: each line is the next
user turn, sent with the history (the model's answers included), whose keys and values the prefix cache keeps
(decode/core/prefix_cache.py), so a turn prefills only its new message. Arms, pool, policy, sampling, device,
dtype and cache flags mean what they mean in ``decode eval``; ``--policy`` takes one policy spec.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Iterator, TextIO

import torch

from ..common import metrics
from ..common.device import dtype_name, resolve_device, resolve_dtype
from ..engine.loop import Generation, build_engine, reads_cost
from ..engine.pools import DEFAULT_POLICY, MODEL_FREE_ARMS, default_pool
from ..common.errors import UserError
from ..evaluation.eval_config import MAX_SEED, EvalConfig, add_decoding_arguments, resolve_cache
from ..choose.length import build_length
from ..core.linear import resolve_linear
from ..core.models import (DEFAULT_TARGET, check_new_tokens, context_of, context_overflow, eos_token_ids,
                           load_model, pad_token_id, target_context)
from ..evaluation.peers import hf_generate
from ..choose.policies import build_policy
from ..core.sampling import SamplingConfig
from ..common.specs import split_specs
from ..core.prefix_cache import DEFAULT_MIB as PREFIX_CACHE_MIB, PrefixCache
from ..evaluation.suites import encode_messages, encode_prompt

PROMPT = ">>> "
# foreground colours per arm (cycled); tokens the target itself chose (bonus/correction) stay plain
PALETTE = ("36", "33", "35", "32", "34", "31", "96", "93", "95", "92", "94", "91")
RESET = "\x1b[0m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?",
                   help="the prompt; '-' or absent with piped stdin = read it from stdin")
    p.add_argument("-i", "--interactive", action="store_true",
                   help=f"read one prompt per line at '{PROMPT.strip()}' (each a new single-turn chat, no history); "
                        "an empty line, EOF (Ctrl-D) or Ctrl-C ends")
    p.add_argument("--chat", action="store_true",
                   help="like --interactive, but one conversation: each line is the next user turn, decoded with the "
                        "history (the model's answers included), whose KV is kept so a turn prefills only its new "
                        "message")
    p.add_argument("--raw", action="store_true", help="feed the prompt text as it is, without the chat template")
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--arms", help="arm specs separated by ';', as in `decode eval` (default, as `decode serve`'s: the "
                                  f"shipped pool for the default target, else '{MODEL_FREE_ARMS}')")
    p.add_argument("--pool", help="pool YAML (recipes/pools/*.yaml); its arms are added to --arms "
                                  "(pass --arms '' for the pool alone)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help="one policy spec choosing the arm each round, e.g. 'ucbspec' or 'ducb:discount=0.9,c=0.1' "
                        "(default: %(default)s; carry=true keeps learning across the prompts of -i / --chat)")
    p.add_argument("--length", help="draft-length controller, as in `decode eval`: fixed, beta-ts, cali-ts, cost "
                                    "(default: the pool's `length`, else fixed)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="integer >= 1 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help=f"integer in [0, {MAX_SEED}]; every prompt starts from it")
    add_decoding_arguments(p)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--show-arms", action="store_true",
                   help="colour each token by the arm that drafted it (target-chosen tokens plain) and print a legend")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour for --show-arms: auto = when stdout is a terminal and NO_COLOR is unset")
    p.add_argument("--compare-hf", action="store_true",
                   help="also decode with plain HF generate on the same ids: identical output? speed ratio?")


# ---- text as it is accepted ---------------------------------------------------------------------------------

class IncrementalText:
    """The generated ids' text, handed out piece by piece as ids arrive.

    The whole id list is decoded every time (a slice decoded alone loses SentencePiece's leading space
    and splits multi-byte characters), and a tail of U+FFFD (the bytes of a character not all generated
    yet) is held back until the ids completing it arrive, so no piece ever shows a replacement character
    that the final text does not have. ``text`` is the final text: the pieces joined plus ``flush()``.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: list[int]) -> str:
        """Add ids; return the text that became final with them ('' while a character is incomplete)."""
        self.ids.extend(ids)
        return self._emit(self.decode(self.ids).rstrip("\ufffd"))

    def flush(self) -> str:
        """What is still held back (a character the generation never completed)."""
        return self._emit(self.decode(self.ids))

    def _emit(self, text: str) -> str:
        # with clean-up of tokenization spaces off, a byte-level or SentencePiece decode of more ids
        # extends the decode of fewer, so the new piece is the tail past what was handed out
        piece = text[len(self.emitted):]
        self.emitted += piece
        return piece

    @property
    def text(self) -> str:
        return self.decode(self.ids)


class TokenPrinter:
    """Writes accepted tokens to ``out`` as they come; with ``colours`` (an ANSI code per arm), each
    token's text in the colour of the arm that drafted it (None = the target chose it: plain), one
    colour code per run of same-arm text, reset at the end of every round."""

    def __init__(self, decode: Callable[[list[int]], str], out: TextIO, colours: list[str] | None = None):
        self.text = IncrementalText(decode)
        self.out = out
        self.colours = colours
        self.current: int | None = None  # the arm whose colour is on

    def add(self, tokens: list[int], origins: list[int | None]) -> None:
        if self.colours is None:
            self.out.write(self.text.push(tokens))
        else:  # one token at a time, so each piece takes its token's colour
            for tok, arm in zip(tokens, origins):
                self._write(self.text.push([tok]), arm)
            self._write("", None)
        self.out.flush()

    def close(self, arm_of_tail: int | None = None) -> None:
        self._write(self.text.flush(), arm_of_tail)
        self._write("", None)
        self.out.write("\n")
        self.out.flush()

    def _write(self, piece: str, arm: int | None) -> None:
        if self.colours is None:
            self.out.write(piece)
            return
        if arm != self.current and (piece or arm is None):
            if self.current is not None:
                self.out.write(RESET)
            if arm is not None:
                self.out.write(f"\x1b[{self.colours[arm]}m")
            self.current = arm
        self.out.write(piece)


def origins_of(tokens: list[int], accepted: int, arm: int) -> list[int | None]:
    """The arm index for each kept draft token, None for the target's bonus/correction token."""
    return [arm if j < accepted else None for j in range(len(tokens))]


def decode_text(tokenizer) -> Callable[[list[int]], str]:
    """The one detokenisation for streaming and for the final text (clean-up of spaces off, so a
    longer decode always extends a shorter one)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def use_colour(mode: str, stream: TextIO) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    return stream.isatty() and "NO_COLOR" not in os.environ


# ---- inputs -------------------------------------------------------------------------------------------------

def read_prompt(arg: str | None, stdin: TextIO) -> str:
    """The single prompt: the argument, or stdin for '-' (or no argument when stdin is piped)."""
    if arg is None and stdin.isatty():
        raise UserError("no prompt: pass one as an argument (decode generate \"...\"), pipe it on stdin, "
                        "or use --interactive")
    text = stdin.read().rstrip("\r\n") if arg in (None, "-") else arg
    if not text.strip():
        src = "stdin" if arg in (None, "-") else "the PROMPT argument"
        raise UserError(f"empty prompt ({src}): there is nothing to continue; pass some text")
    return text


def interactive_prompts(stdin: TextIO, err: TextIO) -> Iterator[str]:
    """Lines typed at the prompt until an empty line or EOF (Ctrl-C is the caller's to catch)."""
    terminal = stdin is sys.stdin and stdin.isatty() and sys.stdout.isatty()
    if terminal:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    while True:
        if terminal:
            try:
                line = input(PROMPT)
            except EOFError:
                err.write("\n")
                return
        else:
            err.write(PROMPT)
            err.flush()
            line = stdin.readline()
            if not line:
                return
        line = line.rstrip("\r\n")
        if not line.strip():
            return
        yield line


def encode(tokenizer, text: str, raw: bool) -> list[int]:
    """Ids of one prompt: the chat template as ``decode eval`` applies it, or the text as it is."""
    if not raw:
        return encode_prompt(tokenizer, text)
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise UserError("the prompt encodes to no tokens; pass some text")
    return list(ids)


def check_args(args) -> tuple[list[str], str, SamplingConfig]:
    """Every check that needs no model: value ranges, prompt source, arm names, the one policy.
    Returns (arm specs, policy spec, sampling)."""
    EvalConfig(max_new_tokens=args.max_new_tokens, top_k=args.top_k, temperature=args.temperature,
               top_p=args.top_p, seed=args.seed).check_ranges()
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be an integer >= 1, got {args.threads}")
    if args.interactive and args.prompt is not None:
        raise UserError("--interactive reads its prompts at the '>>>' prompt; drop the PROMPT argument "
                        "(or drop --interactive to decode just that prompt)")
    if args.chat and args.prompt is not None:
        raise UserError("--chat reads its turns at the '>>>' prompt; drop the PROMPT argument")
    if args.chat and args.raw:
        raise UserError("--chat renders the conversation with the chat template; drop --raw")
    args.interactive = args.interactive or args.chat
    collected = default_pool(args.target, args.arms, args.pool)
    specs = collected.arms
    if args.length is None:  # the pool's draft-length controller, unless --length names one
        args.length = collected.length
    policies = split_specs(args.policy or "")
    if len(policies) != 1:
        raise UserError(f"--policy takes exactly one policy spec (e.g. 'ucbspec' or 'ducb:discount=0.9,c=0.1'), "
                        f"got {len(policies)}: {policies}; `decode eval --policies` compares several")
    try:
        build_policy(policies[0], len(specs), 1)  # names and parameters, before any model loads
    except UserError as exc:
        raise UserError(f"--policy: {exc}") from None
    if args.compile and args.cache == "dynamic":
        raise UserError("--compile needs --cache static (a dynamic cache changes shape every round)")
    return specs, policies[0], SamplingConfig(args.temperature, args.top_k, args.top_p)


# ---- the run ------------------------------------------------------------------------------------------------

def load_engine(args, specs: list[str], sampling: SamplingConfig, err: TextIO, needs_hidden: bool = False):
    """The target loaded and its engine built from the decoding flags ``generate`` and ``serve`` share (--target
    --device --dtype --cache --compile --linear --forward --verifier --threads --seed), announcing the load on ``err``:
    (model, tokenizer, engine, the engine's generator)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cache = resolve_cache(args.cache, device, args.compile)  # --compile with dynamic is refused by check_args
    linear = resolve_linear(args.linear, device, dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    err.write(f"loading {args.target} ({device}, {dtype_name(dtype)}, {cache} cache, {linear} linears)…\n")
    torch.manual_seed(args.seed)
    model, tok = load_model(args.target, dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    gen = torch.Generator().manual_seed(args.seed)
    engine = build_engine(model, tok, specs, sampling, gen, cache=cache, compile=args.compile, linear=linear,
                          verifier=args.verifier, target_name=args.target, trust_remote_code=args.trust_remote_code,
                          needs_hidden=needs_hidden, forward=args.forward)
    return model, tok, engine, gen


class Session:
    """The loaded target, engine and policy, decoding one prompt after another (a carry=true policy or
    length controller keeps learning across the prompts of an interactive session)."""

    def __init__(self, args, specs: list[str], policy_spec: str, sampling: SamplingConfig, err: TextIO):
        self.length = build_length(args.length, args.seed)
        model, tok, self.engine, self.gen = load_engine(args, specs, sampling, err,
                                                        needs_hidden=self.length.needs_target_hidden)
        arms = self.engine.arms
        self.eos = eos_token_ids(model, tok)
        self.policy = build_policy(policy_spec, len(arms), self.engine.max_len, seed=args.seed)
        self.labels = [a.label for a in arms]
        self.model, self.tok, self.sampling, self.args, self.err = model, tok, sampling, args, err
        self.pad = pad_token_id(tok, self.eos)
        self.warm = False
        self.history: list[dict] | None = [] if args.chat else None  # --chat: the conversation so far

    def _seed(self) -> None:
        """Every prompt starts from --seed (the engine's generator; HF generate samples from torch's)."""
        self.gen.manual_seed(self.args.seed)
        torch.manual_seed(self.args.seed)

    def _warm_up(self, ids: list[int]) -> None:
        """The engine's untimed warm-up (:meth:`SpecEngine.warm_up`: a short decode nothing learns from, and the
        cost curve's probe where the length controller or policy reads it), and HF generate's with --compare-hf."""
        if self.warm:
            return
        n = min(8, self.args.max_new_tokens)
        info = self.engine.prepare([len(ids)], self.args.max_new_tokens)  # compiles now, with --compile
        if info is not None:
            self.err.write(f"compiled {info['graphs']} target graph(s) in {info['seconds']:.0f} s "
                           f"(cached on disk in {info['cache_dir']})\n")
        self.engine.warm_up(ids, n, probe_cost=reads_cost(self.policy, self.length))
        if self.args.compare_hf:
            hf_generate(self.model, ids, n, self.sampling, self.eos, self.pad)
        self.warm = True

    def decode(self, text: str, out: TextIO, colours: list[str] | None) -> Generation:
        """Decode one prompt (with ``--chat``, the conversation's next turn), streaming its text to ``out``; then the
        summary (and HF comparison) to stderr."""
        if self.history is None:
            ids = encode(self.tok, text, self.args.raw)
        else:  # the interactive loop ends at an empty line, so a turn has text
            ids = encode_messages(self.tok, self.history + [{"role": "user", "content": text}])
        overflow = context_overflow(self.args.max_new_tokens, context_of(self.model.config), self.args.target,
                                    [len(ids)])
        if overflow:
            self.err.write(f"note: {overflow}\n")
        self._warm_up(ids)
        target = self.engine.target
        if self.history is not None and target.prefix_cache is None:  # after the warm-up: it times no real turn
            target.prefix_cache = PrefixCache(PREFIX_CACHE_MIB * 2 ** 20)
        self._seed()
        printer = TokenPrinter(decode_text(self.tok), out, colours)
        state = self.engine.begin(ids, self.policy, self.args.max_new_tokens, self.length)
        last: int | None = None
        try:
            while not state.done:
                r = self.engine.step(state)
                origins = origins_of(r.tokens, r.record.accepted, r.arm)
                printer.add(r.tokens, origins)
                last = origins[-1] if origins else last
        finally:
            printer.close(last)
        g = self.engine.finish(state)
        self.err.write(summary(g, self.labels, self.args.show_arms, colours) + "\n")
        if self.history is not None:
            self.history += [{"role": "user", "content": text},
                             {"role": "assistant", "content": self.tok.decode(g.tokens, skip_special_tokens=True)}]
            self.err.write(f"turn {len(self.history) // 2}: prompt {len(ids)} tokens, {target.prefix_reused} of them "
                           f"kept from earlier turns\n")
        if self.args.compare_hf:
            self.err.write(self._compare_hf(ids, g) + "\n")
        self.err.flush()
        return g

    def _compare_hf(self, ids: list[int], g: Generation) -> str:
        self._seed()
        tokens, seconds, stopped_by = hf_generate(self.model, ids, self.args.max_new_tokens, self.sampling,
                                                  self.eos, self.pad)
        hf_tps = metrics.tokens_per_s(len(tokens), seconds)
        ours = metrics.tokens_per_s(len(g.tokens), decoding_seconds(g))
        line = (f"hf generate: {len(tokens)} tokens in {seconds:.2f} s ({hf_tps:.1f} tokens/s, stopped by "
                f"{stopped_by}); speed ratio {metrics.speedup(ours, hf_tps):.2f}x (ours / hf tokens/s)")
        if not self.sampling.greedy:
            return line + "; outputs not compared (sampling draws differ between the two decoders)"
        if tokens == g.tokens:
            return line + "; identical output: yes"
        first = next((j for j, (a, b) in enumerate(zip(tokens, g.tokens)) if a != b), min(len(tokens), len(g.tokens)))
        return line + f"; identical output: NO (first difference at new token {first})"


def decoding_seconds(g: Generation) -> float:
    """Setup (resets + prefill) plus every round's own time: the decoding, without the printing between
    rounds (``Generation.wall_time`` would include it)."""
    return g.setup_time + sum(t.total for t in g.step_times)


def summary(g: Generation, labels: list[str], show_arms: bool = False, colours: list[str] | None = None) -> str:
    """MAT, tokens/s, rounds, arm pulls, the stop reason; with ``--show-arms`` also the legend (each arm
    in its colour, when colour is on, with the drafted tokens it got kept)."""
    n, seconds = len(g.tokens), decoding_seconds(g)
    reason = {"eos": "eos (the model ended its answer)", "length": "length (--max-new-tokens reached)"}[g.stopped_by]
    lines = [f"{n} new tokens in {seconds:.2f} s ({metrics.tokens_per_s(n, seconds):.1f} tokens/s) · "
             f"MAT {metrics.mat(n, g.target_forwards):.2f} ({g.target_forwards} target forwards) · "
             f"{len(g.rounds)} rounds · stopped by {reason}"]
    pulls = metrics.pull_counts([r.arm for r in g.rounds], labels)
    lines.append("arm pulls: " + ", ".join(f"{lab} {k}" for lab, k in pulls.items()))
    if show_arms:
        kept = [sum(r.accepted for r in g.rounds if r.arm == i) for i in range(len(labels))]
        names = [f"\x1b[{colours[i]}m{lab}{RESET}" if colours else lab for i, lab in enumerate(labels)]
        lines.append("legend: " + ", ".join(f"{name} ({k} drafted tokens kept)" for name, k in zip(names, kept))
                     + f", target (plain: {n - sum(kept)} bonus/correction tokens)")
    return "\n".join(lines)


def run(args) -> int:
    specs, policy_spec, sampling = check_args(args)
    text = None if args.interactive else read_prompt(args.prompt, sys.stdin)
    # the target's context from its config alone, before the weights load
    check_new_tokens(args.max_new_tokens, target_context(args.target, args.trust_remote_code), args.target)
    out, err = sys.stdout, sys.stderr
    session = Session(args, specs, policy_spec, sampling, err)
    colours = ([PALETTE[i % len(PALETTE)] for i in range(len(session.labels))]
               if args.show_arms and use_colour(args.color, out) else None)
    if text is not None:
        session.decode(text, out, colours)
        return 0
    try:
        for line in interactive_prompts(sys.stdin, err):
            try:
                session.decode(line, out, colours)
            except UserError as exc:  # a prompt the target cannot take: say why, ask for the next
                err.write(f"error: {exc}\n")
    except KeyboardInterrupt:  # Ctrl-C ends the session, mid-answer or at the prompt
        err.write("\n")
    return 0
