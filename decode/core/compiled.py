"""Compiled verification forwards: one static-shape graph per number of scored positions.

Why static shapes: on a small target most of a step is per-op and per-layer overhead (``../shared/MEASURED.md``),
which inductor removes by fusing the small ops (norms, rotary, activations, residuals) into a few kernels. A
graph compiled with ``dynamic=True`` keeps every size symbolic and generic; a graph per size is specialised.
A round scores ``n = L + 1`` positions with L small, so the sizes a run needs are few and known up front
(1 … max draft + 1): :meth:`Target.warm_up` compiles each of them once at load, with a progress
message, so no compilation lands inside a timed round. The KV cache is HF's ``StaticCache`` whose tensors and
length pointer keep their addresses (decode/core/target.py), so moving the pointer never recompiles; its
capacity is part of a graph's shape, so a run sizes the cache once for its longest prompt
(``Target.reserve_capacity``) instead of growing it per prompt.

Compile cost is paid once per machine: inductor's on-disk caches (FX graph and AOT autograd caches) live
under ``<adaspec cache>/inductor`` (``TORCHINDUCTOR_CACHE_DIR`` overrides it), so a later run on the same
machine re-traces each graph (seconds) but does not re-generate or re-compile its kernels.

Devices: CPU uses inductor's C++/OpenMP kernels (``mode="default"``); CUDA uses ``mode="reduce-overhead"``
(CUDA graphs: one graph launch per round). A CUDA-graph output lives in a buffer the next replay overwrites,
so :meth:`CompiledForward.__call__` clones what it returns there.

Tree drafts are scored eagerly (their 4-D mask and node count vary per round); prefill too (its length varies
per prompt).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from ..common.errors import UserError

# sizes of compiled graphs one run may hold (positions × {with, without hidden states} × cache capacities)
RECOMPILE_LIMIT = 64


def inductor_cache_dir() -> Path:
    """Point inductor's on-disk caches at the project's cache folder (unless the user chose one)."""
    from .models import cache_dir

    path = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir() / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


class CompiledForward:
    """``torch.compile(model, dynamic=False)`` with the bookkeeping a report needs: the shapes compiled so
    far and the seconds their first calls took (compiling + one forward)."""

    def __init__(self, model: torch.nn.Module):
        import torch._dynamo

        inductor_cache_dir()
        limit = max(int(getattr(torch._dynamo.config, "recompile_limit", 8)), RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.config.cache_size_limit = limit  # older name of the same limit
        device = next(model.parameters()).device
        self.cuda_graphs = device.type == "cuda"
        self.fn = torch.compile(model, dynamic=False, mode="reduce-overhead" if self.cuda_graphs else None)
        self.shapes: set[tuple] = set()
        self.seconds = 0.0  # first calls of every shape: compile + one forward
        self.announce = True  # print a line to stderr whenever a new shape compiles

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, past_key_values,
                 output_hidden_states: bool):
        key = (input_ids.shape[1], past_key_values.get_max_length(), bool(output_hidden_states))
        first = key not in self.shapes
        if first and len(self.shapes) >= RECOMPILE_LIMIT:
            raise UserError(f"the compiled target forward would need more than {RECOMPILE_LIMIT} graphs (shape {key}); "
                            "run without --compile or with shorter drafts")
        if first and self.announce:
            print(f"compiling the target forward: {key[0]} position(s), cache of {key[1]} …", end="",
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():  # inference_mode tensors do not mix with compiled graphs
            out = self.fn(input_ids=input_ids, position_ids=position_ids, past_key_values=past_key_values,
                          use_cache=True, output_hidden_states=output_hidden_states)
        if self.cuda_graphs:  # the graph's output buffers are overwritten by the next replay
            out.logits = out.logits.clone()
            if out.hidden_states is not None:
                out.hidden_states = tuple(h.clone() for h in out.hidden_states)
        if first:
            self.shapes.add(key)
            self.seconds += time.perf_counter() - t0
            if self.announce:
                print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return out

    @property
    def graphs(self) -> int:
        return len(self.shapes)

    def describe(self) -> dict:
        """For reports: how many graphs, and the seconds their first calls took."""
        return {"graphs": self.graphs, "seconds": round(self.seconds, 2),
                "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}

