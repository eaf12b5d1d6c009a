"""Seconds of one EAGLE training step (loss + backward, the trainer's own ``make_loss``) on real answers.

    .venv/bin/python scripts/bench_eagle_train_step.py [--head pretrained/smollm2-135m-instruct/eagle]
        [--rows 4] [--max-length 256] [--ttt 1,3,7] [--reps 5] [--online] [--dtype bfloat16]

What a CPU training minute buys: the shipped head (warm start, as ``make pretrained`` trains it) on ``--rows``
shipped answers (pretrained/<target>/answers, round-robin over tasks, prompt + answer cut to ``--max-length``,
loss on answer tokens, the trainer's own encoding and collator), features cached as ``feature_cache.enabled=true``
stores them (``--online``: the frozen target runs in every step, as the gpu budget trains). Prints per TTT depth
the median step time over ``--reps`` after one warm-up, and answer tokens trained per second. Run it alone
(2 cores); compare code versions by running each in one session, interleaved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--head", default="pretrained/smollm2-135m-instruct/eagle")
    p.add_argument("--answers", default="pretrained/smollm2-135m-instruct/answers")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--ttt", default="1,3,7", help="comma-separated TTT depths (head.ttt_steps)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--online", action="store_true", help="run the target in every step instead of caching features")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the step's compute dtype (train.dtype: bfloat16 runs it under autocast)")
    args = p.parse_args(argv)

    import torch

    from decode.choose.heads import load_head
    from decode.core.models import load_model
    from toolkit.answers import load_answers, read_record
    from toolkit.train.data import collator, encode_example
    from toolkit.train.eagle import EagleSection, EagleTrainModule, _cached_tensors, make_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok = load_model(args.target)
    head = load_head(args.head, target, expect="eagle").float().train()
    answers = REPO / args.answers
    by_task = [load_answers(answers, t) for t in sorted(read_record(answers)["tasks"])]
    rows = [by_task[i % len(by_task)][i // len(by_task)] for i in range(args.rows)]
    inputs = dict(collator(tok)([encode_example(tok, r, args.max_length) for r in rows]))  # the trainer's batches
    if not args.online:  # what the feature cache stores and hands the loss
        inputs.update(_cached_tensors(target, head.target_layers)(inputs))
    module = EagleTrainModule(target, head)
    tokens = int((inputs["labels"] != -100).sum())
    print(f"{args.rows} rows × ≤ {args.max_length} tokens ({tokens} answer tokens), features "
          f"{'online' if args.online else 'cached'}, {args.dtype}, {torch.get_num_threads()} threads")
    for depth in (int(x) for x in args.ttt.split(",")):
        section = EagleSection(features="fused" if head.fused else "final", ttt_steps=depth, noise=0.0,
                               feature_layers=list(head.feature_layers) if head.fused else None,
                               layer=head.layer, input_norm=head.input_norm, fc_bias=head.fc_bias)
        loss_fn = make_loss(section)
        times = []
        for rep in range(args.reps + 1):
            head.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                loss, _ = loss_fn(module, inputs)
            loss.backward()
            if rep:
                times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        print(f"ttt_steps={depth}: {s * 1000:8.1f} ms/step, {tokens / s:8.0f} answer tokens/s (loss {loss.item():.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
