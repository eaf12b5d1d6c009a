"""`python -m toolkit ship` (`make pretrained`) and the pool that ships with the repository: a trained head
becomes a float16 folder with its run record that drafts the same tokens, and `recipes/pools/pretrained.yaml`
resolves from any working directory."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decode.common.errors import UserError
from decode.choose.heads import EagleHead, load_head, save_head
from decode.core.models import load_model
from decode.engine.batch import check_batch_arm_specs
from decode.engine.pools import REPO_ROOT, load_pool
from toolkit.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def trained_head(tiny_target_dir, tmp_path):
    target, _ = load_model(tiny_target_dir)
    head = EagleHead(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    folder = tmp_path / "runs" / "eagle"
    save_head(head, folder)
    (folder / "run.json").write_text(json.dumps({"kind": "eagle", "train": {"epochs": 1, "dtype": "bfloat16"},
                                                 "head": {"init_from": "pretrained/older"},
                                                 "data": {"root": str(tmp_path / "runs" / "distill")},
                                                 "elsewhere": ["/elsewhere/data.jsonl"]}))
    (folder / "eval.json").write_text(json.dumps({"heldout": {"top1_agreement": 0.42}}))
    return target, folder


def test_ship_writes_a_float16_folder_that_drafts_like_the_original(trained_head, tiny_target_dir, tmp_path, capsys,
                                                                   monkeypatch):
    target, folder = trained_head
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pretrained" / "eagle"
    argv = ["ship", str(folder), "--out", str(out), "--target", tiny_target_dir, "--command", "make pretrained"]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["SHIPPED.md", "eval.json", "head.json", "head.safetensors",
                                                    "run.json"]
    assert not out.with_name("eagle.partial").exists()
    weights = load_file(str(out / "head.safetensors"))
    assert all(v.dtype == torch.float16 for v in weights.values() if v.is_floating_point())
    original = load_file(str(folder / "head.safetensors"))
    assert weights.keys() == original.keys()
    assert (out / "head.safetensors").stat().st_size < 0.6 * (folder / "head.safetensors").stat().st_size
    shipped = (out / "SHIPPED.md").read_text()
    assert "make pretrained" in shipped and '"top1_agreement": 0.42' in shipped and "1.000" in shipped
    assert "trained in bfloat16, saved in float32" in shipped and "warm-started from: pretrained/older" in shipped
    # the run record names paths under the working directory relatively, others as they were
    record = json.loads((out / "run.json").read_text())
    assert record["data"]["root"] == "runs/distill" and record["elsewhere"] == ["/elsewhere/data.jsonl"]
    assert record["train"] == {"epochs": 1, "dtype": "bfloat16"}
    assert json.loads((out / "eval.json").read_text())["heldout"]
    # it loads as a head of the target and drafts the same top-1 tokens as the float32 original
    a, b = load_head(folder, target), load_head(out, target)
    feats = torch.randn(1, 8, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, target.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(a.draft_logits(a(feats, ids)).argmax(-1), b.draft_logits(b(feats, ids)).argmax(-1))
    # an existing folder is replaced only when asked
    capsys.readouterr()
    assert main(argv) == 2 and "--force" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    assert main(["ship", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "not a trained head folder" in capsys.readouterr().err


def test_the_shipped_pool_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = load_pool(REPO / "recipes/pools/pretrained.yaml")
    assert shipped.length == "cost"  # each arm's L is a cap; the machine's cost curve picks the length
    specs = shipped.arms
    eagle = next(s for s in specs if s.startswith("eagle:"))
    path = eagle.split("path=")[1].split(",")[0]
    assert Path(path).is_absolute() and (Path(path) / "head.json").is_file() and "tree=dynamic" in eagle
    assert (Path(path) / "SHIPPED.md").is_file() and (Path(path) / "run.json").is_file()
    union = next(s for s in specs if s.startswith("union:"))
    assert f"eagle:path={path}:L=5:tree=dynamic" in union  # the union's head: the same folder, resolved alike
    check_batch_arm_specs(specs)  # the server and decode eval --batch take the pool as it is
    assert REPO_ROOT == REPO
    pool = tmp_path / "pool.yaml"
    pool.write_text("arms: ['eagle:path=pretrained/no-such-head,L=2']\n")
    with pytest.raises(UserError, match="path pretrained/no-such-head does not exist"):
        load_pool(pool)
