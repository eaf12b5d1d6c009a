"""One trainer plumbing shared by every trained artifact (drafters now; EAGLE heads, early-exit layers
and calibrators reuse it).

* :mod:`.data`     distilled sets → held-out split by prompt → chat-template tokens, loss on response only
* :mod:`.runtime`  HF ``Trainer`` + DeepSpeed ZeRO config + ``train.device``/``train.dtype`` (autocast, float32
                   master weights) + exact resume + gather
* :mod:`.metrics`  drafter-vs-target agreement and simulated acceptance on held-out text
* :mod:`.drafter`  the independent-drafter recipe (``scripts/train_drafter.py``)

An artifact module supplies a model, a ``loss_fn`` for :class:`.runtime.LossTrainer` and an export
step (:mod:`toolkit.export`); everything else is here once.
"""
