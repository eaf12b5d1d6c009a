"""bench-tree: the forward-cost-vs-nodes table (timings are printed, never asserted)."""
import torch

from decode.bench.bench_tree import markdown_table, measure, random_tree
from decode.core.target import Target
from decode.core.tree import depths
from helpers import tiny_llama


def test_random_trees_are_topological_and_depth_capped():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 40):
        p = random_tree(n, g, max_depth=3)
        assert p.numel() == n and bool((p < torch.arange(n)).all()) and int(depths(p).max()) <= 3


def test_measure_times_every_size_and_leaves_the_cache_as_it_was():
    model = tiny_llama(seed=1)
    target = Target(model)
    prompt = [1, 2, 3, 4, 5, 6]
    rows = measure(target, prompt, [1, 3, 8], repeats=1, progress=False)
    assert list(rows) == [1, 3, 8]
    for r in rows.values():
        assert r["step_ms"] > 0 and r["chain_ms"] > 0 and r["tree_ms"] > 0
    assert target.kv.length == len(prompt) - 1  # every timed forward was rolled back
    table = markdown_table(rows)
    assert table.count("\n") == 4 and "| 8 |" in table
