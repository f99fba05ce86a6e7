"""Check the planner's memory and time formulas (lightning_megatrain/planner/) against one GPU (one device call).

Parts: (1) the pinned host allocator's rounding; (2) one Llama-3.2-3B-shaped HF decoder layer recomputed with grad
the way engine/streamed.py does it (bf16 weights from a slot, fp32 input, autocast without cache): saved bytes, peak
in backward, fwd and fwd+bwd time; (3) the chunked loss and HF's loss at the 3B vocabulary: peak bytes.
Usage: python benchmarks/planner_gpu_check.py --out DIR   (writes DIR/planner_gpu_check.json)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)

from lightning_megatrain import planner
from lightning_megatrain.models.loss import causal_lm_loss

SHAPE = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
         "num_hidden_layers": 2, "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": True,
         "max_position_embeddings": 8192}
dev = torch.device("cuda")


def pinned_rounding() -> dict:
    out = {}
    n = 100_663_296  # 3B layer: 402,653,184 bytes fp32
    t = torch.empty(n, dtype=torch.float32, pin_memory=True)
    try:
        stats = torch.cuda.host_memory_stats()
        out["allocated_bytes"] = stats.get("allocated_bytes.current")
    except Exception as e:  # noqa: BLE001
        out["host_memory_stats_error"] = repr(e)
    out["requested_bytes"] = t.numel() * 4
    del t
    return out


def saved_and_peak(run, weights: list, gout: torch.Tensor) -> tuple[int, int]:
    """Bytes one layer's graph saves (allocated after ``run()`` less its output) and the peak of its backward above
    the state before ``run()``; ``run() -> (input, output)`` builds the graph (warmed up by the caller)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    x, y = run()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(y, [x, *weights], gout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads, x, y
    return saved, peak


def layer_check(batch: int, seq: int) -> dict:
    cfg = LlamaConfig(**{k: v for k, v in SHAPE.items() if k != "model_type"}, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, 0).to(dev, torch.bfloat16).train()
    weights = [p for p in layer.parameters()]
    for p in weights:
        p.requires_grad_(True)
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    x0 = torch.randn(batch, seq, cfg.hidden_size, device=dev)
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, seq)
    cos_sin = rope(x0, pos)
    gout = torch.randn_like(x0)

    def run(grad: bool):
        x = x0.detach().requires_grad_(grad)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False), torch.set_grad_enabled(grad):
            y = layer(x, position_embeddings=cos_sin, attention_mask=None)
        return x, (y[0] if isinstance(y, tuple) else y)

    for _ in range(2):  # warm-up
        x, y = run(True)
        torch.autograd.grad(y, [x, *weights], gout)
    del x, y
    saved, peak = saved_and_peak(lambda: run(True), weights, gout)
    times = {}
    for name, grad in (("fwd_ms", False), ("fwd_bwd_ms", True)):  # the engine's forward, then its recompute+backward
        for i in range(13):
            if i == 3:  # three warm-ups of this mode
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            x, y = run(grad)
            if grad:
                torch.autograd.grad(y, [x, *weights], gout)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 10 * 1e3
    shape = planner.describe(SHAPE)
    f_saved, f_trans = planner.layer_activation(shape, shape.layers[0], seq, 2)
    tokens = batch * seq
    return dict(batch=batch, seq=seq, tokens=tokens, saved_bytes=saved, saved_per_token=saved / tokens,
                formula_saved_per_token=f_saved, backward_peak_bytes=peak, backward_peak_per_token=peak / tokens,
                formula_peak_per_token=f_saved + f_trans - 4 * 3072 + 2 * shape.layers[0].numel / tokens,
                **times)


def loss_check(tokens: int, naive: bool) -> dict:
    torch.cuda.empty_cache()
    H, V = SHAPE["hidden_size"], SHAPE["vocab_size"]
    w = torch.randn(V, H, device=dev, requires_grad=True)
    h = torch.randn(1, tokens, H, device=dev, requires_grad=True)
    labels = torch.randint(0, V, (1, tokens), device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        if naive:
            from transformers.loss.loss_utils import ForCausalLMLoss

            logits = torch.nn.functional.linear(h, w)
            loss = ForCausalLMLoss(logits, labels, vocab_size=V)
            del logits
        else:
            loss = causal_lm_loss(h, w, labels)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base  # includes w.grad and h.grad (fp32)
    chunk = min(4096, tokens)
    formula = (tokens * V * 12 if naive else V * H * 8 + chunk * V * 8 + 8 * H * tokens) + 4 * V * H + 4 * H * tokens
    return {"tokens": tokens, "naive": naive, "peak_bytes": peak, "formula_bytes": formula}


def head_time(tokens: int) -> dict:
    """Chunked LM head + loss, forward (which computes the grads) + backward, at the 3B vocabulary."""
    H, V = SHAPE["hidden_size"], SHAPE["vocab_size"]
    w = torch.randn(V, H, device=dev, requires_grad=True)
    h = torch.randn(1, tokens, H, device=dev, requires_grad=True)
    labels = torch.randint(0, V, (1, tokens), device=dev)
    for i in range(8):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            causal_lm_loss(h, w, labels).backward()
    torch.cuda.synchronize()
    return {"tokens": tokens, "ms": (time.perf_counter() - t0) / 5 * 1e3}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="layer,loss,head_time")
    a = ap.parse_args()
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "pinned": pinned_rounding()}
    parts = a.parts.split(",")
    if "layer" in parts:
        res["layer"] = [layer_check(4, 4096), layer_check(8, 4096), layer_check(2, 8192)]
    if "loss" in parts:
        res["loss"] = [loss_check(16384, False), loss_check(8192, True)]
    if "head_time" in parts:
        res["head_time"] = head_time(32768)
    print(json.dumps(res, indent=1))
    with open(f"{a.out}/planner_gpu_check.json", "w") as f:
        json.dump(res, f, indent=1)
