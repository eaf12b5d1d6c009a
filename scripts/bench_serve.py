"""What serving over HTTP costs, and how the server holds up under concurrent clients, batched or not.

Servers run in this process (``decode.commands.serve.command.RunningServer``, the same code ``python -m decode
serve`` runs), one per ``--max-batch`` value, all loaded before anything is timed.

* Load (always): for each client count in ``--clients``, ``--requests`` greedy chat requests from that many
  concurrent openai clients, sent to each server in turn (the order rotates per client count and per
  ``--repeat``, whose cells are summed, so machine drift hits every server alike): aggregate tokens/s (completion
  tokens of all requests ÷ wall time), per-request latency p50/p95, the mean batch size the server ran and the
  share of the wall time it spent starting requests (prefill: the same work at every batch size, so it bounds the
  ratio batching can reach; both from its /metrics), errors, and whether every request's tokens equal the first
  server's for the same prompt (greedy is lossless, whatever the batch).
* Conversations (``--turns``): each request is instead one of the suite's multi-turn questions (MT-bench's in
  Spec-Bench), its user turns sent in order, each with the conversation so far — the server's own answers included,
  as a chat client re-sends them — so a server's prefix cache can take the previous turn's prompt and answer. The
  table adds the share of prompt tokens the server found cached (``usage.prompt_tokens_details``); latency is per
  turn.
* Overhead (``--overhead``): on the first server, per prompt and interleaved, the engine decoding directly (what
  ``decode generate`` measures) and the same prompt through ``/v1/chat/completions``.

Run it alone on the machine (no training, no tests): it measures time.

    .venv/bin/python scripts/bench_serve.py --max-batch 1,8 --clients 1,2,4,8,16 --requests 48 --max-tokens 64 \\
        -- --arms 'pld:L=4;suffix:L=6' --policy ucbspec:carry=true
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

from decode.commands.serve.command import RunningServer  # noqa: E402
from decode.evaluation.suites import encode_prompt, load_jsonl_suite  # noqa: E402

DEV = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def metrics(url: str, *names: str) -> dict[str, float]:
    """The values of ``names`` in one read of the server's /metrics (0 where absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = {n: re.search(r"^%s ([0-9.e+-]+)$" % re.escape(n), text, re.M) for n in names}
    return {n: float(m.group(1)) if m else 0.0 for n, m in found.items()}


COUNTERS = {"rounds": "adaspec_batch_rounds_total", "rows": "adaspec_batch_rows_total",
            "prefill": "adaspec_prefill_seconds_total"}


def load(s, prompts, requests: int, clients: int, max_tokens: int, turns: bool = False) -> dict:
    """``requests`` greedy chat requests (prompts in turn) from ``clients`` concurrent clients; with ``turns`` each
    request is a prompt's conversation (its first turn and followups, each sent with the history so far)."""
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=1200)
    before = metrics(s.url, *COUNTERS.values())

    def one(i):
        """(per-turn latencies, the tokens of every turn, prompt tokens, cached prompt tokens, error or None)."""
        q = prompts[i % len(prompts)]
        messages, latencies, tokens, prompt, cached = [], [], [], 0, 0
        try:
            for text in (q.text, *q.followups) if turns else (q.text,):
                messages.append({"role": "user", "content": text})
                t0 = time.perf_counter()
                r = c.chat.completions.create(model=s.model, messages=messages, max_tokens=max_tokens,
                                              temperature=0, extra_body={"adaspec": {"return_token_ids": True}})
                latencies.append(time.perf_counter() - t0)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
                tokens += r.model_extra["adaspec"]["token_ids"]
                prompt += r.usage.prompt_tokens
                cached += r.usage.prompt_tokens_details.cached_tokens
            return latencies, tokens, prompt, cached, None
        except Exception as exc:  # counted, reported
            return latencies + [time.perf_counter() - t0], tokens, prompt, cached, exc  # the failed turn's too

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    after = metrics(s.url, *COUNTERS.values())
    return summarise({"wall": wall, "latencies": sorted(t for o in out for t in o[0]),
                      "completion_tokens": sum(len(o[1]) for o in out),
                      "prompt_tokens": sum(o[2] for o in out), "cached_tokens": sum(o[3] for o in out),
                      **{k: after[n] - before[n] for k, n in COUNTERS.items()},
                      "errors": sum(o[4] is not None for o in out), "tokens": {i: o[1] for i, o in enumerate(out)}})


def merge(acc: dict | None, r: dict) -> dict:
    """Repeats of one cell as one: tokens/s over their summed wall time, latency quantiles over every request."""
    if acc is None:
        return r
    lat = sorted(acc.pop("latencies") + r.pop("latencies"))
    out = {"wall": acc["wall"] + r["wall"], "errors": acc["errors"] + r["errors"], "latencies": lat,
           **{k: acc[k] + r[k] for k in ("completion_tokens", "prompt_tokens", "cached_tokens")},
           "rounds": acc["rounds"] + r["rounds"], "rows": acc["rows"] + r["rows"],
           "prefill": acc["prefill"] + r["prefill"],
           "tokens": acc["tokens"],  # the first repeat's; a repeat that differs from it is not identical
           "repeats_differ": acc.get("repeats_differ", False)
           or any(acc["tokens"][i] != t for i, t in r["tokens"].items())}
    return summarise(out)


def summarise(r: dict) -> dict:
    lat = r["latencies"]
    return {**r, "tokens_per_s": r["completion_tokens"] / r["wall"], "p50": statistics.median(lat),
            "p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "batch_mean": r["rows"] / r["rounds"] if r["rounds"] else 0.0, "prefill_share": r["prefill"] / r["wall"],
            "cached_share": r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0}


def overhead(s, prompts, max_tokens: int) -> dict:
    """tokens/s of the engine decoding directly and through HTTP, per prompt and interleaved."""
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    engine, policy, tok = s.worker.engine, s.worker.policy, s.worker.tok

    def direct(text):
        t0 = time.perf_counter()
        g = engine.generate(encode_prompt(tok, text), policy, max_tokens)
        return len(g.tokens), time.perf_counter() - t0

    def http(text):
        t0 = time.perf_counter()
        r = c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": text}],
                                      max_tokens=max_tokens, temperature=0)
        return r.usage.completion_tokens, time.perf_counter() - t0

    methods = {"engine (decode generate)": direct, "HTTP": http}
    tokens, seconds = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0.0)
    names = list(methods)
    for i, q in enumerate(prompts):
        for k in names[i % len(names):] + names[:i % len(names)]:
            n, secs = methods[k](q.text)
            tokens[k] += n
            seconds[k] += secs
    return {k: tokens[k] / seconds[k] for k in methods}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default=str(DEV), help="Spec-Bench style JSONL (default: Spec-Bench dev)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=48, help="requests per client count and server")
    p.add_argument("--clients", default="1,2,4,8,16", help="concurrent client counts")
    p.add_argument("--max-batch", default="1,8", help="one server per value (its --max-batch)")
    p.add_argument("--repeat", type=int, default=1,
                   help="cells per client count and server, their order rotated, summed (default: %(default)s)")
    p.add_argument("--turns", action="store_true",
                   help="each request is a multi-turn conversation of the suite (its questions with several turns), "
                        "every turn sent with the history so far, the server's answers included")
    p.add_argument("--overhead", action="store_true", help="also measure HTTP against the engine directly")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench_serve.json")
    p.add_argument("server_args", nargs="*", help="after --: more `decode serve` flags (e.g. -- --arms 'pld:L=4')")
    a = p.parse_args()
    if a.repeat < 1:
        p.error(f"--repeat must be >= 1, got {a.repeat}")

    prompts, seen = [], {}
    for q in load_jsonl_suite(a.suite):
        if a.turns and not q.followups:
            continue
        if seen.get(q.category, 0) < a.per_category:
            seen[q.category] = seen.get(q.category, 0) + 1
            prompts.append(q)
    if not prompts:
        p.error(f"--turns: {a.suite} has no question with more than one turn")
    batches = [b.strip() for b in a.max_batch.split(",")]
    counts = [int(c) for c in a.clients.split(",")]
    results: dict = {}
    with contextlib.ExitStack() as stack:
        servers = {b: stack.enter_context(RunningServer(["--state-file", "none", "--threads", str(a.threads),
                                                         "--max-batch", b, *a.server_args])) for b in batches}
        s0 = servers[batches[0]]
        for s in servers.values():  # warm each HTTP path once
            load(s, prompts, 2, 2, 8)
        if a.overhead:
            results["overhead"] = overhead(s0, prompts, a.max_tokens)
        for n, clients in enumerate(counts):
            got = {}
            for rep in range(a.repeat):  # the order rotates per client count and per repeat: drift hits all alike
                k = (n + rep) % len(batches)
                for b in batches[k:] + batches[:k]:
                    got[b] = merge(got.get(b), load(servers[b], prompts, a.requests, clients, a.max_tokens, a.turns))
            ref = got[batches[0]]["tokens"]
            for b in batches:
                r = got[b]
                r["identical"] = not r.pop("repeats_differ", False) and all(
                    r["tokens"][i] == ref[i] for i in ref if ref[i] and r["tokens"][i])
                del r["tokens"], r["latencies"]
                print(f"{clients} clients, --max-batch {b}: {r['tokens_per_s']:.1f} tok/s, p50 {r['p50']:.2f} s, "
                      f"p95 {r['p95']:.2f} s, mean batch {r['batch_mean']:.2f}, errors {r['errors']}", file=sys.stderr)
            results[clients] = {b: got[b] for b in batches}
        labels, policy = s0.worker.labels, s0.worker.policy_spec
        chosen = {b: getattr(s.worker, "max_batch", 1) for b, s in servers.items()}

    what = "conversations of " + "/".join(sorted({str(1 + len(q.followups)) for q in prompts})) + " turns" \
        if a.turns else "prompts"
    print(f"\n{len(prompts)} {what} ({a.per_category}/category of {Path(a.suite).name}), {a.requests} requests per "
          f"cell × {a.repeat}, {a.max_tokens} max tokens, greedy, {torch.get_num_threads()} thread(s), "
          f"arms {', '.join(labels)}, policy {policy}; "
          f"--max-batch {', '.join(f'{b} (= {chosen[b]})' for b in batches)}\n")
    base = batches[0]
    print("| clients | --max-batch | tokens/s | × " + base + " | p50 s | p50 ÷ " + base + " | p95 s | mean batch | "
          "prefill share | cached share | errors | tokens = " + base + " |\n" + "|---" * 12 + "|")
    for clients in counts:
        for b in batches:
            r, r0 = results[clients][b], results[clients][base]
            print(f"| {clients} | {b} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / r0['tokens_per_s']:.2f} | "
                  f"{r['p50']:.2f} | {r['p50'] / r0['p50']:.2f} | {r['p95']:.2f} | {r['batch_mean']:.2f} | "
                  f"{r['prefill_share']:.0%} | {r['cached_share']:.0%} | "
                  f"{r['errors']} | {'yes' if r['identical'] else 'NO'} |")
    if a.overhead:
        o = results["overhead"]
        print("\n" + ", ".join(f"{k}: {v:.1f} tok/s" for k, v in o.items()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(a), "arms": labels, "policy": policy, "max_batch": chosen,
                               "results": results}, indent=1))
    ok = all(r["errors"] == 0 and r["identical"] for c in counts for r in results[c].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
