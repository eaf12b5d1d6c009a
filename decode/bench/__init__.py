"""Layer ``bench``: timing benchmarks that print numbers — a round broken into phases (``bench_round``),
verification forwards against their size (``bench_tree``), the fused verifier against the reference
(``bench_verify``), the drafting cost per token (``draft_cost``). Imports the layers up to ``evaluation``."""
