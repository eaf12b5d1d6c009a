"""``name:key=value,...`` component specs (arms, policies, ...): parsed and typed in one place.

:func:`parse_spec` keeps values as text; :func:`bind_params` converts each one to the type its
factory declares, with the range from ``Annotated[int, Range(1)]``, so ``pld:L=2.5`` or ``L=abc`` fail
naming the component, the parameter, the value and the valid range instead of being coerced.
"""
from __future__ import annotations

import difflib
import inspect
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Union

from .errors import UserError

_INT = re.compile(r"[+-]?\d+")
_WHAT = {int: "an integer", float: "a finite number", bool: "true or false", str: "text"}


@dataclass(frozen=True)
class Range:
    """Valid interval of a numeric spec parameter: ``L: Annotated[int, Range(1)] = 4``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x) -> bool:
        return ((self.lo is None or (x > self.lo if self.lo_open else x >= self.lo))
                and (self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)))

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else ""


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"pld:L=4,n=3"`` → ("pld", {"L": "4", "n": "3"}); values are typed later by :func:`bind_params`."""
    spec = spec.strip()
    if not spec:
        raise UserError("empty spec; use e.g. pld:L=4 or ucbspec:delta=0.5")
    name, _, rest = spec.partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = (s.strip() for s in item.partition("="))
        if not eq or not k:
            raise UserError(f"spec '{spec}': parameter '{item}' must look like key=value")
        if k in params:
            raise UserError(f"spec '{spec}': parameter '{k}' is given twice")
        params[k] = v
    return name, params


def split_specs(text: str) -> list[str]:
    """Split ``"pld:L=4,n=3;suffix"`` or ``"pld suffix"``: arms are separated by ';' or spaces,
    and a ',' starts a new arm only when the next item has no '=' (so ``pld:L=4,suffix`` works)."""
    out: list[str] = []
    for chunk in text.replace(";", " ").split():
        for item in chunk.split(","):
            if out and "=" in item and ":" not in item:
                out[-1] += "," + item
            elif item:
                out.append(item)
    return out


# --------------------------------------------------------------------------- typed parameters

@dataclass(frozen=True)
class _Param:
    kind: type | None  # bool/int/float/str, or None when undeclared (value kept as given)
    range: Range | None
    required: bool


def _unpack(ann) -> tuple[type | None, Range | None]:
    """``Annotated[int, Range(1)] | None`` → (int, Range(1)); anything but one plain type → (None, None)."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        members = [a for a in typing.get_args(ann) if a is not type(None)]
        return _unpack(members[0]) if len(members) == 1 else (None, None)
    if typing.get_origin(ann) is Annotated:
        base, *meta = typing.get_args(ann)
        kind, _ = _unpack(base)
        return kind, next((m for m in meta if isinstance(m, Range)), None)
    return (ann, None) if ann in _WHAT else (None, None)


def _own_params(fn: Callable, skip: int) -> tuple[dict[str, _Param], bool]:
    """Keyword-settable parameters of ``fn`` after ``skip`` positional ones; True if it takes ``**kw``."""
    out, open_ = {}, False
    positional = 0
    try:  # modules use `from __future__ import annotations`: resolve the annotation strings
        sig = inspect.signature(fn, eval_str=True)
    except Exception:
        sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            open_ = True
            continue
        if p.kind is p.VAR_POSITIONAL:
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and positional < skip:
            positional += 1
            continue
        kind, rng = _unpack(p.annotation)
        if kind is None and type(p.default) in _WHAT:
            kind = type(p.default)  # e.g. `seed=0` without an annotation
        out[p.name] = _Param(kind, rng, p.default is p.empty)
    return out, open_


def declared_params(factory: Callable, skip: int) -> tuple[dict[str, _Param], bool]:
    """A factory's spec parameters; for a class, ``**kw`` is followed up the ``__init__`` chain (policies
    pass their base class's parameters on). The bool says whether unknown names may still be accepted."""
    if not isinstance(factory, type):
        return _own_params(factory, skip)
    out: dict[str, _Param] = {}
    for cls in factory.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or cls is object:
            continue
        own, open_ = _own_params(init, skip + 1)  # + self
        for k, v in own.items():
            if k not in out or (out[k].kind is None and v.kind is not None):
                out[k] = v
        if not open_:
            return out, False
    return out, True


def _convert(kind: type, value):
    """``value`` (spec text or a Python value) as ``kind``, or None if it is not one."""
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value if isinstance(value, bool) else None
    if kind is int:
        if isinstance(value, str):
            return int(value) if _INT.fullmatch(value) else None
        return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None
    if kind is float:
        try:
            x = float(value) if isinstance(value, (str, numbers.Real)) and not isinstance(value, bool) else None
        except ValueError:
            return None
        return x if x is not None and math.isfinite(x) else None
    return value if isinstance(value, str) else None


def _guess(text: str):
    """Undeclared parameters (a factory's ``**kw``): the text's most specific type."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.lower() == "true" if text.lower() in ("true", "false") else text


def bind_params(owner: str, name: str, factory: Callable, skip: int, params: dict[str, Any]) -> dict[str, Any]:
    """Check ``params`` against ``factory``'s declared parameters and convert them to their types.

    ``owner`` names the component in errors (``arm 'pld:L=2.5'``); ``skip`` = positional arguments the
    caller supplies itself (they are not spec parameters).
    """
    declared, open_ = declared_params(factory, skip)
    bad = f"{owner}: bad parameters:"
    out = {}
    for k, value in params.items():
        p = declared.get(k)
        if p is None:
            if open_:
                out[k] = _guess(value) if isinstance(value, str) else value
                continue
            if not declared:
                raise UserError(f"{bad} '{name}' takes no parameters, got '{k}'")
            lower = {n.lower(): n for n in declared}
            close = difflib.get_close_matches(k.lower(), list(lower), n=1, cutoff=0.5)
            hint = f"; did you mean '{lower[close[0]]}'?" if close else ""
            raise UserError(f"{bad} unknown parameter '{k}'{hint} (parameters: {', '.join(declared)})")
        if p.kind is None:
            out[k] = _guess(value) if isinstance(value, str) else value
            continue
        x = _convert(p.kind, value)
        if x is None or (p.range is not None and x not in p.range):
            rng = f" {p.range}" if p.range is not None else ""
            raise UserError(f"{bad} {k} must be {_WHAT[p.kind]}{rng}, got '{value}'")
        out[k] = x
    missing = [k for k, p in declared.items() if p.required and k not in out]
    if missing:
        raise UserError(f"{bad} missing required parameter '{missing[0]}' (e.g. {missing[0]}=...)")
    return out
