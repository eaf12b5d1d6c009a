"""A KV cache for B rows with per-row valid slots: what batched rounds run the target on (decode/engine/batch.py), and
what an arm that drafts batched runs its own model on (decode/choose/arms/eagle/batched.py).

A forward appends W slots to every row (its block, padded); afterwards a row keeps the slots it needs and marks the
rest invalid — rollback is a per-row mask, not a crop (a tree's accepted path is kept the same way, whatever slots
it sits in). Keys were rotated at their row's *logical* positions, so where a slot sits does not matter: attention
is over the visible set, and :meth:`RowCache.compact` gathers each row's valid slots to the front when padding and
rejected drafts pile up. Rows join (prefilled alone, padded into
the batch: :meth:`RowCache.add`) and leave (:meth:`RowCache.select`) between forwards."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .target import allocate_cache, round_up

SLOTS = 64  # the capacity grows in multiples of this many slots per row

class RowCache:
    """One KV cache for B rows with per-row valid slots (see the module docstring).

    The slots live in a pre-allocated HF cache of :class:`~decode.core.target.PrefixLayer` layers (``[B, heads,
    capacity, dim]``): a forward writes its W block slots in place after the ``slots`` filled ones and attends over
    the filled prefix, so a round copies nothing of the cache (an HF ``DynamicCache`` concatenates every layer's
    whole cache every forward: at 8 rows × 300 tokens that was ~10% of a round here). The layers view the first B
    rows of an allocation with room for more rows and more slots, both grown by doubling (:meth:`reserve`, a row
    joining past the rows' room): a row joining writes its own slots only, a row leaving moves the kept rows'
    filled slots within it, and compaction gathers in place. (A join used to copy every row's cache into a new
    allocation one row taller: 28 ms of each ~200 ms join at 16 rows.)"""

    def __init__(self, config=None):
        self.config = config  # the model's (allocation before any row has a slot of its own)
        self.hf = None  # an HF StaticCache of PrefixLayers, [B, heads, capacity, dim] per layer; None = no slot yet
        # per layer, the allocation its keys/values view the first B rows of: [row room, heads, capacity, dim]
        self._base: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, T], on the CPU (masks are built there)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def capacity(self) -> int:
        return self._base[0][0].shape[2] if self.hf is not None else 0

    @property
    def row_room(self) -> int:
        """How many rows the allocation holds (≥ rows)."""
        return self._base[0][0].shape[0] if self.hf is not None else 0

    def lengths(self) -> list[int]:
        return self.valid.sum(1).tolist()

    def _set(self, base: list[tuple[torch.Tensor, torch.Tensor]], filled: int) -> None:
        """Install per-layer ``[row room, heads, capacity, dim]`` allocations, the layers viewing the first ``rows``
        rows with ``filled`` slots in use."""
        self._base = base
        for layer, (k, v) in zip(_layers(self.hf), base):
            layer.keys, layer.values = k[:self.rows], v[:self.rows]
            layer.max_cache_len, layer.filled = k.shape[2], filled

    def _allocate(self, rows: int, capacity: int, dtype: torch.dtype, device) -> None:
        if self.config is None:
            raise ValueError("RowCache(config=...) is needed to hold slots (the model's config sizes the layers)")
        self.hf = allocate_cache(self.config, "prefix", capacity, dtype, device, batch=rows)
        self._set([(layer.keys, layer.values) for layer in _layers(self.hf)], 0)

    def _regrown(self, rows: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, a zeroed ``[rows, heads, capacity, dim]`` allocation holding the current rows' filled slots
        first."""
        out = []
        for layer in _layers(self.hf):
            T = layer.filled
            k = layer.keys.new_zeros(rows, layer.keys.shape[1], capacity, layer.keys.shape[3])
            v = torch.zeros_like(k)
            B = layer.keys.shape[0]
            k[:B, :, :T], v[:B, :, :T] = layer.keys[:, :, :T], layer.values[:, :, :T]
            out.append((k, v))
        return out

    def reserve(self, width: int, dtype: torch.dtype, device) -> None:
        """Room for a forward of ``width`` more slots per row (allocated or doubled as needed)."""
        need = self.slots + width
        if self.hf is None:
            self._allocate(self.rows, round_up(need, SLOTS), dtype, device)
        elif need > self.capacity:
            self._set(self._regrown(self.row_room, max(2 * self.capacity, round_up(need, SLOTS))), self.slots)

    def add(self, cache: DynamicCache | None, n: int) -> None:
        """Append one row whose (one-row, dynamic) cache holds ``n`` slots, all valid; ``cache`` None for ``n == 0``."""
        T = max(self.slots, n)
        self.valid = torch.cat([_pad(self.valid, T), _pad(torch.ones(1, n, dtype=torch.bool), T)])
        new = [] if cache is None else _layers(cache)
        if self.hf is None and not new:
            return  # no slot in any row yet: allocated by the first forward
        self._room(T, new)
        self._write(self.rows - 1, new, n, T)

    def fill(self, row: int, cache: DynamicCache, n: int) -> None:
        """Give ``row``, which has no valid slot (a drafter's row that had nothing to draft from yet), the ``n`` slots
        of a one-row dynamic cache, all valid, as its first slots (every row's slots widen when n is past them)."""
        if self.valid[row].any():
            raise ValueError(f"row {row} already holds slots: only an empty row is filled")
        T = max(self.slots, n)
        self.valid = _pad(self.valid, T)
        self.valid[row, :n] = True
        new = _layers(cache)
        self._room(T, new)
        self._write(row, new, n, T)

    def _room(self, T: int, like: list) -> None:
        """An allocation holding every row and ``T`` slots (a first one shaped like the layers ``like``; else rows
        and slots doubled when there is no room)."""
        if self.hf is None:
            self._allocate(self.rows, round_up(T, SLOTS), like[0].keys.dtype, like[0].keys.device)
        elif self.rows > self.row_room or T > self.capacity:
            rows = self.rows if self.rows <= self.row_room else max(self.rows, 2 * self.row_room)
            slots = self.capacity if T <= self.capacity else max(2 * self.capacity, round_up(T, SLOTS))
            self._set(self._regrown(rows, slots), T)

    def _write(self, r: int, new: list, n: int, T: int) -> None:
        """Row ``r``'s slots: the one-row layers ``new``'s ``n`` first, the rest up to ``T`` cleared (a former row's,
        or padding, may be there); the layers then view ``T`` filled slots."""
        with torch.inference_mode():  # the slots were written by inference-mode forwards
            for i, (k, v) in enumerate(self._base):
                if new:
                    k[r, :, :n], v[r, :, :n] = new[i].keys[0], new[i].values[0]
                k[r, :, n:T] = 0
                v[r, :, n:T] = 0
        self._set(self._base, T)

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (in that order). In place: the kept rows' filled slots move to the front rows of the
        same allocation, which the layers then view (a row leaving copies the filled slots only, once, not the
        whole capacity into a new allocation: rows finish every few rounds when they speculate). Rows moving from
        past the kept count into free places (the engine's order, ``fill_holes``) are copied alone."""
        idx = torch.tensor(keep, dtype=torch.long)
        self.valid = self.valid[idx]
        if not keep:
            self.hf, self._base, self.valid = None, [], torch.zeros(0, 0, dtype=torch.bool)
            return
        if self.hf is not None:
            n, T = len(keep), self.slots
            moves = [(dst, src) for dst, src in enumerate(keep) if dst != src]
            # rows only from past the kept count into places left free: no kept row is overwritten, so row by row
            alone = all(src >= n for _, src in moves)
            dev = _layers(self.hf)[0].keys.device
            idx = idx.to(dev)
            with torch.inference_mode():  # the slots were written by inference-mode forwards
                for layer in _layers(self.hf):
                    if moves and alone:
                        for dst, src in moves:
                            layer.keys[dst, :, :T] = layer.keys[src, :, :T]
                            layer.values[dst, :, :T] = layer.values[src, :, :T]
                    elif moves:  # the right side is gathered into a new tensor first, so rows may overlap
                        layer.keys[:n, :, :T] = layer.keys[idx, :, :T]
                        layer.values[:n, :, :T] = layer.values[idx, :, :T]
            self._set(self._base, T)

    def attention(self, block_valid: torch.Tensor, dtype: torch.dtype, device,
                  within: torch.Tensor | None = None) -> torch.Tensor:
        """Additive mask ``[B, 1, W, T + W]`` for a forward of W block slots per row: query j of row b sees that
        row's valid cached slots and the real block slots k <= j (and itself, so a padding query is finite).
        ``within`` ([B, W, W] bool): which block slots each block slot sees instead of k <= j (a token tree: its
        ancestors and itself, decode/core/tree.py ``ancestor_matrix``)."""
        B, W = block_valid.shape
        T = self.slots
        causal = torch.tril(torch.ones(W, W, dtype=torch.bool))[None] if within is None else within
        block = causal & block_valid[:, None, :]
        block |= torch.eye(W, dtype=torch.bool)[None]
        visible = torch.cat([self.valid[:, None, :].expand(B, W, T), block], dim=2)
        mask = torch.zeros(B, W, T + W, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None].to(device)

    def block(self, block_valid: torch.Tensor, dtype: torch.dtype, device,
              within: torch.Tensor | None = None) -> torch.Tensor:
        """Before a forward of ``block_valid.shape[1]`` slots per row: room for them, and the additive mask it takes
        (pass ``hf`` as the forward's ``past_key_values``; :meth:`commit` after it). ``within``: as
        :meth:`attention`."""
        mask = self.attention(block_valid, dtype, device, within)
        self.reserve(block_valid.shape[1], dtype, device)
        return mask

    def export(self, row: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of ``row``'s first ``n`` valid slots' keys and values (its first n logical positions), per layer
        ``[kv heads, n, dim]``: a finished row kept in a prefix cache (decode/core/prefix_cache.py)."""
        slots = self.valid[row].nonzero()[:, 0]
        if not 0 < n <= len(slots):  # a valid slot implies an allocation
            raise ValueError(f"cannot export {n} positions of row {row}, which holds {len(slots)}")
        layers = _layers(self.hf)
        idx = slots[:n].to(layers[0].keys.device)
        return [x.keys[row][:, idx] for x in layers], [x.values[row][:, idx] for x in layers]

    def commit(self, keep_block: torch.Tensor) -> None:
        """After a forward of W block slots: row b keeps the block slots ``keep_block[b]`` ([B, W] bool)."""
        self.valid = torch.cat([self.valid, keep_block], dim=1)

    def forget(self, start: int) -> None:
        """Every row's slots from ``start`` on become invisible (a drafter's speculative steps, once its draft is
        out)."""
        self.valid[:, start:] = False

    def tidy(self, slack: int) -> bool:
        """:meth:`compact` once the cache holds more than the longest row + ``slack`` slots (padding and rejected
        drafts piled up); whether it did."""
        if self.rows and self.slots > max(self.lengths()) + slack:
            self.compact()
            return True
        return False

    def compact(self) -> None:
        """Gather each row's valid slots to the front ([B, max valid]); order within a row is kept."""
        if self.hf is None or not self.rows:
            return
        n = self.valid.sum(1)
        width = int(n.max())
        T = self.slots
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # valid slots first
        for layer in _layers(self.hf):
            idx = order.to(layer.keys.device)[:, None, :, None]
            k = torch.gather(layer.keys[:, :, :T], 2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            v = torch.gather(layer.values[:, :, :T], 2,
                             idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
            layer.keys[:, :, :width], layer.values[:, :, :width] = k, v
            layer.filled = width
        self.valid = torch.arange(width)[None, :] < n[:, None]


def _layers(cache: DynamicCache) -> list:
    """The cache's initialised layers (their ``keys``/``values`` are ``[B, heads, T, dim]``)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


def _pad(valid: torch.Tensor, T: int) -> torch.Tensor:
    return torch.cat([valid, torch.zeros(valid.shape[0], T - valid.shape[1], dtype=torch.bool)], dim=1)
