"""Pool files (``recipes/pools/*.yaml``): exported drafters + model-free arms → arm specs for ``--pool``.

Format::

    target: smollm2-135m-instruct     # what the drafters were trained for (checked against drafter.json)
    L: 4                              # default draft length of the drafter arms
    drafters:                         # export folders written by `make train-drafter`
      - {name: math, path: runs/drafters/cpu-small/math/export}
      - {name: code, path: runs/drafters/cpu-small/code/export, L: 5}
    arms: [pld:L=4, suffix:L=6]       # any other arm specs, as for --arms
    length: cost                      # optional: the draft-length controller of sequential decoding

``length`` is what ``decode eval`` and ``decode generate`` run when no ``--length`` is given (then every L above is
a cap): the shipped pool asks for ``cost``, which drafts per round the length that pays most on the machine's
measured verification curve, so one pool file suits a CPU whose cost jumps at 4 positions and one where it is
flat. Batched rounds (``--batch``, ``decode serve``) choose lengths from the batch's cost whatever the pool says.

Relative paths — a drafter's ``path`` and the ``path=`` of an arm spec (``eagle:path=pretrained/...,L=2``) —
are resolved against the repository root first, then the working directory, so a pool file works from any
directory.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..common.errors import UserError
from ..common.io import REPO_ROOT, resolve_repo_path
from ..common.specs import parse_spec

# what `decode generate` and `decode serve` run when neither --arms nor --pool is given: the trained pool that ships
# for the default target (``default_pool``), or these model-free arms, which run on any target with nothing trained;
# under the per-round router, learning across prompts and requests
SHIPPED_POOL = REPO_ROOT / "recipes" / "pools" / "pretrained.yaml"
MODEL_FREE_ARMS = "pld:L=4;suffix:L=6"
DEFAULT_POLICY = "router:carry=true"

_KEYS = {"target", "L", "drafters", "arms", "description", "length"}
_DRAFTER_KEYS = {"name", "path", "L"}


def _int_L(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{where}: L must be an integer >= 1 (a drafter arm's draft length), got {value!r}")
    return value


def _train_command(path: str) -> str:
    """How to create a missing export, read off the layout `make train-drafter` writes:
    ``<out_root>/<recipe name>/<task>/export`` (the pool's ``name`` is only a label)."""
    p = Path(path)
    if p.name != "export" or len(p.parts) < 3:
        return ("point path at the export/ folder that `make train-drafter TASK=<task>` writes "
                "(runs/drafters/<recipe>/<task>/export)")
    task, recipe = p.parent.name, p.parent.parent.name
    cmd = f"make train-drafter TASK={task}"
    if recipe != "cpu-small":  # the Makefile's default DRAFTER_RECIPE
        file = f"recipes/drafters/{recipe}.yaml"
        cmd += f" DRAFTER_RECIPE={file}" if (REPO_ROOT / file).is_file() else f" with the drafter recipe '{recipe}'"
    data = ("`make distill TASK=<task> N=64` for each task it should cover" if task == "all"
            else f"`make distill TASK={task} N=64`")
    return f"`{cmd}` (after {data})"


@dataclass(frozen=True)
class Pool:
    """Arms to decode with, and the draft-length controller a pool file asks for (None: the run's own)."""
    arms: list[str]
    length: str | None = None


def load_pool(path: str | Path) -> Pool:
    """A pool file's arm specs (one ``drafter:path=...,L=...,name=...`` per drafter, then the arms) and its
    ``length``."""
    import yaml

    from ..choose.arms import arm_names

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--pool {p}: file not found; pass a pool YAML such as recipes/pools/default-target.yaml")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"pool {p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"pool {p}: the top level must be a mapping with 'drafters' and/or 'arms'")
    unknown = set(data) - _KEYS
    if unknown:
        raise UserError(f"pool {p}: unknown field(s) {sorted(unknown)}; valid fields: {sorted(_KEYS)}")
    default_L = _int_L(data.get("L", 4), f"pool {p}")
    target = data.get("target")
    drafters, arms = data.get("drafters") or [], data.get("arms") or []
    if not isinstance(drafters, list) or not isinstance(arms, list):
        raise UserError(f"pool {p}: 'drafters' and 'arms' must be lists")
    specs: list[str] = []
    untrained: list[str] = []
    for i, d in enumerate(drafters):
        where = f"pool {p}: drafters[{i}]"
        if not isinstance(d, dict) or "path" not in d:
            raise UserError(f"{where} must be a mapping with at least 'path' (and usually 'name')")
        bad = set(d) - _DRAFTER_KEYS
        if bad:
            raise UserError(f"{where}: unknown field(s) {sorted(bad)}; valid: {sorted(_DRAFTER_KEYS)}")
        name = str(d.get("name") or Path(str(d["path"])).parent.name)
        folder = resolve_repo_path(str(d["path"]))
        if folder is None or not (folder / "config.json").is_file():
            untrained.append(f"drafters[{i}] '{name}' (no exported model at {d['path']}): "
                             f"{_train_command(str(d['path']))}")
            continue
        meta_file = folder / "drafter.json"
        if target and meta_file.is_file():
            trained_for = json.loads(meta_file.read_text()).get("target")
            if trained_for and trained_for != target:
                raise UserError(f"{where} ('{name}') was trained for target '{trained_for}', but the pool is for "
                                f"'{target}'; use a drafter trained for this target")
        text = str(folder)
        if any(c in text for c in ",;= \t") or any(c in name for c in ",;= \t"):
            raise UserError(f"{where}: path/name may not contain spaces, ',', ';' or '=' (they separate arm specs); "
                            f"rename '{text}' / '{name}'")
        L = _int_L(d.get("L", default_L), where)
        specs.append(f"drafter:path={text},L={L},name={name}")
    if untrained:
        raise UserError(f"pool {p}: {len(untrained)} drafter(s) not trained yet — {'; '.join(untrained)}. "
                        "cpu-small trains in ~4–12 min per drafter on 2 CPU cores; or fix the paths")
    known = set(arm_names())
    for i, spec in enumerate(arms):
        if not isinstance(spec, str):
            raise UserError(f"pool {p}: arms[{i}] must be an arm spec string like 'pld:L=4', got {spec!r}")
        name, params = parse_spec(spec)
        if name not in known:
            raise UserError(f"pool {p}: arms[{i}] '{spec}': unknown arm '{name}'; known arms: "
                            f"{', '.join(sorted(known))}")
        specs.append(_with_paths_resolved(spec.strip(), f"pool {p}: arms[{i}] '{spec}'"))
    if not specs:
        raise UserError(f"pool {p} names no drafters and no arms; add entries under 'drafters' or 'arms'")
    return Pool(specs, _length(data.get("length"), f"pool {p}"))


def _length(spec, where: str) -> str | None:
    """A pool's ``length``, checked as ``--length`` is (name and parameters)."""
    if spec is None:
        return None
    from ..choose.length import build_length, length_names
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"{where}: length must be a draft-length controller spec ({', '.join(length_names())}, "
                        f"e.g. 'cost'), got {spec!r}")
    try:
        build_length(spec)
    except UserError as exc:
        raise UserError(f"{where}: length '{spec}': {exc}") from None
    return spec.strip()


def map_paths(spec: str, fn) -> str:
    """``spec`` with the ``path=`` of each arm in it (a union's sub-arms' too) replaced by ``fn(arm name, path)``;
    a spec without one is returned as it is."""
    name, params = parse_spec(spec)
    if name == "union" and "arms" in params:
        from ..choose.arms.union import sub_specs
        params["arms"] = "+".join(map_paths(sub, fn).replace(",", ":") for sub in sub_specs(str(params["arms"])))
    elif "path" in params:
        params["path"] = fn(name, params["path"])
    else:
        return spec
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in params.items())


def _with_paths_resolved(spec: str, where: str) -> str:
    """``spec`` with its ``path=`` (and a union's sub-arms' paths) made absolute: a pool works from any directory."""
    def resolve(_name: str, path: str) -> str:
        folder = resolve_repo_path(path)
        if folder is None:
            raise UserError(f"{where}: path {path} does not exist (relative paths are looked up under "
                            f"{REPO_ROOT} and the working directory)")
        return str(folder)

    return map_paths(spec, resolve)


def collect_arms(arms: str | None, pool: str | None, example: str) -> Pool:
    """The arm specs of ``--arms`` (';'-separated) followed by ``--pool``'s, every spec checked as far as it can
    be without a model (name, typed and ranged parameters, the head or drafter folder it names:
    decode/choose/arms/base.py check_arm_spec), with the pool's ``length``; ``example`` is the --arms value an
    error suggests."""
    from ..choose.arms import arm_names, check_arm_spec
    from ..common.specs import split_specs
    specs, length = split_specs(arms or ""), None
    if pool:
        read = load_pool(pool)
        specs, length = specs + read.arms, read.length
    if not specs:
        raise UserError(f"no arms: pass --arms (e.g. '{example}') or --pool")
    known = arm_names()
    for s in specs:
        name, _ = parse_spec(s)
        if name not in known:
            raise UserError(f"--arms: unknown arm '{name}' in '{s}'; known arms: {', '.join(known)}")
        check_arm_spec(s)
    return Pool(specs, length)


def default_pool(target: str, arms: str | None, pool: str | None, err: TextIO | None = None) -> Pool:
    """``--arms`` (+ ``--pool``) as given (:func:`collect_arms`); with neither, the shipped pool for the default target
    (its trained head, with the pool's ``length``), else :data:`MODEL_FREE_ARMS`. A shipped pool that cannot be used
    (its head missing from a partial checkout) is said on ``err`` (default: stderr as it is then) and the model-free
    arms run instead."""
    from ..core.models import DEFAULT_TARGET
    if arms is not None or pool is not None:
        return collect_arms(arms, pool, MODEL_FREE_ARMS)
    if target == DEFAULT_TARGET and SHIPPED_POOL.exists():
        try:
            return load_pool(SHIPPED_POOL)
        except UserError as exc:
            (err or sys.stderr).write(f"note: the shipped pool is not usable ({exc}); running {MODEL_FREE_ARMS}\n")
    return collect_arms(MODEL_FREE_ARMS, None, MODEL_FREE_ARMS)
