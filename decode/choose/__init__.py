"""Layer ``choose``: what a round chooses with — ``heads`` (trainable modules on a frozen target, shared with
``toolkit``), ``arms`` (proposers, registered by name), ``policies`` (arm selection), ``length`` controllers,
``rewards`` and counterfactual ``feedback``. Imports ``common`` and ``core``."""
