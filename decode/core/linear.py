"""How the target's linear layers run: ``stock`` (``torch.nn.Linear``), ``onednn`` (weights pre-packed once
for oneDNN, CPU only) or ``stream`` (our float32 CPU kernel for a few rows, decode/core/kernels/stream.py).
``auto``, on a CPU where a packed kernel runs, times them on the loaded target and keeps the fastest split
(:func:`probe_linear`); elsewhere it is ``stock``.

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

``stream`` (decode/core/kernels/stream.py): a kernel of ours that reads each float32 weight once for up to 8 rows
at a time, flat where both BLAS paths are not (that Xeon: a forward of 2 / 4 / 8 / 12 positions 74 / 78 / 87 /
90 ms against stock's 73 / 97 / 113 / 138 and oneDNN's 97 / 100 / 106 / 138, in one interleaved run). ``auto``
measures it as a third candidate where it builds; ``mixed`` then runs stock below ``packed_from`` rows and the
kernel it measured faster (``PackedLinear.kernel``) from there on.
"""
from __future__ import annotations

import functools
import itertools
import sys
import weakref

import torch

from ..common.device import interleaved_medians, seconds_of
from ..common.errors import UserError
from .kernels.stream import pack_stream, stream_linear, stream_usable
from .models import weight_sharing_copy

LINEAR_KINDS = ("auto", "onednn", "stream", "stock")
KERNELS = ("onednn", "stream")  # the packed kinds (ties in auto's measurements go to the first)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
STREAM_MAX_ROWS = 256  # more rows (a long prefill) run stock: the stream kernel is for the few rows of a round


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
    """A ``torch.nn.Linear`` whose weight is packed once for ``kernel`` (``onednn``: reordered for oneDNN;
    ``stream``: blocked for decode/core/kernels/stream.py). ``weight``/``bias`` stay the stock module's (shared)
    parameters, so code reading them (tied embeddings, draft heads) sees the usual tensors. Eager oneDNN calls run
    the op directly (no custom-op dispatch: ~210 linears per forward); a graph being compiled calls
    :func:`onednn_linear`. Fewer rows than ``packed_from`` (``mixed``) and, for ``stream``, more than
    ``STREAM_MAX_ROWS`` run stock ``F.linear``."""

    def __init__(self, linear: torch.nn.Linear, kernel: str = "onednn", packed_from: int = 1):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.packed_from = packed_from  # fewer rows than this run stock F.linear (``mixed``: probe_linear sets it)
        self.max_rows = STREAM_MAX_ROWS if kernel == "stream" else sys.maxsize  # more rows run stock
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        if kernel == "stream":
            self.packed = pack_stream(linear.weight)
            return
        self.packed = pack_weight(linear.weight)
        self.key = next(_KEYS)
        _PACKED[self.key] = self.packed
        weakref.finalize(self, _PACKED.pop, self.key, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed_from <= x.numel() // self.in_features <= self.max_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.kernel == "stream":
            return stream_linear(x, self.packed, self.bias, self.out_features)
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.weight, self.bias, self.key)
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kernel} packed"


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


def kernel_usable(kernel: str, device, dtype: torch.dtype) -> str | None:
    """None when ``kernel`` (one of KERNELS) can run linears on ``device`` in ``dtype`` here, else the reason not.
    ``stream`` is built on the first ask (decode/core/kernels/stream.py)."""
    if kernel == "onednn":
        return onednn_usable(device, dtype)
    device = torch.device(device)
    if device.type != "cpu":
        return f"the target runs on {device.type} (the stream kernel is for CPUs)"
    if dtype != torch.float32:
        return f"dtype {str(dtype).removeprefix('torch.')} (the stream kernel is float32)"
    return stream_usable()


def resolve_linear(spec: str, device, dtype: torch.dtype) -> str:
    """``auto`` stays ``auto`` where a packed kernel is usable (the engine then measures them: :func:`probe_linear`),
    else ``stock``; ``onednn`` or ``stream`` where unusable is an error naming why. Resolved before the model loads
    (from the run's device and dtype)."""
    if spec not in LINEAR_KINDS:
        raise UserError(f"--linear must be one of {', '.join(LINEAR_KINDS)}, got '{spec}'")
    if spec == "stock":
        return "stock"
    if spec == "auto":
        return "auto" if any(kernel_usable(k, device, dtype) is None for k in KERNELS) else "stock"
    why = kernel_usable(spec, device, dtype)
    if why is not None:
        raise UserError(f"--linear {spec} cannot run here: {why}; use --linear stock (or auto)")
    return spec


def pack_linears(model: torch.nn.Module, kernel: str = "onednn") -> torch.nn.Module:
    """A copy of ``model`` whose every ``nn.Linear`` is a :class:`PackedLinear` for ``kernel``, sharing all
    parameters and buffers with ``model`` (which is left untouched)."""
    fast = weight_sharing_copy(model)
    for module in list(fast.modules()):
        _pack_children(module, kernel)
    fast.eval()
    return fast


def _pack_children(module: torch.nn.Module, kernel: str = "onednn", packed_from: int = 1) -> int:
    """Replace the ``nn.Linear`` children of ``module`` (not deeper) by PackedLinears; returns how many."""
    linears = [(name, child) for name, child in module.named_children() if type(child) is torch.nn.Linear]
    for name, child in linears:
        setattr(module, name, PackedLinear(child, kernel, packed_from))
    return len(linears)


def _time_forward(model: torch.nn.Module, positions: int) -> float:
    """Seconds of one uncached forward over ``positions`` tokens: the rows every linear multiplies in a round."""
    ids = torch.arange(1, positions + 1, device=next(model.parameters()).device).unsqueeze(0)
    return seconds_of(lambda: model(input_ids=ids, use_cache=False))


def probe_linear(model: torch.nn.Module, positions: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10), reps: int = 4,
                 measure=_time_forward, kernels: tuple[str, ...] = KERNELS) -> tuple[str, torch.nn.Module, dict]:
    """``--linear auto`` on a CPU: time the stock model and a packed copy per usable kernel (of ``kernels``) on
    forwards of ``positions`` tokens (the rows every linear multiplies in a round of that size; one warm-up, then
    ``reps`` rounds interleaved between them, medians) and pick a kernel and where it starts: the (kernel, t) with the
    lowest summed medians when forwards of fewer than t positions run stock and the rest that kernel (ties: more
    stock, then the kernel listed first). t at the smallest size = the kernel alone (``onednn`` / ``stream``), past
    the largest = ``stock``, else ``mixed`` (the kernel from t positions on, also beyond the sizes probed). A kernel
    that cannot run here is left out with its reason on stderr. Returns (kind, the model to run, {"chosen",
    "kernel", "packed_from", "ms": {kind: {positions: ms}}}); seconds for the default target."""
    device, dtype = _placement(model)
    usable = []
    for kernel in kernels:
        why = kernel_usable(kernel, device, dtype)
        if why is None:
            usable.append(kernel)
        else:
            print(f"--linear auto: {kernel} left out: {why}", file=sys.stderr)
    models = {"stock": model, **{k: pack_linears(model, k) for k in usable}}
    sizes = sorted(set(int(n) for n in positions))
    with torch.inference_mode():
        medians = interleaved_medians({(kind, n): functools.partial(measure, m, n) for kind, m in models.items()
                                       for n in sizes}, reps)
    ms = {kind: {n: round(1e3 * medians[kind, n], 2) for n in sizes} for kind in models}
    cost = {(k, t): sum(ms["stock"][n] for n in sizes if n < t) + sum(ms[k][n] for n in sizes if n >= t)
            for k in usable for t in sizes}
    cost[None, sizes[-1] + 1] = sum(ms["stock"].values())
    kernel, start = min(cost, key=lambda kt: (cost[kt], -kt[1], usable.index(kt[0]) if kt[0] else -1))
    if kernel is None:
        chosen, run, start = "stock", model, None
    elif start == sizes[0]:
        chosen, run = kernel, models[kernel]
    else:
        chosen, run = "mixed", models[kernel]
        for module in run.modules():
            if isinstance(module, PackedLinear):
                module.packed_from = start
    what = {"stock": "stock", "mixed": f"{kernel} from {start} positions on, stock below"}.get(chosen, chosen)
    print(f"--linear auto: {what} linears (forward of {'/'.join(map(str, sizes))} positions: "
          + ", ".join(f"{k} {'/'.join(f'{v:.1f}' for v in per.values())} ms" for k, per in ms.items()) + ")",
          file=sys.stderr)
    return chosen, run, {"chosen": chosen, "kernel": kernel, "packed_from": start,
                         "ms": {k: {str(n): v for n, v in per.items()} for k, per in ms.items()}}


def linear_model(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """The model the target runs for a resolved ``kind`` (``stock``: ``model`` itself)."""
    return pack_linears(model, kind) if kind in KERNELS else model


def packing_of(model: torch.nn.Module) -> tuple[str, int] | None:
    """(kernel, packed_from) of the PackedLinears a run model holds (what ``--linear`` resolved to), None for a
    stock model: the arms' modules are packed the same way (:func:`pack_arm_linears`)."""
    packed = next((m for m in model.modules() if isinstance(m, PackedLinear)), None)
    return None if packed is None else (packed.kernel, packed.packed_from)


def pack_arm_linears(arms, stock_model: torch.nn.Module, kernel: str = "onednn", packed_from: int = 1) -> int:
    """Pack, in place, the linears of the modules the arms own (an EAGLE head's layer, fc and draft-vocabulary
    projection; a drafter model; those of a union's sub-arms), once they are loaded, for ``kernel`` from
    ``packed_from`` rows on (the target's own split: :func:`packing_of`). A module of ``stock_model`` is
    never changed (early-exit stacks run the target's own layers; the hf reference runs them too): only parents the
    arm owns get a PackedLinear child, which may wrap a shared weight. Returns how many linears were packed."""
    stock = {id(m) for m in stock_model.modules()}
    seen, packed = set(), 0
    for arm in (p for a in arms for p in getattr(a, "parts", (a,))):  # a union's sub-arms; a batch drafter as it is
        for value in vars(arm).values():
            if not isinstance(value, torch.nn.Module) or kernel_usable(kernel, *_placement(value)) is not None:
                continue
            for module in list(value.modules()):
                if id(module) in stock or id(module) in seen:
                    continue
                seen.add(id(module))
                weight = getattr(module, "draft_weight", None)  # an EAGLE head's draft-vocabulary projection
                if isinstance(weight, torch.Tensor) and getattr(module, "draft_projection", None) is None:
                    module.draft_projection = PackedLinear(_AsLinear(weight, module.draft_bias), kernel, packed_from)
                    packed += 1
                packed += _pack_children(module, kernel, packed_from)
    return packed


class _AsLinear:
    """A weight (and bias) seen as the ``nn.Linear`` a PackedLinear wraps (shared, not copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(module.parameters(), None)
    return (torch.device("meta"), torch.float32) if p is None else (p.device, p.dtype)
