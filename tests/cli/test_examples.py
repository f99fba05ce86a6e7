"""The two example scripts run on a CPU (a few steps, via their command-line flags)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.cli_paths import EXAMPLES


@pytest.mark.parametrize("script", ["train_demo.py", "existing_project.py"])
def test_example_runs(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--max-steps", "3", "--accelerator", "cpu", "--root-dir", tmp_path],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: global_step=3 train_loss=" in result.stdout
    if script == "train_demo.py":
        assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
