"""Layer ``core``: what one round is made of — resolving and loading models (``models``, ``vocab``, ``linear``,
``compiled``), the ``Target`` (KV cache, prefill, score, rollback) and its ``hidden`` states, ``draft``/``tree``
values, ``sampling``, the ``verify`` backends and the verification ``cost`` curve. Imports ``common`` only."""
