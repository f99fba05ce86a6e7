"""Does a bf16 gpt-oss model train with transformers' default experts implementation (grouped_mm) on this GPU, and
does it with the strategy's compiled layers? Each case in its own process (a device-side assert ends the CUDA
context): a small GptOss (hidden 256, 16 experts, top-4, 2 layers, 4 x 256 tokens), two training steps.

- ``plain``: the model in bf16 on the GPU, two forward and backward passes (no optimizer step), no strategy;
- ``plain_compiled``: the same with each decoder layer compiled (``layer.compile()``, as a plain user would);
- ``plain_dynamic``: compiled with ``dynamic=True`` (the strategy marks the batch and sequence dims dynamic);
- ``plain_autocast``: fp32 weights under bf16 autocast, layers compiled (as the strategy's bf16-mixed computes);
- ``plain_checkpointed``: ``plain_autocast`` with ``dynamic=True`` and each layer under transformers' non-reentrant
  gradient checkpointing (its forward recomputed in backward, as the strategy's layers are);
- ``megatrain`` / ``megatrain_compiled`` / ``megatrain_auto``: ``CausalLMModule`` with
  ``MegaTrainStrategy(compile_layers=False/True/"auto")``, bf16-mixed, two optimizer steps.

    python benchmarks/grouped_mm_check.py             # one line per case and experts implementation: ok, or the error
    python benchmarks/grouped_mm_check.py grouped_mm --modes megatrain --heads 8   # one case, 8 heads
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import sys
import torch
mode, impl, heads = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = dict(model_type="gpt_oss", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=2, head_dim=64, num_local_experts=16,
              num_experts_per_tok=4, vocab_size=512, layer_types=["sliding_attention", "full_attention"],
              experts_implementation=impl, pad_token_id=0, eos_token_id=1, use_cache=False)
torch.manual_seed(0)
ids = torch.randint(0, 512, (4, 256))
if mode.startswith("plain"):
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = dict(config)
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    mixed = mode in ("plain_autocast", "plain_checkpointed")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32 if mixed else torch.bfloat16).cuda()
    if mode == "plain_checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    if mode != "plain":
        for layer in model.model.layers:
            layer.compile(dynamic=True if mode in ("plain_dynamic", "plain_checkpointed") else None)
    for _ in range(2):
        with torch.autocast("cuda", torch.bfloat16, enabled=mixed):
            loss = model(input_ids=ids.cuda(), labels=ids.cuda()).loss
        loss.backward()
else:
    import logging
    import lightning as L
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's placement lines
    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain.models import CausalLMModule
    module = CausalLMModule(config=config, attn_implementation="eager")
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4)
    compile_layers = {"megatrain": False, "megatrain_compiled": True, "megatrain_auto": "auto"}[mode]
    strategy = MegaTrainStrategy(compile_layers=compile_layers, overlap_optimizer=False,
                                 gpu_optimizer_groups=0)
    L.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, loader)
torch.cuda.synchronize()
print("ok")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("impls", nargs="*", default=["grouped_mm", "eager"])
    ap.add_argument("--modes", default="plain,plain_compiled,plain_dynamic,plain_autocast,plain_checkpointed,"
                                       "megatrain,megatrain_compiled")
    ap.add_argument("--heads", type=int, default=4,
                    help="attention heads: gpt-oss's sinks parameter has one element per head (4: 8 bf16 bytes)")
    ap.add_argument("--blocking", action="store_true",
                    help="CUDA_LAUNCH_BLOCKING=1 in each case: a device-side assert is raised by the op that failed")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case (compiling one takes a minute)")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        for impl in args.impls:
            try:
                env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1") if args.blocking else None
                r = subprocess.run([sys.executable, "-c", CHILD, mode, impl, str(args.heads)], capture_output=True,
                                   text=True, timeout=args.timeout, env=env)
            except subprocess.TimeoutExpired:
                print(f"{mode} {impl} heads={args.heads}: TIMEOUT after {args.timeout:g} s", flush=True)
                continue
            last = (r.stdout.strip().splitlines() or [""])[-1]
            ok = r.returncode == 0 and last == "ok"
            chose = [line for line in r.stderr.splitlines() if "MegaTrain: compile_layers=" in line]
            print(f"{mode} {impl} heads={args.heads}: {'ok' if ok else 'FAILED'}", *chose[:1], flush=True)
            if not ok:  # the traceback's last frames and the error
                print("\n".join(r.stderr.strip().splitlines()[-40:]), flush=True)


if __name__ == "__main__":
    main()
