"""Layer ``commands`` (top): the ``python -m decode`` entry point (``cli``) and the subcommands that are
not a lower layer's own module: ``generate`` (stream one prompt) and ``serve`` (the OpenAI-compatible
server). May import every layer."""
