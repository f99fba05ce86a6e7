"""lightning_megatrain.optim.host_optimizer: the host Adam implementations and the update functions the engine applies
layer by layer (HostUpdate on the host, fused_device_update for gpu_optimizer_groups), against torch's AdamW; and
DeepSpeed as an optional extra: the fallback and the error without it."""

from __future__ import annotations

import builtins
import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.optim import deepspeed_adam, host_optimizer

from helpers.parity import assert_records_close, run

REPO = Path(__file__).resolve().parents[2]


def test_device_update_is_the_adamw_step_with_clipping():
    """engine/device_state.py's update (here on CPU tensors) equals AdamW.step() on grads scaled by the clip factor,
    per param group (weight decay on one, not the other), with the moments held apart from the parameters, and
    skips a parameter without a gradient as step() does."""
    from lightning_megatrain.optim.host_optimizer import fused_device_update

    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5), (2,)]
    ref_params = [torch.randn(s) for s in shapes]
    params = [p.clone() for p in ref_params]  # keys of the optimizer state, as the host masters are
    mirrors = [p.clone() for p in ref_params]  # what the update writes, as the device mirrors are

    def adamw(ps):
        return torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                                 weight_decay=0.1, fused=True)

    ref, opt = adamw(ref_params), adamw(params)
    for p, m in zip(params, mirrors):
        opt.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
    for step in range(3):
        grads = [torch.randn(s) for s in shapes[:3]] + [None]
        coef = None if step == 0 else torch.tensor(0.5)
        for p, g in zip(ref_params, grads):
            p.grad = None if g is None else g * (1.0 if coef is None else coef)
        ref.step()
        fused_device_update(opt, coef)(params, mirrors, grads)
    for k, (a, b) in enumerate(zip(mirrors, ref_params)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"param {k}")
    assert torch.equal(mirrors[3], params[3])  # never had a gradient: untouched


@pytest.mark.parametrize("weights", ["bf16_sr", "bf16_kahan", "fp32"])
def test_compact_device_update_is_the_compactadamw_step_with_clipping(weights):
    """optim/compact_update.py's update of compact device groups (here on CPU tensors; on a GPU in
    tests/engine/test_gpu_compact_state.py) writes into mirrors held apart from the parameters exactly what
    ``CompactAdamW.step()`` writes into the parameters, bit for bit: each parameter's stochastic-rounding stream (its
    position over all param groups), per-group hyperparameters, the clip factor inside the kernel (0.5: exact, so
    the reference scales its grads instead); a parameter without a gradient is untouched, its step count too."""
    from lightning_megatrain.optim.compact_adam import CompactAdamW, new_state
    from lightning_megatrain.optim.compact_update import compact_device_update

    torch.manual_seed(0)
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    shapes = [(300, 4), (700,), (3, 5), (2,)]
    ref_params = [torch.randn(s).to(dtype) for s in shapes]
    params = [p.clone() for p in ref_params]  # the optimizer state's keys, as the host masters are
    mirrors = [p.clone() for p in ref_params]  # what the update writes, as the device mirrors are
    initial = [p.clone() for p in ref_params]

    def compact(ps):
        return CompactAdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                            weight_decay=0.1, weights=weights, moments="int8", compile=False)

    ref, opt = compact(ref_params), compact(params)
    for p, m in zip(params, mirrors):
        opt.state[p].update(new_state(m, weights, "int8"))
    for step in range(3):
        grads = [torch.randn(s).to(dtype) for s in shapes[:3]] + [None]
        coef = None if step == 0 else torch.tensor(0.5)
        for p, g in zip(ref_params, grads):
            p.grad = None if g is None else g * (1.0 if coef is None else 0.5)
        ref.step()
        compact_device_update(opt, coef)(params, mirrors, grads)
    for k, (a, b) in enumerate(zip(mirrors[:3], ref_params[:3])):
        assert torch.equal(a, b), f"param {k}"
        assert float(opt.state[params[k]]["step"]) == 3
    assert torch.equal(mirrors[3], params[3]) and float(opt.state[params[3]]["step"]) == 0
    assert all(torch.equal(p, w) for p, w in zip(params, initial))  # the keys stay as they were


def test_deepspeed_cpu_adam_matches_torch():
    from lightning_megatrain.optim import host_optimizer

    torch.manual_seed(0)
    init = [torch.randn(257, 33), torch.randn(1000)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    results = []
    for mode in ("deepspeed", "torch"):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = torch.optim.AdamW(
            [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
        )
        try:
            opt = host_optimizer.to_host_optimizer(opt, mode)
        except RuntimeError as e:
            pytest.skip(f"DeepSpeedCPUAdam does not build here: {e}")
        assert (type(opt).__name__ == "HostCPUAdam") == (mode == "deepspeed")
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append(params)
    for a, b in zip(*results):
        # different fp32 instruction order (AVX vs ATen): weights agree to 1e-4 of one update (lr 1e-2)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_host_update_skips_parameters_stepped_on_the_gpu():
    """HostUpdate(skip=...) leaves the parameters of gpu_optimizer_groups (and their states) to the device step."""
    from lightning_megatrain.optim.host_optimizer import HostUpdate

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    reference = torch.optim.AdamW(ref[:1], lr=1e-2, fused=True)
    before = params[1].detach().clone()
    with torch.no_grad():
        update = HostUpdate(opt, None, skip=frozenset({id(params[1])}))
        update.prepare([params])
        update(params)
    reference.step()
    torch.testing.assert_close(params[0], ref[0], rtol=0, atol=0)
    assert torch.equal(params[1], before) and params[1] not in opt.state


# --- DeepSpeed is an optional extra (`pip install lightning-megatrain[deepspeed]`) --------------------------------


@pytest.fixture
def without_deepspeed(monkeypatch):
    """``import deepspeed`` fails as it does where the extra is not installed; host_optimizer's once-per-process
    memory of a failed build and of its warning starts empty."""
    real_import = builtins.__import__

    def import_without_deepspeed(name, *args, **kwargs):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_without_deepspeed)
    monkeypatch.setattr(host_optimizer, "_deepspeed_failure", None)
    monkeypatch.setattr(host_optimizer, "_warned", False)


def _adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([nn.Parameter(torch.randn(4, 3))], lr=1e-2, weight_decay=0.1)


def test_auto_without_deepspeed_falls_back_to_torch_fused_adamw_with_one_warning(without_deepspeed):
    with pytest.warns(UserWarning, match=r"DeepSpeedCPUAdam is unavailable \(ModuleNotFoundError: No module named "
                      r"'deepspeed'\); using torch fused AdamW(.|\n)*lightning-megatrain\[deepspeed\]") as record:
        optimizers = [host_optimizer.to_host_optimizer(_adamw(), "auto") for _ in range(2)]
    assert sum("DeepSpeedCPUAdam is unavailable" in str(w.message) for w in record) == 1  # once per process
    for optimizer in optimizers:  # the same object, flipped to torch's fused kernel
        assert type(optimizer) is torch.optim.AdamW and all(g["fused"] for g in optimizer.param_groups)


def test_deepspeed_mode_without_deepspeed_names_the_extra(without_deepspeed):
    with pytest.raises(RuntimeError, match=r"cpu_adam='deepspeed'\) could not build DeepSpeedCPUAdam \("
                       r"ModuleNotFoundError: No module named 'deepspeed'\)(.|\n)*HINT(.|\n)*"
                       r"`pip install lightning-megatrain\[deepspeed\]`"):
        host_optimizer.to_host_optimizer(_adamw(), "deepspeed")


def test_strategy_trains_without_deepspeed(without_deepspeed):
    # the default cpu_adam="auto" through Trainer.fit: the one warning, then torch's fused AdamW, step for step the
    # same as plain Lightning with the same kernel
    with pytest.warns(UserWarning, match="DeepSpeedCPUAdam is unavailable"):
        got = run(MegaTrainStrategy(), "llama_tied", steps=2)
    assert_records_close(got, run("auto", "llama_tied", steps=2, optimizer="adamw_fused"))


def test_the_package_imports_without_deepspeed():
    # no module of the package imports deepspeed at import time: only to_host_optimizer does, on first use
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        sys.modules["deepspeed"] = None  # `import deepspeed` now raises ModuleNotFoundError, as where not installed
        import lightning_megatrain
        for module in pkgutil.walk_packages(lightning_megatrain.__path__, "lightning_megatrain."):
            if not module.name.endswith("__main__"):  # that one runs the CLI
                importlib.import_module(module.name)
        print("imported", len(sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize(("saved_by", "loaded_by"), [("torch", "deepspeed"), ("deepspeed", "torch"), ("plain", "torch"),
                                                     ("plain", "deepspeed")])
def test_state_loads_across_host_implementations(saved_by, loaded_by):
    # a checkpoint of one host Adam (or of plain Lightning's torch AdamW) resumed under another: the hyperparameters,
    # moments and step counts carry over, the implementation flags stay the loader's, and the next step runs and
    # equals the saver's own next step (1e-5: DeepSpeedCPUAdam and torch's fused kernel differ by ~1e-6 in one step)
    def make(mode):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(16)) for _ in range(2)]
        adamw = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
        return params, adamw if mode == "plain" else host_optimizer.to_host_optimizer(adamw, mode)

    def step(params, optimizer, seed):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()

    params, saver = make(saved_by)
    for seed in (1, 2):
        step(params, saver, seed)
    saved = copy.deepcopy(saver.state_dict())  # as torch.load gives it: no tensor shared with the saver
    values = [p.detach().clone() for p in params]

    loaded_params, loader = make(loaded_by)
    own_flags = [{k: g[k] for k in host_optimizer._IMPLEMENTATION_KEYS if k in g} for g in loader.param_groups]
    with torch.no_grad():
        for p, v in zip(loaded_params, values):
            p.copy_(v)
    host_optimizer.load_host_state(loader, saved)
    assert [{k: g[k] for k in flags} for g, flags in zip(loader.param_groups, own_flags)] == own_flags
    assert loader.param_groups[0]["lr"] == 0.1 and loader.param_groups[0]["weight_decay"] == 0.01
    if loaded_by == "torch":
        assert host_optimizer.overlappable(loader)  # still the fused path the overlapped step needs
    step(params, saver, 3)
    step(loaded_params, loader, 3)
    for a, b in zip(loaded_params, params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("via", ["HostUpdate", "step"])
def test_deepspeed_resumed_is_bitwise_the_uninterrupted(via, fast_cpuinfo):
    """[Note: DeepSpeed's beta powers]: 20 steps, the state saved and loaded into a new DeepSpeedCPUAdam (a fresh C++
    object), 20 more: parameters and moments bitwise those of 40 uninterrupted steps, through the engine's update
    and through ``optimizer.step()`` (before the fix: 6e-7 apart)."""

    def make():
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(1000)) for _ in range(3)]
        adamw = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2,
                                  weight_decay=0.1)
        try:
            return params, host_optimizer.to_host_optimizer(adamw, "deepspeed")
        except RuntimeError as e:
            pytest.skip(f"DeepSpeedCPUAdam does not build here: {e}")

    def steps(params, optimizer, seeds):
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if via == "step":
                optimizer.step()
                continue
            update = host_optimizer.HostUpdate(optimizer)
            update.prepare([params])
            with torch.no_grad():
                update(params)

    ref_params, ref = make()
    steps(ref_params, ref, range(40))
    params, first = make()
    steps(params, first, range(20))
    saved = copy.deepcopy(first.state_dict())
    resumed_params, resumed = make()
    with torch.no_grad():
        for p, q in zip(resumed_params, params):
            p.copy_(q)
    host_optimizer.load_host_state(resumed, saved)
    steps(resumed_params, resumed, range(20, 40))
    for k, (a, b) in enumerate(zip(resumed_params, ref_params)):
        assert torch.equal(a, b), f"param {k}: max diff {float((a - b).abs().max()):.3g}"
        assert torch.equal(resumed.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"]), k


# --- The CPUAdam extension's first build (a silent minute without a message) ----------------------------------------


def test_cpu_adam_build_dir_is_the_torch_extensions_cache_until_built(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(CPUAdamBuilder, "_loaded_ops", {})  # as in a fresh process
    folder = deepspeed_adam.cpu_adam_build_dir()
    assert folder == tmp_path / "cpu_adam"
    (folder / "cpu_adam.so").touch()  # built by an earlier run: loaded, not built
    assert deepspeed_adam.cpu_adam_build_dir() is None
    assert deepspeed_adam.cpu_adam_build_dir(built_too=True) == folder  # where a rebuild would take its lock


def test_a_build_lock_left_behind_is_named_with_its_age(tmp_path):
    """torch waits, silently and forever, while its build lock exists; a build killed mid-way leaves it (a later run
    then hung in FileBaton.wait): the warning names the file, its age and what to do."""
    assert deepspeed_adam.build_lock_warning(tmp_path) is None and deepspeed_adam.build_lock_warning(None) is None
    lock = tmp_path / "lock"
    lock.touch()
    message = deepspeed_adam.build_lock_warning(tmp_path, now=lock.stat().st_mtime + 600)
    assert message.startswith(f"MegaTrain: DeepSpeed's CPU Adam build waits for {lock} (made 10 min ago)")
    assert "HINT: if no other build runs, delete the file; or use cpu_adam='torch'." in message


def test_building_cpu_adam_is_logged_before_the_build_and_the_fallback_still_warns(tmp_path, monkeypatch, caplog):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    events = []

    def build(self, verbose=False):  # the JIT build, mocked: it fails, as without g++
        events.append("build")
        raise RuntimeError("mocked build failure")

    monkeypatch.setattr(deepspeed_adam, "cpu_adam_build_dir", lambda built_too=False: tmp_path / "cpu_adam")
    monkeypatch.setattr(CPUAdamBuilder, "load", build)
    monkeypatch.setattr(host_optimizer, "_deepspeed_failure", None)
    monkeypatch.setattr(host_optimizer, "_warned", False)
    caplog.set_level("INFO", logger=host_optimizer.log.name)
    caplog.handler.emit = lambda record, emit=caplog.handler.emit: (events.append("log"), emit(record))
    with pytest.warns(UserWarning, match=r"DeepSpeedCPUAdam is unavailable \(RuntimeError: .*using torch fused AdamW"):
        host_optimizer.to_host_optimizer(_adamw(), "auto")
    assert events == ["log", "build"]  # said before the build started
    assert f"building DeepSpeed's CPU Adam extension in {tmp_path / 'cpu_adam'} (once per machine" in caplog.text


def test_no_build_message_when_the_extension_is_cached(monkeypatch, caplog):
    pytest.importorskip("deepspeed")
    monkeypatch.setattr(deepspeed_adam, "cpu_adam_build_dir", lambda built_too=False: None)
    monkeypatch.setattr(host_optimizer, "_deepspeed_failure", None)
    caplog.set_level("INFO", logger=host_optimizer.log.name)
    host_optimizer.to_host_optimizer(_adamw(), "auto")
    assert "building" not in caplog.text
