"""Repository paths and common flags for the ``megatrain`` app tests (a helper module, not a conftest)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DEMO_CONFIG = CONFIGS / "demo.yaml"
EXAMPLES = REPO / "examples"

# Flags that make a CLI run quiet; the demo config's relative paths resolve in the test's cwd.
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
