"""Does a bf16 gpt-oss layer train with transformers' default experts implementation (grouped_mm) on this GPU,
without the strategy? Plain PyTorch: one tiny GptOss model (4 experts, top-2) in bf16 on CUDA, forward and backward
of 61 tokens, once per experts implementation, each in its own process (a device-side assert ends the CUDA context).

    python benchmarks/grouped_mm_check.py          # prints one line per implementation: ok, or the error
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import torch
from transformers import GptOssConfig, GptOssForCausalLM
cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                   layer_types=["full_attention"], experts_implementation=sys.argv[1], pad_token_id=0,
                   eos_token_id=1)
torch.manual_seed(0)
model = GptOssForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.bfloat16).cuda()
ids = torch.randint(0, 256, (1, 61), device="cuda")
model(input_ids=ids, labels=ids).loss.backward()
torch.cuda.synchronize()
print("ok")
"""


def main() -> None:
    for impl in ("grouped_mm", "eager"):
        r = subprocess.run([sys.executable, "-c", "import sys\n" + CHILD, impl], capture_output=True, text=True)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        error = next((ln for ln in r.stderr.splitlines() if "Assertion" in ln or "Error" in ln), r.stderr[-300:])
        print(f"{impl}: {'ok' if r.returncode == 0 and last == 'ok' else 'FAILED: ' + error.strip()[:300]}")


if __name__ == "__main__":
    main()
