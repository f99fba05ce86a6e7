"""Sequence tiles (engine/tiling.py, [Note: sequence tiles]): the position-wise block of each decoder layer run a tile
of positions at a time gives the untiled block's results, alone, under the compiled layer's selective checkpoint and
through ``Trainer(strategy=MegaTrainStrategy(seq_tile=...))`` against plain Lightning."""

from __future__ import annotations

import functools
import logging
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine.compiled import _save_matmuls
from lightning_megatrain.engine.tiling import AUTO_TILE, SequenceTiles, find_block, run_tiled, tile_length

from helpers.families import FAMILIES, SEQ
from helpers.parity import assert_records_close, run

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*smaller than the logging interval.*",
)

TILE = 5  # does not divide SEQ = 16: tiles of 5, 5, 5 and 1 positions


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_tile_length_auto_tiles_long_rows_only():
    assert tile_length(None, 10**6) is None
    assert tile_length("auto", 32_768) is None and tile_length("auto", 32_769) == AUTO_TILE
    assert tile_length(TILE, TILE) is None and tile_length(TILE, SEQ) == TILE


# The wrapper alone, B = 3 and T = 37 in tiles of 5 (the last one of 2), forward and backward against the untiled block.
# On the CPU a dense MLP's output and input grad are bitwise those of the untiled block (each position's row is the
# same GEMM row); its weight grads sum the tiles' partial sums, a different order (~2e-7 relative). An MoE block groups
# each tile's tokens by expert (other GEMM shapes, another summation order): within 1e-6, not bitwise. gpt-oss also
# returns its router scores flattened to [B * t, k], put back in the untiled (b, t) order.
@pytest.mark.parametrize("family", ["llama_tied", "qwen3", "mixtral", "qwen3_moe", "gpt_oss"])
def test_tiled_block_equals_untiled(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    _, block = find_block(model.model.layers[0])
    x0 = torch.randn(3, 37, model.config.hidden_size)
    grad_out = torch.randn_like(x0)
    results = []
    for tile in (None, 5):
        x = x0.clone().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        out = block(x) if tile is None else run_tiled(block.forward, x, tile)
        outs = out if isinstance(out, tuple) else (out,)
        outs[0].backward(grad_out)
        results.append((outs, x.grad, [p.grad for p in block.parameters()]))
    (outs, dx, dw), (ref_outs, ref_dx, ref_dw) = results[1], results[0]
    assert [o.shape for o in outs] == [o.shape for o in ref_outs]
    dense = family not in ("mixtral", "qwen3_moe", "gpt_oss")
    for o, ref in zip(outs, ref_outs):
        assert torch.equal(o, ref) if dense else _rel(o, ref) < 1e-6
    assert torch.equal(dx, ref_dx) if dense else _rel(dx, ref_dx) < 1e-6
    for g, ref in zip(dw, ref_dw):
        if ref.norm() > 0:  # an expert without tokens has an all-zero grad on both sides
            assert _rel(g, ref) < 1e-6
    if family == "gpt_oss":
        assert torch.equal(outs[1], ref_outs[1])  # router scores [B * T, k]: the same rows, in the same order


def test_tiles_put_flattened_outputs_back_in_order_and_refuse_scalars():
    class Block(nn.Module):
        def __init__(self, aux: bool = False):
            super().__init__()
            self.aux = aux

        def forward(self, x):  # [B, t, H] -> ([B, t, H], [B * t, H], None)
            out = (x * 2, x.reshape(-1, x.shape[-1]) + 1, None)
            return out + (x.sum(),) if self.aux else out

    x = torch.randn(2, 7, 3)
    got, ref = run_tiled(Block().forward, x, 3), Block()(x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] is None
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(\), which is neither .* HINT: use seq_tile="):
        run_tiled(Block(aux=True).forward, x, 3)


def test_install_shadows_each_block_and_uninstall_restores_it(caplog):
    class Plain(nn.Module):  # a layer without a position-wise block: logged once, runs untiled
        def forward(self, x):
            return x

    model = AutoModelForCausalLM.from_config(FAMILIES["mixtral"]())
    layers = model.model.layers
    custom = layers[1].mlp.forward
    layers[1].mlp.forward = custom  # an instance forward set before ours
    stack = nn.ModuleList([*layers, Plain(), Plain()])
    tiles = SequenceTiles(stack, TILE)
    with caplog.at_level(logging.INFO, logger="lightning_megatrain.engine.tiling"):
        tiles.install()
    assert [b for b, _ in tiles.blocks] == [layer.mlp for layer in layers]
    assert all("forward" in layer.mlp.__dict__ for layer in layers)
    assert caplog.text.count("no position-wise block") == 1 and "Plain" in caplog.text
    tiles.uninstall()
    assert "forward" not in layers[0].mlp.__dict__ and layers[1].mlp.__dict__["forward"] is custom
    assert not [k for layer in layers for k in layer.mlp.__dict__ if k.startswith("_megatrain")]


@pytest.fixture
def block_inputs(monkeypatch):
    """The sequence lengths every LlamaMLP, Qwen3MLP and MixtralSparseMoeBlock forward receives."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    lengths: list[int] = []
    for cls in (LlamaMLP, Qwen3MLP, MixtralSparseMoeBlock):

        def recording(self, x, _forward=cls.forward):
            lengths.append(x.shape[1])
            return _forward(self, x)

        monkeypatch.setattr(cls, "forward", recording)
    return lengths


@functools.cache
def _reference(family: str, seed: int):
    return run("auto", family, optimizer="adamw_fused", accumulate=2, clip=1.0, seed=seed)


def _global_norm(grads: dict) -> float:
    return float(torch.stack([g.norm() for g in grads.values() if g is not None]).norm())


# Through the Trainer against plain Lightning, with accumulation (2 micro-batches per step) and clipping that fires;
# llama_untied has attention dropout (outside the block), whose masks the tiles' own checkpoints must not disturb;
# qwen3 keeps layer 0's graph (tiles with grad in forward), the others recompute every layer. Untiled, these records
# are bitwise plain Lightning's up to the first update; tiles change the summation order of weight grads: the first
# step within 1e-6 (2.4e-7 measured), later ones within 1e-4 (1.3e-5 measured, in a Mixtral expert's grad after an
# Adam update, which normalises rounding noise in small grads).
@pytest.mark.parametrize(("family", "seed", "keep"), [("llama_untied", 1, 0), ("qwen3", 0, 1), ("mixtral", 0, 0)])
def test_tiled_training_parity(family, seed, keep, block_inputs):
    ref = _reference(family, seed)
    assert all(_global_norm(g) > 1.0 for g in ref.grads)  # clipping bites
    block_inputs.clear()
    strategy = MegaTrainStrategy(cpu_adam="torch", seq_tile=TILE, keep_layers=keep)
    rec = run(strategy, family, accumulate=2, clip=1.0, seed=seed)
    assert_records_close(rec, ref, rtol=1e-6, rtol_updated=1e-4)
    # per micro-batch (3 steps x 2) each block in 4 tiles, never the whole row: a recomputed layer's block runs them
    # three times (in forward without grad, in the layer's recompute, and each tile once more by its checkpoint in
    # backward), a kept layer's twice (forward with grad, the re-run in backward)
    assert sorted(set(block_inputs)) == [1, TILE]
    layers = FAMILIES[family]().num_hidden_layers
    assert len(block_inputs) == 3 * 2 * 4 * (3 * (layers - keep) + 2 * keep)


def test_untiled_when_off_or_short(block_inputs):
    run(MegaTrainStrategy(cpu_adam="torch", seq_tile=None), "llama_tied", steps=1)
    run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", steps=1)  # "auto": rows of 16 positions are short
    assert set(block_inputs) == {SEQ}


class _Alive(TorchDispatchMode):
    """Bytes of the storages that aten ops produced and that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive(self) -> int:
        return sum(n for ref, n in self.storages.values() if ref() is not None)


def _layer(intermediate: int = 512):
    config = LlamaConfig(hidden_size=32, intermediate_size=intermediate, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    return config, LlamaDecoderLayer(config, 0)


# The compiled layer's selective checkpoint saves matmul outputs ([Note: compiled layers]); where it runs eagerly
# (dynamo could not trace the layer whole) its cache would hold every tile's gate and up projections for the
# layer's whole backward, 2 x T x I values, unless the policy leaves a tile's ops to the tile's own checkpoint.
def test_eager_selective_checkpoint_leaves_tiles_to_their_checkpoint():
    config, layer = _layer()
    seq = 256
    x0 = torch.randn(1, seq, config.hidden_size)
    cos, sin = LlamaRotaryEmbedding(config)(x0, torch.arange(seq)[None])
    context_fn = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _save_matmuls)
    alive = []
    for tile in (None, 32):
        tiles = SequenceTiles(nn.ModuleList([layer]), tile) if tile else None
        if tiles:
            tiles.install()
        x = x0.clone().requires_grad_(True)
        with _Alive() as mode:
            out = torch.utils.checkpoint.checkpoint(type(layer).forward, layer, x, position_embeddings=(cos, sin),
                                                    attention_mask=None, use_reentrant=False, context_fn=context_fn)
        alive.append(mode.alive())
        out.sum().backward()
        if tiles:
            tiles.uninstall()
    tile_projections = 2 * seq * config.intermediate_size * 4  # gate and up, fp32
    assert alive[0] - alive[1] > 0.9 * tile_projections, alive


def _saved_widths(strategy: MegaTrainStrategy) -> set[int]:
    """The last dimensions of every activation autograd saves while ``strategy`` trains llama_untied (dropout, with
    accumulation and clipping, as the parity reference): the widths of what the layers' graphs hold. Weights (leaves
    that require grad, and views of them: ``down_proj.weight`` is [H, I] too) are left out."""
    widths: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if t.dim() and not (base.is_leaf and base.requires_grad):
            widths.add(t.shape[-1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rec = run(strategy, "llama_untied", accumulate=2, clip=1.0, seed=1)
    assert_records_close(rec, _reference("llama_untied", 1), rtol=1e-4, rtol_updated=1e-3)
    return widths


# compile_layers=True through the Trainer (inductor on the CPU), layer 0 kept and the rest recomputed: the tiles are
# traced into each layer's graph, with no graph break and still one graph per grad mode for all layers (not one per
# layer or tile); their nested checkpoints override the selective policy ([Note: compiled layers]), so no graph saves
# an [*, I] tensor (untiled, eager or compiled, the MLP's gate and up projections are saved). The records match plain
# Lightning within the compiled layers' tolerance (as tests/strategy/test_parity.py, test_compiled_layers_parity).
def test_tiled_compiled_layers_parity():
    from torch._dynamo.utils import counters

    intermediate = FAMILIES["llama_untied"]().intermediate_size
    assert intermediate in _saved_widths(MegaTrainStrategy(cpu_adam="torch", keep_layers=1, seq_tile=None))
    torch._dynamo.reset()
    counters.clear()
    strategy = MegaTrainStrategy(cpu_adam="torch", keep_layers=1, compile_layers=True, seq_tile=TILE)
    widths = _saved_widths(strategy)
    assert counters["stats"]["unique_graphs"] == 2 + 1 and not counters["graph_break"]  # + the setup's probe
    assert intermediate not in widths and FAMILIES["llama_untied"]().hidden_size in widths
