"""Target features cached on disk for teacher-forced head training (``feature_cache.enabled: true``).

A self-drafting head (EAGLE) learns from the frozen target's hidden states on text. Computed on the fly,
every epoch pays one full target forward per sequence; the head itself is one decoder layer. Caching runs
the target once per training example, stores what the loss reads (the head's input features and the
target's final hidden state) and lets every later step pay for the head alone.

Layout of ``<dir>``: ``meta.json`` (what the cache was built from: target signature, tensor names, dtype,
a hash of every example's token ids) and shards ``shard-00000.safetensors``…, each holding the tensors of
``shard_examples`` consecutive examples as ``"<name>.<example index>"`` ([length, width]). A shard file
appears atomically when complete, so an interrupted build resumes at the first missing shard; a cache
built from other examples, another target or other tensors is rebuilt (it is a cache, nothing is lost).

Stored in ``dtype`` (float16 by default: half the disk and RAM of float32; the loss reads them back as
float32, so a cached run differs from an on-the-fly one by the rounding of the stored features).
The whole cache is loaded into memory for training (width × tokens × 2 bytes: 576 × 1M tokens ≈ 1.2 GB).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from safetensors.torch import load_file, save_file

from decode.common.errors import UserError
from decode.common.io import atomic_path, atomic_write_json

META = "meta.json"
INDEX = "cache_index"  # dataset column: the example's row in the cache
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class FeatureCacheSection:
    enabled: bool = False  # true: one target forward per example, then train on the stored features
    dir: str | None = None  # null = <out_dir>/feature_cache
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    shard_examples: int = 64  # examples per shard file (the unit of resume)
    batch_size: int = 8  # examples per target forward while building

    def __post_init__(self):
        if self.shard_examples < 1 or self.batch_size < 1:
            raise UserError(f"feature_cache.shard_examples and feature_cache.batch_size must be >= 1, got "
                            f"{self.shard_examples}, {self.batch_size}")


def _ids_hash(dataset) -> str:
    h = hashlib.sha256()
    for batch in dataset.iter(batch_size=1024):
        for ids in batch["input_ids"]:
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()


class FeatureStore:
    """The cached tensors of every example, in memory: ``store[i]`` → {name: [length, width] float32}."""

    def __init__(self, tensors: dict[str, torch.Tensor], names: list[str], size: int):
        self._tensors, self.names, self.size = tensors, names, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {n: self._tensors[f"{n}.{i}"].float() for n in self.names}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


def build_feature_cache(section: FeatureCacheSection, folder: Path, dataset, compute: Callable, collate,
                        fingerprint: dict, device, progress: bool = True) -> FeatureStore:
    """Cache ``compute(batch) → {name: [B, T, width]}`` for every row of ``dataset`` (rows padded by ``collate``;
    each row keeps its own length) under ``folder``, resuming complete shards, and load it.

    ``fingerprint``: what the tensors depend on besides the examples (target, layers); a mismatch rebuilds."""
    from tqdm.auto import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    n, per = len(dataset), section.shard_examples
    meta = {"fingerprint": fingerprint, "dtype": section.dtype, "examples": n, "shard_examples": per,
            "ids_sha256": _ids_hash(dataset)}
    meta_path = folder / META
    shards = [folder / f"shard-{s:05d}.safetensors" for s in range((n + per - 1) // per)]
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if old is not None and {k: v for k, v in old.items() if k != "names"} != meta:
        print(f"[feature cache] {folder} was built from other examples or settings: rebuilding", flush=True)
        for f in folder.glob("shard-*.safetensors"):
            f.unlink()
        old = None
    names = old.get("names") if old else None
    todo = [s for s, f in enumerate(shards) if not f.is_file()]
    built = sum(min(per, n - s * per) for s in todo)
    t0, tokens = time.perf_counter(), 0
    bar = tqdm(total=built, desc="caching target features", unit="ex", disable=not progress or not built)
    cols = [c for c in ("input_ids", "attention_mask", "labels") if c in dataset.column_names]
    for s in todo:
        out: dict[str, torch.Tensor] = {}
        for lo in range(s * per, min(n, (s + 1) * per), section.batch_size):
            rows = dataset.select(range(lo, min(n, (s + 1) * per, lo + section.batch_size)))
            batch = collate([{c: r[c] for c in cols} for r in rows])
            lengths = batch["attention_mask"].sum(-1).tolist()
            with torch.inference_mode():
                got = compute({k: v.to(device) for k, v in batch.items()})
            names = sorted(got)
            for j, length in enumerate(lengths):
                for name in names:
                    out[f"{name}.{lo + j}"] = got[name][j, :length].to("cpu", DTYPES[section.dtype]).contiguous()
            tokens += sum(lengths)
            bar.update(len(lengths))
        with atomic_path(shards[s]) as tmp:
            save_file(out, str(tmp))
        atomic_write_json(meta_path, {**meta, "names": names}, indent=2)
    bar.close()
    if built:
        secs = time.perf_counter() - t0
        print(f"[feature cache] {built} examples, {tokens} tokens in {secs:.0f} s ({tokens / max(secs, 1e-9):.0f} "
              f"tokens/s) → {folder}", flush=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in shards:
        tensors.update(load_file(str(f)))
    if names is None or len(tensors) != n * len(names):
        raise UserError(f"feature cache {folder} is incomplete ({len(tensors)} tensors for {n} examples); "
                        f"delete the folder and rerun")
    return FeatureStore(tensors, names, n)


class CachedFeatureCollator:
    """``collate`` + the cached tensors of the batch's examples (by their ``cache_index``), zero-padded to
    the batch's length: the loss reads ``inputs[name]`` instead of running the target."""

    def __init__(self, collate, store: FeatureStore):
        self.collate, self.store = collate, store

    def __call__(self, features: list[dict]) -> dict:
        index = [int(f[INDEX]) for f in features]
        batch = self.collate([{k: v for k, v in f.items() if k != INDEX} for f in features])
        T = batch["input_ids"].shape[1]
        cached = [self.store[i] for i in index]  # each example's tensors converted once
        for name in self.store.names:
            rows = [c[name] for c in cached]
            padded = rows[0].new_zeros(len(rows), T, rows[0].shape[-1])
            for j, r in enumerate(rows):
                padded[j, :r.shape[0]] = r[:T]
            batch[name] = padded
        return batch


def with_feature_cache(section: FeatureCacheSection, out: Path, train_ds, collate, compute: Callable,
                       fingerprint: dict, device, progress: bool = True):
    """(dataset, collate) for training: unchanged when the cache is off; else the dataset gains the
    ``cache_index`` column and the collator the cached tensors (built or resumed here)."""
    if not section.enabled:
        return train_ds, collate
    folder = Path(section.dir) if section.dir else out / "feature_cache"
    store = build_feature_cache(section, folder, train_ds, compute, collate, fingerprint, device, progress)
    print(f"[feature cache] {len(store)} examples, {store.nbytes / 2**20:.0f} MiB in memory", flush=True)
    return train_ds.add_column(INDEX, list(range(len(train_ds)))), CachedFeatureCollator(collate, store)
