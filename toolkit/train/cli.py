"""``python -m toolkit train <kind> [--recipe FILE] [--task T] [key=value ...]``: one command for every
trained artifact (kinds: :mod:`.kinds`), on one plumbing (:func:`.runtime.run_training`: resume check, run
record, training arguments, the loss trainer, time budget), each kind exporting what its arm loads.
``python -m toolkit train <kind> --help`` lists the kind's recipe fields. The same command line works under
``torchrun``/``deepspeed`` through ``scripts/train_<kind>.py``; a rerun of a command resumes its run.
"""
from __future__ import annotations

import argparse
import os

from decode.common.errors import UserError, run_user_command

from .kinds import KINDS, get_kind

INTERRUPTED = "interrupted; rerun the same command to resume from the latest checkpoint"


class _KindParser(argparse.ArgumentParser):
    """Its help ends with the kind's recipe fields (the module loads only when help is asked for)."""

    kind_name = ""

    def format_help(self) -> str:
        from toolkit.config import describe_fields

        kind = get_kind(self.kind_name)
        fields = "\n".join("  " + line for line in describe_fields(kind.schema))
        return (super().format_help() + f"\nrecipe fields (defaults of the schema; {kind.recipe} sets some of "
                f"them; override any with key=value):\n{fields}\n")


def add_kind_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    kind = get_kind(name)
    parser.add_argument("--recipe", default=None, help=f"YAML recipe (default {kind.recipe})")
    if kind.task_in_recipe:
        parser.add_argument("--task", default=None,
                            help="task whose distilled set to train on (runs/distill/<task>; default: the recipe's)")
    else:
        parser.add_argument("--task", default=None,
                            help="distilled task to train on (math, code, chat, ...) or 'all' (required)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides, e.g. train.max_steps=20 train.max_minutes=30 train.device=cuda "
                             "train.dtype=bfloat16")


def kind_parser(name: str, prog: str | None = None) -> argparse.ArgumentParser:
    kind = get_kind(name)
    parser = _KindParser(prog=prog or f"python -m toolkit train {kind.name}",
                         description=f"Train {kind.help}.",
                         epilog="Launch with python, torchrun or deepspeed; the command line is the same.")
    parser.kind_name = kind.name
    add_kind_arguments(parser, name)
    return parser


def run_kind(name: str, args: argparse.Namespace):
    """Load the recipe (file, then ``--task``, then overrides: later wins) and train; UserErrors propagate."""
    from toolkit.config import load_recipe

    kind = get_kind(name)
    path = args.recipe or str(kind.recipe_path)
    if kind.task_in_recipe:
        overrides = [*args.overrides, *([f"task={args.task}"] if args.task else [])]
        return kind.train(load_recipe(kind.schema, path, overrides))
    if not args.task:
        raise UserError(f"train {kind.name} needs --task (a distilled task such as math, code, chat, or 'all')")
    kind.train(load_recipe(kind.schema, path, args.overrides), args.task, recipe_file=path)
    return 0


def main_for(name: str, argv: list[str] | None = None) -> int:
    """The launchers' entry (``scripts/train_<kind>.py``, each module's ``main``): one kind's command line;
    a UserError prints one line and returns 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run_user_command(_main_for, name, argv, interrupted=INTERRUPTED)


def _main_for(name: str, argv: list[str] | None):
    parser = kind_parser(name, prog=f"train_{get_kind(name).name.replace('-', '_')}")
    return run_kind(name, parser.parse_intermixed_args(argv))


# --------------------------------------------------------------------------- `python -m toolkit train`

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", help=f"what to train: {', '.join(KINDS)}")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="[--recipe FILE] [--task T] [key=value ...]; `train <kind> --help` lists the fields")
    parser.epilog = "kinds:\n" + "\n".join(f"  {k.name:<11} {k.help} (default recipe {k.recipe})"
                                          for k in KINDS.values())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    kind = get_kind(args.kind)  # unknown kind: a UserError listing the kinds
    return run_kind(kind.name, kind_parser(kind.name).parse_intermixed_args(args.args))
