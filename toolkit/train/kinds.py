"""The catalog of trainable kinds: name → recipe schema, default recipe, train function. The ``train``
command (:mod:`.cli`), the ``scripts/train_*.py`` launchers and the ``make train-*`` targets read it; a new
kind is one entry here plus its module (recipe dataclass, model builder, loss, export) on the shared
plumbing (:func:`.runtime.run_training`).

Modules are imported only when a kind is used, so listing the kinds costs nothing.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from decode.common.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Kind:
    name: str  # as typed: `python -m toolkit train <name>`
    module: str  # defines the schema class and the train function
    schema_name: str
    recipe: str  # default recipe, relative to the repository root
    task_in_recipe: bool  # heads: --task sets the recipe's `task`; drafter: --task names the data (required)
    help: str

    def load(self):
        return importlib.import_module(self.module)

    @property
    def schema(self) -> type:
        return getattr(self.load(), self.schema_name)

    @property
    def train(self):
        """``train(recipe)`` for heads, ``train(recipe, task, recipe_file)`` for the drafter."""
        return self.load().train

    @property
    def recipe_path(self) -> Path:
        return REPO_ROOT / self.recipe


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("drafter", "toolkit.train.drafter", "DrafterRecipe", "recipes/drafters/cpu-small.yaml", False,
         "a task drafter (small LM) on distilled data; multi-GPU: deepspeed scripts/train_drafter.py"),
    Kind("eagle", "toolkit.train.eagle", "EagleRecipe", "recipes/heads/eagle.yaml", True,
         "an EAGLE feature head on the frozen target"),
    Kind("early-exit", "toolkit.train.early_exit", "EarlyExitRecipe", "recipes/heads/early_exit.yaml", True,
         "an EESD early-exit drafter (first target layers + a trained exit layer)"),
    Kind("calibrator", "toolkit.train.calibrator", "CalibratorRecipe", "recipes/heads/calibrator.yaml", True,
         "a Cali-TS acceptance predictor for a trained head"),
)}
ALIASES = {"early_exit": "early-exit"}  # the heads' folder/recipe spelling


def get_kind(name: str) -> Kind:
    kind = KINDS.get(ALIASES.get(name, name))
    if kind is None:
        raise UserError(f"unknown kind '{name}'; train one of: {', '.join(KINDS)} "
                        f"(python -m toolkit train <kind> --help lists a kind's recipe fields)")
    return kind
