"""lightning_megatrain.optim.compact_adam and optim.rounding: AdamW over compact state against torch's AdamW (bit for
bit in fp32, within stated bounds on a toy problem in the compact formats), the rounding and quantization maps, the
bytes per parameter, save and resume, and the errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from lightning_megatrain.optim import compact_adam
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS, CompactAdamW, adamw_update, new_state
from lightning_megatrain.optim.rounding import (
    BLOCK,
    _hash32,
    _hash_bits,
    decode_signed,
    decode_unsigned,
    encode_signed,
    encode_unsigned,
    nearest_bits,
    round_stochastic,
)

COMPACT = [("fp32", "int8"), ("bf16_sr", "int8"), ("bf16_kahan", "int8")]


def _grads(shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


@pytest.mark.parametrize("decoupled", [True, False])
def test_fp32_formats_are_torch_adamw_bit_for_bit(monkeypatch, decoupled):
    """weights="fp32", moments="fp32" is torch's single-tensor Adam/AdamW exactly, over two param groups, with a
    chunk boundary and a partial last block inside a parameter; an infinite weight in the group without weight decay
    stays infinite with finite moments, as in torch (which adds no decay term there to turn it into NaN)."""
    monkeypatch.setattr(compact_adam, "CHUNK", 2 * BLOCK)
    shapes = [(7, 150), (33,)]  # 1050 elements: chunks of 512, 512, 26
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref[1].data[0] = float("inf")
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    groups = lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0, "lr": 3e-3}]
    opt_ref = kind(groups(ref), lr=1e-2, weight_decay=0.1, foreach=False)
    opt = CompactAdamW(groups(ours), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=decoupled, weights="fp32",
                       moments="fp32", compile=False)
    for grads in _grads(shapes, 5):
        for a, b, g in zip(ref, ours, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt_ref.step()
        opt.step()
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
        assert torch.equal(opt_ref.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"].view(b.shape))


def test_grad_scale_is_a_scaled_gradient():
    """``grad_scale`` (the clipping factor) gives the update of the gradient multiplied by it first."""
    w0, g = torch.randn(1000), torch.randn(1000)
    out = []
    for grad, scale in ((g * 0.37, 1.0), (g, 0.37)):
        w, state = w0.clone(), new_state(w0, "fp32", "fp32")
        adamw_update(w, grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True,
                     weights="fp32", moments="fp32", seed=0, grad_scale=scale)
        out.append(w)
    assert torch.equal(*out)


def test_chunks_do_not_change_the_result(monkeypatch):
    """The stochastic rounding's bits and the quantization blocks follow the element index, not the chunk: a step
    in chunks of 2 blocks equals a step in one chunk, bit for bit."""
    w0, g = torch.randn(5 * BLOCK + 17).bfloat16(), torch.randn(5 * BLOCK + 17)
    out = []
    for chunk in (2 * BLOCK, 1 << 20):
        monkeypatch.setattr(compact_adam, "CHUNK", chunk)
        w, state = w0.clone(), new_state(w0, "bf16_sr", "int8")
        for step in range(3):
            adamw_update(w, g, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True,
                         weights="bf16_sr", moments="int8", seed=step)
        out.append((w, state))
    assert torch.equal(out[0][0], out[1][0])
    for key in out[0][1]:
        assert torch.equal(out[0][1][key], out[1][1][key]), key


def test_block_quantization_error_bounds():
    """[Note: 8-bit moments]: each decoded value is within the map's half-step of the original, in each block's own
    scale (an outlier in one block leaves the other blocks' precision alone); an all-zero block decodes to 0."""
    torch.manual_seed(0)
    x = torch.randn(4 * BLOCK) * torch.logspace(-6, 0, 4 * BLOCK)  # magnitudes over 6 decades
    x[3 * BLOCK:] = 0.0
    x[5] = 1e3  # an outlier in block 0
    codes, scale = encode_signed(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (4,)
    s = scale.repeat_interleave(BLOCK)
    q, dq = (x.abs() / s.clamp_min(1e-30)).sqrt(), 0.5 / 127  # the stored sqrt of |x| / scale, half a step
    err = (decode_signed(codes, scale) - x).abs()
    assert torch.all(err <= s * ((q + dq) ** 2 - q**2) * 1.0001 + 1e-30)
    v = x.square()
    codes, scale = encode_unsigned(v, v.sqrt())
    assert codes.dtype == torch.uint8
    s = scale.repeat_interleave(BLOCK)
    q, dq = (v / s.clamp_min(1e-30)) ** 0.25, 0.5 / 255
    err = (decode_unsigned(codes, scale) - v).abs()
    assert torch.all(err <= s * ((q + dq) ** 4 - q**4) * 1.0001 + 1e-30)
    # blocks 1 and 2 (no outlier): sqrt(v) within 4% down to 1/10,000 of the block maximum
    inner = slice(BLOCK, 3 * BLOCK)
    keep = v[inner] >= 1e-4 * scale[1:3].repeat_interleave(BLOCK)
    rel = (decode_unsigned(codes, scale)[inner].sqrt() - v[inner].sqrt()).abs() / v[inner].sqrt()
    assert rel[keep].max() < 0.04
    assert torch.all(decode_unsigned(codes, scale)[3 * BLOCK:] == 0) and torch.all(scale[3:] == 0)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    """[Note: stochastic rounding]: each value lands on one of its two bf16 neighbours, on average on itself; the
    same start gives the same bits, another start others, element i's bits are hash(start + i) whatever the chunk;
    nearest_bits is bf16's round to nearest even."""
    x = torch.full((200_000,), 1.0 + 2**-10)  # 1/8 of the way from 1.0 to the next bf16 (1 + 2**-7)
    r = round_stochastic(x, torch.tensor(12345))
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert r.mean().item() == pytest.approx(1.0 + 2**-10, abs=2**-7 * 0.01)
    assert torch.equal(r, round_stochastic(x, torch.tensor(12345)))
    assert not torch.equal(r, round_stochastic(x, torch.tensor(12346)))
    y = -torch.rand(100_000) * 10
    assert ((round_stochastic(y, torch.tensor(7)) - y).abs() < y.abs() * 2**-7).all()
    assert (round_stochastic(y, torch.tensor(7)) - y).mean().abs() < 1e-3 * y.abs().mean() * 2**-7 * 100
    z = torch.randn(100_000) * torch.logspace(-20, 20, 100_000)
    assert torch.equal(nearest_bits(z).view(torch.float32), z.bfloat16().float())
    start = 2**31 - 40  # the int32 index wraps inside this range
    bits = _hash_bits(torch.tensor(start), 80)
    assert bits.tolist() == [_hash32((start + i) & 0xFFFFFFFF) & 0xFFFF for i in range(80)]
    assert torch.equal(bits[50:], _hash_bits(torch.tensor(start + 50), 30))


def _teacher_student(weights, moments, *, lr, shift=0.0, steps=200):
    """A 2-layer tanh MLP fitting a teacher of the same shape plus noise, minibatches of 64: the full-data loss at
    steps 0, 50, ..., 200, and the first layer's weights at the start and at the end."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 32, generator=g)
    t1, t2 = torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 8, generator=g) / 64**0.5
    Y = torch.tanh(X @ t1) @ t2 + 0.1 * torch.randn(512, 8, generator=g)
    inits = [shift + torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 8, generator=g) / 64**0.5]
    if weights == "torch":
        ps = [torch.nn.Parameter(w.clone()) for w in inits]
        opt = torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)
    else:
        dtype = torch.float32 if weights == "fp32" else torch.bfloat16
        ps = [torch.nn.Parameter(w.to(dtype)) for w in inits]
        opt = CompactAdamW(ps, lr=lr, weight_decay=0.01, weights=weights, moments=moments, compile=False)
    loss = lambda x, y: ((torch.tanh(x @ ps[0].float()) @ ps[1].float() - y) ** 2).mean()
    first, curve = ps[0].detach().clone(), [loss(X, Y).item()]
    for step in range(steps):
        idx = torch.randint(0, 512, (64,), generator=g)
        for p, grad in zip(ps, torch.autograd.grad(loss(X[idx], Y[idx]), ps)):
            p.grad = grad.to(p.dtype)
        opt.step()
        if step % 50 == 49:
            curve.append(loss(X, Y).item())
    return torch.tensor(curve), first, ps[0].detach()


def test_compact_variants_track_fp32_adamw():
    """Each compact format's full-data loss stays within 2% of torch's fp32 AdamW at every 50th of 200 steps
    (lr 1e-2; measured: within 0.6%) while the loss falls 35-fold."""
    ref, _, _ = _teacher_student("torch", None, lr=1e-2)
    assert ref[-1] < ref[0] / 30
    for weights, moments in COMPACT:
        curve, _, _ = _teacher_student(weights, moments, lr=1e-2)
        torch.testing.assert_close(curve, ref, rtol=0.02, atol=0, msg=f"{weights}, {moments}")


def test_round_to_nearest_stalls_where_stochastic_rounding_and_kahan_do_not():
    """Weights around 1 (shifted by +1) and lr 1e-3: an AdamW step (at most ~3 lr) is below half a bf16 unit at
    magnitude >= 1 (2**-8), so bf16 rounded to nearest never moves those weights and ends 30% above fp32's loss;
    stochastic rounding and the Kahan compensation move them and end within 1% of it."""
    ref, _, _ = _teacher_student("torch", None, lr=1e-3, shift=1.0)
    nearest, before, after = _teacher_student("bf16", "fp32", lr=1e-3, shift=1.0)
    large = before.float().abs() >= 1.0
    assert large.sum() > 1000 and torch.equal(after[large], before[large])
    assert nearest[-1] > 1.3 * ref[-1]
    for weights in ("bf16_sr", "bf16_kahan"):
        curve, before, after = _teacher_student(weights, "int8", lr=1e-3, shift=1.0)
        assert (after[large] != before[large]).float().mean() > 0.9
        assert curve[-1] == pytest.approx(ref[-1].item(), rel=0.01), weights


def test_state_bytes_per_parameter():
    """[Note: compact host state]'s table, and the bytes a CompactAdamW step really allocates for each layout."""
    assert {k: sum(v.bytes_per_param().values()) for k, v in HOST_STATE_LAYOUTS.items()} == {
        "fp32": 16, "int8_moments": 10.03125, "compact": 6.03125, "compact_kahan": 8.03125}
    n = 64 * BLOCK
    for name, layout in HOST_STATE_LAYOUTS.items():
        p = torch.nn.Parameter(torch.zeros(n, dtype=layout.weight_dtype))
        p.grad = torch.ones(n, dtype=layout.grad_dtype)
        opt = CompactAdamW([p], weights=layout.weights, moments=layout.moments, compile=False)
        opt.step()
        states = sum(t.nbytes for t in opt.state[p].values()) - 4  # less the step count
        allocated = (p.nbytes + p.grad.nbytes + states) / n
        assert allocated == sum(layout.bytes_per_param().values()), name


@pytest.mark.parametrize("compile", [False, True])  # eager ops; the native kernel (CPU, 8-bit moments)
@pytest.mark.parametrize("weights", ["bf16_sr", "bf16_kahan"])
def test_save_and_resume_are_bit_exact(weights, compile):
    """Three steps, a state dict through torch.save, three more: a new optimizer on the saved weights resumes to
    the same weights and states bit for bit (the block scales stay fp32; the rounding bits follow the step)."""
    shapes = [(40, 30), (70,)]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    opt = CompactAdamW(params, lr=1e-2, weights=weights, compile=compile)
    grads = _grads(shapes, 6)
    saved = None
    for k, step_grads in enumerate(grads):
        if k == 3:
            buffer = io.BytesIO()
            torch.save({"weights": [p.detach().clone() for p in params], "optim": opt.state_dict()}, buffer)
            saved = buffer.getvalue()
        for p, g in zip(params, step_grads):
            p.grad = g.bfloat16()
        opt.step()
    loaded = torch.load(io.BytesIO(saved))
    resumed = [torch.nn.Parameter(w) for w in loaded["weights"]]
    opt2 = CompactAdamW(resumed, lr=1e-2, weights=weights, compile=compile)
    opt2.load_state_dict(loaded["optim"])
    assert opt2.state[resumed[0]]["exp_avg_scale"].dtype == torch.float32
    assert opt2.state[resumed[0]]["exp_avg"].dtype == torch.int8
    for step_grads in grads[3:]:
        for p, g in zip(resumed, step_grads):
            p.grad = g.bfloat16()
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            assert torch.equal(value, opt2.state[b][key]), key


def test_compiled_kernel_matches_eager(monkeypatch):
    """The torch.compile'd chunk update (inductor's C++ backend; what GPU parameters run, and CPU ones where the
    native kernel does not build) gives eager's result: the same bf16 weights and 8-bit codes except where fp32
    reassociation moves a value across a rounding boundary (one unit), and a compensation that is not folded to zero
    (inductor drops a bf16 round trip: optim/rounding.py nearest_bits)."""
    monkeypatch.setattr(compact_adam, "_native", lambda *args: False)
    torch.manual_seed(0)
    n = 3 * BLOCK + 5
    w0, grads = torch.randn(n).bfloat16(), [torch.randn(n) for _ in range(2)]
    out = []
    for compile in (False, True):
        w, state = w0.clone(), new_state(w0, "bf16_kahan", "int8")
        for step, g in enumerate(grads):
            adamw_update(w, g, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True,
                         weights="bf16_kahan", moments="int8", seed=step, compile=compile)
        out.append((w.float() + state["compensation"].float(), state))
    assert compact_adam._compile_failure is None
    (eager, s_eager), (compiled, s_compiled) = out
    assert s_compiled["compensation"].abs().max() > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert (s_compiled["exp_avg"].int() - s_eager["exp_avg"].int()).abs().max() <= 1


def test_errors():
    with pytest.raises(ValueError, match=r"CompactAdamW\(weights='bf8'\): choose one of"):
        CompactAdamW([torch.nn.Parameter(torch.zeros(2))], weights="bf8")
    with pytest.raises(ValueError, match=r"CompactAdamW\(moments='int4'\): choose one of"):
        CompactAdamW([torch.nn.Parameter(torch.zeros(2))], moments="int4")
    with pytest.raises(ValueError, match=r"CompactAdamW\(compile='yes'\)"):
        CompactAdamW([torch.nn.Parameter(torch.zeros(2))], compile="yes")
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    with pytest.raises(TypeError, match=r"weights='bf16_sr'\) updates contiguous bfloat16 .* got a float32 .*"
                                        r"HINT: cast the module with `.to\(torch.bfloat16\)`"):
        CompactAdamW([p], compile=False).step()
    a = torch.nn.Parameter(torch.zeros(4))
    a.grad = torch.ones(4)
    opt = CompactAdamW([a], weights="fp32", compile=False)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    b = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"saved with weights='fp32', this optimizer has weights='bf16_kahan'"):
        CompactAdamW([b], weights="bf16_kahan", compile=False).load_state_dict(saved)


@pytest.mark.parametrize("weights", ["bf16_sr", "bf16_kahan", "fp32"])
def test_update_is_device_generic(weights):
    """Every tensor the eager kernel makes is on the parameter's device: a step on the meta device (which refuses
    CPU operands, as a GPU does) runs, and the states stay there. benchmarks/compact_quality.py runs it on a GPU."""
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    p = torch.nn.Parameter(torch.zeros(3 * BLOCK + 5, device="meta", dtype=dtype))
    p.grad = torch.zeros_like(p)
    opt = CompactAdamW([p], weights=weights, compile=False)
    opt.step()
    opt.step()
    state = opt.state[p]
    assert float(state["step"]) == 2 and state["step"].device.type == "cpu"
    assert {k for k, v in state.items() if v.device.type != "meta"} == {"step"}



def test_compiled_kernel_is_one_graph_for_every_parameter_shape_and_step(monkeypatch):
    """The chunks reach the compiled kernel detached, so parameters of any shape, and chunks at any position, share
    one graph per format pair (as views, their bases' sizes were guarded: a graph per shape, and past
    ``torch._dynamo.config.recompile_limit`` (8) the kernel ran eagerly). Whole blocks only: a partial block is
    another graph (its padding), a chunk of one block too (torch.compile specializes size 1). Nor do the values that
    change between steps and groups recompile it: the bias corrections, a scheduled lr, weight decay 0 or not, a
    clipping factor of 1 or not, a cycled beta1 (Python floats there were guarded by value on the H200: a graph per
    step). The inductor kernel (what GPU parameters run): the native one is not asked here."""
    monkeypatch.setattr(compact_adam, "_native", lambda *args: False)
    monkeypatch.setattr(compact_adam, "CHUNK", 4 * BLOCK)
    monkeypatch.setattr(compact_adam, "_compiled", None)
    torch._dynamo.reset()
    # one chunk (square), three chunks (the last partial), two chunks of a 1D parameter
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(32, 32), (40, 64), (6 * BLOCK,)]]
    opt = CompactAdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], weights="fp32",
                       moments="int8", compile=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for step in range(4):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (step + 1)
            group["betas"] = (0.95 - 0.01 * step, 0.999)  # OneCycleLR's cycle_momentum changes beta1 each step
        for p in params:
            p.grad = torch.randn_like(p)
        if step % 2:
            opt.step()
        else:  # the engine's form, with a clipping factor
            for index, p in enumerate(params):
                if not opt.state[p]:
                    opt.state[p].update(new_state(p, "fp32", "int8"))
                opt.update_param(p, p.grad, opt.param_groups[index // 2], index, grad_scale=0.5 + 0.1 * step)
    assert compact_adam._compile_failure is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
