"""``python -m decode <command>``: one entry point; each subcommand lives in its own module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Register new ones
in :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, help)
    "eval": ("decode.evaluate", "evaluate arms and policies against autoregressive decoding"),
    "bench-verify": ("decode.bench_verify", "time the fused Triton verifier vs the PyTorch reference (GB/s)"),
    "simulate": ("decode.simulate", "stopping-time regret of policies on synthetic or replayed bandit instances"),
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="decode", description="Adaptive speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (mod_name, help_text) in COMMANDS.items():
        mod = importlib.import_module(mod_name)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip().splitlines()[0])
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
