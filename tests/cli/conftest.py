"""Fixtures for the ``megatrain`` app tests (CPU, offline): a clean ``sys.argv`` and a temporary cwd."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when it gets `args` while sys.argv also holds arguments (pytest's own).
    monkeypatch.setattr(sys, "argv", ["megatrain"])


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in ``tmp_path`` so the configs' relative checkpoint and log folders land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
