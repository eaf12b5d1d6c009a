"""Kernels of our own where the field's libraries have none (decode/core/kernels/stream.py)."""
