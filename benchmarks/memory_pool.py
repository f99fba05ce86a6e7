"""Both memories as one pool, measured against the planner (planner/pool.py, [Note: memory pool]).

Trains the Llama-2-13B shape (13.02B parameters, fp32 masters, grads and AdamW moments: 194 GiB of state, more than
the H200's 128 GiB host) with ``MegaTrainStrategy()`` and no options, so ``gpu_optimizer_groups="auto"`` must keep
the state of the first groups on the GPU, and writes one JSON row: the groups chosen, tokens/s, peak host RSS and
peak GPU memory, each beside the planner's prediction for the same run. ``--layers`` truncates the depth (the row
says so); ``--host-gib`` makes the process see a host of that much RAM (``MemTotal``, and free memory that less its
RSS), so a truncated model needs the split too. A thread samples the machine's ``MemAvailable`` and the RSS of this
process and its children (torch.compile's workers) into ``<out>.host-samples.txt`` ([Note: host reserve]). Where the
host runs out, a census of what Python holds is written before the kernel's OOM killer can end the run silently:
when ``MemAvailable`` falls below ``--watch-gib``, ``<out>.census.json`` gets every CPU tensor storage reachable from
Python (deduplicated, by dtype and shape, pinned or not), ``/proc/meminfo`` and the descendants' commands and RSS,
and the process exits with status 86; a census after the first and third steps goes there too.

    python benchmarks/memory_pool.py                      # H200: full depth, 8 x 1024 tokens, about 4-5 minutes
    python benchmarks/memory_pool.py --layers 20 --host-gib 60
    python benchmarks/memory_pool.py --dry-run            # CPU: tiny Llama, the code path (no split without CUDA)
    python benchmarks/memory_pool.py --layers 63 --host-state compact   # H200: 20.3B, compact state in both memories
    python benchmarks/memory_pool.py --layers 90 --host-state compact   # H200: 28.9B, likewise
    python benchmarks/memory_pool.py --model llama-3.1-70b --layers 4 --seq-len 4096 --keep-layers 0
    python benchmarks/memory_pool.py --model gpt-oss-120b --layers 2 --seq-len 4096 --host-state compact --keep-layers 0

``--model`` takes the shapes of benchmarks/scale_plan.py too (Llama-3.1-70B, gpt-oss-120b with eager attention, its
``layer_types`` pattern cut to the depth), for the truncated-depth runs that docs/scale.md plans full depth from; two
depths give the time and memory of one layer. ``--keep-layers 0`` recomputes every layer, as the planner plans and as
all but a few of a full-depth model's layers run. The row also has each host optimizer step's wall seconds on its
worker thread and the seconds the training thread waited for it (benchmark instrumentation: the engine's
``OverlappedStep`` wrapped), so the host rate beside the run is measured rather than inferred from the step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402
from scale_plan import GPT_OSS_120B, LLAMA_31_70B  # noqa: E402

GIB = 2**30

LLAMA2_13B = dict(workloads._LLAMA, vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=40, tie_word_embeddings=False,
                  max_position_embeddings=4096, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


SHAPES = {"llama-2-13b": LLAMA2_13B, "llama-3.1-70b": LLAMA_31_70B,
          "gpt-oss-120b": json.loads(GPT_OSS_120B.read_text())}


class HostStepClock:
    """Benchmark instrumentation: wall seconds of each host optimizer step on its worker thread and of the training
    thread's waits for it, by wrapping the engine's ``OverlappedStep`` (engine/overlap.py) for this process.

    A step's seconds are ``_run``'s: building the update (which waits for the last grads' D2H copies and the
    clipping factor) and then every group's update, so they exceed the optimizer's own time by that wait (it cancels
    in the difference of two depths). Layers updated during backward (``update_during_backward``) run on another
    worker and are not in them. A step's waits are the training thread's blocked seconds from its launch to the
    next launch, which include the next launch's own wait for it."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.waited: list[float] = []  # per step: the training thread's blocked seconds until the next launch

    def install(self) -> None:
        from lightning_megatrain.engine import overlap

        cls, clock = overlap.OverlappedStep, self
        run, wait, wait_all, launch = cls._run, cls.wait, cls.wait_all, cls.launch

        def timed_run(step, make_update):
            t = time.perf_counter()
            try:
                run(step, make_update)
            finally:
                clock.steps.append(time.perf_counter() - t)

        def timed(fn):
            def waiting(step, *args):
                t = time.perf_counter()
                try:
                    return fn(step, *args)
                finally:
                    if clock.waited:
                        clock.waited[-1] += time.perf_counter() - t
            return waiting

        def counted_launch(step, make_update):
            launch(step, make_update)
            clock.waited.append(0.0)  # this step's waits start: the next forward's reads of the masters

        cls._run, cls.wait, cls.wait_all, cls.launch = timed_run, timed(wait), timed(wait_all), counted_launch


def force_host_limit(limit_gib: float) -> None:
    """Make this process see a host of ``limit_gib`` GiB: ``MemTotal`` is the limit and what it may still allocate is
    the limit less its RSS (or less, where the machine has less), so the engine's reserve and split are a host's of
    that size, as ``megatrain plan --host-ram`` plans it."""
    from lightning_megatrain import _hardware

    real_available, real_meminfo = _hardware.available_host_bytes, _hardware.meminfo_bytes

    def available():
        real = real_available()
        forced = int(limit_gib * GIB - (_hardware.host_rss_gib() or 0.0) * GIB)
        return (forced, f"forced: a {limit_gib:g} GiB host") if real is None or forced < real[0] else real

    _hardware.available_host_bytes = available
    _hardware.meminfo_bytes = lambda field: int(limit_gib * GIB) if field == "MemTotal" else real_meminfo(field)


class HostSampler(threading.Thread):
    """Every half second: the machine's ``MemAvailable``, ``AnonPages`` and ``Shmem``, this process's RSS and its
    children's (torch.compile's workers) into ``path``, one line each, flushed (a run the OOM killer ends keeps its
    last samples); the extremes in :meth:`summary`. Below ``watch_gib`` of ``MemAvailable`` it writes a census
    (:func:`census`) to ``census_path`` and ends the process with status 86, before the OOM killer would."""

    def __init__(self, path: Path, census_path: Path, watch_gib: float) -> None:
        super().__init__(daemon=True)
        self.path, self.min_available, self.max_children, self.max_rss = path, float("inf"), 0.0, 0.0
        self.census_path, self.watch_gib, self.censuses = census_path, watch_gib, {}
        self.t0 = time.perf_counter()

    def record(self, label: str) -> None:
        """Add a census under ``label`` to the census file (rewritten whole, so a later exit keeps it)."""
        self.censuses[label] = census(time.perf_counter() - self.t0)
        self.census_path.write_text(json.dumps(self.censuses, indent=1) + "\n")

    def run(self) -> None:
        from lightning_megatrain._hardware import meminfo_bytes

        with self.path.open("w") as f:
            f.write("t_s mem_available_gib anon_pages_gib shmem_gib rss_gib children_rss_gib children\n")
            while True:
                kids = _descendants(os.getpid())
                children = sum(_rss(pid) for pid in kids) / GIB
                available, rss = (meminfo_bytes("MemAvailable") or 0) / GIB, _rss(os.getpid()) / GIB
                anon, shmem = ((meminfo_bytes(k) or 0) / GIB for k in ("AnonPages", "Shmem"))
                self.min_available = min(self.min_available, available)
                self.max_children, self.max_rss = max(self.max_children, children), max(self.max_rss, rss)
                f.write(f"{time.perf_counter() - self.t0:.1f} {available:.2f} {anon:.2f} {shmem:.2f} {rss:.2f} "
                        f"{children:.2f} {len(kids)}\n")
                f.flush()
                if available < self.watch_gib:
                    self.record(f"watchdog: MemAvailable {available:.2f} GiB")
                    f.write("watchdog: exit 86\n")
                    f.flush()
                    os._exit(86)
                time.sleep(0.5)

    def summary(self) -> dict:
        return {"min_mem_available_gib": self.min_available, "max_children_rss_gib": self.max_children,
                "max_rss_gib": self.max_rss, "samples": str(self.path)}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (procfs: each process's parent is the 4th field of its ``stat``)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # exited meanwhile
                continue
    out, frontier = [], [pid]
    while frontier:
        frontier = [child for child, p in parent.items() if p in frontier]
        out += frontier
    return out


def census(t_s: float, top: int = 15) -> dict:
    """What holds host memory: every CPU tensor storage reachable from Python (``gc``), each counted once, grouped by
    dtype, the first shape seen with it and whether it is pinned; ``/proc/meminfo``; this process's ``status`` memory
    lines; the descendants' commands and RSS. Storages held only by C++ (autograd's saved tensors, allocator caches)
    are not reachable and show as RSS beyond ``tensors_gib``."""
    import gc

    storages: dict[int, tuple[int, str]] = {}
    with warnings.catch_warnings():  # torch.is_tensor on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in tensors:
        try:
            if obj.device.type != "cpu" or obj.is_sparse:
                continue
            st = obj.untyped_storage()
            if st.data_ptr() not in storages:
                storages[st.data_ptr()] = (st.nbytes(), f"{obj.dtype} {list(obj.shape)} pinned={obj.is_pinned()}")
        except Exception:  # a tensor subclass or a freed storage: not counted
            continue
    by_kind: dict[str, list[int]] = {}
    for nbytes, kind in storages.values():
        entry = by_kind.setdefault(kind, [0, 0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes
    ranked = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: line.split(":")[1].strip() for line in f}
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: line.split(":")[1].strip() for line in f if line.startswith(("Vm", "Rss"))}
    kids = []
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                kids.append({"pid": pid, "comm": f.read().strip(), "rss_gib": round(_rss(pid) / GIB, 3)})
        except OSError:
            continue
    return {"t_s": round(t_s, 1), "tensors_gib": round(sum(n for n, _ in storages.values()) / GIB, 2),
            "storages": len(storages),
            "top": [{"kind": k, "count": c, "gib": round(b / GIB, 3)} for k, (c, b) in ranked[:top]],
            "meminfo": meminfo, "status": status, "descendants": kids}


def _is_tensor(obj: object) -> bool:
    import torch

    try:
        return torch.is_tensor(obj)
    except ReferenceError:  # a weakref proxy whose object is gone
        return False


def _rss(pid: int) -> int:
    """A process's resident set in bytes (0 where it exited meanwhile)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def planned(config: dict, micro_batch: int, seq_len: int, host_gib: float | None, gpu_gib: float | None,
            host_state: str, groups: int | str = "auto", attn_implementation: str = "sdpa",
            update_during_backward: bool | str = "auto", keep_layers: int | str = "auto",
            compile_layers: bool | str = "auto") -> dict:
    """The planner's prediction of this run: a machine whose usable host RAM is the budget (or this machine's)."""
    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.planner import Machine, plan

    engine = EngineConfig(host_state=host_state, gpu_optimizer_groups=groups, keep_layers=keep_layers,
                          update_during_backward=update_during_backward, compile_layers=compile_layers)
    p = plan(workloads.hf_config(config), seq_len=seq_len, micro_batch=micro_batch, config=engine,
             host_state=host_state, attn_implementation=attn_implementation,
             machine=Machine(host_ram_gib=host_gib, gpu_mem_gib=gpu_gib))
    return {"fits": p.fits, "gpu_optimizer_groups": p.assumptions["gpu_optimizer_groups"],
            "memory_pool": p.memory_pool, "tokens_per_s": p.tokens_per_s, "host_gib": p.host_total / GIB,
            "host_usable_gib": p.host_usable / GIB, "gpu_peak_gib": p.gpu_total / GIB,
            "gpu_allocated_gib": p.gpu_allocated / GIB, "time_s": p.time,
            "verdict": p.verdict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-13b", choices=list(SHAPES),
                    help="the shape (llama-3.1-70b and gpt-oss-120b: benchmarks/scale_plan.py's)")
    ap.add_argument("--layers", type=int,
                    help="decoder layers (default: the shape's own; fewer truncate it, more deepen it)")
    ap.add_argument("--keep-layers", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="MegaTrainStrategy(keep_layers=...): 'auto' (the default) or N; 0 recomputes every layer")
    ap.add_argument("--host-state", default="fp32", choices=["fp32", "int8_moments", "compact", "compact_kahan"],
                    help="MegaTrainStrategy(host_state=...): the host's bytes per parameter (docs/compact-state.md)")
    ap.add_argument("--gpu-optimizer-groups", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="MegaTrainStrategy(gpu_optimizer_groups=...): 'auto' (the default the row is about) or N")
    ap.add_argument("--update-during-backward", type=lambda v: {"auto": "auto", "true": True, "false": False}[v],
                    default="auto", help="MegaTrainStrategy(update_during_backward=...): auto (the default), true, "
                                         "false (as benchmarks/scale_plan.py plans)")
    ap.add_argument("--experts-implementation", choices=["eager", "grouped_mm"],
                    help="an MoE shape's transformers experts implementation (default: transformers'). gpt-oss in "
                         "bf16 with grouped_mm and compiled layers hit a device-side assert in torch 2.11's grouped "
                         "GEMM on the H200 (benchmarks/results/2026-12-04-memory-pool-gpt-oss-120b-2l-compact-"
                         "grouped-mm-assert-h200-c61a4e0.log); eager loops over the experts that have tokens")
    ap.add_argument("--compile-layers", type=lambda v: {"auto": "auto", "true": True, "false": False}[v],
                    default="auto", help="MegaTrainStrategy(compile_layers=...): auto (the default), true, false")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8,
                    help="optimizer steps; the first 4 are not timed (the end of the 4th starts the clock)")
    ap.add_argument("--host-gib", type=float, help="host RAM the process sees, GiB (default: the machine's)")
    ap.add_argument("--out", default="benchmarks/results/memory-pool-h200.json")
    ap.add_argument("--watch-gib", type=float,
                    help="write the census and exit (status 86) below this much MemAvailable, GiB (default 3; "
                         "0 with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="tiny Llama on this machine (CPU): the code path")
    args = ap.parse_args()

    import lightning as L
    import torch

    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain._hardware import H100_BF16_PEAK_FLOPS, host_rss_gib
    from lightning_megatrain.planner import describe
    from lightning_megatrain.planner.capacity import with_layers

    if args.dry_run:
        config = dict(workloads.MODELS["tiny-llama"]["config"], num_hidden_layers=2)
    else:  # at --layers, a layer_types pattern repeated to that depth as the planner repeats it
        config = with_layers(SHAPES[args.model], args.layers) if args.layers else dict(SHAPES[args.model])
    if args.experts_implementation:
        config["experts_implementation"] = args.experts_implementation
    full_depth = SHAPES[args.model]["num_hidden_layers"]
    attn = describe(workloads.hf_config(config)).attn  # transformers' own: eager where it has no SDPA (gpt-oss)
    micro_batch, seq_len = (2, 64) if args.dry_run else (args.micro_batch, args.seq_len)
    steps = 4 if args.dry_run else args.steps
    on_cuda = torch.cuda.is_available() and not args.dry_run
    gpu_gib = torch.cuda.mem_get_info()[1] / GIB if on_cuda else None
    prediction = planned(config, micro_batch, seq_len, args.host_gib, gpu_gib, args.host_state,
                         args.gpu_optimizer_groups, attn, args.update_during_backward, args.keep_layers,
                         args.compile_layers)
    print("planned:", prediction["verdict"], flush=True)
    if args.host_gib is not None:
        force_host_limit(args.host_gib)
    # a dry run writes no result, so its samples go to a temporary folder
    samples = Path(tempfile.mkdtemp()) if args.dry_run else Path(args.out).parent
    samples.mkdir(parents=True, exist_ok=True)
    stem = Path(args.out).with_suffix("").name
    watch_gib = args.watch_gib if args.watch_gib is not None else 0.0 if args.dry_run else 3.0
    sampler = HostSampler(samples / f"{stem}.host-samples.txt", samples / f"{stem}.census.json", watch_gib)
    sampler.start()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's log.info lines (the optimizer)

    times: list[float] = []
    losses: list[float] = []  # each optimizer step's (one micro-batch: accumulation is not used here)

    class Chosen(L.Callback):
        groups = None

        def on_train_start(self, trainer, pl_module):
            print("host optimizer:", ", ".join(type(o).__name__ for o in trainer.optimizers), flush=True)

        def on_train_end(self, trainer, pl_module):  # the engine's decision ("auto" resolved at the first batch)
            Chosen.groups = trainer.strategy.engine.config.gpu_optimizer_groups

    class Clock(L.Callback):
        # reads the clock, no parameters: the overlapped optimizer step is not waited for ([Note: user hooks]).
        # Without it (up to d4ea2b4) every step finished its host update before this hook, so those runs timed the
        # step without the overlap.
        megatrain_reads_state = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())
            losses.append(float(outputs["loss"]))  # the clock has waited for the GPU already
            if len(times) in (1, 3):
                sampler.record(f"after step {len(times)}")

    # the bf16 layouts' masters are bf16: built so, the model of a host that holds 6 B/param needs no fp32 copy first
    dtype = "bfloat16" if args.host_state.startswith("compact") else "float32"
    module = workloads.make_module(config, loss="chunked", optimizer="adamw", grad_ckpt=False, direct_clip=False,
                                   dtype=dtype, attn_implementation=attn)
    host_clock = HostStepClock()
    host_clock.install()
    data = torch.randint(0, config["vocab_size"], (micro_batch * steps, seq_len))
    loader = torch.utils.data.DataLoader(data, batch_size=micro_batch)
    strategy = MegaTrainStrategy(host_state=args.host_state, gpu_optimizer_groups=args.gpu_optimizer_groups,
                                 keep_layers=args.keep_layers, update_during_backward=args.update_during_backward,
                                 compile_layers=args.compile_layers)
    trainer = L.Trainer(accelerator="cuda" if on_cuda else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed" if on_cuda or dtype == "bfloat16" else "32-true", max_steps=steps,
                        gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock(), Chosen()])
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    timed = times[3:] if len(times) > 4 else times[1:]
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1 else float("nan")
    chosen = Chosen.groups
    n_params = sum(p.numel() for p in module.parameters())
    active = workloads.count_params(config)[1]  # MoE: the experts a token runs
    row = {
        "model": "tiny-llama" if args.dry_run else args.model if config["num_hidden_layers"] == full_depth else
        f"{args.model} shape {'TRUNCATED' if config['num_hidden_layers'] < full_depth else 'DEEPENED'} to "
        f"{config['num_hidden_layers']} layers",
        "layers": config["num_hidden_layers"], "attn_implementation": attn, "keep_layers": args.keep_layers,
        "update_during_backward": args.update_during_backward, "experts_implementation": args.experts_implementation,
        "compile_layers": args.compile_layers,
        "n_params": n_params, "host_state": args.host_state, "gpu_optimizer_groups_option": args.gpu_optimizer_groups,
        "micro_batch": micro_batch, "seq_len": seq_len, "steps": steps, "host_limit_gib": args.host_gib,
        "measured": {"tokens_per_s": micro_batch * seq_len / step_s, "step_s": step_s,
                     # 6N per token (N active: MoE) over the dense bf16 peak (PaLM's MFU; attention not counted)
                     "mfu": 6 * active * micro_batch * seq_len / step_s / H100_BF16_PEAK_FLOPS,
                     "gpu_optimizer_groups": chosen,
                     "peak_host_rss_gib": host_rss_gib("VmHWM"),
                     "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
                     "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_cuda else None,
                     "wall_s": time.perf_counter() - t0, "losses": losses,
                     # per optimizer step (the last one's waits are the end of training's): see HostStepClock
                     "host_step_s": host_clock.steps, "host_step_waited_s": host_clock.waited},
        "host_samples": sampler.summary(),
        "planned": prediction,
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
    }
    print(json.dumps(row, indent=1, default=str))
    if not args.dry_run:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
