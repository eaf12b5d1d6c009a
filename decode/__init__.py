"""decode: the runtime — load a target and a pool of arms, choose arms online, verify losslessly.

The package is layered; ``LAYERS`` below is the order, bottom first, written once (tests/test_layers.py
enforces it). A module imports its own layer and the layers below it, never one above; ``decode`` never
imports ``toolkit``.

- ``common``      errors, atomic IO, devices, spec strings, registries, metrics (MAT, speed-up, …)
- ``core``        what one round is made of: models, the Target (KV cache, score, rollback), hidden states,
                  drafts and trees, sampling, verifiers, the verification cost curve
- ``choose``      what the round chooses with: heads (trained modules), arms (proposers), policies,
                  length controllers, rewards, counterfactual feedback
- ``engine``      the round itself (``SpecEngine.step``) and building an engine from arm specs and pools
- ``simulation``  counterfactual traces of the engine and the offline regret simulator
- ``evaluation``  prompt suites, HF peers, evaluation runs, reports, comparisons, plots
- ``bench``       timing benchmarks of a round's parts (round phases, tree forwards, verifier, draft cost)
- ``commands``    the ``python -m decode`` CLI and its subcommands (generate, serve)
"""

LAYERS = ("common", "core", "choose", "engine", "simulation", "evaluation", "bench", "commands")
