"""Building our C++ ops once per machine: ``torch.utils.cpp_extension`` into ``<cache>/kernels``, keyed by what a
``-march=native`` build depends on."""
from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

import torch


def machine_key(source: Path, cflags: tuple[str, ...]) -> str:
    """The source, the flags, torch and this CPU: a build for one of them does not load for another."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith(("flags", "Features"))), cpu)
    except OSError:
        pass
    text = "\n".join([source.read_text(), " ".join(cflags), torch.__version__, cpu])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def build_op(stem: str, source: Path, cflags: tuple[str, ...], what: str) -> str | None:
    """Build (first time, announced on stderr) or load ``source``, which registers its ops with torch; None when it
    is loaded, else the reason it cannot be (compiler, headers or ninja missing), in one line."""
    if not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")):
        return f"this CPU runs torch at {torch.backends.cpu.get_cpu_capability()} (the kernels need AVX2 or AVX-512)"
    from torch.utils.cpp_extension import load

    from ..models import cache_dir

    name = f"{stem}_{machine_key(source, cflags)}"
    build = cache_dir() / "kernels" / name
    fresh = not any(build.glob("*.so"))
    build.mkdir(parents=True, exist_ok=True)
    if fresh:
        print(f"compiling {what} for this CPU (once, ~15 s) ...", file=sys.stderr, flush=True)
    try:
        load(name, [str(source)], extra_cflags=list(cflags), build_directory=str(build), is_python_module=False)
    except Exception as exc:  # compiler, headers or ninja missing: the reason, in one line
        return f"building {source.name} failed ({str(exc).strip().splitlines()[-1][:160]})"
    return None
