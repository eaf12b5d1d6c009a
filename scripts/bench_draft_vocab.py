"""Is the draft vocabulary what holds an EAGLE head back off its training data? Teacher-forced top-1 agreement of
one head with other draft vocabularies, on the target's own greedy answers to an evaluation suite.

    .venv/bin/python scripts/bench_draft_vocab.py --records runs/dev70/records.jsonl \\
        [--head pretrained/smollm2-135m-instruct/eagle] [--sizes 8192,16384,24576,32768]

Answers: the ``hf`` rows of a ``decode eval`` records file (plain greedy ``generate``), each after its prompt as
that run encoded it (the suite and target its header names, the chat template of decode/evaluation/suites.py).
Vocabularies: the head's own; the N most frequent tokens of the shipped answers (``pretrained/<target>/answers``,
plus the special tokens) for each ``--sizes`` N; the whole target vocabulary. An EAGLE head's LM head is the
target's own rows (decode/core/vocab.py), so the same trained weights load under any subset. Agreement is
``toolkit.train.eagle.heldout_agreement``'s (every answer token, the target's argmax there), per category, with each
subset's coverage of the answers' tokens.

Measured 2026-11-29 (docs/training.md, draft vocabulary; the shipped head, Spec-Bench dev 13 × 2, 96 tokens, 2,433
positions): 0.523 with its own 8,193 tokens (covering 89.8% of the answers' tokens), 0.520 / 0.527 / 0.529 / 0.530
with 8k / 16k / 24k / 32k from the shipped answers, 0.531 with all 49,152.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def answers(lines: list[dict], tok) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, answer ids) of every ``hf`` row of a ``decode eval`` records file's ``lines``."""
    from decode.evaluation.suites import encode_prompt, load_jsonl_suite

    suite = Path(lines[0]["config"]["suite"])
    prompts = {p.id: p for p in load_jsonl_suite(suite if suite.is_absolute() else REPO / suite)}
    return [(r["category"], encode_prompt(tok, prompts[r["prompt_id"]].text), r["token_ids"])
            for r in lines[1:] if r.get("method") == "hf"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", required=True, help="a decode eval records.jsonl with hf rows")
    ap.add_argument("--head", default="pretrained/smollm2-135m-instruct/eagle")
    ap.add_argument("--sizes", default="8192,16384,24576,32768", help="subset sizes from the shipped answers")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from decode.choose.heads.common import read_head_config, read_head_weights
    from decode.choose.heads.eagle import EagleHead
    from decode.core.models import load_model
    from decode.core.vocab import DraftVocab, count_tokens, select_draft_vocab, special_token_ids
    from toolkit.answers import load_answers
    from toolkit.train.eagle import EagleTrainModule, heldout_agreement

    torch.set_num_threads(args.threads)
    head_dir = Path(args.head)
    lines = [json.loads(line) for line in Path(args.records).read_text().splitlines() if line.strip()]
    target = lines[0]["config"]["target"]
    model, tok = load_model(target, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    rows = answers(lines, tok)
    V = model.get_output_embeddings().weight.shape[0]
    counts = count_tokens((r["response_ids"] for r in load_answers(REPO / "pretrained" / target / "answers")), V)
    meta = read_head_config(head_dir)
    vocabs = {"the head's own": DraftVocab.load(head_dir, V) if meta.get("draft_vocab") else None}
    for n in (int(s) for s in args.sizes.split(",") if s):
        vocabs[f"{n} from the shipped answers"] = select_draft_vocab(counts, size=n, special_ids=special_token_ids(tok))
    vocabs["the whole vocabulary"] = None
    examples = [{"input_ids": p + a, "attention_mask": [1] * (len(p) + len(a)), "labels": [-100] * len(p) + a}
                for _, p, a in rows]
    tokens = [t for _, _, a in rows for t in a]
    print(f"{len(rows)} answers, {len(tokens)} tokens ({args.records}); head {head_dir}")
    for name, vocab in vocabs.items():
        head = EagleHead.from_head_config(meta, model, draft_vocab=vocab)
        head.load_trainable_state_dict(read_head_weights(head_dir))
        report = heldout_agreement(EagleTrainModule(model, head), examples, progress=False, per_example=True)
        by = defaultdict(lambda: [0, 0])
        for (cat, _, _), ex in zip(rows, report["per_example"]):
            by[cat][0] += len(ex["target"])
            by[cat][1] += sum(d == t for d, t in zip(ex["drafts"], ex["target"]))
        ids = set(range(V)) if vocab is None else set(vocab.d2t.tolist())
        cover = sum(t in ids for t in tokens) / max(len(tokens), 1)
        cats = " ".join(f"{c} {h / n:.2f}" for c, (n, h) in sorted(by.items()))
        print(f"{name:>28}: {len(ids):>6} tokens, cover {cover:.1%}, top-1 {report['top1_agreement']:.3f} ({cats})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
