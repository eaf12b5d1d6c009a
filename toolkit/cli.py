"""``python -m toolkit <command>``: builds artifacts for the decode runtime; one module per subcommand.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Register new ones
in :data:`COMMANDS` (one line each), as in :mod:`decode.commands.cli`.
"""
from __future__ import annotations

import sys

from decode.commands.cli import dispatch

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, help)
    "distill": ("toolkit.distill", "self-distillation: the target answers task prompts (datasets on disk)"),
    "train": ("toolkit.train.cli",
              "train a drafter, EAGLE head, early-exit drafter or calibrator (one plumbing; resumable)"),
    "pool": ("toolkit.pool", "distill → train a pool's arms → pool file → decode eval, resumable "
             "(budgets: small ≤ 60 min and medium ≤ 75 min on a CPU, large, gpu)"),
    "train-drafter": ("toolkit.train.drafter",
                      "train a task drafter on distilled data (also: deepspeed scripts/train_drafter.py)"),
    "diagonal": ("toolkit.diagonal", "MetaSD's diagonal: every drafter on every task's held-out distilled split; "
                 "does each task drafter beat the generalist?"),
    "answers": ("toolkit.answers", "finished distillations → the compressed answers folder the repository ships "
                "(merged by id, leakage-checked, ≤ 25 MiB)"),
    "ship": ("toolkit.ship", "a trained head → the small float16 folder the repository ships (pretrained/)"),
    "export": ("toolkit.export_formats",
               "export a trained EAGLE head or drafter for vLLM, SGLang, EAGLE or transformers"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("toolkit", "Build datasets, drafters and heads for decode.", COMMANDS, argv,
                    interrupted="interrupted (rerun the same command to resume)")


if __name__ == "__main__":
    sys.exit(main())
