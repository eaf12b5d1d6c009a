"""``python -m toolkit diagonal``: every drafter on every task's held-out distilled split (MetaSD's diagonal),
on tiny drafters with known answers: a copy of the target (acceptance 1) and random drafters."""
import json

import pytest
import torch

from decode.common.errors import UserError
from helpers import tiny_llama
from test_train_drafter import distilled  # noqa: F401  (the tiny distilled math/code tasks fixture)
from toolkit.diagonal import markdown, parse_drafters, verdicts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, tiny_target_dir):
    """math = the target itself, code and all = random drafters; exports as the trainer writes them, the
    recipes recording held-out fractions 0.3 (math, code) and 0.5 (all)."""
    from decode.core.models import load_model
    from toolkit.export import export_model

    root = tmp_path_factory.mktemp("drafters")
    target, tok = load_model(tiny_target_dir)
    V = target.get_output_embeddings().weight.shape[0]
    out = {}
    for name, model, fraction in (("math", target, 0.3), ("code", tiny_llama(vocab=V, layers=1, seed=8), 0.3),
                                  ("all", tiny_llama(vocab=V, layers=1, seed=9), 0.5)):
        out[name] = str(export_model(model, tok, root / name, target=tiny_target_dir, target_tokenizer=tok, task=name,
                                     recipe={"data": {"heldout_fraction": fraction}}))
    return out


def _spec(paths):
    return ",".join(f"{k}={v}" for k, v in paths.items())


def _reference(path, examples, d2t=None):
    """Top-1 agreement with the labels, computed directly (d2t: argmax over those columns only)."""
    from decode.core.models import load_model

    model = load_model(path)[0]
    hits = n = 0
    with torch.inference_mode():
        for ex in examples:
            logits = model(torch.tensor([ex["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(ex["labels"][1:])
            m = labels != -100
            q = logits[m]
            pred = q.argmax(-1) if d2t is None else d2t[q[:, d2t].argmax(-1)]
            hits += int((pred == labels[m]).sum())
            n += int(m.sum())
    return hits / n


def _held(distilled, tiny_target_dir, task, fraction=0.3):
    from transformers import AutoTokenizer

    from toolkit.diagonal import heldout_split

    return heldout_split(str(distilled), task, fraction, 200, AutoTokenizer.from_pretrained(tiny_target_dir), 512)


def test_diagonal_scores_every_drafter_on_every_task_and_compares_with_the_generalist(
        tmp_path, tiny_target_dir, distilled, drafters, capsys):
    from toolkit.cli import main
    from toolkit.train.data import DataSection, is_heldout, load_examples, split_heldout

    out = tmp_path / "diag.json"
    assert main(["diagonal", "--drafters", _spec(drafters), "--data-root", str(distilled), "--out", str(out),
                 "--device", "cpu", "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    assert rep["tasks"] == ["math", "code"] and rep["target"] == tiny_target_dir
    assert rep["heldout_fraction"] == 0.3  # the smallest the drafters trained with: held out from all of them
    for task in ("math", "code"):  # the trainer's split by prompt hash, tokenised as it does
        section = DataSection(root=str(distilled), heldout_fraction=0.3, heldout_max=200)
        _, held = split_heldout(load_examples(section, task), section)
        assert rep["heldout_examples"][task] == len(held) > 0 and all(is_heldout(p, 0.3) for p in held["prompt"])
    cells = rep["cells"]
    for task in ("math", "code"):
        assert cells["math"][task]["acceptance"] == pytest.approx(1.0, abs=1e-5)  # the target drafts itself
        assert cells["math"][task]["target_agreement"] == 1.0
        assert cells["code"][task]["acceptance"] < 1.0 and cells["all"][task]["acceptance"] < 1.0
        held = _held(distilled, tiny_target_dir, task)
        for name in drafters:
            assert cells[name][task]["label_agreement"] == pytest.approx(_reference(drafters[name], held)), (name, task)
            assert cells[name][task]["positions"] == sum(sum(x != -100 for x in ex["labels"][1:]) for ex in held)
    v = rep["verdicts"]["acceptance"]
    assert v["math"]["beats_generalist"] is True and v["math"]["delta"] == pytest.approx(
        1.0 - cells["all"]["math"]["acceptance"], abs=1e-5)
    code_delta = cells["code"]["code"]["acceptance"] - cells["all"]["code"]["acceptance"]
    assert v["code"]["delta"] == pytest.approx(code_delta) and v["code"]["beats_generalist"] == (code_delta > 0)
    printed = capsys.readouterr().out
    assert "| drafter \\ task | math | code |" in printed and "**1.000**" in printed  # the diagonal, marked
    assert "| task drafter − all | +" in printed and (tmp_path / "diag.md").read_text().strip() == rep["markdown"]


def test_labels_only_and_the_drafters_draft_vocabulary(tmp_path, tiny_target_dir, distilled, drafters):
    """--target none: label agreement only; a drafter folder with draft_vocab.safetensors is scored on its
    subset (--vocab auto, as the arm drafts) or on the full vocabulary (--vocab none)."""
    import shutil

    from decode.core.models import load_model
    from decode.core.vocab import DraftVocab
    from toolkit.cli import main

    pruned = tmp_path / "code_pruned"
    shutil.copytree(drafters["code"], pruned)
    held = _held(distilled, tiny_target_dir, "code", fraction=0.5)
    labels = sorted({x for ex in held for x in ex["labels"] if x >= 0})
    d2t = torch.tensor(labels[::2])  # half of the labels: the subset's argmax differs from the full one
    Vt = load_model(str(pruned))[0].get_output_embeddings().weight.shape[0]
    DraftVocab(d2t, Vt).save(pruned)
    res = {}
    for vocab in ("auto", "none"):
        out = tmp_path / f"{vocab}.json"
        assert main(["diagonal", "--drafters", f"code={pruned},all={drafters['all']}", "--data-root", str(distilled),
                     "--tasks", "code", "--target", "none", "--heldout-fraction", "0.5", "--vocab", vocab,
                     "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
        res[vocab] = json.loads(out.read_text())
    for vocab, rep in res.items():
        assert rep["target"] is None and set(rep["cells"]["code"]["code"]) == {"positions", "label_agreement"}
        assert list(rep["verdicts"]) == ["label_agreement"]
    assert res["auto"]["draft_vocab"]["code"]["size"] == len(d2t) and res["none"]["draft_vocab"]["code"] is None
    assert res["auto"]["cells"]["code"]["code"]["label_agreement"] == pytest.approx(
        _reference(str(pruned), held, d2t))
    assert res["none"]["cells"]["code"]["code"]["label_agreement"] == pytest.approx(_reference(str(pruned), held))


def test_verdicts_and_the_matrix():
    cells = {"math": {"math": {"acceptance": 0.6}, "chat": {"acceptance": 0.2}},
             "all": {"math": {"acceptance": 0.5}, "chat": {"acceptance": 0.4}}}
    v = verdicts(cells, ["math", "chat"], "all", "acceptance")
    assert v["math"]["beats_generalist"] is True and v["math"]["delta"] == pytest.approx(0.1)
    assert v["chat"] == {"delta": None, "beats_generalist": None, "why": "no 'chat' drafter"}
    md = markdown(cells, ["math", "chat"], "all", "acceptance", v).splitlines()
    assert md[4] == "| math | **0.600** | 0.200 |" and md[5] == "| all | 0.500 | 0.400 |"
    assert md[6] == "| task drafter − all | +0.100 (beats) | — |"
    assert parse_drafters(" math=a, all=b ,") == {"math": "a", "all": "b"}


@pytest.mark.parametrize("argv, needle", [
    (["--drafters", "math"], "'math' must look like NAME=PATH"),
    (["--drafters", "math=a,math=b"], "names 'math' twice"),
    (["--drafters", "all={all}"], "no tasks: name the task drafters"),
    (["--drafters", "math={math}", "--heldout-fraction", "1.5"], "--heldout-fraction must be in (0, 1)"),
    (["--drafters", "math={math}", "--tasks", "poetry"], "poetry"),
    (["--drafters", "math={math}", "--out", "x.md"], "pass a .json file path"),
])
def test_bad_input_is_one_line(tmp_path, distilled, drafters, capsys, argv, needle):
    from toolkit.cli import main

    argv = [a.format(**drafters) for a in argv]
    assert main(["diagonal", *argv, "--data-root", str(distilled), "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
