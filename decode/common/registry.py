"""Name → factory tables for the pluggable units (arms, policies, rewards, length controllers).

One place for registration and for the two user errors every table raises: an unknown name (listing
the known ones) and bad parameters in a ``name:key=value`` spec (typed and range-checked against the
factory's signature by :func:`decode.common.specs.bind_params` before anything is built).
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import UserError
from .specs import bind_params


class Registry:
    def __init__(self, kind: str, plural: str | None = None, hint: str = ""):
        self.kind = kind  # e.g. "arm", "length controller": used in error messages
        self.plural = plural or kind + "s"
        self.hint = hint  # appended to the unknown-name error (how to set it)
        self._factories: dict[str, Callable[..., Any]] = {}
        self._checks: dict[str, Callable[[dict], None]] = {}

    def register(self, name: str, check: Callable[[dict], None] | None = None):
        """Decorator; a registered class also gets ``cls.name = name``. ``check(typed params)`` validates what
        the signature cannot (a folder the spec names, sub-specs) without building: :meth:`check` runs it."""
        def deco(factory):
            if isinstance(factory, type):
                factory.name = name
            self.add(name, factory)
            if check is not None:
                self._checks[name] = check
            return factory
        return deco

    def add(self, name: str, factory: Callable[..., Any]) -> None:
        if name in self._factories and self._factories[name] is not factory:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def check(self, name: str, spec: str, positional: int, params: dict) -> dict:
        """The spec's parameters typed and range-checked against the factory (which takes ``positional``
        arguments of its own first), without building anything: what a CLI validates before models load."""
        if name not in self._factories:
            where = f" in '{spec}'" if spec != name else ""
            raise UserError(f"unknown {self.kind} '{name}'{where}; known {self.plural}: "
                            f"{', '.join(self.names())}{self.hint}")
        typed = bind_params(f"{self.kind} '{spec}'", name, self._factories[name], positional, params)
        if name in self._checks:
            try:
                self._checks[name](typed)
            except UserError as exc:
                raise UserError(f"{self.kind} '{spec}': {exc}") from None
        return typed

    def build(self, name: str, spec: str, /, *args, **params):
        """``factory(*args, **params)``; ``spec`` is the user's text, quoted in errors."""
        params = self.check(name, spec, len(args), params)
        factory = self._factories[name]
        try:
            return factory(*args, **params)
        except TypeError as exc:
            raise UserError(f"{self.kind} '{spec}': bad parameters ({exc})") from exc
