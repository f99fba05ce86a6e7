# Two commands on a fresh machine: `make demo` (trains a tiny model with strategy="megatrain") and `make test`.
PYTHON ?= python3
# A pinned torch first: on CPU-only machines this takes a local CPU build instead of a multi-GB CUDA download.
TORCH ?= torch==2.13.0

.PHONY: install demo test
install:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) examples/train_demo.py

test: install
	$(PYTHON) -m pytest -q
