"""What serving over HTTP costs, and how the server holds up under concurrent clients.

One server runs in this process (``decode.commands.serve.command.RunningServer``, the same code ``python -m decode
serve`` runs). Phase 1, per prompt and interleaved (rotated order): the engine decoding directly (what
``decode generate`` measures: prefill + rounds), the same prompt through ``/v1/chat/completions``, and the
same prompt streamed; tokens/s of each and their ratio, greedy outputs checked identical. Phase 2: a bounded
load (``--requests`` requests from ``--clients`` concurrent openai clients) with p50/p95 latency, aggregate
tokens/s and errors. Run it alone on the machine (no training, no tests): it measures time.

    .venv/bin/python scripts/bench_serve.py [--max-tokens 64] [--requests 50 --clients 8] [--out runs/bench_serve.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402
import torch  # noqa: E402

from decode.commands.serve.command import RunningServer  # noqa: E402
from decode.evaluation.suites import encode_prompt, load_jsonl_suite  # noqa: E402

DEV = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default=str(DEV), help="Spec-Bench style JSONL (default: Spec-Bench dev)")
    p.add_argument("--per-category", type=int, default=1, help="prompts per category (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench_serve.json")
    p.add_argument("server_args", nargs="*", help="after --: more `decode serve` flags (e.g. -- --arms 'pld:L=4')")
    a = p.parse_args()

    prompts, seen = [], {}
    for q in load_jsonl_suite(a.suite):
        if seen.get(q.category, 0) < a.per_category:
            seen[q.category] = seen.get(q.category, 0) + 1
            prompts.append(q)
    with RunningServer(["--state-file", "none", "--threads", str(a.threads), *a.server_args]) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        engine, policy, tok = s.worker.engine, s.worker.policy, s.worker.tok

        def direct(text):
            ids = encode_prompt(tok, text)
            t0 = time.perf_counter()
            g = engine.generate(ids, policy, a.max_tokens)
            return list(g.tokens), time.perf_counter() - t0

        def http(text, stream=False):
            msgs = [{"role": "user", "content": text}]
            ex = {"adaspec": {"return_token_ids": True}}
            t0 = time.perf_counter()
            if stream:
                chunks = list(client.chat.completions.create(model=s.model, messages=msgs, max_tokens=a.max_tokens,
                                                             temperature=0, stream=True, extra_body=ex))
                final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
                return final.model_extra["adaspec"]["token_ids"], time.perf_counter() - t0
            r = client.chat.completions.create(model=s.model, messages=msgs, max_tokens=a.max_tokens, temperature=0,
                                               extra_body=ex)
            return r.model_extra["adaspec"]["token_ids"], time.perf_counter() - t0

        methods = {"engine (decode generate)": direct, "HTTP": http, "HTTP stream": lambda t: http(t, True)}
        http(prompts[0].text)  # warm the HTTP path once
        tokens = {k: 0 for k in methods}
        seconds = {k: 0.0 for k in methods}
        identical = True
        names = list(methods)
        for i, q in enumerate(prompts):
            outs = {}
            for k in names[i % len(names):] + names[:i % len(names)]:  # rotate: noise hits all alike
                toks, secs = methods[k](q.text)
                outs[k] = toks
                tokens[k] += len(toks)
                seconds[k] += secs
            identical &= len({tuple(v) for v in outs.values()}) == 1
            print(f"{i + 1}/{len(prompts)} {q.category}: " + ", ".join(f"{k} {len(v)} tok" for k, v in outs.items()),
                  file=sys.stderr)
        tps = {k: tokens[k] / seconds[k] for k in methods}
        base = tps["engine (decode generate)"]

        lat, errors, done_tokens = [], 0, 0

        def one(i):
            q = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            try:
                r = client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": q.text}],
                                                   max_tokens=a.max_tokens, temperature=0)
                return time.perf_counter() - t0, r.usage.completion_tokens, None
            except Exception as exc:  # counted, reported
                return time.perf_counter() - t0, 0, exc

        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as pool:
            for secs, n, exc in pool.map(one, range(a.requests)):
                lat.append(secs)
                done_tokens += n
                errors += exc is not None
        wall = time.perf_counter() - t0

    rows = ["| path | tokens | tokens/s | ÷ engine |", "|---|---|---|---|"]
    rows += [f"| {k} | {tokens[k]} | {tps[k]:.2f} | {tps[k] / base:.3f} |" for k in methods]
    q = statistics.quantiles(lat, n=20)
    load = (f"load: {a.requests} requests from {a.clients} clients, {a.max_tokens} max tokens: p50 "
            f"{statistics.median(lat):.2f} s, p95 {q[18]:.2f} s, {done_tokens / wall:.2f} tokens/s aggregate, "
            f"{errors} errors, wall {wall:.1f} s")
    setting = (f"{len(prompts)} prompts ({a.per_category}/category of {Path(a.suite).name}), {a.max_tokens} new tokens, "
               f"greedy, {torch.get_num_threads()} thread(s), arms {', '.join(s.worker.labels)}, policy "
               f"{s.worker.policy_spec}; outputs identical across paths: {'yes' if identical else 'NO'}")
    print("\n".join(rows) + "\n\n" + setting + "\n" + load)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens_per_s": tps, "tokens": tokens, "identical": identical, "setting": setting,
                               "load": {"p50": statistics.median(lat), "p95": q[18], "errors": errors,
                                        "tokens_per_s": done_tokens / wall, "requests": a.requests,
                                        "clients": a.clients}}, indent=1))
    return 0 if identical and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
