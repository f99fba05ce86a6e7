"""Sequence tiles (engine/tiling.py, [Note: sequence tiles]): the position-wise block of each decoder layer run a tile
of positions at a time gives the untiled block's results, alone, under the compiled layer's selective checkpoint and
through ``Trainer(strategy=MegaTrainStrategy(seq_tile=...))`` against plain Lightning; so do the norms folded into
the tiles of their readers (engine/folded_norms.py, [Note: folded norms])."""

from __future__ import annotations

import functools
import logging
import weakref

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import folded_norms
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
# A dense MLP's output and input grad are each position's row of the same GEMMs: bitwise where the CPU GEMM rounds a
# row the same whatever the number of rows (MKL on AVX-512), within 1e-6 where it does not (MKL on an AVX2 AMD EPYC:
# 2.5e-8 relative, measured). The weight grads sum the tiles' partial sums, a different order (~2e-7 relative). An MoE
# block groups each tile's tokens by expert (other GEMM shapes, another summation order): within 1e-6. gpt-oss also
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
    for o, ref in zip(outs, ref_outs):
        assert _rel(o, ref) < 1e-6
    assert _rel(dx, ref_dx) < 1e-6
    for g, ref in zip(dw, ref_dw):
        if ref.norm() > 0:  # an expert without tokens has an all-zero grad on both sides
            assert _rel(g, ref) < 1e-6
    if family == "gpt_oss":
        assert torch.equal(outs[1], ref_outs[1])  # router scores [B * T, k]: the same rows, in the same order


# The layers with their norms folded into the tiles ([Note: folded norms]) against the same tiles with the norms
# untiled (FOLDED_NORMS, FOLDED_ATTENTION emptied) and against the untiled model: B = 2, T = 16 in tiles of 5, 5, 5 and
# 1, through every layer (inputs_embeds in, logits out). First the norm before the block alone: it computes each row
# as the untiled norm does and the block gets the same tile inputs. Then the norm before attention too, inside the
# tiles of q, k and v: GEMMs of 10 rows instead of 32. The logits equal the unfolded tiles' within 1e-6: bitwise where
# the CPU GEMM rounds a row the same whatever the number of rows (MKL on AVX-512), not where it does not (MKL on an
# AVX2 AMD EPYC). Grads within 1e-6 of the untiled model's (measured: input grad 1.3e-7, 3.5e-7 for Gemma2;
# weights 3.7e-7): the residual stream's grad now adds the norms' paths per tile (three per tile for the norm before
# attention) before the residual add's grad, another summation order, and the folded norms' and projections' weight
# grads sum tile partial sums. (Tiles alone are not bitwise at this shape: the CPU GEMM of 10 rows of the MLP rounds
# otherwise than that of 32.) Gemma2 folds its pre_feedforward_layernorm; its post_attention_layernorm (on the
# attention output) runs as itself.
@pytest.mark.parametrize("family", ["llama_tied", "qwen3", "qwen3_moe", "gemma2"])
def test_folded_norm_equals_unfolded(family, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    layers = model.model.layers
    folded = "pre_feedforward_layernorm" if family == "gemma2" else "post_attention_layernorm"
    x0 = torch.randn(2, SEQ, model.config.hidden_size)
    grad_out = torch.randn(2, SEQ, model.config.vocab_size)
    results = []
    for tile, folds in ((None, ()), (TILE, ()), (TILE, ("block",)), (TILE, ("block", "attention"))):
        tiles = SequenceTiles(layers, tile) if tile else None
        if tiles:
            with monkeypatch.context() as m:
                if "block" not in folds:
                    m.setattr(folded_norms, "FOLDED_NORMS", {})
                if "attention" not in folds:
                    m.setattr(folded_norms, "FOLDED_ATTENTION", {})
                tiles.install()
            assert [n for n, *_ in tiles.norms] == ([getattr(ly, folded) for ly in layers] if "block" in folds else [])
            attention = "attention" in folds
            assert [n for n, *_ in tiles.input_norms] == ([ly.input_layernorm for ly in layers] if attention else [])
            projections = [getattr(ly.self_attn, n) for ly in layers for n in ("q_proj", "k_proj", "v_proj")]
            assert [p for p, *_ in tiles.projections] == (projections if attention else [])
        x = x0.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        logits = model(inputs_embeds=x).logits
        logits.backward(grad_out)
        results.append((logits, x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        if tiles:
            tiles.uninstall()
    (ref_out, ref_dx, ref_dw), (un_out, _, _) = results[:2]
    assert _rel(results[2][0], un_out) < 1e-6 and _rel(results[3][0], un_out) < 1e-6
    for out, dx, dw in results[2:]:
        assert dw.keys() == ref_dw.keys() and any(folded in n for n in dw) and any("input_layernorm" in n for n in dw)
        assert _rel(out, ref_out) < 1e-6 and _rel(dx, ref_dx) < 1e-6
        for n, ref in ref_dw.items():
            if ref.norm() > 0:  # an expert without tokens has an all-zero grad on both sides
                assert _rel(dw[n], ref) < 1e-6, n


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


# Install and uninstall, blocks, folded norms and projections alike: an instance forward set before ours comes back;
# a norm reachable under another name too (here layer 2's post_attention_layernorm is layer 0's input_layernorm) is
# not folded, so layer 2's block runs tiled after its norm ran whole, and layer 0's q, k and v run untiled after
# theirs. The attention fold is decided per layer: Qwen3.5's linear-attention layers (no self_attn) keep their norm.
def test_install_shadows_each_block_and_norm_and_uninstall_restores_them(caplog):
    class Plain(nn.Module):  # a layer without a position-wise block: logged once, runs untiled
        def forward(self, x):
            return x

    model = AutoModelForCausalLM.from_config(FAMILIES["mixtral"]())
    layers = model.model.layers
    custom, custom_norm = layers[1].mlp.forward, layers[1].post_attention_layernorm.forward
    custom_input_norm, custom_q = layers[1].input_layernorm.forward, layers[1].self_attn.q_proj.forward
    layers[1].mlp.forward = custom  # instance forwards set before ours
    layers[1].post_attention_layernorm.forward = custom_norm
    layers[1].input_layernorm.forward = custom_input_norm
    layers[1].self_attn.q_proj.forward = custom_q
    layers[2].post_attention_layernorm = layers[0].input_layernorm
    stack = nn.ModuleList([*layers, Plain(), Plain()])
    tiles = SequenceTiles(stack, TILE)
    with caplog.at_level(logging.INFO, logger="lightning_megatrain.engine.tiling"):
        tiles.install()
    norms = [layer.post_attention_layernorm for layer in layers]
    input_norms = [layer.input_layernorm for layer in layers]
    projections = [getattr(ly.self_attn, n) for ly in layers for n in ("q_proj", "k_proj", "v_proj")]
    assert [b for b, *_ in tiles.blocks] == [layer.mlp for layer in layers]
    assert [n for n, *_ in tiles.norms] == norms[:2]
    assert [n for n, *_ in tiles.input_norms] == input_norms[1:]
    assert [p for p, *_ in tiles.projections] == projections[3:]
    assert all("forward" in m.__dict__ for m in [*(layer.mlp for layer in layers), *norms[:2], *projections[3:]])
    assert "forward" not in norms[2].__dict__ and layers[2].mlp._megatrain_norm is None
    assert not any("forward" in p.__dict__ for p in projections[:3])
    assert layers[1].self_attn.q_proj._megatrain_norm is custom_input_norm  # the norm's own forward, in each tile
    assert caplog.text.count("no position-wise block") == 1 and "Plain" in caplog.text
    assert caplog.text.count("runs inside each tile") == 1 and "('post_attention_layernorm') of 2 layers" in caplog.text
    assert "('input_layernorm') of 2 layers runs inside the tiles of its projections ('self_attn.k_proj', " \
        "'self_attn.q_proj', 'self_attn.v_proj')" in caplog.text
    tiles.uninstall()
    assert "forward" not in layers[0].mlp.__dict__ and layers[1].mlp.__dict__["forward"] is custom
    assert "forward" not in norms[0].__dict__ and norms[1].__dict__["forward"] is custom_norm
    assert input_norms[1].__dict__["forward"] is custom_input_norm and projections[3].__dict__["forward"] is custom_q
    assert "forward" not in input_norms[2].__dict__ and not any("forward" in p.__dict__ for p in projections[4:])
    modules = [m for layer in layers for m in (layer.mlp, *layer.children(), *layer.self_attn.children())]
    assert not [k for m in modules for k in m.__dict__ if k.startswith("_megatrain")]
    if "qwen3_5" in FAMILIES:
        hybrid = AutoModelForCausalLM.from_config(FAMILIES["qwen3_5"]()).model.layers
        assert [f is not None for f in folded_norms.folded_attention(hybrid)] == [
            layer.block_type == "full_attention" for layer in hybrid
        ] != [True] * len(hybrid)


# Rows no longer than a tile run as without tiles: the folded norms run as themselves (and the block and the
# projections untiled on their outputs), bitwise the uninstalled model's logits and grads; on a longer row both norms
# return their input itself and q_proj applies the norm before attention in each tile.
def test_folded_norm_runs_itself_on_short_rows():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES["llama_tied"]())
    layer = model.model.layers[0]
    x0 = torch.randn(2, TILE, model.config.hidden_size)
    results = []
    for tile in (None, TILE):
        tiles = SequenceTiles(model.model.layers, tile) if tile else None
        if tiles:
            tiles.install()
            assert len(tiles.norms) == len(tiles.input_norms) == len(model.model.layers)
            long = torch.randn(2, TILE + 1, model.config.hidden_size)
            for norm in (layer.post_attention_layernorm, layer.input_layernorm):
                assert torch.equal(norm(x0), type(norm).forward(norm, x0)) and norm(long) is long
            q_proj, input_norm = layer.self_attn.q_proj, layer.input_layernorm
            assert torch.equal(q_proj(x0), nn.Linear.forward(q_proj, x0))
            tiled = torch.cat([nn.Linear.forward(q_proj, type(input_norm).forward(input_norm, part))
                               for part in long.split(TILE, dim=1)], dim=1)
            assert torch.equal(q_proj(long), tiled)
        x = x0.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        model(inputs_embeds=x).logits.sum().backward()
        results.append([x.grad, *(p.grad for p in model.parameters())])
        if tiles:
            tiles.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.fixture
def block_inputs(monkeypatch):
    """The sequence lengths every LlamaMLP, Qwen3MLP, MixtralSparseMoeBlock and Gemma2MLP forward receives."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    lengths: list[int] = []
    for cls in (LlamaMLP, Qwen3MLP, MixtralSparseMoeBlock, Gemma2MLP):

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
# qwen3 keeps layer 0's graph (tiles with grad in forward), the others recompute every layer; the norm before the
# block runs in the tiles (folded: gemma2's pre_feedforward_layernorm, the others' post_attention_layernorm), and so
# does the norm before attention, in the tiles of q, k and v (the installs' log lines say so).
# Untiled, these records are bitwise plain Lightning's up to the first update; tiles change the summation order of
# grads: the first step within 1e-6 (worst measured 2.8e-7 llama_untied, 3.3e-7 qwen3, 2.9e-7 mixtral, 3.4e-7 gemma2),
# later ones within 3e-4 (worst measured 1.4e-5 llama_untied, 1.3e-4 qwen3, 7.0e-6 mixtral, 6.3e-5 gemma2; Qwen3's
# is its k_norm weight grad after two Adam updates, which normalise rounding noise in small grads: 6.9e-5 without the
# norm before attention folded, so 1e-4 held before the tiled q, k and v and fails with them).
@pytest.mark.parametrize(("family", "seed", "keep"),
                         [("llama_untied", 1, 0), ("qwen3", 0, 1), ("mixtral", 0, 0), ("gemma2", 0, 0)])
def test_tiled_training_parity(family, seed, keep, block_inputs, caplog):
    ref = _reference(family, seed)
    assert all(_global_norm(g) > 1.0 for g in ref.grads)  # clipping bites
    block_inputs.clear()
    strategy = MegaTrainStrategy(cpu_adam="torch", seq_tile=TILE, keep_layers=keep)
    with caplog.at_level(logging.INFO, logger="lightning_megatrain.engine.tiling"):
        rec = run(strategy, family, accumulate=2, clip=1.0, seed=seed)
    assert_records_close(rec, ref, rtol=1e-6, rtol_updated=3e-4)
    # per micro-batch (3 steps x 2) each block in 4 tiles, never the whole row: a recomputed layer's block runs them
    # three times (in forward without grad, in the layer's recompute, and each tile once more by its checkpoint in
    # backward), a kept layer's twice (forward with grad, the re-run in backward)
    assert sorted(set(block_inputs)) == [1, TILE]
    layers = FAMILIES[family]().num_hidden_layers
    assert f"the norm before attention ('input_layernorm') of {layers} layers runs inside the tiles" in caplog.text
    assert len(block_inputs) == 3 * 2 * 4 * (3 * (layers - keep) + 2 * keep)


def test_untiled_when_off_or_short(block_inputs):
    run(MegaTrainStrategy(cpu_adam="torch", seq_tile=None), "llama_tied", steps=1)
    run(MegaTrainStrategy(cpu_adam="torch"), "llama_tied", steps=1)  # "auto": rows of 16 positions are short
    assert set(block_inputs) == {SEQ}


class _Alive(TorchDispatchMode):
    """Bytes of the storages that aten ops produced and that are still alive: not those of their inputs (views of
    them, in-place results), such as the tiles' views of the layer's input."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
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


# What the folded norms no longer keep ([Note: folded norms], planner/memory.py's _tiled): a Llama layer with grad,
# tiled, alive after forward against the same tiles with a fold off (its allow-list emptied). The norm before the
# block, in fp32: its fp32 normalised value (4H per token) and rsqrt (4), and its output (4H), which the tiles keep as
# their input, all [B, T, *]. The norm before attention: its normalised value and rsqrt (4H + 4), and what q, k and v
# save of its output: in fp32 the output itself (4H, one tensor for the three), under bf16 autocast each projection's
# own bf16 copy (3 x 2H); and under autocast the projections' bf16 weights, which autocast casts once, and which a
# tile's backward casts again. Folded, the tiles keep views of the residual stream, alive either way.
@pytest.mark.parametrize(("fold", "dtype", "per_token"), [
    ("FOLDED_NORMS", torch.float32, lambda H: 8 * H + 4),
    ("FOLDED_ATTENTION", torch.float32, lambda H: 8 * H + 4),
    ("FOLDED_ATTENTION", torch.bfloat16, lambda H: 10 * H + 4),
])
def test_folded_norm_keeps_no_activations(fold, dtype, per_token, monkeypatch):
    config, layer = _layer()
    batch, seq, H = 2, 256, config.hidden_size
    x0 = torch.randn(batch, seq, H)
    cos, sin = LlamaRotaryEmbedding(config)(x0, torch.arange(seq)[None])
    alive = []
    for on in (False, True):
        with monkeypatch.context() as m:
            if not on:
                m.setattr(folded_norms, fold, {})
            tiles = SequenceTiles(nn.ModuleList([layer]), 32)
            tiles.install()
        assert len(tiles.norms if fold == "FOLDED_NORMS" else tiles.input_norms) == on
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), _Alive() as mode:
            out = layer(x, position_embeddings=(cos, sin), attention_mask=None)
        alive.append(mode.alive())
        out.float().sum().backward()
        tiles.uninstall()
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    weights = sum(2 * p.weight.numel() for p in projections) if dtype == torch.bfloat16 else 0
    assert alive[0] - alive[1] == per_token(H) * batch * seq + weights, alive


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
