"""Shared test helpers (not tests): ``pyproject.toml`` puts ``tests/`` on ``sys.path`` (pytest's ``pythonpath``), so
test files import them as ``from helpers.parity import ...``.

- ``families``: tiny random-init configs of real causal-LM architectures.
- ``parity``: train one of them under a strategy and record losses, gradients and weights; compare two records.
- ``faults``: a module whose loss or gradients turn NaN on chosen micro-batches, snapshots of every parameter and
  optimizer state, a short fit (the all-or-nothing step tests).
- ``gpu``: the CUDA tests' strategy with the "auto" mechanisms off, and ``parity.run`` on the GPU.
- ``packing``: one document packed among others, its losses and gradient through the strategy, per row layout.
- ``cli_paths``: repository paths and quiet flags for the ``megatrain`` app tests.
"""
