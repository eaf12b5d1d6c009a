"""Speculation under load: goodput of batched rounds (decode/engine/batch.py) against HF ``generate`` batched.

For each batch size B, the suite's prompts are cut into groups of B; every group is decoded by every method,
interleaved (the order rotates per group, so machine noise hits every method alike):

* ``hf``: HF ``model.generate`` on the B prompts at once, left padding, greedy (the plain baseline at that B);
* ``batch:none``: our batched rounds without speculation (one token per row per round);
* ``batch:<arm>``: fixed speculation, every row plays that arm (``--fixed``, e.g. ``pld:L=3``);
* ``batch:<arm>+schedule``: that arm with K from the batch size (``--schedule``, vLLM's per-batch-size table);
* ``batch:<arm>+ema``: that arm with K from an EMA of accepted lengths over tiers (``--ema``, SGLang-style);
* ``batch:<policy>``: every row's own policy over ``--pool`` (``none`` included: a row may stop speculating), each
  row drafting its arm's L;
* ``batch:<policy>+cost``: the same, with the draft length chosen jointly for the batch from the learnt block cost
  (decode/engine/batch.py ``length="cost"``: speculation backs off as the batch grows).

Per method and B it prints goodput (generated tokens of the whole batch per second), per-request latency p50/p95
(from the group's start to the row's last token; for ``hf`` every row ends with the batch), MAT (tokens per target
forward per row) and how many rows equal their own plain greedy decoding (HF ``generate`` alone on that prompt);
for a row that differs, the first differing position. Run it alone on the machine: it measures time.

    .venv/bin/python scripts/bench_batch.py [--batch 1,2,4,8] [--per-category 2] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from decode.choose.arms import ArmEnv, build_arm  # noqa: E402
from decode.choose.policies import build_policy  # noqa: E402
from decode.core.linear import linear_model  # noqa: E402
from decode.core.models import DEFAULT_TARGET, eos_token_ids, load_model  # noqa: E402
from decode.core.sampling import SamplingConfig  # noqa: E402
from decode.core.verify import Verifier  # noqa: E402
from decode.engine.batch import BatchEngine  # noqa: E402
from decode.evaluation.suites import encode_prompt, load_jsonl_suite  # noqa: E402

DEV = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def hf_batched(model, prompts, n, pad_id, eos):
    """HF generate on the prompts at once, left padding; each row's tokens up to and including its first EOS."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, min_new_tokens=0,
                             eos_token_id=sorted(eos) or None, pad_token_id=pad_id)
    rows = []
    for r in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(r) if t in eos), len(r))
        rows.append(r[:cut])
    return rows


def top2_margin(model, prompt, ref, position):
    """The target's own top-2 logit margin where a row first differs from its plain decoding: a near-tie that
    another batch shape's float rounding can flip, not a lossless failure, when it is tiny."""
    ids = torch.tensor([list(prompt) + list(ref[:position])])
    with torch.inference_mode():
        top = model(ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def first_difference(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--suite", default=str(DEV))
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fixed", default="pld:L=4", help="';'-separated arms played by every row ('' = none)")
    p.add_argument("--schedule", default="1-2=4,3-4=2,5-=1", help="B ranges → K for the +schedule baseline")
    p.add_argument("--ema", default="1,2,4", help="K tiers of the +ema baseline")
    p.add_argument("--pool", default="none;pld:L=2;pld:L=4;suffix:L=3")
    p.add_argument("--policy", default="ucbspec", help="each row's policy over --pool ('' = none)")
    p.add_argument("--linear", default="stock", choices=("stock", "onednn"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench_batch.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    model, tok = load_model(a.target)
    run = linear_model(model, a.linear)
    eos = set(eos_token_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    seen, texts = {}, []
    for q in load_jsonl_suite(a.suite):
        if seen.get(q.category, 0) < a.per_category:
            seen[q.category] = seen.get(q.category, 0) + 1
            texts.append(q.text)
    prompts = [encode_prompt(tok, t) for t in texts]
    refs = [hf_batched(model, [pr], a.max_new_tokens, pad, eos)[0] for pr in prompts]  # plain greedy, one at a time
    greedy = SamplingConfig()
    env = ArmEnv(model, tok, greedy)

    def engine(pool, policy, length="fixed"):
        return BatchEngine(run, lambda: [build_arm(s, env) for s in pool],
                           lambda K: build_policy(policy, K, 4, seed=0), Verifier(greedy, "torch"), eos, pad_id=pad,
                           length=length)

    methods = {"hf": None, "batch:none": (["none"], "fixed:arm=0")}
    for arm in filter(None, a.fixed.split(";")):
        methods[f"batch:{arm}"] = ([arm], "fixed:arm=0")
        methods[f"batch:{arm}+schedule"] = ([arm], "fixed:arm=0", f"schedule:{a.schedule}")
        methods[f"batch:{arm}+ema"] = ([arm], "fixed:arm=0", f"ema:{a.ema}")
    if a.policy:
        methods[f"batch:{a.policy}"] = (a.pool.split(";"), a.policy)
        methods[f"batch:{a.policy}+cost"] = (a.pool.split(";"), a.policy, "cost")
    sizes = [int(b) for b in a.batch.split(",")]
    print(f"{len(prompts)} prompts, {a.max_new_tokens} tokens, {a.threads} threads, linear {a.linear}, "
          f"methods {', '.join(methods)}", file=sys.stderr)
    engine(["none"], "fixed:arm=0").generate(prompts[:2], 4)  # warm-up
    results = {}
    for B in sizes:
        groups = [list(range(i, min(i + B, len(prompts)))) for i in range(0, len(prompts), B)]
        acc = {m: {"tokens": 0, "seconds": 0.0, "latency": [], "forwards": 0, "rows": 0, "lossless": 0,
                   "differs_at": []} for m in methods}
        for g_i, group in enumerate(groups):
            names = list(methods)
            names = names[g_i % len(names):] + names[:g_i % len(names)]
            batch = [prompts[i] for i in group]
            for m in names:
                t0 = time.perf_counter()
                if methods[m] is None:
                    outs = hf_batched(model, batch, a.max_new_tokens, pad, eos)
                    t1 = time.perf_counter()
                    lat = [t1 - t0] * len(outs)
                    forwards = [len(o) for o in outs]
                else:
                    rows = engine(*methods[m]).generate(batch, a.max_new_tokens)
                    t1 = time.perf_counter()
                    outs = [r.tokens for r in rows]
                    lat = [r.finished - t0 for r in rows]
                    forwards = [len(r.rounds) for r in rows]
                s = acc[m]
                s["tokens"] += sum(map(len, outs))
                s["seconds"] += t1 - t0
                s["latency"] += lat
                s["forwards"] += sum(forwards)
                s["rows"] += len(outs)
                for i, o in zip(group, outs):
                    d = first_difference(o, refs[i])
                    s["lossless"] += d is None
                    if d is not None:
                        s["differs_at"].append({"prompt": i, "position": d, "top2_margin": round(
                            top2_margin(model, prompts[i], refs[i], d), 5) if d < len(refs[i]) else None})
        results[B] = {}
        for m, s in acc.items():
            lat = sorted(s["latency"])
            results[B][m] = {"goodput": s["tokens"] / s["seconds"], "p50": statistics.median(lat),
                             "p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))], "mat": s["tokens"] / s["forwards"],
                             "rows": s["rows"], "lossless_rows": s["lossless"], "differs_at": s["differs_at"]}
        base = results[B]["hf"]["goodput"]
        print(f"\nB = {B}  ({len(groups)} groups)\n| method | goodput tok/s | × hf | p50 s | p95 s | MAT | rows = plain greedy |"
              f"\n|---|---|---|---|---|---|---|")
        for m, r in results[B].items():
            print(f"| {m} | {r['goodput']:.1f} | {r['goodput'] / base:.2f} | {r['p50']:.2f} | {r['p95']:.2f} | "
                  f"{r['mat']:.2f} | {r['lossless_rows']}/{r['rows']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "results": results}, indent=1))
    for B, res in results.items():
        for m, r in res.items():
            for d in r["differs_at"]:
                print(f"B={B} {m}: prompt {d['prompt']} differs from its plain greedy decoding at token {d['position']}"
                      f" (the target's top-2 logit margin there: {d['top2_margin']})", file=sys.stderr)
    print(f"\n{a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
