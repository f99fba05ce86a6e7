"""lightning_megatrain.optim.compact_kernel ([Note: native compact kernel]): the native AdamW over 8-bit moments gives
the eager kernel's weights, codes and scales (within the last unit: torch's CPU square root is not correctly rounded,
the native one is), whatever the number of threads and across a tensor's partial last block; without a compiler
the compiled kernel runs instead, with one warning. Its save and resume: tests/optim/test_compact_adam.py."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_megatrain.optim import compact_adam, compact_kernel
from lightning_megatrain.optim.compact_adam import adamw_update, new_state
from lightning_megatrain.optim.rounding import BLOCK

N = 9 * BLOCK + 37  # nine whole blocks and a partial one


def _steps(weights, grad_dtype, decoupled, native, n=N, steps=3, beta1=0.9):
    torch.manual_seed(0)
    w_dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    w = (torch.randn(n) * 0.1).to(w_dtype)
    state = new_state(w, weights, "int8")
    for step in range(steps):
        g = (torch.randn(n) * torch.logspace(-5, 0, n)).to(grad_dtype)  # magnitudes over 5 decades in each block
        adamw_update(w, g, state, lr=1e-2, betas=(beta1, 0.999), eps=1e-8, weight_decay=0.1 if decoupled else 0.05,
                     decoupled=decoupled, weights=weights, moments="int8", seed=4321 + step, grad_scale=0.7,
                     compile=native)
    return w, state


@pytest.mark.parametrize("weights", ["fp32", "bf16", "bf16_sr", "bf16_kahan"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_native_kernel_matches_eager(weights, grad_dtype, decoupled, monkeypatch):
    """Three steps (clipping's factor, AdamW's decoupled or Adam's L2 decay) through the native kernel (it ran: three
    calls) and the eager ops: weights within 1e-6 norm-wise (fp32) or one bf16 unit, codes within one step of the
    map, scales within 1e-5 relative (measured: fp32 weights differ in the last bit in ~7% of elements, bf16 weights
    and codes are bitwise but for a handful)."""
    assert compact_kernel.library() is not None, compact_kernel._failure
    calls = []
    update = compact_kernel.update
    monkeypatch.setattr(compact_kernel, "update", lambda *a, **k: calls.append(1) or update(*a, **k))
    (w, s), (ref, s_ref) = _steps(weights, grad_dtype, decoupled, True), _steps(weights, grad_dtype, decoupled, False)
    assert len(calls) == 3
    if weights == "fp32":
        assert (w - ref).norm() <= 1e-6 * ref.norm()  # norm-wise: a weight near 0 makes any elementwise rtol moot
    else:  # one bf16 unit: 2**-7 relative at most
        assert ((w.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-30).all()
        assert (w != ref).float().mean() < 0.01
    for key in ("exp_avg", "exp_avg_sq"):
        assert (s[key].int() - s_ref[key].int()).abs().max() <= 1, key
        assert (s[key] != s_ref[key]).float().mean() < 0.01, key
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        torch.testing.assert_close(s[key], s_ref[key], rtol=1e-5, atol=0)
    if weights == "bf16_kahan":  # the compensation is each rounding's error: equal where the weights' rounding is
        same = (w.float() + s["compensation"].float() - ref.float() - s_ref["compensation"].float()).abs()
        assert same.max() <= ref.float().abs().max() * 2**-14


@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_two_steps_give_the_eager_moments_bitwise(beta1):
    """The new moments (before any square root: torch's CPU one is not correctly rounded) are the eager ops' to the
    bit, so after two steps the first moment's codes and every block's scales are (measured): the moment's update is
    torch's lerp in both of its forms (a weight 1 - beta1 below 0.5, and 0.7; the other form gives ~50 other scales
    here) and its addcmul, each a fused multiply-add."""
    (_, s), (_, s_ref) = (_steps("bf16_sr", torch.float32, True, native, n=64 * BLOCK, steps=2, beta1=beta1)
                          for native in (True, False))
    for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(s[key], s_ref[key]), key


def test_state_the_kernel_cannot_take_goes_elsewhere():
    """A state of another length or dtype, a Kahan state without its compensation, weights not of the format's
    dtype, a strided gradient: ``_native`` says no (the kernel checks nothing and would write past the tensors)."""
    w, g = torch.zeros(N, dtype=torch.bfloat16), torch.zeros(N)
    state = new_state(w, "bf16_kahan", "int8")
    assert compact_adam._native(w, g, state, "bf16_kahan", "int8")
    assert not compact_adam._native(w, g, state, "bf16_kahan", "fp32")
    assert not compact_adam._native(w, g, {k: v for k, v in state.items() if k != "compensation"}, "bf16_kahan", "int8")
    assert not compact_adam._native(w, g, {**state, "exp_avg": state["exp_avg"][:-1]}, "bf16_kahan", "int8")
    assert not compact_adam._native(w, g, {**state, "exp_avg_sq": state["exp_avg_sq"].to(torch.int8)}, "bf16_kahan",
                                   "int8")
    assert not compact_adam._native(w, g, {**state, "exp_avg_scale": state["exp_avg_scale"][:-1]}, "bf16_kahan", "int8")
    assert not compact_adam._native(w.float(), g, state, "bf16_kahan", "int8")
    assert not compact_adam._native(w, torch.zeros(2 * N)[::2], state, "bf16_kahan", "int8")
    assert not compact_adam._native(w, g.double(), state, "bf16_kahan", "int8")


def test_native_kernel_is_bitwise_whatever_the_threads():
    """Blocks are independent: one thread and two give the same bits (the stochastic rounding's too)."""
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append(_steps("bf16_sr", torch.bfloat16, True, True, n=64 * BLOCK + 5))
    finally:
        torch.set_num_threads(before)
    (a, sa), (b, sb) = out
    assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_without_a_compiler_the_compiled_kernel_runs(monkeypatch, tmp_path, caplog):
    """No C++ compiler: ``_native`` says no (``adamw_update`` takes the compiled kernel) and one warning, once, names
    the cause; nothing is left in the build folder."""
    monkeypatch.setattr(compact_kernel, "_library", None)
    monkeypatch.setattr(compact_kernel, "_failure", None)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lightning_megatrain.optim.compact_kernel"):
        w = torch.zeros(BLOCK)
        assert not compact_adam._native(w, w, new_state(w, "fp32", "int8"), "fp32", "int8")
        assert compact_kernel.library() is None  # tried once
    assert [r.getMessage() for r in caplog.records] == [
        "MegaTrain: the native compact AdamW kernel does not build (RuntimeError: no C++ compiler ('no-such-compiler-"
        "here': set $CXX) on PATH); the compiled one runs instead (several times slower)"]
    assert not list(tmp_path.iterdir())


def test_every_loop_over_a_block_vectorizes(tmp_path):
    """The kernel's speed rests on each loop over a block's elements vectorizing: a test of lerp's form inside the
    update loop once kept it scalar, 2-3x slower, with the same results (benchmarks/results/
    2026-12-03-compact-kernel-lerp-form-2core.txt). GCC's vectorizer report names the loops it vectorized; every
    ``for (int64_t i = 0; i < n; ++i)`` of the source must be among them (other compilers: skipped)."""
    import subprocess

    try:
        compiler = compact_kernel._compiler()
    except RuntimeError:
        pytest.skip("no C++ compiler")
    if "Free Software Foundation" not in subprocess.run([*compiler, "--version"], capture_output=True,
                                                        text=True).stdout:
        pytest.skip("the vectorizer report read here is GCC's")
    source = compact_kernel.SOURCE
    loops = {k for k, line in enumerate(source.read_text().splitlines(), 1)
             if "for (int64_t i = 0; i < n; ++i)" in line}
    report = subprocess.run([*compiler, *compact_kernel.FLAGS, "-fopt-info-vec-optimized", str(source), "-o",
                             str(tmp_path / "kernel.so")], capture_output=True, text=True, check=True).stderr
    reports: dict[int, int] = {}  # source line -> how many instantiations' loops GCC reports vectorized there
    for line in report.splitlines():
        if line.startswith(str(source)) and "loop vectorized" in line:
            reports[int(line.split(":")[1])] = reports.get(int(line.split(":")[1]), 0) + 1
    assert len(loops) >= 5 and loops <= set(reports), f"not vectorized: lines {sorted(loops - set(reports))}"
    # the update loop (the one lerp's weight is read in) in every one of update_block's 16 instantiations
    # (4 weight formats x 2 gradient dtypes x coupled or decoupled decay)
    update = next(k for k, line in enumerate(source.read_text().splitlines(), 1) if "lerp_weight, gi - mi" in line)
    update_loop = max(k for k in loops if k < update)
    assert reports[update_loop] >= 16, reports
