"""CPU smoke test of benchmarks/ranks.py: two gloo ranks started by Lightning's own launcher (the script runs again
as rank 1), the tiny Llama, and the result row rank 0 writes; ``cpu_binding="auto"`` binds the ranks Lightning
starts. The numbers need the x2 GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_megatrain.cpu_binding import numa_nodes, rank_cpus

ROOT = Path(__file__).resolve().parents[1]


def test_ranks_benchmark_dry_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ranks.py"), "--dry-run", "--devices", "2",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-ranks-megatrain-tiny-llama-cpu-x2.json")
    row = json.loads(path.read_text())
    assert row["world"] == 2 and row["tokens_per_step"] == 2 * 2 * 2 * 64
    assert len(row["step_times_s"]) == 2 and row["tokens_per_s"] > 0
    assert len(row["peak_host_gib_by_rank"]) == 2 and all(g > 0 for g in row["peak_host_gib_by_rank"])
    allowed = os.sched_getaffinity(0)
    want = [rank_cpus(r, 2, allowed, numa_nodes(), []) for r in range(2)]  # None: fewer physical cores than ranks
    assert row["cpus_by_rank"] == [len(w.cpus) if w is not None else len(allowed) for w in want]
