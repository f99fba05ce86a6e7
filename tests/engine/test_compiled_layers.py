"""The compiled layer's selective save (engine/streamed.py, [Note: compiled layers]): fewer bytes kept for backward,
the same numbers as the plain compiled layer."""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightning_megatrain.engine.compiled import compile_layer_forward as _compile


def _run(forward, layer, x0, cos, sin, grad_out):
    """One forward with grad and its backward: (saved activation bytes, output, input grad, weight grads)."""
    saved: list[torch.Tensor] = []
    x = x0.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = forward(layer, x, position_embeddings=(cos, sin), attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    activation_bytes = sum(n for ptr, n in storages.items() if ptr not in weights and ptr != cos.data_ptr()
                           and ptr != sin.data_ptr())
    out.backward(grad_out)
    return activation_bytes, out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]


def test_compiled_layer_saves_matmul_outputs_only_with_the_same_results():
    # the Llama-3.2-3B layer's proportions at a quarter of its width: hidden 3072 -> 768, 8 kv heads of 24 -> 2 of 6,
    # intermediate 8192 -> 2048, head_dim 128
    config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    batch, seq = 2, 256
    x0 = torch.randn(batch, seq, config.hidden_size, dtype=torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(config)(x0, torch.arange(seq)[None].expand(batch, seq))
    grad_out = torch.randn_like(x0)

    forward = type(layer).forward
    plain = _run(torch.compile(forward), layer, x0, cos, sin, grad_out)
    layer.zero_grad(set_to_none=True)
    selective = _run(_compile(forward), layer, x0, cos, sin, grad_out)

    per_token = [r[0] / (batch * seq) / 2 for r in (plain, selective)]  # bf16 values per token
    # plain: input, both norms' outputs, q/k/v, attention out (twice: as computed and transposed for o_proj), gate,
    # up, SiLU x up (11,536 measured); selective: input, the q/k/v, o_proj, gate and up matmul outputs, attention out
    # and the norms' statistics (7,948)
    assert per_token[1] < 0.72 * per_token[0], per_token
    assert per_token[1] > 9 * config.hidden_size, per_token  # the matmul outputs themselves are still saved
    for a, b in zip(plain[1:3], selective[1:3]):
        assert torch.equal(a, b)
    for a, b in zip(plain[3], selective[3]):
        assert torch.equal(a, b)
