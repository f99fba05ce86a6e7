"""Does a bf16 gpt-oss model train with transformers' default experts implementation (grouped_mm) on this GPU, and
does it with the strategy's compiled layers? Each case in its own process (a device-side assert ends the CUDA
context): a small GptOss (hidden 256, 16 experts, top-4, 2 layers, 4 x 256 tokens), two training steps.

- ``plain``: the model in bf16 on the GPU, forward and backward, no strategy;
- ``plain_compiled``: the same with each decoder layer compiled (``layer.compile()``, as a plain user would);
- ``megatrain`` / ``megatrain_compiled``: ``CausalLMModule`` with ``MegaTrainStrategy(compile_layers=False/True)``,
  bf16-mixed, two optimizer steps.

    python benchmarks/grouped_mm_check.py             # one line per case and experts implementation: ok, or the error
    python benchmarks/grouped_mm_check.py grouped_mm  # that implementation only
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
import torch
mode, impl = sys.argv[1], sys.argv[2]
config = dict(model_type="gpt_oss", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=16,
              num_experts_per_tok=4, vocab_size=512, layer_types=["sliding_attention", "full_attention"],
              experts_implementation=impl, pad_token_id=0, eos_token_id=1, use_cache=False)
torch.manual_seed(0)
ids = torch.randint(0, 512, (4, 256))
if mode.startswith("plain"):
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = dict(config)
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.bfloat16).cuda()
    if mode == "plain_compiled":
        for layer in model.model.layers:
            layer.compile()
    for _ in range(2):
        model(input_ids=ids.cuda(), labels=ids.cuda()).loss.backward()
else:
    import lightning as L
    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain.models import CausalLMModule
    module = CausalLMModule(config=config, attn_implementation="eager")
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4)
    strategy = MegaTrainStrategy(compile_layers=mode == "megatrain_compiled", overlap_optimizer=False,
                                 gpu_optimizer_groups=0)
    L.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, loader)
torch.cuda.synchronize()
print("ok")
"""


def main() -> None:
    for mode in ("plain", "plain_compiled", "megatrain", "megatrain_compiled"):
        for impl in sys.argv[1:] or ("grouped_mm", "eager"):
            r = subprocess.run([sys.executable, "-c", CHILD, mode, impl], capture_output=True, text=True)
            last = (r.stdout.strip().splitlines() or [""])[-1]
            error = next((ln for ln in r.stderr.splitlines() if "Assertion" in ln or "Error" in ln), r.stderr[-300:])
            ok = r.returncode == 0 and last == "ok"
            print(f"{mode} {impl}: {'ok' if ok else 'FAILED: ' + error.strip()[:300]}", flush=True)


if __name__ == "__main__":
    main()
