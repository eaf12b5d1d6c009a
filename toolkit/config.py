"""Typed recipes: YAML files validated into dataclasses, with ``key=value`` command-line overrides.

Every toolkit recipe (distillation, drafter training, ...) is a dataclass schema loaded with
:func:`load_recipe`. The loader is strict so that a typo fails before hours of compute: unknown
keys, missing required fields and wrong types raise :class:`decode.common.errors.UserError` naming the
field (``generation.batch_size``) and the fix.

Supported field types: ``bool``, ``int``, ``float`` (ints accepted), ``str``, ``Literal[...]``,
``X | None``, ``list[X]``, ``dict[str, X]``, nested dataclasses, and unions of dataclasses that
carry a ``type: Literal["name"]`` discriminator field (e.g. prompt sources).

Overrides: ``generation.max_new_tokens=64``, ``sources.0.path=data.jsonl`` (list index), values
parsed as YAML (``temperatures=[0,0.7]``, ``limit=null``); a ``str`` field keeps the literal text.

A schema may declare ``renamed_fields: ClassVar[dict[str, str]]`` (old name → where it lives now), so a
recipe or override that uses a moved field gets one line naming the new place instead of "unknown field".

Device and dtype fields (every recipe that runs a model): ``device: str`` checked with
:func:`check_device_spec` and ``dtype: DTypeName``; they are resolved on the machine that runs the job by
:mod:`decode.common.device` (``auto`` = CUDA + bfloat16 when a GPU is visible, else CPU + float32). Only the
spelling is checked at load, so a recipe naming ``cuda`` still prints on a machine without a GPU.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from decode.common.errors import UserError

T = TypeVar("T")
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]  # = "auto" + decode.common.device.DTYPES (tested)
DEVICE_CHOICES = "auto|cpu|cuda[:N]"  # = decode.common.device.DEVICES
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
TASK_RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "tasks"
_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
DISCRIMINATOR = "type"


# --------------------------------------------------------------------------- type helpers

def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _strip_optional(tp):
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    if tp in (bool, int, float, str):
        return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, Sequence, tuple):
        return f"a list of {_type_name(typing.get_args(tp)[0])}" if typing.get_args(tp) else "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _fmt_path(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<recipe>"


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _discriminated(tp) -> dict[str, type] | None:
    """For a union of dataclasses with ``type: Literal[...]`` fields: {type value: class}."""
    if not _is_union(tp):
        return None
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    if not members or not all(dataclasses.is_dataclass(m) for m in members):
        return None
    table = {}
    for m in members:
        lit = _hints(m).get(DISCRIMINATOR)
        if typing.get_origin(lit) is not Literal:
            return None
        for v in typing.get_args(lit):
            table[v] = m
    return table


def check_device_spec(value: str, field: str) -> None:
    """Spelling of a device field (``auto|cpu|cuda[:N]``); whether the GPU exists is checked when the job
    starts (:func:`decode.common.device.resolve_device`). No torch import: launch-time checks stay fast."""
    if not isinstance(value, str) or not _DEVICE_RE.fullmatch(value.strip().lower()):
        raise UserError(f"{field} must be {DEVICE_CHOICES}, got {value!r}")


def resolve_device_field(value: str, field: str):
    """:func:`decode.common.device.resolve_device` for a recipe field, its errors phrased as overrides
    (``device=cuda: no CUDA device ...; use device=cpu or device=auto``)."""
    import torch

    from decode.common.device import resolve_device

    spec = value.strip().lower()
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{field}={value}: no CUDA device is visible to PyTorch (is this the CUDA build of torch?); "
                        f"use {field}=cpu or {field}=auto")
    return resolve_device(spec, flag=field)


def _renamed(cls, key) -> str | None:
    return (getattr(cls, "renamed_fields", None) or {}).get(key)


# --------------------------------------------------------------------------- validation

class _Ctx:
    def __init__(self, origin: str):
        self.origin = origin

    def fail(self, path: tuple, msg: str) -> UserError:
        where = _fmt_path(path)
        return UserError(f"{self.origin}: field '{where}' {msg} (fix the recipe or override {where}=<value>)")


def _coerce(tp, value, path: tuple, ctx: _Ctx):
    if tp is Any:
        return value
    if value is None:
        if tp is type(None) or (_is_union(tp) and type(None) in typing.get_args(tp)):
            return None
        raise ctx.fail(path, f"must be {_type_name(tp)}, got null; set a value")
    table = _discriminated(tp)
    if table is not None:
        if not isinstance(value, Mapping):
            raise ctx.fail(path, f"must be a mapping with a '{DISCRIMINATOR}' key ({', '.join(table)}), "
                                 f"got {value!r}")
        kind = value.get(DISCRIMINATOR)
        if kind not in table:
            raise ctx.fail(path + (DISCRIMINATOR,), f"must be one of {', '.join(map(repr, table))}, got {kind!r}; "
                                                     f"{_suggest(str(kind), table)}")
        return _build(table[kind], value, path, ctx)
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        errors = []
        for a in args:
            try:
                return _coerce(a, value, path, ctx)
            except UserError as exc:
                errors.append(exc)
        if len(args) == 1:
            raise errors[0]
        raise ctx.fail(path, f"must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed if a == value):
            raise ctx.fail(path, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}; "
                                 f"{_suggest(str(value), [str(a) for a in allowed])}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ctx.fail(path, f"must be a boolean (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ctx.fail(path, f"must be an integer, got {value!r} ({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 (PyYAML) reads `1e-3` as a string; it is meant as a number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ctx.fail(path, f"must be a number, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ctx.fail(path, f"must be a string, got {value!r} ({type(value).__name__}); quote it in YAML")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ctx.fail(path, f"must be {_type_name(tp)} (e.g. [a, b]), got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        items = [_coerce(item_tp, v, path + (i,), ctx) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ctx.fail(path, f"must be a mapping, got {value!r}")
        k_tp, v_tp = typing.get_args(tp) or (Any, Any)
        return {_coerce(k_tp, k, path, ctx): _coerce(v_tp, v, path + (k,), ctx) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, ctx)
    raise TypeError(f"config: unsupported field type {tp!r} at {_fmt_path(path)}")


def _build(cls, data, path: tuple, ctx: _Ctx):
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        data = to_dict(data)
    if not isinstance(data, Mapping):
        raise ctx.fail(path, f"must be {_type_name(cls)}, got {data!r}")
    hints, fields = _hints(cls), _fields(cls)
    for key in data:
        if key not in fields:
            where = _fmt_path(path + (key,))
            if _renamed(cls, key):
                raise UserError(f"{ctx.origin}: field '{where}' is now '{_renamed(cls, key)}'; rename it "
                                f"in the recipe or the override")
            raise UserError(f"{ctx.origin}: unknown field '{where}'; {_suggest(str(key), fields)}"
                            f"valid fields here: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], path + (name,), ctx)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ctx.fail(path + (name,), f"is required ({_type_name(hints[name])}); add it to the recipe "
                                           f"or pass {_fmt_path(path + (name,))}=<value>")
    try:
        return cls(**kwargs)
    except UserError as exc:
        raise UserError(f"{ctx.origin}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ctx.fail(path, f"is invalid: {exc}") from None


# --------------------------------------------------------------------------- public API

def to_dict(obj) -> Any:
    """Plain (YAML/JSON-able) view of a recipe; ``from_dict(type(obj), to_dict(obj)) == obj``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = sorted((f.name for f in dataclasses.fields(obj) if f.init), key=lambda n: n != DISCRIMINATOR)
        return {n: to_dict(getattr(obj, n)) for n in names}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def from_dict(schema: type[T], data: Mapping, *, origin: str = "recipe") -> T:
    """Validate a mapping into the dataclass ``schema`` (strict: unknown keys and wrong types fail)."""
    return _build(schema, data if data is not None else {}, (), _Ctx(origin))


def parse_override(item: str) -> tuple[list[str | int], Any, str]:
    """``"a.b.0.c=value"`` → (['a', 'b', 0, 'c'], parsed value, raw text)."""
    if "=" not in item:
        raise UserError(f"override '{item}' must look like key=value (e.g. generation.batch_size=16)")
    key, raw = item.split("=", 1)
    key = key.strip().replace("[", ".").replace("]", "")
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in key.split(".")]
    if not key or any(p == "" for p in parts):
        raise UserError(f"override '{item}': empty key; use dotted keys like generation.batch_size=16")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value, raw


def apply_overrides(schema: type[T], obj: T | Mapping, overrides: Sequence[str], *, origin: str = "recipe") -> T:
    """Validate ``obj`` (an instance or a raw mapping) with ``key=value`` overrides applied on top."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else _deepcopy(obj or {})
    for item in overrides:
        parts, value, raw = parse_override(item)
        _set(schema, data, parts, value, raw, item)
    if overrides:
        origin = f"{origin} (with overrides {' '.join(overrides)})"
    return from_dict(schema, data, origin=origin)


def _deepcopy(x):
    if isinstance(x, Mapping):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_deepcopy(v) for v in x]
    return x


def _default_of(cls, name: str):
    f = _fields(cls)[name]
    if f.default is not dataclasses.MISSING:
        return to_dict(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return to_dict(f.default_factory())
    return None


def _set(schema, data: dict, parts: list, value, raw: str, item: str) -> None:
    node, tp, path = data, schema, ()
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        tp = _strip_optional(tp)
        table = _discriminated(tp)
        if table is not None:  # pick the union member from the current value's discriminator
            tp = table.get(node.get(DISCRIMINATOR) if isinstance(node, Mapping) else None, tp)
        if dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if isinstance(part, str) and part not in fields and _renamed(tp, part):
                raise UserError(f"override '{item}': field '{_fmt_path(path + (part,))}' is now "
                                f"'{_renamed(tp, part)}'")
            if not isinstance(part, str) or part not in fields:
                raise UserError(f"override '{item}': unknown field '{_fmt_path(path + (part,))}'; "
                                f"{_suggest(str(part), fields)}valid fields here: {', '.join(fields)}")
            child_tp = _hints(tp)[part]
        elif typing.get_origin(tp) in (dict, Mapping):
            child_tp = (typing.get_args(tp) or (Any, Any))[1]
        elif typing.get_origin(tp) in (list, tuple, Sequence):
            if not isinstance(part, int) or not isinstance(node, list) or not 0 <= part < len(node):
                n = len(node) if isinstance(node, list) else 0
                raise UserError(f"override '{item}': '{_fmt_path(path)}' is a list of {n} item(s); index it with "
                                f"0..{max(n - 1, 0)} or replace the whole list, e.g. {_fmt_path(path)}=[...]")
            child_tp = (typing.get_args(tp) or (Any,))[0]
        else:
            raise UserError(f"override '{item}': '{_fmt_path(path)}' is {_type_name(tp)} and has no "
                            f"field '{part}'")
        path = path + (part,)
        if last:
            if _strip_optional(child_tp) is str and value is not None and not isinstance(value, str):
                value = raw.strip()  # e.g. target=123 or out=2024: keep the literal text
            node[part] = value
            return
        if isinstance(node, Mapping) and (part not in node or node[part] is None):
            default = _default_of(tp, part) if dataclasses.is_dataclass(tp) else None
            node[part] = default if default is not None else {}
        node, tp = node[part], child_tp


def load_recipe(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = (),
                *, defaults: Mapping | None = None) -> T:
    """Load ``path`` (YAML) into ``schema``, apply ``key=value`` overrides, validate everything."""
    data: dict = dict(defaults or {})
    origin = "recipe"
    if path is not None:
        p = Path(path)
        origin = f"recipe {p}"
        if p.is_dir():
            raise UserError(f"recipe {p} is a folder; pass a YAML recipe file (see recipes/)")
        if not p.is_file():
            raise UserError(f"recipe file {p} not found; pass an existing YAML file (see recipes/)")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{origin}: not UTF-8 text (a binary file?); pass a YAML recipe file "
                            "(see recipes/)") from None
        except OSError as exc:
            raise UserError(f"{origin}: cannot read it ({exc.strerror or exc})") from None
        except yaml.YAMLError as exc:
            raise UserError(f"{origin}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, Mapping):
            raise UserError(f"{origin}: the top level must be a mapping of fields, got {type(loaded).__name__}")
        data.update(loaded)
    return apply_overrides(schema, data, overrides, origin=origin)


def dump_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, allow_unicode=True)


def task_names() -> list[str]:
    """The tasks ``make distill TASK=...`` knows: one recipe each in ``recipes/tasks/``."""
    return sorted(p.stem for p in TASK_RECIPES.glob("*.yaml"))


def task_recipe(task: str) -> Path:
    p = TASK_RECIPES / f"{task}.yaml"
    if not p.is_file():
        raise UserError(f"--task {task}: no recipe {p}; available tasks: {', '.join(task_names()) or 'none'}")
    return p


# --------------------------------------------------------------------------- shared recipe sections

@dataclasses.dataclass
class DraftVocabSection:
    """The vocabulary a drafting head drafts from (decode/core/vocab.py, FR-Spec): the most frequent tokens of
    the target's own outputs (the distilled responses it trains on) plus the special tokens. A recipe's
    ``draft_vocab: null`` drafts from the full vocabulary."""

    size: int | None = None  # N most frequent tokens; null = the fewest that reach `coverage`
    coverage: float = 0.95  # share of the distilled output tokens the frequent tokens must cover (size: null)

    def __post_init__(self):
        if self.size is not None and self.size < 1:
            raise UserError(f"draft_vocab.size must be >= 1 (or null to choose it by draft_vocab.coverage), "
                            f"got {self.size}")
        if not 0.0 < self.coverage <= 1.0:
            raise UserError(f"draft_vocab.coverage must be in (0, 1], got {self.coverage}")


def describe_fields(schema: type, prefix: str = "") -> list[str]:
    """One line per leaf field of a recipe schema, ``path = default  (type)``, for ``--help`` (nested sections
    are walked; a section that may be null says so)."""
    lines = []
    hints = _hints(schema)
    for name, f in _fields(schema).items():
        path, tp = prefix + name, hints[name]
        inner = _strip_optional(tp)
        if dataclasses.is_dataclass(inner):
            if inner is not tp:
                lines.append(f"{path} = {{...}} or null")
            lines += describe_fields(inner, path + ".")
            continue
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = "(required)" if missing else yaml.safe_dump(_default_of(schema, name), default_flow_style=True,
                                                              width=10_000).strip().removesuffix("...").strip()
        lines.append(f"{path} = {default}  ({_type_name(tp)})")
    return lines
