"""``megatrain plan``: the planner's command line (the ``megatrain`` CLI, cli.py, hands it its arguments)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import (
    ACHIEVED_TFLOPS,
    COMPILED_TFLOPS,
    GPU_REF_GIB,
    HOST_OS_RESERVE_FRACTION,
    HOST_OS_RESERVE_MIN_GIB,
    HOST_STATE_BYTES,
    INTER_HOST_GBPS,
    NVLINK_GBPS,
    OPTIMIZERS,
    PRECISIONS,
    Machine,
    Plan,
    plan,
)
from lightning_megatrain.planner.capacity import largest_models, render_capacities
from lightning_megatrain.planner.result import memo_pays, partial_memo


def _auto_int(none: bool = False):
    """An argparse type: ``auto``, an int, or (``none=True``) ``none`` for None; the range is EngineConfig's check."""

    def parse(text: str) -> int | str | None:
        if text == "auto" or (none and text == "none"):
            return None if text == "none" else text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need auto{', none' if none else ''} or an int; got {text!r}") from None

    return parse


def plan_main(argv: Sequence[str], prog: str = "megatrain plan") -> int:
    """``megatrain plan --model NAME_OR_DIR_OR_JSON --seq-len L [--micro-batch B] ... [--json]``: prints the plan of
    :func:`lightning_megatrain.planner.plan` as a table (or JSON); returns 0."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Host RAM, GPU memory and throughput of Trainer(strategy='megatrain') for a model (no weights "
        "are loaded).",
    )
    add = parser.add_argument
    add("--model", required=True, help="local dir with config.json, a .json file, inline JSON "
        "('{\"model_type\": \"llama\", ...}') or a hub name")
    add("--seq-len", type=int, required=True)
    add("--micro-batch", type=int, default=1)
    add("--grad-accum", type=int, default=1)
    add("--precision", choices=list(PRECISIONS), default="bf16-mixed")
    add("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    add("--loss", choices=["chunked", "naive"], default="chunked")
    add("--attn-implementation", help="as model.attn_implementation, e.g. eager (default: the config's)")
    add("--host-ram", type=float, help=f"GiB (default: this machine's); max({HOST_OS_RESERVE_MIN_GIB:g} GiB, "
        f"{HOST_OS_RESERVE_FRACTION * 100:g}%%) of it is left to the OS and other processes")
    add("--gpu-mem", type=float, help=f"GiB (default: this machine's GPU, else {GPU_REF_GIB:.0f} as on an H200)")
    add("--cpu-cores", type=int)
    add("--tflops", type=float, help=f"achieved TFLOP/s on executed FLOPs (default {ACHIEVED_TFLOPS:.0f} bf16, "
        f"{COMPILED_TFLOPS:.0f} with --compile-layers); named, attention runs at it too (else at its kernel's "
        "measured rates on long rows)")
    add("--no-offload", action="store_true", help="keep every layer's input on the GPU")
    add("--num-slots", type=int, default=2)
    add("--overlap-optimizer", action="store_true",
        help="as MegaTrainStrategy(overlap_optimizer=True): Adam runs beside the next forward")
    add("--update-during-backward", action="store_true",
        help="as MegaTrainStrategy(update_during_backward=True), with --overlap-optimizer: the last layers' host Adam "
        "starts during backward, their snapshots in the host memory left free")
    add("--gpu-optimizer-groups", type=_auto_int(), default=0, metavar="auto|N",
        help="as MegaTrainStrategy(gpu_optimizer_groups=N): the residents and N-1 layers step on the GPU; auto: as "
        "the strategy decides it, with the state split between host and GPU where the host cannot hold it all")
    add("--compile-layers", action="store_true",
        help="as MegaTrainStrategy(compile_layers=True): decoder layers through torch.compile")
    add("--attention-memo", nargs="?", const=True, default=False, type=int, metavar="N",
        help="as MegaTrainStrategy(attention_memo=True): a recomputed layer's attention output kept from its forward "
        "for its recompute (GPU memory for time; docs/long-context.md); with N, the last N layers' only. Without it "
        "a plan the memos would make 5%% faster, still fitting, ends with a line saying so: the strategy's "
        "attention_memo='auto' takes every layer's; where those do not fit or pay, the line names the N whose memos "
        "fit the GPU memory the plan leaves, if they pay")
    add("--loss-chunk-size", type=int, default=4096)
    add("--seq-tile", type=_auto_int(none=True), default="auto", metavar="auto|none|N",
        help="as MegaTrainStrategy(seq_tile=...): positions per tile of the MLP/MoE block (default auto: "
        "engine/tiling.py's rule)")
    add("--segment-layers", type=_auto_int(), default="auto", metavar="auto|K",
        help="as MegaTrainStrategy(segment_layers=K): one layer-input checkpoint per K recomputed layers "
        "(default auto)")
    add("--sub-segment-layers", type=_auto_int(), default="auto", metavar="auto|M",
        help="as MegaTrainStrategy(sub_segment_layers=M): nested recompute, a segment's replay keeps every M-th "
        "input (1: flat; default auto)")
    add("--device-checkpoints", type=_auto_int(), default="auto", metavar="auto|N",
        help="as MegaTrainStrategy(device_checkpoints=N): the last N checkpoints stay on the GPU (default auto)")
    add("--host-state", choices=list(HOST_STATE_BYTES), default="fp32",
        help="host state layout: fp32 (16 B/param), int8_moments (10.03), compact (6.03), compact_kahan (8.03); "
        "docs/compact-state.md")
    add("--largest", action="store_true",
        help="instead of one plan: the deepest model of this shape that fits, for each host state, and for each "
        "with its state in both memories (gpu_optimizer_groups=auto)")
    add("--devices", type=int, default=1, help="ranks (GPUs) per host, as Trainer(devices=N); --host-ram and "
        "--cpu-cores are the host's, shared by its ranks (docs/multi-gpu.md, Planning several ranks)")
    add("--num-nodes", type=int, default=1, help="hosts, as Trainer(num_nodes=M)")
    add("--nvlink-gbps", type=float, default=NVLINK_GBPS, help=f"GB/s between the GPUs of one host, per GPU and "
        f"direction, as all-gather bus bandwidth (default {NVLINK_GBPS:g}, assumed: planner/constants.py)")
    add("--inter-host-gbps", type=float, default=INTER_HOST_GBPS, help=f"GB/s (1e9 bytes/s, not Gbit/s) between "
        f"hosts, per GPU and direction (default {INTER_HOST_GBPS:g}: a 400 Gb/s NIC per GPU at 80%%)")
    add("--json", action="store_true", help="print the plan as JSON")
    ns = parser.parse_args(list(argv))
    try:
        config = EngineConfig(num_slots=ns.num_slots, overlap_optimizer=ns.overlap_optimizer,
                              update_during_backward=ns.update_during_backward,
                              gpu_optimizer_groups=ns.gpu_optimizer_groups, compile_layers=ns.compile_layers,
                              seq_tile=ns.seq_tile, segment_layers=ns.segment_layers,
                              sub_segment_layers=ns.sub_segment_layers, device_checkpoints=ns.device_checkpoints,
                              attention_memo=ns.attention_memo)
        machine = Machine(host_ram_gib=ns.host_ram, gpu_mem_gib=ns.gpu_mem, cpu_cores=ns.cpu_cores,
                          achieved_tflops=ns.tflops, nvlink_gbps=ns.nvlink_gbps, inter_host_gbps=ns.inter_host_gbps)
        kwargs = dict(seq_len=ns.seq_len, micro_batch=ns.micro_batch, grad_accum=ns.grad_accum,
                      precision=ns.precision, optimizer=ns.optimizer, loss=ns.loss, loss_chunk_size=ns.loss_chunk_size,
                      attn_implementation=ns.attn_implementation, offload_activations=not ns.no_offload,
                      config=config, machine=machine)
        if ns.largest and ns.devices * ns.num_nodes > 1:
            raise ValueError(f"--largest plans one rank; got --devices {ns.devices} --num-nodes {ns.num_nodes}")
        if ns.largest:
            capacities = largest_models(ns.model, **kwargs)
        else:
            p = plan(ns.model, host_state=ns.host_state, devices=ns.devices, num_nodes=ns.num_nodes, **kwargs)
    except (ValueError, OSError) as err:  # OSError: a --model path that does not exist, a Hub name not reachable
        parser.error(str(err))
    if ns.largest:
        print(json.dumps([dataclasses.asdict(c) for c in capacities], indent=2) if ns.json
              else render_capacities(str(ns.model)[:60], capacities))
        return 0
    print(json.dumps(p.to_dict(), indent=2) if ns.json else p.report())
    engine_flags = (ns.overlap_optimizer, ns.update_during_backward, ns.gpu_optimizer_groups, ns.compile_layers)
    if not ns.json and engine_flags == (False, False, 0, False):
        print(_defaults_line(ns.model, host_state=ns.host_state, devices=ns.devices, num_nodes=ns.num_nodes,
                             **{**kwargs, "config": config.replace(overlap_optimizer="auto", compile_layers="auto",
                                                                   update_during_backward="auto",
                                                                   gpu_optimizer_groups="auto",
                                                                   attention_memo="auto")}))
    if not ns.json and ns.attention_memo is False and ns.devices * ns.num_nodes == 1:
        line = _memo_line(p, ns.model, host_state=ns.host_state, **{**kwargs, "config": config})
        if line:
            print(line)
    return 0


def _memo_line(p: Plan, model: object, *, config: EngineConfig, **kwargs: object) -> str | None:
    """The line under a plan that the attention memos would make ``MEMO_MIN_GAIN`` faster or more, still fitting
    (result.py ``memo_pays``, the rule of the strategy's ``attention_memo="auto"``): long rows, whose attention is
    most of a layer (docs/long-context.md). Every layer's memos, which "auto" takes; where those do not fit or pay,
    those of the last ``Plan.memo_fitting`` layers (the GPU memory ``p`` leaves), an explicit option. None where
    neither pays."""
    memo = plan(model, config=config.replace(attention_memo=True), **kwargs)
    if memo_pays(p, memo):
        flag, option, note = "--attention-memo", "attention_memo=True", "; 'auto' takes it by this rule"
    elif (memo := partial_memo(p, lambda n: plan(model, config=config.replace(attention_memo=n), **kwargs))):
        flag, option = f"--attention-memo {p.memo_fitting}", f"attention_memo={p.memo_fitting}"
        note = f": the last {p.memo_fitting} layers' memos, in the GPU memory the plan leaves; 'auto' does not take it"
    else:
        return None
    gain = memo.tokens_per_s / p.tokens_per_s - 1
    return (f"  The plan above with {flag} (MegaTrainStrategy({option}){note}): {memo.tokens_per_s:,.0f} tokens/s "
            f"({gain:+.0%}) and fits (GPU peak {memo.gpu_total / 2**30:.1f} GiB)")


def _defaults_line(model: object, **kwargs: object) -> str:
    """The lines under a plan made with the command's engine defaults (eager layers, a serial host step, no device
    groups, no attention memos): what ``MegaTrainStrategy()``'s ``"auto"`` options plan instead, and the flags that
    plan them (with several ranks the overlapped host step and compiled layers: the rest is refused there)."""
    try:
        auto = plan(model, **kwargs)
    except ValueError as err:  # an option "auto" cannot take here: say so rather than fail the plan above
        return f"  MegaTrainStrategy()'s own defaults could not be planned: {err}"
    several = kwargs["devices"] * kwargs["num_nodes"] > 1
    flags = "--overlap-optimizer --compile-layers" if several else (
        "--overlap-optimizer --update-during-backward --gpu-optimizer-groups auto --compile-layers"
        + (" --attention-memo" if "attention memos" in auto.gpu else ""))
    return (f"  The plan above has the command's defaults: eager layers, a serial host step, no device groups or "
            f"memos.\n  MegaTrainStrategy()'s own (\"auto\") plan {auto.tokens_per_s:,.0f} tokens/s and "
            f"{'fits' if auto.fits else 'does not fit'}: {flags}")
