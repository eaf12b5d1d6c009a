"""Training-time vs decode-time first-token agreement of an EAGLE head on the same held-out answers (issue 31).

    .venv/bin/python scripts/bench_eagle_consistency.py [--head pretrained/smollm2-135m-instruct/eagle] [--n 12]

Held-out answers: the shipped head's run record (``eval.json`` → ``recipe.data``) names its distilled data
(``runs/pools/<target>-medium/distill``, ``heldout_fraction`` 0.125, first ``heldout_max`` 48 rows), which a
fresh checkout does not have. ``--answers FILE`` reads such rows (JSONL with ``prompt_ids``/``response_ids``, e.g.
exported from a distill folder); otherwise the answers are regenerated: the prompts the ``medium`` pool budget
distilled (the first ``num_prompts`` of each task recipe's sources, leakage-checked and rendered by the
distiller's own template) that the recipe's hash split holds out, answered by the target with the distiller's
own batched generation (one prompt per batch) at ``--temperatures`` (default greedy only, the temperature-0 rows of
the held-out split; the sampled rows cannot be reproduced exactly: they depended on the batch and the seed), with
the distiller's filters and the head recipe's ``data.max_length`` cut. Tasks are taken round-robin. Answers are
cached in ``--cache`` so a rerun only measures.

Both sides run on the same rows and the same loaded head (the shipped float16 weights, as ``decode`` loads them):
* training side: ``toolkit.train.eagle.heldout_agreement`` (one full target forward per row, the head teacher
  forced on all positions at once), exactly the computation behind ``eval.json``'s ``heldout.top1_agreement``;
* decode side: ``decode.choose.arms.eagle.teacher.teacher_forced_agreement`` through ``build_engine`` (the arm as
  ``decode eval`` builds it, the target's cache kind and linears, prefill + rounds, features from the verification
  forwards), one answer token per round (``advance=one``); then ``advance=match`` at the arm's ``--L``: decoding's
  own acceptance per draft position on these texts.
Figures: agreement with the target's argmax (what eval.json reports and greedy decoding accepts) and with the
answer's token, binomial standard errors sqrt(p(1-p)/n) (positions treated as independent: an underestimate, as
positions within an answer are correlated), and the positions where the two sides drafted different tokens.

Measured (shipped head, AMD EPYC 2-core KVM guest shared with other jobs, 1 thread; issue 31):
* 12 regenerated greedy held-out answers (chat 3, code 3, math 2, qa 2, summarization 2; the translation prompt's
  greedy answer was dropped by the repetition filter), 1,257 positions: training side 0.552 ± 0.014, decode side
  0.552 ± 0.014, drafts different at 0 positions; advance=match L=2: 0.516 (732 rounds) and, given position 1
  accepted, 0.409 (374).
* 16 answers at the distiller's four temperatures (5 × 0.0, 6 × 0.3, 5 × 0.7), 1,783 positions: both sides
  0.482 ± 0.012 (answer-token agreement 0.465), 0 positions differ; the run record says 0.501 ± 0.006 (6,811).
* ``--builtin 64`` (make demo's six prompts, greedy): both sides 0.385 ± 0.025 over 384 positions (summarization
  0.27, extraction 0.31, rewriting 0.33 … math 0.53), 0 differ, also with ``--linear onednn``; advance=match L=2:
  0.325 (268 rounds), then 0.365 (85) given position 1 accepted — make demo's 0.32 and 0.12, whose second figure
  is P(position 2 accepted | a draft reached position 2) = 0.325 × 0.365 (decode/common/metrics.py).
So the decode path computes exactly what training scores; the demo's lower figures come from its prompts
(passage copying/rewriting, which the distilled tasks lack), from rounds starting after a miss (harder positions
than the average one) and from the unconditional position-2 metric.

The figures above are the EAGLE-1 head's. The third H100 session's EAGLE-3 head (shipped 2026-11-27), same 12
regenerated greedy answers (held out of its training too: the split is by prompt hash at the same fraction), Zen 5
AMD EPYC, 2 threads: both sides 0.642 ± 0.014 (chat 0.583, code 0.752, math 0.701, qa 0.651, summarization 0.484),
0 positions differ; advance=match L=2: 0.615 (639 rounds), then 0.588 (391) given position 1 accepted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def regenerate(model, tok, n: int, temperatures: list[float], record: dict, seed: int = 0,
               have: list[dict] = ()) -> list[dict]:
    """Held-out rows of the head's distillation, regenerated (module docstring); rows in ``have`` (same task,
    temperature and prompt) are reused, not regenerated."""
    from decode.core.models import eos_token_ids
    from decode.core.sampling import SamplingConfig
    from toolkit.config import load_recipe, task_recipe
    from toolkit.distill import DistillRecipe, Unit, _row, generate_batch, plan_units, select_rendered
    from toolkit.pool import BUDGETS
    from toolkit.train.data import is_heldout

    data = record["recipe"]["data"]
    fraction, max_length = data["heldout_fraction"], data["max_length"]
    budget = BUDGETS["medium"]
    eos = set(eos_token_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    queues = []
    for task in sorted(budget.tasks):  # load_examples reads the task folders in name order
        recipe = load_recipe(DistillRecipe, task_recipe(task), [f"num_prompts={budget.prompts}",
                                                                 f"generation.max_new_tokens={budget.max_new_tokens}"])
        sel, rendered = select_rendered(recipe, tok)
        prompts = sel.prompts
        units = [u for u in plan_units(task, prompts, [rendered[p.text][1] for p in prompts], temperatures)
                 if is_heldout(prompts[u.prompt].text, fraction)]
        queues.append((task, recipe, prompts, rendered, units))
    rows, gen = [], torch.Generator().manual_seed(seed)
    while len(rows) < n and any(q[4] for q in queues):
        for task, recipe, prompts, rendered, units in queues:
            while units and len(rows) < n:
                u: Unit = units.pop(0)
                p = prompts[u.prompt]
                text, ids = rendered[p.text]
                old = next((r for r in have if (r["task"], r["temperature"], r["prompt"]) == (task, u.temperature,
                                                                                           p.text)), None)
                if old is not None:
                    rows.append(old)
                    break
                if len(ids) >= max_length:
                    continue  # tokenize_sft keeps no response token of it
                t0 = time.perf_counter()
                o = generate_batch(model, [ids], sampling=SamplingConfig(u.temperature), max_new_tokens=
                                   recipe.generation.max_new_tokens, eos_ids=eos, pad_id=pad, generator=gen)[0]
                row = _row(recipe, tok, p, text, ids, u, o, eos)
                print(f"  generated {task} T={u.temperature} {len(o.ids)} tokens in {time.perf_counter() - t0:.0f} s"
                      + (f" (filtered: {row['filtered']})" if row["filtered"] else ""), flush=True)
                if row["filtered"]:
                    continue
                answer = list(o.ids)[:max_length - len(ids)]  # the recipe's data.max_length cut
                rows.append({"task": task, "temperature": u.temperature, "prompt": p.text, "prompt_ids": list(ids),
                             "response_ids": answer, "generated_tokens": len(o.ids)})
                break  # round-robin over tasks
    return rows


def builtin_rows(model, tok, max_new_tokens: int) -> list[dict]:
    """The target's greedy answers to ``decode eval``'s built-in prompts (what ``make demo`` decodes), as
    ``decode eval`` encodes them."""
    from decode.core.models import eos_token_ids
    from decode.core.sampling import SamplingConfig
    from decode.evaluation.suites import BUILTIN, encode_prompt
    from toolkit.distill import generate_batch

    eos = set(eos_token_ids(model, tok))
    rows = []
    for p in BUILTIN:
        ids = encode_prompt(tok, p.text)
        o = generate_batch(model, [ids], sampling=SamplingConfig(), max_new_tokens=max_new_tokens, eos_ids=eos)[0]
        rows.append({"task": p.category, "temperature": 0.0, "prompt": p.text, "prompt_ids": ids,
                     "response_ids": list(o.ids)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default="pretrained/smollm2-135m-instruct/eagle")
    ap.add_argument("--n", type=int, default=12, help="held-out answers (default %(default)s)")
    ap.add_argument("--answers", help="JSONL rows with prompt_ids/response_ids (default: regenerate, see --cache)")
    ap.add_argument("--cache", default="runs/bench/eagle_consistency/answers.jsonl",
                    help="where regenerated answers are kept (reused when it holds enough rows)")
    ap.add_argument("--builtin", type=int, metavar="TOKENS", default=0,
                    help="instead of held-out answers: the target's greedy answers of this many tokens to decode "
                         "eval's built-in prompts (make demo: 64)")
    ap.add_argument("--temperatures", default="0.0", help="distillation temperatures to regenerate (comma list)")
    ap.add_argument("--L", type=int, default=2, help="draft length of the advance=match pass (0 = skip it)")
    ap.add_argument("--cache-kind", default="prefix", help="target KV cache kind (decode eval's CPU default: prefix)")
    ap.add_argument("--linear", default="stock",
                    help="target linears: stock | onednn | stream | auto (decode eval: auto)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from decode.choose.arms.eagle.teacher import teacher_forced_agreement
    from decode.choose.heads import load_head
    from decode.core.models import load_model
    from decode.core.sampling import SamplingConfig
    from decode.engine.loop import build_engine
    from toolkit.train.eagle import EagleTrainModule, heldout_agreement

    head_dir = Path(args.head)
    record = json.loads((head_dir / "eval.json").read_text())
    target_spec = record.get("target", "smollm2-135m-instruct")
    model, tok = load_model(target_spec, dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    if args.builtin:
        rows = builtin_rows(model, tok, args.builtin)[:args.n]
        source = f"decode eval's built-in prompts, greedy answers of {args.builtin} tokens"
    elif args.answers:
        rows = [json.loads(line) for line in open(args.answers) if line.strip()][:args.n]
        source = args.answers
    else:
        cache = Path(args.cache)
        temps = [float(t) for t in args.temperatures.split(",")]
        rows = []
        if cache.is_file():
            rows = [r for r in map(json.loads, cache.read_text().splitlines()) if r.get("temperature") in temps]
        if len(rows) < args.n:
            print(f"regenerating {args.n} held-out answers (T in {temps}) ...", flush=True)
            rows = regenerate(model, tok, args.n, temps, record, have=rows)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text("".join(json.dumps(r) + "\n" for r in rows))
        rows = rows[:args.n]
        source = f"regenerated ({cache})"
    pairs = [(r["prompt_ids"], r["response_ids"]) for r in rows]
    tasks = [r.get("task", "?") for r in rows]
    print(f"{len(pairs)} answers, {sum(len(a) for _, a in pairs)} answer tokens; source: {source}", flush=True)

    # training side: the toolkit's held-out evaluation on these rows
    head = load_head(head_dir, model, expect="eagle")
    t0 = time.perf_counter()
    train_rows = [{"input_ids": p + a, "attention_mask": [1] * (len(p) + len(a)), "labels": [-100] * len(p) + a}
                  for p, a in pairs]
    train = heldout_agreement(EagleTrainModule(model, head), train_rows, progress=False, per_example=True)
    t_train = time.perf_counter() - t0

    # decode side: the arm as decode eval builds it, one answer token per round
    engine = build_engine(model, tok, [f"eagle:path={head_dir},L=1"], SamplingConfig(), torch.Generator(),
                          cache=args.cache_kind, linear=args.linear)
    t0 = time.perf_counter()
    forced = teacher_forced_agreement(engine, pairs, depth=1, advance="one")
    t_decode = time.perf_counter() - t0
    match = None
    if args.L > 0:
        t0 = time.perf_counter()
        match = teacher_forced_agreement(engine, pairs, depth=args.L, advance="match")
        t_match = time.perf_counter() - t0

    def cell(hits, n):
        p = hits / n if n else float("nan")
        return f"{p:.3f} ± {se(p, n):.3f}"

    lines = [f"{'rows':<14} {'n':>5}  {'train top1':>14}  {'decode top1':>14}  {'train ref':>14}  {'decode ref':>14}"
             f"  {'drafts differ':>13}"]
    groups = {"all": list(range(len(pairs)))}
    for i, t in enumerate(tasks):
        groups.setdefault(t, []).append(i)
    out_groups = {}
    for name, idx in groups.items():
        n = sum(len(forced.examples[i].drafts) for i in idx)
        tr = [train["per_example"][i] for i in idx]
        de = [forced.examples[i] for i in idx]
        tt = sum(sum(a == b for a, b in zip(e["drafts"], e["target"])) for e in tr)
        tref = sum(sum(a == b for a, b in zip(e["drafts"], e["reference"])) for e in tr)
        dt, dref = sum(e.agree_target for e in de), sum(e.agree_reference for e in de)
        diff = sum(sum(a != b for a, b in zip(e["drafts"], f.drafts)) for e, f in zip(tr, de))
        out_groups[name] = {"answers": len(idx), "positions": n, "train_top1": tt, "decode_top1": dt,
                            "train_reference": tref, "decode_reference": dref, "drafts_differ": diff}
        lines.append(f"{name:<14} {n:>5}  {cell(tt, n):>14}  {cell(dt, n):>14}  {cell(tref, n):>14}  "
                     f"{cell(dref, n):>14}  {diff:>13}")
    print()
    print("\n".join(lines))
    h = record.get("heldout") or {}
    if h:
        p, n = h["top1_agreement"], h["positions"]
        print(f"\nrun record (eval.json heldout): top1 {p:.3f} ± {se(p, n):.3f} over {n} positions "
              f"({h['examples']} rows, temperatures 0/0.3/0.7/1.0 mixed)")
    print(f"training side {t_train:.0f} s, decode side {t_decode:.0f} s")
    if match is not None:
        s = match.summary()
        acc = ", ".join(f"{a:.3f} ({r})" if a is not None else "-" for a, (r, _) in
                        zip(s["acceptance_per_position_target"], match.by_depth_target))
        print(f"decode, advance=match L={args.L}: acceptance per draft position vs the target's argmax "
              f"(reached) {acc}; rounds {sum(len(e.positions) for e in match.examples)}, {t_match:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "head": str(head_dir), "source": source, "groups": out_groups, "train": {k: v for k, v in train.items()
                                                                                   if k != "per_example"},
            "decode": forced.summary(), "decode_match": match.summary() if match else None,
            "run_record_heldout": h, "rows": [{k: r.get(k) for k in ("task", "temperature", "prompt")} for r in rows],
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
