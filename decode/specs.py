"""``name:key=value,...`` component specs (arms, policies), parsed in one place."""
from __future__ import annotations

from .errors import UserError


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"pld:L=4,n=3"`` → ("pld", {"L": 4, "n": 3})."""
    spec = spec.strip()
    if not spec:
        raise UserError("empty spec; use e.g. pld:L=4 or ucbspec:delta=0.5")
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        if "=" not in item:
            raise UserError(f"spec '{spec}': parameter '{item}' must look like key=value")
        k, v = item.split("=", 1)
        params[k.strip()] = _parse_value(v.strip())
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
