"""Every measured or assumed number the planner uses, with where it comes from: the one home of each.

Unless stated, measured on one H200 SXM with a 16-core host on 2026-11-29 and recorded in shared/BENCHMARKS.md
("the H200" below). A number that is assumed rather than measured says so.
"""

from __future__ import annotations

from lightning_megatrain._hardware import (  # noqa: F401 (the planner's constants, one import)
    H100_BF16_PEAK_FLOPS,
    HOST_OS_RESERVE_FRACTION,
    HOST_OS_RESERVE_MIN_GIB,
)

# --- PCIe (Gen5 x16, pinned host memory), GB/s = 1e9 B/s -------------------------------------------------------------
PCIE_H2D_GBPS = 55.4  # host to device
PCIE_D2H_GBPS = 55.3  # device to host
PCIE_DUPLEX_GBPS = 97.0  # both directions at once, in total

# --- GPU rates, TFLOP/s on *executed* FLOPs (8N + attention + head, timing.py) ----------------------------------------
# BENCHMARKS.md's bf16 3B layer (14.3 ms fwd, 43.3 ms fwd+bwd at 32K tokens, seq 4096 as in benchmarks/core_gpu.py)
# and chunked head (150 ms) both run at ~515 counted this way (457 counting 6N only). The engine's own path (fp32
# residual stream, autocast without cache, bf16 slot weights) measured 425-437 for fwd+bwd on the H200
# (benchmarks/planner_gpu_check.py, 2026-11-29, 5 iterations): 450 default.
ACHIEVED_TFLOPS = 450.0
# compile_layers: plain GPU training with every decoder layer compiled ran 1.29x its eager rate on the same FLOPs
# (3.21B on the H200: 21,459 / 16,589 tokens/s at 32K tokens, 21,672 / 16,802 at 64K with the chunked loss;
# benchmarks/results/2026-11-29-llama-3.2-3b-h200.json); applied to the whole step: 450 x 1.29.
COMPILED_TFLOPS = 580.0
# Attention where SDPA runs it without a mask (cuDNN's kernel, torch's choice on the H200; the same kernel in eager
# and compiled layers), on the FLOPs timing.py counts: causal, the backward counted 2x the forward. Measured alone,
# 32 heads x 128, bf16, at 131,072 tokens (benchmarks/attention_backends.py,
# benchmarks/results/2026-12-04-attention-backends-h200-a82a356.json): forward 571 (690 at 32,768), backward 530 on
# FlashAttention's 2.5x count, so 424 on this one. Below ACHIEVED/COMPILED for the backward: at long context, where
# attention is most of a layer, one rate for the whole layer planned the 7B steps 8-15% fast, these within 5%
# (benchmarks/planner_attention_check.py). Used from ATTN_RATES_FROM_SEQ tokens per row, the shortest measured;
# shorter rows keep the one rate, calibrated on runs at 4,096 that include their (small) attention.
ATTN_FWD_TFLOPS = 570.0
ATTN_BWD_TFLOPS = 425.0
ATTN_RATES_FROM_SEQ = 32768
# attention_memo="auto" (config.py) takes the memos where the plan with them is at least this much faster (and fits),
# and `megatrain plan` names them on the same rule: a margin over the planner's error at long context (within 5% on
# the 7B runs at 131,072 and 262,144 tokens above), so a chosen memo is a measured gain, not a planned one. The 7B
# shape at 131,072 tokens planned +18% and ran +14% (docs/long-context.md).
MEMO_MIN_GAIN = 1.05
FP32_TFLOPS = 50.0  # 32-true: H200 datasheet fp32 (non-tensor) ~67 TFLOP/s; assumed ~75% achieved, not measured
PEAK_TFLOPS = H100_BF16_PEAK_FLOPS / 1e12  # dense bf16 datasheet peak (_hardware.py); MFU is quoted against it

# --- Host -------------------------------------------------------------------------------------------------------------
CPU_ADAM_GPARAMS = 3.6  # DeepSpeedCPUAdam, 16 threads, fp32, Gparam/s
TORCH_ADAM_GPARAMS = 3.1  # torch fused AdamW on the CPU, same machine (what the overlapped step runs)
# CompactAdamW (optim/compact_adam.py) for host_state other than fp32, on CPU parameters its native kernel
# (optim/compact_kernel.py), Gparam/s on the H200's 16 cores: alone, 1.6e9 parameters in 16 tensors, `compact` 3.86
# and 4.01 in two commands (torch's fused AdamW 3.94 in the first; `compact_kahan` 4.62; DeepSpeedCPUAdam 4.18;
# benchmarks/results/2026-12-03-compact-adam-h200-{fp32-draw,compact-first}-6a652c3.log, -deepspeed-6a652c3.json);
# the lowest, for every compact layout. Beside a training run it holds: the 28.88B `compact` run's 5.97 s step
# (2026-12-04-memory-pool-28.9b-compact-h200-12steps-b86cf4b.json) is planned within 8% at this rate and 21% slow
# at 3.04 (0.98x TORCH_ADAM_GPARAMS, the rule before it), the step being paced by the host update. Unlike fused
# AdamW's in-run rate (TORCH_ADAM_GPARAMS, below its 3.94 alone) it does not fall beside the transfers; the kernel
# moves about 10 host bytes per parameter to AdamW's 28 (a likely reason, not measured; `int8_moments`, with fp32
# weights and grads, moves about 16 and ran 5.72 alone, not beside a run: its rate here is the assumption least
# backed). Inductor's kernel, which runs where the native one does not build: 0.12x fused AdamW's
# (2026-12-03-compact-adam-h200-a233b00.log).
COMPACT_ADAM_GPARAMS = 3.86
CPU_REF_CORES = 16  # the cores those rates were measured on; a plan scales them linearly to its cores
HOST_COPY_GBPS = 79.0  # host memory copy, 16 threads, read+write GB/s
HOST_REF_GIB = 128.0  # host RAM of the H200's host: a plan's limit where this machine's is unknown
GPU_REF_GIB = 139.0  # usable memory of the H200 (its device tool: "about 139 GiB"): the limit without a GPU here
PROCESS_GIB = 3.0  # host: CUDA context, libraries, Python (engine estimate, not measured)
GPU_RESERVE_GIB = 2.0  # GPU: CUDA context, cuBLAS workspaces, allocator fragmentation (estimate, not measured)
# Host memory a split of the state between host and GPU (planner/pool.py ``split``) leaves unplanned: what the process
# allocates between the engine's split and its checkpoints' placement at the first micro-batch, both measured. On the
# H200 a 28.9B compact run split with 0.1 GiB spare and then found the host 0.1 GiB short, a drift of about 0.2 GiB
# (benchmarks/results/2026-12-03-memory-pool-28.9b-compact-refused-checkpoints-h200-dc759fa.log); 1 GiB ASSUMED.
SPLIT_HOST_MARGIN_GIB = 1.0
# Host RAM a plan leaves to the OS and other processes (a plan fits the host when its total is at most the limit
# less the reserve): _hardware.py holds the rule and its rationale, the engine leaves the same ([Note: host reserve]).

# --- Several ranks (planner/ranks.py) -------------------------------------------------------------------------------
# NVLink between the GPUs of one host, per GPU and direction: the H200 SXM's NVLink is 900 GB/s in total, both
# directions (NVIDIA's H200 datasheet, 18 fourth-generation links as on the H100 SXM), so 450 each way.
# ASSUMED achieved: 80% of it as NCCL's ring all-gather / reduce-scatter bus bandwidth (busbw, nccl-tests'
# PERFORMANCE.md), with NVLink SHARP (NVLS) off as on the lent hosts (NCCL_NVLS_ENABLE=0); not measured here.
NVLINK_GBPS = 360.0
# Between hosts, per GPU and direction: ASSUMED one 400 Gb/s NIC per GPU (a DGX H200's ConnectX-7s) at 80% of its
# 50 GB/s line rate. No two hosts were available to measure it; ``--inter-host-gbps`` overrides it.
INTER_HOST_GBPS = 40.0
# one small collective (the per-layer presence flags, the grad norm, the finite check): ASSUMED launch + sync latency
COLLECTIVE_LATENCY_S = 50e-6
# GPU memory of the NCCL communicator (its per-channel, per-peer buffers): ASSUMED, not measured
NCCL_GPU_GIB = 1.0

# optimizer -> (host state bytes/param, Gparam/s at CPU_REF_CORES). Adam moves 28 B/param (read p,g,m,v; write p,m,v);
# SGD is assumed to run at the same bytes/s: 12 B/param (p,g,p), with momentum 20 B/param. Derived, not measured.
OPTIMIZERS = {"adamw": (8, CPU_ADAM_GPARAMS), "adam": (8, CPU_ADAM_GPARAMS),
              "sgd": (0, CPU_ADAM_GPARAMS * 28 / 12), "sgd_momentum": (4, CPU_ADAM_GPARAMS * 28 / 20)}
PRECISIONS = {"bf16-mixed": 2, "32-true": 4}  # compute itemsize
