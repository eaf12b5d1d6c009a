"""Target features cached on disk for teacher-forced head training (``feature_cache.enabled: true``).

A self-drafting head (EAGLE) learns from the frozen target's hidden states on text. Computed on the fly,
every epoch pays one full target forward per sequence; the head itself is one decoder layer. Caching runs
the target once per training example, stores what the loss reads (the head's input features and the
target's final hidden state) and lets every later step pay for the head alone.

Layout of ``<dir>``: ``meta.json`` (what the cache was built from: target signature, tensor names, dtype,
a hash of the examples' token ids in order and one per example) and shards ``shard-00000.safetensors``…, each
holding the tensors of ``shard_examples`` consecutive examples as ``"<name>.<example index>"`` ([length,
width]). A shard file appears atomically when complete, so an interrupted build resumes at the first missing
shard. A cache built from other examples is rebuilt beside the old one (``<dir>/.rebuild``) and replaces it;
examples it already holds (same target, tensors and dtype, matched by their token ids' hash) are copied over
instead of recomputed, as are those of the caches listed in ``reuse`` — so changing the mix (more open
text, another held-out split) pays only for the new examples. Another target or other tensors: rebuilt
from scratch (it is a cache, nothing is lost).

Stored in ``dtype`` (float16 by default: half the disk and RAM of float32; the loss reads them back as
float32, so a cached run differs from an on-the-fly one by the rounding of the stored features).
The whole cache is loaded into memory for training (width × tokens × 2 bytes: 576 × 1M tokens ≈ 1.2 GB).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
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
    reuse: list[str] = field(default_factory=list)  # other caches whose examples are copied instead of recomputed

    def __post_init__(self):
        if self.shard_examples < 1 or self.batch_size < 1:
            raise UserError(f"feature_cache.shard_examples and feature_cache.batch_size must be >= 1, got "
                            f"{self.shard_examples}, {self.batch_size}")
        for r in self.reuse:
            if not (Path(r) / META).is_file():
                raise UserError(f"feature_cache.reuse: {r} is not a feature cache (no {META}); point it at a "
                                "<out_dir>/feature_cache folder of an earlier run")


def _example_keys(dataset) -> tuple[str, list[str]]:
    """(hash of every example's token ids in order: the cache's identity; each example's own hash: what lets a
    rebuilt cache take the features it already holds instead of recomputing them)."""
    whole, keys = hashlib.sha256(), []
    for batch in dataset.iter(batch_size=1024):
        for ids in batch["input_ids"]:
            raw = len(ids).to_bytes(4, "little") + torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
            whole.update(raw)
            keys.append(hashlib.sha256(raw).hexdigest()[:32])
    return whole.hexdigest(), keys


class _Donor:
    """The examples an existing cache holds, by their hash (``meta.json``'s ``example_keys``): reused when a cache
    is rebuilt for other examples (another mix, more open text) with the same target, tensors and dtype.
    Shards are read whole, the last two kept (examples are mostly reused in order)."""

    def __init__(self, folder: Path, meta: dict | None, fingerprint: dict, dtype: str):
        self.where: dict[str, tuple[Path, int]] = {}
        self.names = (meta or {}).get("names")
        self._shards: dict[Path, dict[str, torch.Tensor]] = {}
        self.why_not = ("no cache there" if not meta else
                        "built for another target or other layers" if meta.get("fingerprint") != fingerprint else
                        f"stored in {meta.get('dtype')}, not {dtype}" if meta.get("dtype") != dtype else
                        "unfinished" if not self.names else
                        "built before per-example keys (rerun its training once to add them)"
                        if not meta.get("example_keys") else None)
        if self.why_not:
            return
        per = meta["shard_examples"]
        for i, key in enumerate(meta.get("example_keys") or ()):
            shard = folder / f"shard-{i // per:05d}.safetensors"
            if shard.is_file():
                self.where.setdefault(key, (shard, i))

    def get(self, key: str, names: list[str] | None) -> dict[str, torch.Tensor] | None:
        if key not in self.where or (names is not None and sorted(names) != sorted(self.names)):
            return None
        shard, i = self.where[key]
        if shard not in self._shards:
            if len(self._shards) >= 2:
                self._shards.pop(next(iter(self._shards)))
            self._shards[shard] = load_file(str(shard))
        return {n: self._shards[shard][f"{n}.{i}"] for n in self.names}


def _read_meta(folder: Path) -> dict | None:
    path = folder / META
    return json.loads(path.read_text()) if path.is_file() else None


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

    ``fingerprint``: what the tensors depend on besides the examples (target, layers); a mismatch rebuilds.
    A cache of other examples is rebuilt in ``<folder>/.rebuild`` (resumable too) and then replaces the old
    one; examples the old cache (or a ``section.reuse`` folder) holds are copied over, not recomputed."""
    from tqdm.auto import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    n, per = len(dataset), section.shard_examples
    ids_sha, keys = _example_keys(dataset)
    meta = {"fingerprint": fingerprint, "dtype": section.dtype, "examples": n, "shard_examples": per,
            "ids_sha256": ids_sha}

    def same(m: dict | None) -> bool:
        return m is not None and {k: m.get(k) for k in meta} == meta

    old = _read_meta(folder)
    if same(old) and "example_keys" not in old:  # a cache from before per-example keys: it can donate from now on
        atomic_write_json(folder / META, {**old, "example_keys": keys}, indent=1)
    donors = [_Donor(Path(r), _read_meta(Path(r)), fingerprint, section.dtype) for r in section.reuse]
    for r, d in zip(section.reuse, donors):
        if d.why_not:
            print(f"[feature cache] nothing to reuse from {r}: {d.why_not}", flush=True)
    into = folder
    if old is not None and not same(old):
        into = folder / ".rebuild"
        print(f"[feature cache] {folder} was built from other examples or settings: rebuilding in {into}", flush=True)
        donors.insert(0, _Donor(folder, old, fingerprint, section.dtype))
        into.mkdir(exist_ok=True)
        if not same(_read_meta(into)):
            for f in into.glob("shard-*.safetensors"):
                f.unlink()
    names = (_read_meta(into) or {}).get("names")
    shards = [into / f"shard-{s:05d}.safetensors" for s in range((n + per - 1) // per)]
    todo = [s for s, f in enumerate(shards) if not f.is_file()]
    built = sum(min(per, n - s * per) for s in todo)
    t0, tokens, reused = time.perf_counter(), 0, 0
    bar = tqdm(total=built, desc="caching target features", unit="ex", disable=not progress or not built)
    cols = [c for c in ("input_ids", "attention_mask", "labels") if c in dataset.column_names]
    for s in todo:
        out: dict[str, torch.Tensor] = {}
        missing = []
        for i in range(s * per, min(n, (s + 1) * per)):
            got = next((t for d in donors if (t := d.get(keys[i], names)) is not None), None)
            if got is None:
                missing.append(i)
                continue
            names = names or sorted(got)
            out.update({f"{name}.{i}": t for name, t in got.items()})
            reused += 1
            bar.update(1)
        for lo in range(0, len(missing), section.batch_size):
            rows = dataset.select(missing[lo:lo + section.batch_size])
            batch = collate([{c: r[c] for c in cols} for r in rows])
            lengths = batch["attention_mask"].sum(-1).tolist()
            with torch.inference_mode():
                got = compute({k: v.to(device) for k, v in batch.items()})
            names = sorted(got)
            for i, j, length in zip(missing[lo:lo + section.batch_size], range(len(lengths)), lengths):
                for name in names:
                    out[f"{name}.{i}"] = got[name][j, :length].to("cpu", DTYPES[section.dtype]).contiguous()
            tokens += sum(lengths)
            bar.update(len(lengths))
        with atomic_path(shards[s]) as tmp:
            save_file(out, str(tmp))
        atomic_write_json(into / META, {**meta, "names": names, "example_keys": keys}, indent=1)
    bar.close()
    if built:
        secs = time.perf_counter() - t0
        print(f"[feature cache] {built - reused} examples, {tokens} tokens computed in {secs:.0f} s "
              f"({tokens / max(secs, 1e-9):.0f} tokens/s), {reused} reused → {folder}", flush=True)
    if into != folder:  # the rebuilt cache replaces the old one; the old meta is voided first, so an interrupted
        # swap leaves a folder that neither matches nor donates (the next run finishes the rebuild)
        atomic_write_json(folder / META, {"replaced_by": str(into)})
        for f in folder.glob("shard-*.safetensors"):
            f.unlink()
        for f in shards:
            f.replace(folder / f.name)
        (into / META).replace(folder / META)
        into.rmdir()
        shards = [folder / f.name for f in shards]
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
