"""Layer ``evaluation``: prompt ``suites``, the HF ``peers`` (the ``hf`` reference, ``hf-static``, ``hf-pld``),
``eval_config``, interleaved evaluation runs (``evaluate``), ``report``/``compare`` (pure functions of the records)
and ``plots``. Imports the layers up to ``simulation``."""
