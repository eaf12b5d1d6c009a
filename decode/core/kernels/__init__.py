"""Kernels of our own where the field's libraries have none: a linear for a round's few rows (stream.py) and the
decoder layer's small ops fused (glue.py); built on first use (build.py)."""
