"""``python -m decode <command>``: one entry point; each subcommand lives in its own module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Register new ones
in :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..common.errors import run_user_command

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, help)
    "eval": ("decode.evaluation.evaluate",
             "evaluate arms and policies against HF generate and autoregressive decoding"),
    "bench-verify": ("decode.bench.bench_verify", "time the fused Triton verifier vs the PyTorch reference (GB/s)"),
    "report": ("decode.evaluation.report", "rebuild an evaluation's report.json and table from its records.jsonl"),
    "simulate": ("decode.simulation.simulate",
                 "stopping-time regret of policies on synthetic or replayed bandit instances"),
    "bench-round": ("decode.bench.bench_round", "break a round into draft, target forward, verify, rollback and "
                    "bookkeeping time per arm"),
    "bench-tree": ("decode.bench.bench_tree", "time one verification forward against its number of positions: chains "
                   "and token trees of 1…64 nodes, as a multiple of a one-token step"),
    "generate": ("decode.commands.generate",
                 "decode one prompt (or an interactive loop), streaming tokens as they are accepted"),
    "compare": ("decode.evaluation.compare", "per-method differences between two evaluation reports"),
    "serve": ("decode.commands.serve.command",
              "an OpenAI-compatible HTTP server (chat/completions, streaming, metrics) whose "
              "arm choice learns across requests"),
}


def describe(doc: str | None, fallback: str) -> str:
    """A subcommand's --help description: the docstring's first paragraph, whole (its first line alone
    can stop mid-sentence); ``fallback`` when there is no docstring."""
    para = (doc or "").strip().split("\n\n")[0]
    return " ".join(para.split()) or fallback


def dispatch(prog: str, description: str, commands: dict[str, tuple[str, str]], argv: list[str] | None = None,
             interrupted: str = "interrupted") -> int:
    """One argparse sub-command per ``commands`` entry; only the one named on the command line imports its module
    (each pulls in torch and transformers: importing all of them made ``--help`` or a mistyped command take 20-40 s
    on a 2-core machine), the others are listed by their help line."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)  # the top-level parser has no other options
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (mod_name, help_text) in commands.items():
        if name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(mod_name)
        p = sub.add_parser(name, help=help_text, description=describe(mod.__doc__, help_text))
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    return run_user_command(modules[args.command].run, args, interrupted=interrupted)


def main(argv: list[str] | None = None) -> int:
    return dispatch("decode", "Adaptive speculative decoding.", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
