"""One trainer for every trained artifact: ``python -m toolkit train <drafter|eagle|early-exit|calibrator>``.

* :mod:`.kinds`    the catalog: kind → recipe schema, default recipe, train function (read by the CLI/scripts)
* :mod:`.cli`      the ``train`` command and the ``scripts/train_*.py`` launchers (``--help`` lists a kind's fields)
* :mod:`.runtime`  :func:`.runtime.run_training` (resume check, run record, training arguments,
                   :class:`.runtime.LossTrainer`, time budget ``train.max_minutes``, tokens/s, gathering), DeepSpeed
                   ZeRO config, ``train.device``/``train.dtype`` (autocast, float32 master weights)
* :mod:`.data`     distilled sets → held-out split by prompt → chat-template tokens, loss on response only
* :mod:`.heads`    what the three head kinds share on top (frozen target, text splits, fingerprint, finish)
* :mod:`.metrics`  drafter-vs-target agreement and simulated acceptance on held-out text
* :mod:`.drafter`, :mod:`.eagle`, :mod:`.early_exit`, :mod:`.calibrator`  one kind each

A kind's module supplies only what differs: its recipe schema, its model/module, its ``loss_fn`` and its
export (drafter: an HF folder, :mod:`toolkit.export`; heads: a head folder, :func:`decode.choose.heads.save_head`).
"""
