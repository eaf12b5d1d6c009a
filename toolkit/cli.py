"""``python -m toolkit <command>``: builds artifacts for the decode runtime; one module per subcommand.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Register new ones
in :data:`COMMANDS` (one line each), as in :mod:`decode.cli`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from decode.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, help)
    "distill": ("toolkit.distill", "self-distillation: the target answers task prompts (datasets on disk)"),
    "train-drafter": ("toolkit.train.drafter", "train a task drafter on distilled data (also: deepspeed scripts/train_drafter.py)"),
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="toolkit", description="Build datasets, drafters and heads for decode.")
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
        print("interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
