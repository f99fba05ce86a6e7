"""Throughput of `Trainer(strategy="megatrain")` against the peers a Lightning user would pick, on one GPU.

The systems and model shapes are described in benchmarks/workloads.py (and at the end of --help).

Workload (shared/BENCHMARKS.md, "Workload and metrics"): random-init models from real configs, synthetic token ids,
no padding, seq 1024, 32K or 64K tokens per optimizer step, reached with gradient accumulation where a micro-batch of
that size does not fit (rows give micro_batch and accumulate; a CUDA OOM is retried once at half the micro-batch).
Weights are drawn like HF's init (normal(0, 0.02) matrices, ones for norms) on the GPU: HF's CPU init of 3.2B
parameters takes ~40 s. Loss: HF `labels=` (parts 32k, 64k) or our CausalLMModule chunked loss (32k-chunked,
64k-chunked). 2 warm-up optimizer steps, 5 measured (median), then 1 profiled step (2 on a GPU) not in the median.
Row keys: system, model, micro_batch, seq_len, tokens_per_step, tokens_per_s, mfu, peak_gpu_gib, peak_host_gib,
host_bytes_per_param, breakdown, error (null on success); plus accumulate, loss, params, mfu_attn, notes, ...; a row
with an error keeps the step_times_s its run printed before it ended (a run killed after its measured steps).
  mfu          6 * all parameters * tokens/s / 989e12 (dense bf16 peak of an H100/H200 SXM); MoE rows add mfu_active.
  mfu_attn     (6 * all parameters + 12 * L * H * T) * tokens/s / 989e12: attention-score FLOPs per token from PaLM
               (Chowdhery et al. 2022) appendix B, H = heads * head_dim, T = seq_len (full, not causal-halved).
  peak_host_gib  peak RSS of the run's subprocess: includes pinned memory and the process baseline
               (host_baseline_gib), so host_bytes_per_param is an upper bound. Since session 13 it is the high-water
               mark (VmHWM) when the last measured step ended, before the profiled step: the profiler's own buffers
               and event lists are not training's; earlier rows, and peak_host_with_profiler_gib, read ru_maxrss after
               the profiled step. host_rss_by_step_gib: [RSS, high-water mark] after each optimizer step.
  host_steady_gib  RSS after the last measured step (VmRSS), past one-off peaks of the first steps.
  host_steady_by_kind_gib  megatrain (since session 11): the same RSS by kind, MegaTrainStrategy.host_memory():
               masters, grads, grad_slabs, offload_cache, optimizer_states, rss, other.
  breakdown    medians per optimizer step, summed over its micro-batches, with torch.cuda.synchronize at each mark:
               forward, backward, grad_finalize (backward end -> on_before_optimizer_step; with sync marks only,
               since session 10: without them the hook is left out and that time counts in clip_and_optimizer),
               clip_and_optimizer, other (data, Lightning); gpu_compute_busy / h2d_busy / d2h_busy / gpu_idle are
               fractions of the profiled step (torch.profiler; union of kernel / memcpy intervals over all streams,
               record_function ranges excluded since 2026-11-29 session 8: earlier megatrain and FSDP rows count them;
               since session 10 the profile starts where the previous step ended, so it spans the whole step);
               kernels sums that step's kernel seconds by kind (matmul, attention, other) and lists the top kernels;
               kernel_gaps (since session 10) sums that step's stretches with no kernel running and names what the
               training thread was doing in each (kernel_gaps()).
  gpu_only_profile  (breakdown key, GPU runs since 2026-12-02) the same busy fractions of the step after the profiled
               one, profiled with CUDA activity only: recording every host op (the profiled step) adds host time, 39 ms
               to the 0.28 s MoE step, which the GPU shows as idle; without host recording the step runs at its
               unprofiled length (compare profiled_step_s with the median) and gpu_idle is the GPU's own.

Seconds per run on the lent H200, estimated (fixed = start-up, build, pinning, first-step extra; steps at 32K / 64K
tokens; from benchmarks/results/2026-11-29-core-*-h200.json and shared/BENCHMARKS.md; 8 optimizer steps a run):
  | system, 3.21B            | fixed s               | step s 32K / 64K | run s 32K / 64K |
  | megatrain                | 55 (+46 CPUAdam JIT)  | 4.1 / 6.7        | 92 / 115 (+46)  |
  | plain                    | 20                    | 2.2 / 4.4        | 40 / 59         |
  | deepspeed_zero3_offload  | 80 (pinned state)     | 4.2 / 6.4        | 118 / 138       |
  | fsdp_cpu_offload         | 35                    | 4.1 / 6.7        | 72 / 95         |
Part 32k: ~368 s with the JIT build, part 64k: ~408 s (454 on a fresh machine): one part per device call (the limit
is 10 min). llama-2-7b needs two calls (e.g. --systems megatrain,plain, then fsdp_cpu_offload; DeepSpeed is refused
by the host-RAM check at once); qwen3-30b-a3b-4l costs about what the 3B does. The parent prints the plan with
estimates first, skips a run whose estimate does not fit in what is left of --budget-s (540 s) and kills one that
overruns it (or 2.5 x its estimate + 60 s), so a call ends in time; the last table gives estimated vs actual seconds
per run to recalibrate _EST.

On the device (Python 3.12, torch 2.11, lightning 2.6.6, transformers 5.17, torchmetrics there; this package is not
installed, the child puts the repo root on sys.path): deepspeed and jsonargparse come from the .whl wheels of
shared/device-wheels/README.md (`../shared/device-wheels/stage.sh` fills ./.whl once; carry ".whl"):
  run(carry=[".whl"], timeout_s=600, command="python3 -m pip install -q --no-index --no-deps --no-compile
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit;
      export TORCH_EXTENSIONS_DIR=$PWD/.ext PYTHONUNBUFFERED=1;
      python3 benchmarks/throughput.py --parts 32k --out $OUT --commit SHA")
(`python benchmarks/throughput.py --wheels [--parts 64k ...]` prints exactly that call with the current commit),
then the same with `--parts 64k`. Each call returns <date>-<model>-<device>.json/.md and one .log (the device returns
at most 8 files). Merge the calls' files into benchmarks/results/ with
  python benchmarks/throughput.py --summarize A/DATE-llama-3.2-3b-h200.json B/DATE-llama-3.2-3b-h200.json
      --out benchmarks/results
Check on a CPU first:  python benchmarks/throughput.py --dry-run [--parts 32k,32k-chunked] [--models tiny-qwen3-moe]
(tiny 2-layer model, hidden 64; 2 optimizer steps of 2 micro-batches through every system's code path; DeepSpeed
runs on its CPU accelerator with Lightning's CUDA-only checks bypassed; torch FSDP cannot run on a CPU: its row says
so).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from statistics import median

import workloads  # benchmarks/workloads.py: this script's folder is on sys.path
from workloads import (
    DEFAULT_SYSTEMS,
    MODELS,
    SYSTEMS,
    attention_flops_per_token,
    count_params,
    layer_class,
    make_module,
    make_strategy,
    split_system,
)

GIB = 1024**3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak of one H100/H200 SXM (NVIDIA data sheet), as in BENCHMARKS.md
PARTS = {"32k": (32768, "hf"), "64k": (65536, "hf"), "32k-chunked": (32768, "chunked"),
         "64k-chunked": (65536, "chunked")}
ROW_KEYS = ("system", "model", "micro_batch", "seq_len", "tokens_per_step", "tokens_per_s", "mfu", "peak_gpu_gib",
            "peak_host_gib", "host_bytes_per_param", "breakdown", "error")
PHASES = ("forward_s", "backward_s", "grad_finalize_s", "clip_and_optimizer_s", "other_s")
BUSY = ("gpu_compute_busy", "h2d_busy", "d2h_busy", "gpu_idle")

# Time model of the plan, seconds on the lent H200 for 3.21B parameters: fixed + steps * (host part, scaling with
# parameters, + GPU part per 32K tokens, scaling with parameters and tokens). Sources: the core_gpu 3B run (16K
# tokens: forward+backward 1.17 s; host step 2.49 s, of which ~1.5 s was the host grad norm since moved to the GPU;
# build 40 s on the CPU, ~5 s drawn on the GPU) and BENCHMARKS.md (full-recompute ceiling 18.6K tokens/s, CPU Adam
# 3.6 Gparam/s, pinning 1.5 GiB/s, ZeRO-3 ~12.9K tokens/s at 64K tokens/step).
_EST = {  # system: (fixed_s, host_s_per_step, gpu_s_per_step_per_32k_tokens)
    "megatrain": (55.0, 1.0, 2.0),
    "megatrain_no_backward_updates": (55.0, 1.0, 2.0),
    "megatrain_overlap": (55.0, 0.4, 2.0),
    "megatrain_overlap_deepspeed": (55.0, 0.4, 2.0),
    "megatrain_recompute_all": (55.0, 1.0, 2.6),
    "megatrain_muon": (55.0, 2.0, 2.4),  # estimated: 40 B/param of host passes, the iteration beside the forward
    "plain_muon": (20.0, 0.4, 2.15),
    "plain": (20.0, 0.05, 2.15),
    "deepspeed_zero3_offload": (80.0, 2.0, 2.2),
    "fsdp_cpu_offload": (35.0, 1.5, 2.6),
}
_JIT_S = 46.0  # first DeepSpeedCPUAdam build on a fresh machine (BENCHMARKS.md); kept in $TORCH_EXTENSIONS_DIR
_REF_PARAMS = 3.21e9
# torch.compile of a decoder layer's graphs in the first step: megatrain's first step took 21-31 s compiled against
# 8-15 s eager (3.21B, 32 x 1024, benchmarks/results/2026-11-29-llama-3.2-3b-h200.json, breakdown.first_step_s)
_COMPILE_S = 20.0
_HOST_B_PER_PARAM = {"deepspeed_zero3_offload": 27.0}  # measured (BENCHMARKS.md): refuse runs that cannot fit
# Dry run: errors that mean "this system cannot run on a CPU at all", with the reason shown in the row.
_CPU_LIMITS = {"FSDP needs a non-CPU accelerator device": "torch FSDP needs an accelerator device"}


def estimate_s(run: dict, params: int, jit: bool) -> float:
    if run["dry_run"]:
        return 15.0
    base, _, compiled = split_system(run["system"])
    fixed, host, gpu = _EST[base]
    fixed += _COMPILE_S if compiled else 0.0
    scale = params / _REF_PARAMS
    steps = run["warmup"] + run["measured"] + 2 * run["profile"] + 1  # +1: the first step's extra cost
    step_s = host * scale + gpu * scale * run["tokens_per_step"] / 32768
    return fixed * max(scale, 0.5) + steps * step_s + (_JIT_S if jit else 0.0)


def union_ns(spans: list[tuple[int, int]]) -> int:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s >= end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def busy_fractions(events: list[tuple[str, int, int]], wall_s: float) -> dict[str, float]:
    """GPU events (name, start_ns, end_ns) of one step -> busy fractions of its wall time, overlaps counted once.

    Kineto names copies "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (...)"; every other non-memcpy/memset event
    on the GPU is a kernel. gpu_idle is the time no GPU activity at all ran (the GPU waited for the host).
    """
    spans: dict[str, list[tuple[int, int]]] = {k: [] for k in ("gpu_compute_busy", "h2d_busy", "d2h_busy")}
    for name, start, end in events:
        if "HtoD" in name:
            spans["h2d_busy"].append((start, end))
        elif "DtoH" in name:
            spans["d2h_busy"].append((start, end))
        elif not name.startswith(("Memcpy", "Memset")):
            spans["gpu_compute_busy"].append((start, end))
    out = {k: union_ns(v) / 1e9 / wall_s for k, v in spans.items()}
    out["gpu_idle"] = 1.0 - union_ns([(s, e) for _, s, e in events]) / 1e9 / wall_s
    return out


def gpu_events(kineto_events) -> list[tuple[str, int, int]]:
    """(name, start_ns, end_ns) of the CUDA kernels, copies and memsets of a profile.

    Kineto also draws every ``record_function`` range that launched GPU work on the GPU timeline (as a
    "gpu_user_annotation" from its first to its last GPU op); those are not GPU work and are left out: by name when
    the same range exists as a CPU user annotation, and the engine's ``megatrain::`` ranges always. (Profiled rows
    before this filter counted them: their gpu_compute_busy included copy time and gaps inside the engine's ranges.)
    """
    from torch.autograd import DeviceType

    annotations = {e.name() for e in kineto_events
                   if e.device_type() == DeviceType.CPU and getattr(e, "is_user_annotation", lambda: False)()}
    return [(e.name(), e.start_ns(), e.end_ns()) for e in kineto_events
            if e.device_type() == DeviceType.CUDA and e.name() not in annotations
            and not e.name().startswith("megatrain::")]


def kernel_seconds(events: list[tuple[str, int, int]], top: int = 12) -> dict:
    """Summed GPU kernel time of one step by kind (matmuls, attention, the rest) and the ``top`` kernels by time.

    Sums, not unions: kernels of different streams may run at once. Kinds by kernel name: cuBLAS/CUTLASS matmuls
    ("gemm", "nvjet", "cutlass", "xmma"), attention ("flash", "fmha", "attention"); copies and memsets are left out.
    """
    kinds = {"matmul_s": ("gemm", "nvjet", "cutlass", "xmma"), "attention_s": ("flash", "fmha", "attention")}
    out = dict.fromkeys([*kinds, "other_kernels_s"], 0.0)
    by_name: dict[str, list[float]] = {}
    for name, start, end in events:
        if name.startswith(("Memcpy", "Memset")):
            continue
        seconds = (end - start) / 1e9
        low = name.lower()
        kind = next((k for k, keys in kinds.items() if any(key in low for key in keys)), "other_kernels_s")
        out[kind] += seconds
        entry = by_name.setdefault(name[:90], [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    out["top"] = [[n, round(t, 4), c] for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    return out


def cpu_spans(kineto_events) -> list[tuple[str, int, int, int]]:
    """(name, start_ns, end_ns, thread) of the host-side events of a profile: ops, ``record_function`` ranges and
    CUDA runtime calls (``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ...)."""
    from torch.autograd import DeviceType

    return [(e.name(), e.start_ns(), e.end_ns(), e.start_thread_id()) for e in kineto_events
            if e.device_type() == DeviceType.CPU]


def kernel_gaps(events: list[tuple[str, int, int]], spans: list[tuple[str, int, int, int]],
                min_ns: int = 100_000, top: int = 12) -> dict:
    """Where the GPU ran no kernel during a profiled step, and what the training thread was doing meanwhile.

    A gap is a stretch of at least ``min_ns`` with no kernel on any stream (copies may run: they are not compute),
    from the first host or GPU event of the profile to the last. Its cause is the chain of host spans of the
    training thread (the thread with the most events) that cover the gap's midpoint, outermost first: annotations
    and the three innermost spans, e.g. ``megatrain::forward_layer_3 > aten::item > aten::_local_scalar_dense >
    cudaStreamSynchronize``.
    Returns the seconds without any kernel (``idle_s``, short gaps between kernels included: launch-bound
    stretches), the summed gap seconds, the seconds per cause, and the ``top`` longest gaps as
    [offset_ms from the profile start, length_ms, cause].
    """
    kernels = sorted((s, e) for n, s, e in events if not n.startswith(("Memcpy", "Memset")))
    if not kernels:
        return {}
    threads: dict[int, int] = {}
    for *_, thread in spans:
        threads[thread] = threads.get(thread, 0) + 1
    main = max(threads, key=threads.get) if threads else None
    mine = [(n, s, e) for n, s, e, t in spans if t == main]
    begin = min([kernels[0][0]] + [s for _, s, _ in mine])
    finish = max([max(e for _, e in kernels)] + [e for _, _, e in mine])
    gaps, end = [], begin
    for s, e in kernels + [(finish, finish)]:
        if s - end >= min_ns:
            gaps.append((end, s))
        end = max(end, e)

    def cause(mid: int) -> str:
        covering = sorted(((s, -e, n) for n, s, e in mine if s <= mid < e))
        if not covering:
            return "(no host span)"
        names = [n for _, _, n in covering]
        chain = [n for n in names[:-3] if n.startswith(("[pl]", "megatrain::", "## "))] + names[-3:]
        return " > ".join(n[:60] for n in chain)

    by_cause: dict[str, float] = {}
    listed = []
    for s, e in gaps:
        c = cause((s + e) // 2)
        by_cause[c] = by_cause.get(c, 0.0) + (e - s) / 1e9
        listed.append([round((s - begin) / 1e6, 1), round((e - s) / 1e6, 2), c])
    return {
        "idle_s": round((finish - begin - union_ns(kernels)) / 1e9, 5),  # all of it, gaps under min_ns too
        "gap_s": round(sum(e - s for s, e in gaps) / 1e9, 4),
        "by_cause": [[c, round(t, 4)] for c, t in sorted(by_cause.items(), key=lambda kv: -kv[1])[:top]],
        "longest": sorted(listed, key=lambda g: -g[1])[:top],
    }


# ----------------------------------------------------------------------------------------------------------------
# Child: one (system, model, tokens, loss) run in a fresh process.


def make_recorder(profile_step: int | None, sync: bool):
    import lightning as L
    import torch

    from lightning_megatrain.callbacks import host_rss_gib

    class StepRecorder(L.Callback):
        """Phase times per optimizer step (summed over its micro-batches) and the GPU busy fractions of one step."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.busy: dict = {}
            self.first_batch_t = None  # perf_counter at the first micro-batch's start
            self._step: dict | None = None  # the optimizer step in progress
            self._prof = None
            self._prof_kernels_only = False
            self._resume = 0.0  # perf_counter when the last profile's analysis ended
            self.late_steps = 0  # megatrain optimizer steps whose host grads landed late

        def _now(self) -> float:
            # Benchmark instrumentation only: a sync at each mark stops work from overlapping across marks.
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            t = self._now()
            if self._step is None:
                if not self.steps:
                    self.first_batch_t = t
                if profile_step == 0:
                    self._start_profile()
                    t = self._now()
                # a step starts where the previous one ended: data loading and Lightning between them count (not
                # the analysis of a profile that ended there: ``_resume``)
                start = max(self.steps[-1]["end"], self._resume) if self.steps else t
                self._step = {"start": start, "global_step": trainer.global_step, "losses": [],
                              **dict.fromkeys(PHASES[:-1], 0.0)}
            self._mark = t

        def _start_profile(self, kernels_only: bool = False) -> None:
            # kernels_only: CUDA activity alone, no host-op recording, whose cost stretches a short step (see
            # gpu_only_profile in the module docstring)
            activities = [] if kernels_only else [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof_kernels_only = kernels_only
            self._prof.__enter__()

        def _phase(self, name: str) -> None:
            t = self._now()
            self._step[name] += t - self._mark
            self._mark = t

        def on_before_backward(self, trainer, pl_module, loss):
            self._phase("forward_s")

        def on_after_backward(self, trainer, pl_module):
            self._phase("backward_s")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._phase("grad_finalize_s")  # megatrain: waits for the grad drains; FSDP / DeepSpeed: hook tails

        def on_train_start(self, trainer, pl_module):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:  # megatrain: count the steps whose grads landed late (engine/optimizer_step.py)
                step = engine.step
                landed = step._landed_update

                def counted(*args, **kwargs):
                    self.late_steps += 1
                    return landed(*args, **kwargs)

                step._landed_update = counted

        def on_train_end(self, trainer, pl_module):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:  # megatrain: the options it ran with, "auto" ones as decided
                import dataclasses

                self.engine_config = dataclasses.asdict(engine.config)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # Lightning reports loss / accumulate_grad_batches; undo that to log the micro-batch's mean token loss.
            # Reading it waits for the compute stream: without sync marks too, a step ends where the GPU is done.
            self._step["losses"].append(float(outputs["loss"]) * trainer.accumulate_grad_batches)
            # clipping + optimizer step (DeepSpeed: engine.step() every micro-batch, a real step at the boundary)
            self._phase("clip_and_optimizer_s")
            if trainer.global_step == self._step["global_step"]:
                return  # accumulating: the optimizer step is not done yet
            step, self._step = self._step, None
            step["end"] = self._mark
            step["step_s"] = step["end"] - step["start"]
            step["other_s"] = step["step_s"] - sum(step[k] for k in PHASES[:-1])
            step["rss_gib"] = host_rss_gib()  # pinned memory included
            step["rss_peak_gib"] = host_rss_gib("VmHWM")  # read before a profile starts: its buffers are not training's
            if hasattr(trainer.strategy, "host_memory"):  # megatrain: the same RSS by kind (sizes only, no sync)
                step["host_gib"] = {k: v / GIB for k, v in trainer.strategy.host_memory().items()}
            streamed = getattr(getattr(trainer.strategy, "engine", None), "streamed", None)
            if streamed is not None:  # megatrain: layers whose graph this step's last micro-batch kept
                step["kept_layers"] = len(streamed.kept)
                policy = streamed.policy  # what the auto policy calibrated (engine/recompute.py)
                if policy.graph_bytes_per_input_byte is not None:
                    step["policy_gib"] = {"layer_graph": policy.graph_bytes_per_input_byte * policy.input_bytes / GIB,
                                          "recompute_all_peak": policy.peak_bytes / GIB,
                                          "budget": policy.budget / GIB}
            self.steps.append(step)
            print(f"STEP {len(self.steps)} {step['step_s']:.4f} s", flush=True)  # survives a kill (step_times())
            if self._prof is not None:
                prof, self._prof = self._prof, None
                prof.__exit__(None, None, None)
                try:  # the profile is a bonus: the timing rows stand without it
                    kineto = prof.profiler.kineto_results.events()
                    events = gpu_events(kineto)
                    if self._prof_kernels_only:
                        self.busy["gpu_only_profile"] = {**busy_fractions(events, step["step_s"]),
                                                         "profiled_step_s": step["step_s"]}
                    else:
                        self.busy = {**busy_fractions(events, step["step_s"]), "profiled_step_s": step["step_s"],
                                     "kernels": kernel_seconds(events), "annotations_excluded": True,
                                     "kernel_gaps": kernel_gaps(events, cpu_spans(kineto))}
                except Exception as e:  # noqa: BLE001
                    self.busy = {"profile_error": f"{type(e).__name__}: {e}"}
            if profile_step is not None and len(self.steps) == profile_step:
                self._start_profile()  # from where the profiled step starts: the time between steps is in it
            elif profile_step is not None and len(self.steps) == profile_step + 1 and torch.cuda.is_available():
                self._start_profile(kernels_only=True)  # the step after the full profile
                self._resume = time.perf_counter()

    if not sync:
        # No mark between backward and the optimizer step: a module or callback with this hook may read p.grad, so
        # megatrain would wait for the grads to land before the step (engine/optimizer_step.py, [Note: late grads]).
        StepRecorder.on_before_optimizer_step = L.Callback.on_before_optimizer_step
        # It reads losses and clocks only: megatrain need not finish the step before its hooks (hooks.py, [Note:
        # user hooks]). With sync marks it counts as a reader, so grads land before the grad_finalize mark.
        StepRecorder.megatrain_reads_state = False
    return StepRecorder()


def train(spec: dict) -> dict:
    """Run one spec in this process; return its row."""
    sys.path.insert(0, REPO)  # the device's copy of the tree has the package uninstalled
    import lightning as L
    import torch

    import lightning_megatrain  # noqa: F401  (registers "megatrain")

    t_child = time.perf_counter()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes after imports (KiB on Linux)
    on_cuda = spec["device"] == "cuda"
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    L.seed_everything(0, verbose=False)
    model_spec = MODELS[spec["model"]]
    config = model_spec["config"]
    params, active = count_params(config)
    strategy, clip, optimizer, act_ckpt, notes = make_strategy(spec["system"], layer_class(config), on_cuda)
    notes += [model_spec["note"]] if "note" in model_spec else []
    if spec["loss"] == "chunked" and spec["system"] == "deepspeed_zero3_offload":
        notes.append("chunked loss: lm_head.weight registered with deepspeed.zero.register_external_parameter")
    base, _, compiled = split_system(spec["system"])
    module = make_module(config, spec["loss"], optimizer, direct_clip=base.startswith("plain"),
                         grad_ckpt=base in ("plain", "plain_muon", "deepspeed_zero3_offload"),
                         compile_layers=compiled and not base.startswith("megatrain"))
    mb, acc, seq = spec["micro_batch"], spec["accumulate"], spec["seq_len"]
    # real runs profile one extra step after the measured ones; dry runs profile their last step
    # (a GPU run also profiles the step after that one, kernels only: gpu_only_profile)
    extra = 1 + on_cuda if spec["profile"] and not spec["dry_run"] else 0
    total_steps = spec["warmup"] + spec["measured"] + extra
    profile_step = total_steps - max(extra, 1) if spec["profile"] else None
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, config["vocab_size"], (mb * acc * total_steps, seq), generator=g)  # [N, T], no padding
    recorder = make_recorder(profile_step, spec["sync"])
    trainer = L.Trainer(
        strategy=strategy, accelerator="cuda" if on_cuda else "cpu", devices=1, precision="bf16-mixed",
        max_steps=total_steps, accumulate_grad_batches=acc, gradient_clip_val=clip, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    t_fit = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=mb))
    fit_s = time.perf_counter() - t_fit
    steps = recorder.steps
    if len(steps) != total_steps:
        raise RuntimeError(f"recorded {len(steps)} optimizer steps, expected {total_steps}")
    measured = steps[spec["warmup"] : spec["warmup"] + spec["measured"]]
    tokens = mb * acc * seq
    tokens_per_s = tokens / median(s["step_s"] for s in measured)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the profiled step's buffers included
    # training's own peak: the high-water mark when the last measured step ended, before the profile started
    peak_host = measured[-1]["rss_peak_gib"] * GIB if measured[-1]["rss_peak_gib"] is not None else peak_rss
    breakdown = {k: median(s[k] for s in measured) for k in PHASES}
    # setup_s: fit() start -> first micro-batch (model build, strategy setup, pinning, optimizer creation)
    breakdown.update(recorder.busy, setup_s=recorder.first_batch_t - t_fit, first_step_s=steps[0]["step_s"],
                     build_s=getattr(module, "build_s", None), sync_marks=spec["sync"],
                     kept_layers=measured[-1].get("kept_layers"), policy_gib=measured[-1].get("policy_gib"),
                     late_grad_steps=recorder.late_steps)
    row = {
        "system": spec["system"], "model": spec["model"], "micro_batch": mb, "seq_len": seq,
        "tokens_per_step": tokens, "tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / PEAK_FLOPS,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
        "peak_host_gib": peak_host / GIB, "host_bytes_per_param": peak_host / params, "breakdown": breakdown,
        "error": None,
        "accumulate": acc, "loss": spec["loss"], "params": params,
        "mfu_attn": (6 * params + attention_flops_per_token(config, seq)) * tokens_per_s / PEAK_FLOPS,
        "model_tflops": 6 * params * tokens_per_s / 1e12,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_cuda else None,
        "peak_host_with_profiler_gib": peak_rss / GIB,
        "host_rss_by_step_gib": [[s["rss_gib"], s["rss_peak_gib"]] for s in steps],
        "host_steady_gib": measured[-1]["rss_gib"],
        "host_steady_bytes_per_param": measured[-1]["rss_gib"] * GIB / params,
        "host_steady_by_kind_gib": measured[-1].get("host_gib"),
        "host_baseline_gib": baseline / GIB, "host_bytes_per_param_above_baseline": (peak_host - baseline) / params,
        "clip": clip, "optimizer": optimizer, "optimizer_class": type(trainer.optimizers[0]).__name__,
        "activation_checkpointing": act_ckpt, "precision": "bf16-mixed", "warmup_steps": spec["warmup"],
        "measured_steps": len(measured), "step_times_s": [s["step_s"] for s in steps],
        "losses": [s["losses"] for s in steps], "fit_s": fit_s, "child_s": time.perf_counter() - t_child,
        "notes": notes, "device_name": torch.cuda.get_device_name() if on_cuda else "cpu",
        "engine_config": getattr(recorder, "engine_config", None),
    }
    if active != params:
        row.update(params_active=active, mfu_active=6 * active * tokens_per_s / PEAK_FLOPS)
    return row


# ----------------------------------------------------------------------------------------------------------------
# Parent: plan, run each spec in a subprocess within the time budget, write JSON + markdown.


def plan(args) -> list[dict]:
    runs = []
    for model in args.models.split(","):
        spec = MODELS[model]
        for part in args.parts.split(","):
            tokens, loss = PARTS[part]
            if args.dry_run:
                tokens = 4 * args.seq_len  # 2 micro-batches of 2 sequences: exercises accumulation
            for system in args.systems.split(","):
                if split_system(system)[0] not in SYSTEMS:
                    raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS} (megatrain ones take _gpuN, "
                                     "megatrain and plain _compiled)")
                cap = spec["micro_batch_cap"][loss]
                if split_system(system)[0] in ("plain", "plain_muon"):
                    cap = min(cap, spec.get("plain_cap", cap))
                mb = min(args.micro_batch or cap, tokens // args.seq_len)
                if tokens % (mb * args.seq_len):
                    raise SystemExit(f"tokens/step {tokens} is not a multiple of micro_batch {mb} x seq {args.seq_len}")
                runs.append(dict(system=system, model=model, part=part, loss=loss, seq_len=args.seq_len,
                                 micro_batch=mb, accumulate=tokens // (mb * args.seq_len), tokens_per_step=tokens,
                                 warmup=0 if args.dry_run else 2, measured=2 if args.dry_run else 5,
                                 profile=args.profile, sync=args.sync, dry_run=args.dry_run,
                                 device="cpu" if args.dry_run else "cuda"))
    return runs


def run_child(run: dict, timeout_s: float, log_path: str) -> dict:
    """Run one spec in a subprocess (its own session, so a timeout kills it and anything it started); append the
    tail of its output to log_path (one log per call: the device returns at most 8 files)."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    error = None
    try:
        out, _ = proc.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        error = f"timeout: killed after {timeout_s:.0f} s (2.5 x its estimate + 60 s, or the end of --budget-s)"
    with open(log_path, "a") as f:
        f.write(f"\n===== {json.dumps(run)}\n{out[-65536:]}")
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is not None:
        return json.loads(line[len("RESULT "):])
    if error is None:
        error = f"exit code {proc.returncode}" + (" (SIGKILL: host OOM?)" if proc.returncode == -9 else "")
    return error_row(run, f"{error}\n{out[-3000:]}", step_times(out))


def step_times(out: str) -> list[float]:
    """The optimizer steps' seconds a child printed before it ended (``STEP i s`` lines): a run killed after its
    measured steps still shows them."""
    return [float(line.split()[2]) for line in out.splitlines() if line.startswith("STEP ")]


def error_row(run: dict, error: str, steps: list[float] | None = None) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update({k: run[k] for k in ("system", "model", "micro_batch", "seq_len", "tokens_per_step", "accumulate",
                                    "loss")}, breakdown={}, error=error, step_times_s=steps or [])
    return row


def run_all(args) -> None:
    import torch

    t_start = time.perf_counter()
    out_dir = args.out or (tempfile.mkdtemp(prefix="throughput-dry-run-") if args.dry_run else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    os.makedirs(out_dir, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: use --dry-run to check the code paths on a CPU")
    device = "cpu" if args.dry_run else _gpu_name()  # not torch.cuda: no CUDA context held by the parent
    date = time.strftime("%Y-%m-%d")
    log = os.path.join(out_dir, f"{date}-throughput-{device_slug(device)}-{args.parts.replace(',', '_')}.log")
    runs = plan(args)
    params = {m: count_params(MODELS[m]["config"])[0] for m in {r["model"] for r in runs}}
    jit_pending = not args.dry_run and not _cpu_adam_cached()
    queue = []
    for r in runs:
        # DeepSpeedCPUAdam's build: megatrain_overlap maps AdamW to torch's fused one (strategy.py), no build
        uses_cpu_adam = split_system(r["system"])[0] in ("megatrain", "megatrain_recompute_all",
                                                         "megatrain_overlap_deepspeed", "deepspeed_zero3_offload")
        queue.append((r, estimate_s(r, params[r["model"]], jit_pending and uses_cpu_adam)))
        jit_pending = jit_pending and not uses_cpu_adam
    print(f"device: {device}; out: {out_dir}; --budget-s {args.budget_s:.0f}; plan, estimated seconds:", flush=True)
    for r, est in queue:
        print(f"  {r['system']:<24} {r['model']:<18} {r['part']:<12} micro {r['micro_batch']} x {r['accumulate']}"
              f"  ~{est:.0f} s", flush=True)
    print(f"  total ~{sum(est for _, est in queue):.0f} s", flush=True)
    results: dict[str, list[dict]] = {}
    timing = []
    while queue:
        run, est = queue.pop(0)
        left = args.budget_s - (time.perf_counter() - t_start)
        t0 = time.perf_counter()
        host_need = _HOST_B_PER_PARAM.get(run["system"], 0.0) * params[run["model"]]
        if not args.dry_run and host_need > _host_ram_bytes():
            row = error_row(run, f"not run: needs ~{host_need / GIB:.0f} GiB host RAM at the measured "
                                 f"{_HOST_B_PER_PARAM[run['system']]:.0f} B/param; the machine has "
                                 f"{_host_ram_bytes() / GIB:.0f} GiB")
        elif left < 0.75 * est:
            row = error_row(run, f"not run: estimated {est:.0f} s, {left:.0f} s left of --budget-s "
                                 f"{args.budget_s:.0f}; run it in another call (--systems, --parts)")
        else:
            # a hung run (e.g. a stuck process-group init) must not eat the next runs' time as well
            row = run_child(run, min(left - 10.0, 2.5 * est + 60.0), log)
            error = row["error"] or ""
            oom = "OutOfMemoryError" in error or "CUDA out of memory" in error
            if oom and args.oom_retry and run["micro_batch"] > 1 and not run.get("oom_retry"):  # once per run
                queue.insert(0, (dict(run, micro_batch=run["micro_batch"] // 2, accumulate=run["accumulate"] * 2,
                                      oom_retry=True), est))
            for needle, reason in _CPU_LIMITS.items():
                if args.dry_run and needle in error:
                    row["error"] = f"cannot run on a CPU ({reason}); its code ran up to that point.\n{error}"
        row["part"] = run["part"]
        results.setdefault(run["model"], []).append(row)
        timing.append((run, est, time.perf_counter() - t0))
        print(summarize([row], header=len(timing) == 1), flush=True)
        write_results(out_dir, date, device, run["model"], results[run["model"]], args)
    print("\n" + summarize([r for rows in results.values() for r in rows]))
    print("\n| run | estimated s | actual s |\n|---|---|---|")
    for run, est, wall in timing:
        print(f"| {run['system']} {run['model']} {run['part']} micro {run['micro_batch']} | {est:.0f} | {wall:.0f} |")
    print(f"total {time.perf_counter() - t_start:.0f} s; files in {out_dir}")


def _cpu_adam_cached() -> bool:
    root = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))
    return any("cpu_adam.so" in files for _, _, files in os.walk(root))


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "cuda"


def _host_ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(next(x for x in f if x.startswith("MemTotal")).split()[1]) * 1024


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_command(args) -> str:
    """The device tool's run() call for these arguments: install the carried .whl wheels, then this script."""
    wheels = os.path.join(REPO, ".whl")
    if not any(f.startswith("deepspeed-") for f in (os.listdir(wheels) if os.path.isdir(wheels) else ())):
        print("# .whl lacks the deepspeed wheel: run ../shared/device-wheels/stage.sh in the repo root first")
    dirty = subprocess.run(["git", "status", "--porcelain", "benchmarks/throughput.py", "lightning_megatrain"],
                           capture_output=True, text=True, cwd=REPO, check=False).stdout.strip()
    if dirty:
        print(f"# uncommitted changes ({' '.join(dirty.split()[1::2])}): commit first so --commit names what ran")
    options = f"--parts {args.parts}"
    options += f" --models {args.models}" if args.models else ""
    options += f" --systems {args.systems}" if args.systems != ",".join(DEFAULT_SYSTEMS) else ""
    command = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
               "/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit; "
               "export TORCH_EXTENSIONS_DIR=$PWD/.ext PYTHONUNBUFFERED=1; "
               f"python3 benchmarks/throughput.py {options} --out $OUT --commit {args.commit or _git_commit()}")
    return json.dumps({"kind": "nvidia-h200", "carry": [".whl"], "timeout_s": 600, "command": command}, indent=1)


def device_slug(device: str) -> str:
    return device.lower().replace("nvidia ", "").replace(" ", "-")


def write_results(out_dir: str, date: str, device: str, model: str, rows: list[dict], args) -> str:
    """Write <date>-<model>-<device>.json and .md into out_dir; return the JSON path."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    meta = {"date": date, "device": device, "git_commit": args.commit or _git_commit(), "torch": version("torch"),
            "lightning": version("lightning"), "transformers": version("transformers"),
            "deepspeed": version("deepspeed"),
            "host_cpus": os.cpu_count(), "host_ram_gib": _host_ram_bytes() / GIB, "dry_run": args.dry_run,
            "argv": sys.argv[1:], "results": rows}
    return _dump(os.path.join(out_dir, f"{date}-{model}-{device_slug(device)}"), meta)


def _dump(base: str, meta: dict) -> str:
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"Throughput on {meta['device']}, {meta['date']}, commit {meta['git_commit']}, torch {meta['torch']}, "
                f"lightning {meta['lightning']}, transformers {meta['transformers']}, deepspeed {meta['deepspeed']}; "
                "by `benchmarks/throughput.py` (MFU and breakdown definitions in its docstring).\n\n"
                + summarize(meta["results"]) + "\n")
    return base + ".json"


def short_error(error: str) -> str:
    """The parent's own reason (not run / timeout / exit code / cannot run on a CPU) and the exception line."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    own = lines[0] if lines[0].startswith(("not run", "timeout", "exit code", "cannot run")) else ""
    text = own if len(lines) == 1 else f"{own} ... {lines[-1]}" if own else lines[-1]
    return text[-300:].replace("|", "/")


def summarize(rows: list[dict], header: bool = True) -> str:
    head = ("| system | model | loss | micro x acc | tokens/step | tokens/s | vs megatrain | MFU | MFU+attn | "
            "peak GPU GiB | peak host GiB | host B/param | step breakdown (median s) / error |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"] if header else []
    ours = {(r["model"], r["tokens_per_step"], r.get("loss")): r["tokens_per_s"] for r in rows
            if r["system"] == "megatrain" and not r.get("error")}
    for r in rows:
        commit = f" @{r['git_commit'][:7]}" if "git_commit" in r else ""
        commit += " (no sync marks)" if r.get("breakdown", {}).get("sync_marks") is False else ""
        base = (f"| {r['system']}{commit} | {r['model']} | {r.get('loss', '')} | "
                f"{r['micro_batch']} x {r.get('accumulate', 1)} | {r['tokens_per_step']} |")
        if r.get("error"):
            lines.append(base + " | | | | | | | | " + short_error(r["error"]) + " |")
            continue
        ref = ours.get((r["model"], r["tokens_per_step"], r.get("loss")))
        b = r["breakdown"]
        # busy fractions profiled before gpu_events() counted record_function ranges: not shown (kept in the JSON)
        busy = [f"{k}={b[k]:.0%}" for k in BUSY if k in b and b.get("annotations_excluded")]
        if "gpu_idle" in b.get("gpu_only_profile", {}):
            busy.append(f"gpu_idle(kernels-only profile)={b['gpu_only_profile']['gpu_idle']:.0%}")
        text = " ".join([f"{k[:-2]}={b[k]:.2f}" for k in PHASES if k in b] + busy)
        gpu = "" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.1f}"
        vs = "" if ref is None else f"{r['tokens_per_s'] / ref:.2f}"
        lines.append(base + f" {r['tokens_per_s']:,.0f} | {vs} | "
                     f"{r['mfu']:.1%} | {r['mfu_attn']:.1%} | {gpu} | {r['peak_host_gib']:.1f} | "
                     f"{r['host_bytes_per_param']:.1f} | {text} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=f"{__doc__}\n{workloads.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results folder (default benchmarks/results; a new temp folder with --dry-run)")
    parser.add_argument("--parts", default="32k", help=f"comma list of {list(PARTS)} (default 32k: one device call)")
    parser.add_argument("--models", help=f"comma list of {list(MODELS)} (default llama-3.2-3b; tiny-llama if dry)")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma list of {list(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--seq-len", type=int, help="default 1024 (64 with --dry-run)")
    parser.add_argument("--micro-batch", type=int, help="override the per-model micro-batch choice")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of this call (default 9 min)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled extra step")
    parser.add_argument("--no-sync", dest="sync", action="store_false",
                        help="no torch.cuda.synchronize at phase marks (the breakdown becomes host-side times)")
    parser.add_argument("--no-oom-retry", dest="oom_retry", action="store_false")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, 2 steps: check every code path")
    parser.add_argument("--commit", help="git commit to record (the device's copy of the tree may have no .git)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="print one table for result files; with --out also write them merged per model there")
    parser.add_argument("--wheels", action="store_true",
                        help="print the device run() call (wheels from .whl, then this script with --parts etc.)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        try:
            row = train(spec)
        except Exception:  # noqa: BLE001  (any failure is a result row)
            import traceback

            traceback.print_exc()
            row = error_row(spec, traceback.format_exc()[-2500:])
        print("RESULT " + json.dumps(row), flush=True)
        return
    if args.wheels:
        print(device_command(args))
        return
    if args.summarize:
        files = []
        for path in args.summarize:
            with open(path) as f:
                files.append(json.load(f))
        rows = [dict(r, git_commit=r.get("git_commit", f["git_commit"])) for f in files for r in f["results"]]
        commits = sorted({f["git_commit"] for f in files})
        print(f"device: {files[0]['device']}, torch {files[0]['torch']}, commits {', '.join(commits)}\n")
        print(summarize(rows))
        for model in dict.fromkeys(r["model"] for r in rows) if args.out else ():
            merged = dict(files[0], results=[r for r in rows if r["model"] == model],
                          merged_from=[os.path.basename(p) for p in args.summarize],
                          git_commit=commits[0] if len(commits) == 1 else "per row (git_commit)")
            name = f"{files[0]['date']}-{model}-{device_slug(files[0]['device'])}"
            print(_dump(os.path.join(args.out, name), merged))
        return
    args.models = args.models or ("tiny-llama" if args.dry_run else "llama-3.2-3b")
    args.seq_len = args.seq_len or (64 if args.dry_run else 1024)
    run_all(args)


if __name__ == "__main__":
    main()
