"""Check the planner's long-context layer formulas (planner/memory.py: ``layer_activation`` with and without
``tile``) and its attention FLOP count (planner/timing.py) against one GPU (one device call).

One HF Llama decoder layer recomputed with grad the way engine/streamed.py does it (bf16 weights as in a slot, fp32
input, autocast without cache, sdpa): bytes saved by its forward and the peak of its backward, untiled and tiled by
engine/tiling.py's ``SequenceTiles`` as the engine installs it (the MLP and the q/k/v projections in tiles of
positions, each tile under a checkpoint, with the norms before them folded into the tiles), up to the 524,288-token
row of the Llama-2-7B shape. The results of 2026-12-01 were measured before the folds, with the MLP alone tiled.
Then the time of the layer's forward and of its recompute + backward at a long sequence, and of causal attention
alone (sdpa: torch picks the kernel, cuDNN on the H200), against the FLOPs the planner counts.
Usage: python benchmarks/planner_long_context_check.py --out DIR   (writes DIR/planner_long_context_check.json)
Results: benchmarks/results/2026-12-01-planner-long-context-h200.json (MLP alone tiled), and
benchmarks/results/2026-12-02-planner-long-context-h200-folds-360d5cf.json (this version, memory part).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from planner_gpu_check import saved_and_peak
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightning_megatrain import planner
from lightning_megatrain.engine.tiling import SequenceTiles

SHAPES = {
    "llama2-7b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                  "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 32},
    "llama3.2-3b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
                    "num_hidden_layers": 1, "num_attention_heads": 24, "num_key_value_heads": 8,
                    "tie_word_embeddings": True},
}
dev = torch.device("cuda")


def _layer(shape: dict, seq: int, tile: int | None):
    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k != "model_type"}, max_position_embeddings=seq,
                      attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, 0).to(dev, torch.bfloat16).train()
    if tile is not None:  # the engine's own tiling: the MLP in tiles, the norms before it and before attention folded
        SequenceTiles(nn.ModuleList([layer]), tile).install()  # into them, q/k/v in tiles ([Note: folded norms])
    return cfg, layer


def memory(name: str, seq: int, tile: int | None, batch: int = 1) -> dict:
    torch.cuda.empty_cache()
    shape = SHAPES[name]
    cfg, layer = _layer(shape, seq, tile)
    weights = list(layer.parameters())
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    x0 = torch.randn(batch, seq, cfg.hidden_size, device=dev)
    cos_sin = rope(x0, torch.arange(seq, device=dev).unsqueeze(0).expand(batch, seq))
    gout = torch.randn_like(x0)

    def run():
        x = x0.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            y = layer(x, position_embeddings=cos_sin, attention_mask=None)
        return x, (y[0] if isinstance(y, tuple) else y)

    x, y = run()  # warm-up
    torch.autograd.grad(y, [x, *weights], gout)
    del x, y
    saved, peak = saved_and_peak(run, weights, gout)
    s = planner.describe(shape)
    f_saved, f_transient = planner.layer_activation(s, s.layers[0], seq, 2, tile)
    tokens = batch * seq
    # the incoming grad (4H) is allocated before the peak is reset; the bf16 weight grads alive at the peak come on
    # top: down_proj's untiled (planner/memory.py's module docstring), the MLP's three with tiles
    weight_grads = (1 if tile is None else 3) * 2 * cfg.hidden_size * cfg.intermediate_size
    return {"shape": name, "seq": seq, "batch": batch, "tile": tile, "saved_per_token": saved / tokens,
            "formula_saved_per_token": f_saved, "backward_peak_per_token": peak / tokens,
            "formula_peak_per_token": f_saved + f_transient - 4 * cfg.hidden_size + weight_grads / tokens}


def _time(fn, warmup: int = 2, reps: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def layer_time(name: str, seq: int, tile: int | None) -> dict:
    torch.cuda.empty_cache()
    shape = SHAPES[name]
    cfg, layer = _layer(shape, seq, tile)
    weights = list(layer.parameters())
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    x0 = torch.randn(1, seq, cfg.hidden_size, device=dev)
    cos_sin = rope(x0, torch.arange(seq, device=dev).unsqueeze(0))
    gout = torch.randn_like(x0)

    def run(grad: bool):
        x = x0.detach().requires_grad_(grad)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False), torch.set_grad_enabled(grad):
            y = layer(x, position_embeddings=cos_sin, attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        if grad:
            torch.autograd.grad(y, [x, *weights], gout)

    fwd, fwd_bwd = _time(lambda: run(False)), _time(lambda: run(True))
    s = planner.describe(shape)
    ly = s.layers[0]
    counted_fwd = (2 * ly.active + planner._attn_flops(s, ly, seq)) * seq
    counted_bwd = 3 * counted_fwd + (2 * ly.mlp_active * seq if tile else 0)  # planner/timing.py
    return {"shape": name, "seq": seq, "tile": tile, "fwd_s": fwd, "recompute_bwd_s": fwd_bwd,
            "fwd_tflops_counted": counted_fwd / fwd / 1e12,
            "recompute_bwd_tflops_counted": counted_bwd / fwd_bwd / 1e12,
            "attention_share_of_fwd": planner._attn_flops(s, ly, seq) * seq / counted_fwd}


def attention_time(seq: int, heads: int = 32, head_dim: int = 128) -> dict:
    """Causal attention alone (sdpa: torch picks the kernel, cuDNN on the H200), bf16 [1, heads, seq, head_dim]:
    forward, forward + backward."""
    torch.cuda.empty_cache()
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    go = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, [q, k, v], go)

    t_fwd, t_both = _time(fwd), _time(fwd_bwd)
    counted = 4 * heads * head_dim * seq * seq / 2  # the planner's 4 * A * T_k per token, T_k = T / 2
    return {"seq": seq, "heads": heads, "head_dim": head_dim, "fwd_s": t_fwd, "fwd_bwd_s": t_both,
            "fwd_tflops_counted": counted / t_fwd / 1e12,
            # the planner counts the backward as 2x the forward; FlashAttention-2 runs 5 matmuls to its 2 (2.5x)
            "fwd_bwd_tflops_counted_3x": 3 * counted / t_both / 1e12,
            "fwd_bwd_tflops_executed_3.5x": 3.5 * counted / t_both / 1e12}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="memory,time,attention")
    a = ap.parse_args()
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    parts = a.parts.split(",")
    if "memory" in parts:
        res["memory"] = [memory("llama2-7b", 32768, None), memory("llama2-7b", 32768, 8192),
                         memory("llama2-7b", 131072, 16384), memory("llama3.2-3b", 65536, 16384),
                         memory("llama3.2-3b", 65536, None), memory("llama2-7b", 524288, 16384)]
        print(json.dumps(res["memory"], indent=1), flush=True)
    if "time" in parts:
        res["time"] = [layer_time("llama2-7b", 131072, None), layer_time("llama2-7b", 131072, 16384)]
        print(json.dumps(res["time"], indent=1), flush=True)
    if "attention" in parts:
        res["attention"] = [attention_time(32768), attention_time(131072)]
        print(json.dumps(res["attention"], indent=1), flush=True)
    with open(f"{a.out}/planner_long_context_check.json", "w") as f:
        json.dump(res, f, indent=1)
