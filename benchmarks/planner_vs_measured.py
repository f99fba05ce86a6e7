"""Compare `megatrain plan` predictions with the runs measured on the H200 (committed result files).

Usage: python benchmarks/planner_vs_measured.py benchmarks/results/2026-11-29-core-*-h200.json
Prints a markdown table: predicted vs measured peak host RSS, peak GPU memory (allocated tensors) and tokens/s.
"""

from __future__ import annotations

import json
import sys

from lightning_megatrain.planner import plan

GIB = 1024**3

# The shapes of benchmarks/core_gpu.py, as HF config dicts (the planner builds them on the meta device).
CONFIGS = {
    "llama-110m": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000),
    "llama-3.2-3b": dict(num_hidden_layers=28, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256),
    "llama-3.2-3b-x2depth": dict(num_hidden_layers=56, hidden_size=3072, intermediate_size=8192,
                                 num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
}


def main(paths: list[str]) -> None:
    rows = [r for path in paths for r in json.load(open(path))["results"] if r.get("strategy") == "megatrain"]
    print("| model | tokens/step | host GiB plan / measured (err) | GPU GiB plan / measured (err) | tokens/s plan / "
          "measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        config = dict(model_type="llama", tie_word_embeddings=True, **CONFIGS[r["model"]])
        p = plan(config, seq_len=r["seq_len"], micro_batch=r["micro_batch"], optimizer=r["optimizer"],
                 loss="naive", host_ram_gib=125, gpu_mem_gib=139, cpu_cores=16,
                 pinned_pow2_rounding=True).to_dict()  # these runs predate the exact-size page-locked buffers
        # max_memory_allocated counts tensors only: compare it with the plan's peak less its runtime reserve (CUDA
        # context and allocator slack, which the plan adds so that its peak fits the card)
        host, gpu = p["host_total"] / GIB, (p["gpu_total"] - p["gpu"]["runtime reserve"]) / GIB
        print(f"| {r['model']} | {r['tokens_per_step']} | {host:.1f} / {r['peak_host_rss_gib']:.1f} "
              f"({host / r['peak_host_rss_gib'] - 1:+.0%}) | {gpu:.1f} / {r['peak_gpu_gib']:.1f} "
              f"({gpu / r['peak_gpu_gib'] - 1:+.0%}) | {p['tokens_per_s']:,.0f} / {r['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
