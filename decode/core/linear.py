"""How the target's linear layers run: ``stock`` (``torch.nn.Linear``) or ``onednn`` (weights pre-packed once
for oneDNN, CPU only). ``auto``, on a CPU whose torch has oneDNN (float32, bfloat16), times both on the loaded
target and keeps the faster (:func:`probe_linear`); elsewhere it is ``stock``.

Why: decoding on a CPU multiplies a few rows (1 … L+1 positions) by every weight matrix. PyTorch's CPU
``F.linear`` calls MKL's sgemm, which has a cliff at small row counts: on this 2-core AVX-512 machine the
576×49152 LM head of the default target took 9.4 ms for 1 row, 23 ms for 2, 35 ms for 3, 17 ms for 4, 34 ms
for 7 (so scoring 3 positions cost 2.06 steps, 4 positions 1.52: the shape of the verification curve was the
BLAS's, not the model's). oneDNN's matmul on weights reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the ops inductor itself emits for
low-precision linears; for float32 it emits MKL's packed sgemm, which keeps the cliff) ran the same LM head
in 3.3–4.3 ms for 1–8 rows, and the whole target forward at 37 ms for one position and 41 ms for five
(stock: 54 and 82 ms); docs/performance.md.

The packed model is a copy of the module tree that *shares* every parameter with the stock model (the
``hf`` reference and the transformers peers keep running the stock modules); only the packed weights are
new memory (about the size of the linear weights once more). Results differ from ``F.linear`` by float32
rounding (another summation order, ~1e-4 absolute on logits of magnitude ~20), like any change of kernel
(scoring 4 positions already runs another sgemm path than scoring 1); greedy equality with plain
``generate`` is checked by the tests and by every evaluation's lossless column.

Packing is not always faster: on an AMX Xeon (Sapphire Rapids class, 2 threads) the stock model stepped in
32.5 ms and the packed one in 41.3 ms (Spec-Bench demo prompts: our autoregressive loop 0.95× against 0.79× of
plain ``generate``). Which is faster is a property of the machine and its BLAS, so ``auto`` measures it — per
number of positions: on that Xeon stock won for 1–3 positions and packing from 4 on (a forward at 300 tokens
of context: 4 positions 51.3 ms packed vs 54.6 stock, 6: 54.9 vs 59.8, 8: 58.0 vs 67.0), so ``auto`` may pick
``mixed``: the packed model with ``PackedLinear.packed_from`` rows, below which each linear runs stock.
"""
from __future__ import annotations

import functools
import itertools
import sys
import weakref

import torch

from ..common.device import interleaved_medians, seconds_of
from ..common.errors import UserError
from .models import weight_sharing_copy

LINEAR_KINDS = ("auto", "onednn", "stock")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


_PACKED: dict[int, torch.Tensor] = {}  # key → packed weight, for the compiled path (see onednn_linear)
_KEYS = itertools.count()


@torch.library.custom_op("adaspec::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    """The packed linear as an opaque op for torch.compile: inductor cannot lower ``_linear_pointwise`` on a
    packed weight that is a graph input, so compiled graphs call this op, which finds the packed weight by
    ``key`` (``weight`` is passed for its shape only)."""
    return packed_linear(x, _PACKED[key], bias)


@onednn_linear.register_fake
def _(x, weight, bias, key):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` whose weight is reordered once for oneDNN. ``weight``/``bias`` stay the stock
    module's (shared) parameters, so code reading them (tied embeddings, draft heads) sees the usual tensors.
    Eager calls run the oneDNN op directly (no custom-op dispatch: ~210 linears per forward); a graph being
    compiled calls :func:`onednn_linear`."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.packed_from = 1  # fewer rows than this run stock F.linear (``mixed``: set by probe_linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack_weight(linear.weight)
        self.key = next(_KEYS)
        _PACKED[self.key] = self.packed
        weakref.finalize(self, _PACKED.pop, self.key, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_from > 1 and x.numel() < self.packed_from * self.in_features:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.weight, self.bias, self.key)
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn packed"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight reordered once for oneDNN (an opaque tensor for :func:`packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_weight(weight)`` (inference only: no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def onednn_usable(device, dtype: torch.dtype) -> str | None:
    """None when linears on ``device`` in ``dtype`` can be packed for oneDNN here, else the reason not
    (answered once per device and dtype)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the target runs on {device.type} (oneDNN packing is for CPUs)"
    if dtype not in PACKABLE_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (oneDNN packing covers float32 and bfloat16)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:  # the op exists and runs on this CPU
        packed_linear(torch.zeros(1, 8, dtype=dtype), pack_weight(torch.zeros(8, 8, dtype=dtype)))
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN linear failed here ({str(e).splitlines()[0][:120]})"
    return None


def resolve_linear(spec: str, device, dtype: torch.dtype) -> str:
    """``auto`` stays ``auto`` where packing is usable (the engine then measures both: :func:`probe_linear`),
    else ``stock``; ``onednn`` where unusable is an error naming why. Resolved before the model loads (from
    the run's device and dtype)."""
    if spec not in LINEAR_KINDS:
        raise UserError(f"--linear must be one of {', '.join(LINEAR_KINDS)}, got '{spec}'")
    if spec == "stock":
        return "stock"
    why = onednn_usable(device, dtype)
    if why is None:
        return spec
    if spec == "onednn":
        raise UserError(f"--linear onednn cannot run here: {why}; use --linear stock (or auto)")
    return "stock"


def pack_linears(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose every ``nn.Linear`` is a :class:`PackedLinear`, sharing all parameters and
    buffers with ``model`` (which is left untouched)."""
    fast = weight_sharing_copy(model)
    for module in list(fast.modules()):
        _pack_children(module)
    fast.eval()
    return fast


def _pack_children(module: torch.nn.Module) -> int:
    """Replace the ``nn.Linear`` children of ``module`` (not deeper) by PackedLinears; returns how many."""
    linears = [(name, child) for name, child in module.named_children() if type(child) is torch.nn.Linear]
    for name, child in linears:
        setattr(module, name, PackedLinear(child))
    return len(linears)


def _time_forward(model: torch.nn.Module, positions: int) -> float:
    """Seconds of one uncached forward over ``positions`` tokens: the rows every linear multiplies in a round."""
    ids = torch.arange(1, positions + 1, device=next(model.parameters()).device).unsqueeze(0)
    return seconds_of(lambda: model(input_ids=ids, use_cache=False))


def probe_linear(model: torch.nn.Module, positions: tuple[int, ...] = (1, 2, 3, 4, 5, 6), reps: int = 4,
                 measure=_time_forward) -> tuple[str, torch.nn.Module, dict]:
    """``--linear auto`` on a CPU: time the stock model and its packed copy on forwards of ``positions`` tokens
    (the rows every linear multiplies in a round of that size; one warm-up, then ``reps`` rounds interleaved
    between the two, medians) and pick where packing starts: the threshold t with the lowest summed medians when
    forwards of fewer than t positions run stock and the rest packed (ties: more stock). t at the smallest size
    = ``onednn``, past the largest = ``stock``, else ``mixed`` (packed from t positions on, also beyond the
    sizes probed). Returns (kind, the model to run, {"chosen", "packed_from", "ms": {kind: {positions: ms}}});
    a few seconds for the default target."""
    packed = pack_linears(model)
    models = {"stock": model, "onednn": packed}
    sizes = sorted(set(int(n) for n in positions))
    with torch.inference_mode():
        medians = interleaved_medians({(kind, n): functools.partial(measure, m, n) for kind, m in models.items()
                                       for n in sizes}, reps)
    ms = {kind: {n: round(1e3 * medians[kind, n], 2) for n in sizes} for kind in models}
    cost = {t: sum(ms["stock"][n] for n in sizes if n < t) + sum(ms["onednn"][n] for n in sizes if n >= t)
            for t in [*sizes, sizes[-1] + 1]}
    start = min(cost, key=lambda t: (cost[t], -t))
    if start > sizes[-1]:
        chosen, run, start = "stock", model, None
    elif start == sizes[0]:
        chosen, run = "onednn", packed
    else:
        chosen, run = "mixed", packed
        for module in packed.modules():
            if isinstance(module, PackedLinear):
                module.packed_from = start
    what = {"stock": "stock", "onednn": "onednn", "mixed": f"onednn from {start} positions on, stock below"}[chosen]
    print(f"--linear auto: {what} linears (forward of {'/'.join(map(str, sizes))} positions: "
          + ", ".join(f"{k} {'/'.join(f'{v:.1f}' for v in per.values())} ms" for k, per in ms.items()) + ")",
          file=sys.stderr)
    return chosen, run, {"chosen": chosen, "packed_from": start,
                         "ms": {k: {str(n): v for n, v in per.items()} for k, per in ms.items()}}


def linear_model(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """The model the target runs for a resolved ``kind`` (``stock``: ``model`` itself)."""
    return pack_linears(model) if kind == "onednn" else model


def pack_arm_linears(arms, stock_model: torch.nn.Module) -> int:
    """Pack, in place, the linears of the modules the arms own (an EAGLE head's layer, fc and draft-vocabulary
    projection; a drafter model; those of a union's sub-arms), once they are loaded. A module of ``stock_model`` is
    never changed (early-exit stacks run the target's own layers; the hf reference runs them too): only parents the
    arm owns get a PackedLinear child, which may wrap a shared weight. Returns how many linears were packed."""
    stock = {id(m) for m in stock_model.modules()}
    seen, packed = set(), 0
    for arm in (p for a in arms for p in getattr(a, "parts", (a,))):  # a union's sub-arms; a batch drafter as it is
        for value in vars(arm).values():
            if not isinstance(value, torch.nn.Module) or onednn_usable(*_placement(value)) is not None:
                continue
            for module in list(value.modules()):
                if id(module) in stock or id(module) in seen:
                    continue
                seen.add(id(module))
                if (isinstance(getattr(module, "draft_weight", None), torch.Tensor)  # an EAGLE draft-vocab head
                        and getattr(module, "draft_weight_packed", None) is None):
                    module.draft_weight_packed = pack_weight(module.draft_weight)
                packed += _pack_children(module)
    return packed


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(module.parameters(), None)
    return (torch.device("meta"), torch.float32) if p is None else (p.device, p.dtype)
