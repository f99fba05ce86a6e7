"""CPU smoke tests of the GPU benchmark scripts: their code paths, row schema, plans and summaries.

The numbers themselves need the GPU machine; these tests catch the bugs that would waste a device call.
`benchmarks/throughput.py --dry-run` runs each system on a tiny model in a subprocess (about 10 s each here).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"



throughput = load_benchmark("throughput")


def _run(*args: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("throughput")
    stdout = _run(str(BENCH / "throughput.py"), "--dry-run", "--systems", "megatrain,plain",
                  "--parts", "32k,32k-chunked", "--out", str(out), timeout=180)
    return out, stdout


def test_throughput_dry_run_rows_have_every_key(dry_run):
    out, stdout = dry_run
    (path,) = out.glob("*-tiny-llama-cpu.json")
    assert path.with_suffix(".md").read_text().count("| tiny-llama |") == 4
    (log,) = out.glob("*-throughput-cpu-32k_32k-chunked.log")  # one log per call: the device returns <= 8 files
    assert log.read_text().count("\n===== {") == 4
    meta = json.loads(path.read_text())
    assert meta["device"] == "cpu" and meta["dry_run"] is True
    rows = meta["results"]
    assert [(r["system"], r["loss"]) for r in rows] == [
        ("megatrain", "hf"), ("plain", "hf"), ("megatrain", "chunked"), ("plain", "chunked")]
    for r in rows:
        assert set(throughput.ROW_KEYS) <= r.keys()
        assert r["error"] is None, r["error"]
        # 2 optimizer steps of 2 micro-batches of 2 x 64 tokens: accumulation is exercised
        assert (r["micro_batch"], r["accumulate"], r["seq_len"], r["tokens_per_step"]) == (2, 2, 64, 256)
        assert len(r["step_times_s"]) == 2 and [len(x) for x in r["losses"]] == [2, 2]
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < r["mfu_attn"]
        assert r["peak_gpu_gib"] is None and r["peak_host_gib"] > r["host_baseline_gib"] > 0
        assert r["host_bytes_per_param"] == pytest.approx(r["peak_host_gib"] * 2**30 / r["params"])
        # [RSS, high-water mark] per step; the peak is the mark after the last measured step, read before ru_maxrss
        (_, first_peak), (last_rss, last_peak) = r["host_rss_by_step_gib"]
        assert first_peak <= last_peak == pytest.approx(r["peak_host_gib"]) and 0 < last_rss <= last_peak
        assert r["peak_host_gib"] <= r["peak_host_with_profiler_gib"] + 1e-3  # KiB (ru_maxrss) vs kB (VmHWM) rounding
        assert set(throughput.PHASES) | set(throughput.BUSY) <= r["breakdown"].keys()
        assert r["breakdown"]["setup_s"] >= r["breakdown"]["build_s"] > 0
    assert rows[0]["optimizer_class"] == "HostCPUAdam" or "fused" in str(rows[0]["notes"])
    assert rows[1]["clip"] == 1.0 and rows[1]["optimizer_class"] == "AdamW"
    # Same init and data in every system: the first micro-batch's loss agrees (bf16) and is ~ln(vocab) at std 0.02.
    first = [r["losses"][0][0] for r in rows]
    assert max(first) - min(first) < 1e-3 * min(first)
    assert first[0] == pytest.approx(math.log(512), rel=0.01)
    assert "| megatrain | tiny-llama | hf | 2 x 2 | 256 |" in stdout and "| estimated s | actual s |" in stdout


def test_throughput_summarize_merges_files(dry_run, tmp_path):
    out, _ = dry_run
    (path,) = out.glob("*-tiny-llama-cpu.json")
    stdout = _run(str(BENCH / "throughput.py"), "--summarize", str(path), str(path), "--out", str(tmp_path),
                  timeout=60)
    commit = json.loads(path.read_text())["git_commit"]
    assert stdout.count(f"| megatrain @{commit[:7]} | tiny-llama | hf | 2 x 2 | 256 |") == 2  # rows name their commit
    merged = json.loads((tmp_path / path.name).read_text())
    assert len(merged["results"]) == 8 and merged["merged_from"] == [path.name, path.name]
    assert merged["git_commit"] == commit and all(r["git_commit"] == commit for r in merged["results"])
    assert (tmp_path / path.name).with_suffix(".md").exists()


def test_performance_table_is_generated_from_the_committed_results():
    readme_table = load_benchmark("readme_table")
    assert readme_table.TARGET == ROOT / "docs" / "performance.md"
    table = readme_table.committed(readme_table.TARGET.read_text())
    assert table == readme_table.table(), "stale table: run python benchmarks/readme_table.py --write"
    # the targets' ratios: each megatrain row against the section's ZeRO-3 reference
    assert "| **24,142** | 2.38 | 1.13 | 47.1% |" in table and "| **26,403** | 2.02 | 1.22 | 51.5% |" in table
    # the table shows result files, not commits (the JSON rows keep theirs)
    assert "`2026-11-29-llama-3.2-3b-h200.json`" in table and "b064dab" not in table


def test_readme_summary_quotes_the_generated_table():
    """README.md's Performance summary quotes each headline row (the defaults): tokens/s, the ratios, MFU and host
    bytes/param."""
    readme_table = load_benchmark("readme_table")
    readme = (ROOT / "README.md").read_text()
    summary = readme[readme.index("## Performance") : readme.index("\n## ", readme.index("## Performance") + 1)]
    assert "docs/performance.md" in summary
    headline = [row.label for row in readme_table.ROWS if row.headline]
    rows = [line.split(" | ") for line in readme_table.table().splitlines()
            if any(line.startswith(f"| {label} |") for label in headline)]
    assert len(rows) == len(headline) == 5
    for cells in rows:
        tokens, zero3, plain, mfu, host = cells[3], cells[4], cells[5], cells[6], cells[8]
        assert f"**{tokens.strip('*')} tokens/s**" in summary, (tokens, cells[0])
        for ratio in (zero3, plain):
            assert not ratio.strip() or f"{ratio.strip()}x" in summary, (ratio, cells[0])
        assert mfu.split()[0] in summary, (mfu, cells[0])
        bytes_per_param = host.split("(")[1].split(")")[0]
        assert f"{bytes_per_param} host bytes/param" in summary, (bytes_per_param, cells[0])
    # the README keeps a summary only: the generated table lives in docs/performance.md
    assert readme_table.BEGIN not in readme


def test_performance_table_check_fails_on_a_stale_page(tmp_path):
    readme_table = load_benchmark("readme_table")
    page = tmp_path / "performance.md"
    stale = readme_table.TARGET.read_text().replace("| **24,142** |", "| **24,000** |")
    page.write_text(stale)
    assert readme_table.committed(page.read_text()) != readme_table.table()
    assert readme_table.write(page) and readme_table.committed(page.read_text()) == readme_table.table()
    assert not readme_table.write(page)


def test_readme_table_selectors_match_exactly_one_row():
    readme_table = load_benchmark("readme_table")
    row = readme_table.ROWS[0]
    with pytest.raises(LookupError, match="0 rows"):
        readme_table._find(row._replace(commit="0000000"))
    assert readme_table._find(row)["tokens_per_s"] > 0


def test_core_gpu_summarize_committed_results():
    files = sorted((BENCH / "results").glob("2026-11-29-core-*.json"))
    assert [f.name for f in files] == ["2026-11-29-core-depth-h200.json", "2026-11-29-core-parity-scale-h200.json"]
    stdout = _run(str(BENCH / "core_gpu.py"), "--summarize", *map(str, files), timeout=60)
    assert stdout.startswith("device: NVIDIA H200")
    for row in ("| auto | llama-110m |", "| megatrain | llama-110m |", "| megatrain | llama-3.2-3b |",
                "| megatrain | llama-3.2-3b-x2depth |"):
        assert row in stdout
    assert "bf16 parity, 50 steps: max relative loss difference" in stdout
    assert "GPU peak at 2x depth: 27.35 GiB vs 27.35 GiB" in stdout


def test_busy_fractions_count_overlap_once():
    ms = 1_000_000  # ns
    events = [("ampere_bf16_gemm", 0, 40 * ms), ("flash_fwd", 30 * ms, 60 * ms),  # overlapping kernels: 60 ms
              ("Memcpy HtoD (Pinned -> Device)", 10 * ms, 30 * ms),
              ("Memcpy DtoH (Device -> Pinned)", 70 * ms, 80 * ms), ("Memset (Device)", 90 * ms, 91 * ms)]
    busy = throughput.busy_fractions(events, wall_s=0.1)
    assert busy == pytest.approx({"gpu_compute_busy": 0.6, "h2d_busy": 0.2, "d2h_busy": 0.1, "gpu_idle": 0.29})
    assert throughput.union_ns([(0, 5), (5, 7), (1, 2), (10, 11)]) == 8


def test_throughput_plan_fits_one_device_call_per_part():
    class Args:
        models, systems, seq_len, micro_batch = "llama-3.2-3b", ",".join(throughput.DEFAULT_SYSTEMS), 1024, None
        profile, sync, dry_run = True, True, False

    params = throughput.count_params(throughput.MODELS["llama-3.2-3b"]["config"])[0]
    assert params == pytest.approx(3.21e9, rel=0.01)
    for part, micro_acc in {"32k": (32, 1), "64k": (32, 2), "64k-chunked": (64, 1)}.items():
        Args.parts = part
        runs = throughput.plan(Args)
        assert [r["system"] for r in runs] == list(throughput.DEFAULT_SYSTEMS)
        assert all((r["micro_batch"], r["accumulate"]) == micro_acc for r in runs)
        assert all(r["micro_batch"] * r["accumulate"] * 1024 == throughput.PARTS[part][0] for r in runs)
        jit_once = [throughput.estimate_s(r, params, jit=i == 0) for i, r in enumerate(runs)]
        assert sum(jit_once) < 540, (part, jit_once)  # the default --budget-s: under 9 of the 10 device minutes
    Args.models, Args.parts = "llama-2-7b", "32k"
    assert {r["system"]: (r["micro_batch"], r["accumulate"]) for r in throughput.plan(Args)}["plain"] == (8, 4)


def test_throughput_oom_is_a_row_and_is_retried_at_half_the_micro_batch(tmp_path, monkeypatch):
    calls = []

    def fake_child(run, timeout_s, log_path):
        calls.append((run["micro_batch"], run["accumulate"]))  # every run OOMs, the retry too
        return throughput.error_row(run, "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of")

    monkeypatch.setattr(throughput, "run_child", fake_child)
    args = throughput.argparse.Namespace(
        out=str(tmp_path), dry_run=True, models="tiny-llama", parts="32k", systems="plain", seq_len=64,
        micro_batch=4, profile=True, sync=True, budget_s=100.0, oom_retry=True, commit="abc")
    throughput.run_all(args)
    assert calls == [(4, 1), (2, 2)]  # same tokens per step at half the micro-batch, and only once
    (path,) = tmp_path.glob("*-tiny-llama-cpu.json")
    meta = json.loads(path.read_text())
    assert meta["git_commit"] == "abc"
    rows = meta["results"]
    assert [(r["micro_batch"], r["accumulate"], r["tokens_per_step"]) for r in rows] == [(4, 1, 256), (2, 2, 256)]
    assert all("OutOfMemoryError" in r["error"] for r in rows)
    assert all(set(throughput.ROW_KEYS) <= r.keys() for r in rows)


def test_killed_run_keeps_the_steps_it_printed():
    # a child killed by the time budget after its measured steps (session 12: 64K finished training, then killed)
    out = "Using bfloat16\nSTEP 1 24.6312 s\nSTEP 2 4.0487 s\nMegaTrain: host memory at train end\n"
    run = dict(system="megatrain", model="tiny-llama", micro_batch=2, seq_len=64, tokens_per_step=256, accumulate=2,
               loss="hf")
    row = throughput.error_row(run, "timeout", throughput.step_times(out))
    assert row["step_times_s"] == [24.6312, 4.0487] and row["error"] == "timeout" and row["tokens_per_s"] is None


def test_kernel_seconds_by_kind():
    ms = 1_000_000
    events = [("ampere_bf16_gemm", 0, 40 * ms), ("nvjet_tst_128x256", 40 * ms, 50 * ms),
              ("flash_fwd_kernel", 30 * ms, 60 * ms), ("Memcpy HtoD (Pinned -> Device)", 0, 20 * ms),
              ("vectorized_elementwise_kernel", 60 * ms, 65 * ms), ("vectorized_elementwise_kernel", 70 * ms, 71 * ms)]
    k = throughput.kernel_seconds(events, top=2)
    assert k["matmul_s"] == pytest.approx(0.05) and k["attention_s"] == pytest.approx(0.03)
    assert k["other_kernels_s"] == pytest.approx(0.006)  # copies are not kernels
    assert k["top"] == [["ampere_bf16_gemm", 0.04, 1], ["flash_fwd_kernel", 0.03, 1]]


def test_gpu_events_leave_out_record_function_ranges():
    from torch.autograd import DeviceType

    class Event:
        def __init__(self, name, device, annotation=False):
            self._name, self._device, self._annotation = name, device, annotation

        def name(self):
            return self._name

        def device_type(self):
            return self._device

        def is_user_annotation(self):
            return self._annotation

        def start_ns(self):
            return 0

        def end_ns(self):
            return 1

    events = [Event("[pl][profile]run_training_batch", DeviceType.CPU, annotation=True),
              Event("[pl][profile]run_training_batch", DeviceType.CUDA),  # its range on the GPU timeline
              Event("megatrain::recompute_layer_3", DeviceType.CUDA), Event("aten::mm", DeviceType.CPU),
              Event("nvjet_sm90_tst_192x192", DeviceType.CUDA),
              Event("Memcpy HtoD (Pinned -> Device)", DeviceType.CUDA)]
    assert [n for n, _, _ in throughput.gpu_events(events)] == ["nvjet_sm90_tst_192x192",
                                                                  "Memcpy HtoD (Pinned -> Device)"]


def test_kernel_gaps_name_what_the_training_thread_did():
    ms = 1_000_000
    events = [("nvjet_a", 0, 10 * ms), ("Memcpy DtoH (Device -> Pinned)", 10 * ms, 14 * ms),
              ("flash_fwd", 14 * ms, 20 * ms), ("nvjet_b", 19 * ms, 30 * ms), ("nvjet_c", 30 * ms + 50_000, 40 * ms)]
    main, worker = 1, 2
    spans = [("[pl][profile]run_training_batch", 0, 50 * ms, main),
             ("aten::item", 10 * ms, 14 * ms, main), ("cudaStreamSynchronize", 11 * ms, 14 * ms, main),
             ("aten::mm", 20 * ms, 21 * ms, main),
             ("megatrain::forward_layer_0", 40 * ms, 50 * ms, main), ("aten::copy_", 41 * ms, 50 * ms, main),
             ("cpu_adam_step", 9 * ms, 49 * ms, worker)]
    gaps = throughput.kernel_gaps(events, spans)
    # the 4 ms sync gap (the D2H copy is not compute) and the 10 ms tail; the 0.05 ms gap is under the threshold
    assert gaps["gap_s"] == pytest.approx(0.014)
    assert gaps["idle_s"] == pytest.approx(0.01405)  # the 0.05 ms gap counts here
    assert gaps["longest"] == [
        [40.0, 10.0, "[pl][profile]run_training_batch > megatrain::forward_layer_0 > aten::copy_"],
        [10.0, 4.0, "[pl][profile]run_training_batch > aten::item > cudaStreamSynchronize"]]
    assert [c for c, _ in gaps["by_cause"]][0].endswith("aten::copy_")
    assert throughput.kernel_gaps([("Memcpy HtoD", 0, 1)], spans) == {}


def test_long_context_dry_run_rows(tmp_path):
    # benchmarks/long_context.py on a tiny model on this machine: one row per length, each with the engine's resolved
    # placement and the planner's prediction beside what was measured
    _run(str(BENCH / "long_context.py"), "--dry-run", "--out", str(tmp_path), timeout=240)
    (path,) = tmp_path.glob("*-long-context-tiny-llama-2l.json")
    rows = json.loads(path.read_text())
    assert [r["seq_len"] for r in rows] == [64, 128]
    for row in rows:
        assert row.get("error") is None, row
        assert row["step_s"] > 0 and len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
        assert row["placement"]["segment_layers"] == 1 and row["placement"]["device_checkpoints"] == 0
        assert row["planned"]["host_gib"] > 0 and row["planned"]["gpu_gib"] > 0


def test_muon_step_dry_run(tmp_path):
    # benchmarks/muon_step.py on a tiny Llama-shaped layer on this machine: the engine's host step of Muon and AdamW,
    # the iteration alone, and the host state each keeps (PYTHONPATH: this checkout's package, not an installed one)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(BENCH / "muon_step.py"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((tmp_path / "muon_step.json").read_text())
    assert row["dry_run"] and row["shape"] == {"hidden": 64, "intermediate": 176, "kv_dim": 32, "layers": 2}
    # per layer: q, o 64 x 64; k, v 32 x 64; gate, up 176 x 64; down 64 x 176; two norms of 64
    assert row["matrix_params"] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64)
    assert row["params"] == row["matrix_params"] + 2 * 2 * 64
    for kind in ("adamw", "muon"):
        assert len(row[kind]["steps_s"]) == 2 and row[kind]["step_s"] > 0
    # fp32 moments: AdamW 8 B/param (+ 4 B step counts per tensor); Muon 4 B on matrices, AdamW's on the norms
    assert 8 < row["adamw"]["state_bytes_per_param"] < 8.1
    assert 4 < row["muon"]["state_bytes_per_param"] < 4.1
    from lightning_megatrain.optim.newton_schulz import ns_flops

    flops = 2 * (2 * ns_flops(64, 64) + 2 * ns_flops(32, 64) + 3 * ns_flops(176, 64))
    assert row["ns_only"]["tflop"] == pytest.approx(flops / 1e12) and row["ns_only"]["dtype"] == "float32"
    assert "| 2 x Llama layer h=64 i=176 kv=32 |" in proc.stdout


def test_compact_adam_dry_run_rows(tmp_path):
    # benchmarks/compact_adam.py on 2 x 2**16 parameters, eager: a row per system with its rate and state bytes; the
    # numbers that count need the H200's 16-core host
    compact_adam = load_benchmark("compact_adam")
    systems = "torch_fused,compact,compact_kahan,int8_moments"
    stdout = _run(str(BENCH / "compact_adam.py"), "--dry-run", "--systems", systems, "--out", str(tmp_path),
                  timeout=240)
    meta = json.loads((tmp_path / "compact_adam.json").read_text())
    rows = meta["results"]
    assert meta["dry_run"] is True and [r["system"] for r in rows] == systems.split(",")
    for r in rows:
        assert set(compact_adam.ROW_KEYS) == r.keys() and r["error"] is None, r
        kernel = "torch fused" if r["system"] == "torch_fused" else "eager"
        assert r["params"] == 2 * 2**16 and r["gparam_per_s"] > 0 and r["kernel"] == kernel
        assert f"| {r['system']} | {r['state_bytes_per_param']:.2f} | {kernel} |" in stdout
        assert r["vs_torch_fused"] == pytest.approx(r["gparam_per_s"] / rows[0]["gparam_per_s"])
    assert [r["state_bytes_per_param"] for r in rows] == [16.0, 6.03125, 8.03125, 10.03125]


def test_soak_summary_measures_growth_and_loss_gap():
    """benchmarks/soak.py's summary: growth after warm-up and the loss gap between the two systems' curves."""
    soak = load_benchmark("soak")
    assert soak.growth([5.0, 10.0, 10.0, 10.1], warmup=1) == pytest.approx(0.01)
    assert soak.growth([1.0], warmup=1) is None

    def run(losses, rss):
        recs = [{"step": i + 1, "time_s": float(i), "host_rss_gib": r, "gpu_alloc_gib": 2.0, "loss": x}
                for i, (x, r) in enumerate(zip(losses, rss))]
        return {"records": recs, "peak_host_gib": max(rss), "peak_gpu_gib": 2.0}

    summary = soak.summarize({"megatrain": run([3.0, 2.0, 1.1], [1.0, 2.0, 2.0]),
                              "plain": run([3.0, 2.0, 1.0], [1.0, 1.0, 1.0])}, warmup=1)
    assert summary["megatrain"]["host_rss_growth"] == 0.0 and summary["megatrain"]["gpu_alloc_growth"] == 0.0
    assert summary["megatrain"]["step_s"] == pytest.approx(1.0)
    assert summary["loss"]["max_abs_diff"] == pytest.approx(0.1)
    assert summary["loss"]["steps_before_floor"] == 3
    assert summary["loss"]["max_rel_diff_before_floor"] == pytest.approx(0.1)


def test_memory_pool_benchmark_dry_run():
    """benchmarks/memory_pool.py --dry-run: a tiny Llama trains on the CPU, the row has the measured and planned
    numbers side by side (the split itself needs CUDA: benchmarks/memory_pool.py on the H200)."""
    out = _run("benchmarks/memory_pool.py", "--dry-run", timeout=300)
    row = json.loads(out[out.index("\n{") + 1:])
    assert row["model"] == "tiny-llama" and row["measured"]["gpu_optimizer_groups"] == 0
    assert row["measured"]["tokens_per_s"] > 0 and row["measured"]["peak_host_rss_gib"] > 0
    assert row["planned"]["fits"] and {"host_gib", "gpu_peak_gib", "tokens_per_s"} <= set(row["planned"])
    # the host sampler ([Note: host reserve]): the machine's free memory and this process's RSS, one line a sample
    samples = row["host_samples"]
    assert 0 < samples["max_rss_gib"] and 0 < samples["min_mem_available_gib"] < float("inf")
    lines = Path(samples["samples"]).read_text().splitlines()
    assert lines[0].split() == ["t_s", "mem_available_gib", "anon_pages_gib", "shmem_gib", "rss_gib",
                                "children_rss_gib", "children"]
    assert len(lines) >= 2 and not (BENCH / "results" / "memory-pool-h200.host-samples.txt").exists()
    # the census after steps 1 and 3: every CPU tensor storage Python reaches, the model's among them
    census = json.loads(Path(samples["samples"]).with_name("memory-pool-h200.census.json").read_text())
    assert list(census) == ["after step 1", "after step 3"]
    assert all(c["storages"] > 0 and c["top"] and "MemAvailable" in c["meminfo"] for c in census.values())


def test_peer_longest_dry_run_climbs_its_ladder():
    """benchmarks/peer_longest.py: plain Lightning with HF checkpointing, one subprocess per length, both lengths of
    the tiny ladder train (the H200 rows are docs/long-context.md's peer table)."""
    out = _run(str(BENCH / "peer_longest.py"), "--dry-run", timeout=300)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["system"], r["model"], r["seq_len"], r["ok"]) for r in rows] == [
        ("plain", "tiny-llama", 64, True), ("plain", "tiny-llama", 128, True)]
    assert all(r["step_s"] > 0 for r in rows)


def test_planner_attention_check_holds_the_long_runs_within_ten_percent(tmp_path):
    """benchmarks/planner_attention_check.py re-plans the committed full-depth long-context runs (the 7B and 3B
    shapes): with the attention kernel's own rates the steps of 131,072 tokens or more are planned within 10% (one
    rate for the whole layer: 8-17% fast), all but the row whose only measured step compiled a graph (flagged, not
    a measure of the planner); and the committed result is what it prints."""
    out = tmp_path / "check.json"
    _run(str(BENCH / "planner_attention_check.py"), "--out", str(out), timeout=120)
    rows = json.loads(out.read_text())["rows"]
    long = [r for r in rows if r["seq_len"] >= 131072 and "compile" not in r["measured_steps"]]
    assert len(long) == 6 and {r["model"] for r in long} == {"llama-2-7b", "llama-3.2-3b"}
    assert any(r["attention_memo"] for r in long) and not all(r["attention_memo"] for r in long)
    assert all(abs(r["error_pct"]) < 10 for r in long), long
    assert min(r["error_one_rate_pct"] for r in long) > 7 and max(r["error_one_rate_pct"] for r in long) > 10
    assert sum("compile" in r["measured_steps"] for r in rows) == 1
    committed = json.loads((BENCH / "results" / "2026-12-04-planner-attention-check.json").read_text())["rows"]
    assert [round(r["planned"]) for r in committed] == [round(r["planned"]) for r in rows]
