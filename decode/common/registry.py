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

    def register(self, name: str):
        """Decorator; a registered class also gets ``cls.name = name``."""
        def deco(factory):
            if isinstance(factory, type):
                factory.name = name
            self.add(name, factory)
            return factory
        return deco

    def add(self, name: str, factory: Callable[..., Any]) -> None:
        if name in self._factories and self._factories[name] is not factory:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def build(self, name: str, spec: str, /, *args, **params):
        """``factory(*args, **params)``; ``spec`` is the user's text, quoted in errors."""
        if name not in self._factories:
            where = f" in '{spec}'" if spec != name else ""
            raise UserError(f"unknown {self.kind} '{name}'{where}; known {self.plural}: {', '.join(self.names())}{self.hint}")
        factory = self._factories[name]
        params = bind_params(f"{self.kind} '{spec}'", name, factory, len(args), params)
        try:
            return factory(*args, **params)
        except TypeError as exc:
            raise UserError(f"{self.kind} '{spec}': bad parameters ({exc})") from exc
