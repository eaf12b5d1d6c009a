"""``python -m decode serve``: an OpenAI-compatible HTTP endpoint whose arm choice learns across requests.

Layers, each importing only those before it (and the decoding core of ``decode``):

- ``protocol``: the request schema (pydantic) and OpenAI-style errors; no model, no HTTP.
- ``metrics``: the Prometheus counters a server exports at ``/metrics``.
- ``worker``: the one thread that owns the engine and decodes queued requests in arrival order (per-request
  sampling, stop strings, cancellation, timeouts) and keeps the carried policy's state file.
- ``app``: the FastAPI routes (chat and text completions, streaming as server-sent events, models, health,
  metrics) in front of a worker.
- ``command``: the CLI: load the target, build the pool, warm up, run uvicorn, save the state on shutdown.
"""
