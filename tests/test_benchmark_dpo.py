"""CPU smoke test of benchmarks/dpo.py (DPO beside SFT on the GPU): its code path and rows, on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*smaller than the logging interval.*")
def test_dpo_benchmark_dry_run(tmp_path):
    sys.path.insert(0, str(BENCH))  # as when run as a script: it imports benchmarks/workloads.py
    spec = importlib.util.spec_from_file_location("bench_dpo", BENCH / "dpo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--dry-run", "--tasks", "sft,dpo", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-dpo-tiny-llama-cpu.json")
    assert json.loads(path.read_text())["results"] == rows
    sft, dpo = rows
    for row in rows:
        assert row["error"] is None and row["tokens_per_s"] > 0 and len(row["step_times_s"]) == 2
        assert row["tokens_per_step"] == 2 * 2 * 32  # 2 pairs of 32-token sequences per micro-batch
    assert sft["reference_s"] is None and dpo["reference_s"] > 0
    # the reference pass ran the same bf16 computation as the first training forward: log 2 before any update
    assert dpo["losses"][0] == pytest.approx(math.log(2), abs=1e-4)
