# Two commands on a fresh machine: `make demo` (trains a tiny model with strategy="megatrain" through the `megatrain`
# CLI and exports it as a HuggingFace folder) and `make test` (lint, then the test suite).
PYTHON ?= python3
# A pinned torch first: on CPU-only machines this takes a local CPU build instead of a multi-GB CUDA download.
TORCH ?= torch==2.13.0

.PHONY: install demo test
install:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) -m lightning_megatrain fit --config configs/demo.yaml
	$(PYTHON) -m lightning_megatrain export checkpoints/demo/last.ckpt out/demo-hf --overwrite

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q
