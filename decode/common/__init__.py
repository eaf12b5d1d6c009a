"""Layer ``common`` (bottom): what every layer uses and that knows nothing of models or rounds — user errors,
atomic writes, device/dtype resolution, ``name:key=value`` spec strings, name registries, the metrics
defined once (MAT, tokens/s, speed-up, …). Imports nothing else from ``decode``."""
