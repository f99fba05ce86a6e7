"""``MegaTrainStrategy(host_state=...)`` on the CPU: parity of each layout against its reference, exact resume through
Lightning checkpoints, the host bytes the engine allocates against the planner's, and the refusals.

References:

- ``int8_moments``: the same module under Lightning's default strategy with ``CompactAdamW(weights="fp32",
  moments="int8")`` as its optimizer (fp32 compute, so both sides compute what the fp32 parity tests compare).
- ``compact`` / ``compact_kahan``: ``bf16_loop`` (tests/helpers/compact.py), a plain PyTorch loop over the same
  model with bf16 parameters, autograd's bf16 grad accumulation and the compact kernel applied as
  ``CompactAdamW.step`` applies it (that module's docstring defines it exactly).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.optim import CompactAdamW, compact_adam
from lightning_megatrain.optim.compact_adam import n_blocks
from lightning_megatrain.planner import HOST_STATE_BYTES

from helpers.compact import LR, WD, WEIGHTS, bf16_loop, fit_engine, max_relative_error
from helpers.forked import in_child
from helpers.host_ram import MEASURABLE, LoadAndMeasure, SaveAndMeasure, Wide, exact_rss
from helpers.parity import ParityLM, assert_records_close, run
from helpers.trainers import cpu_trainer


@pytest.fixture(autouse=True)
def eager_kernel(monkeypatch):
    """No inductor build of the compact kernel (minutes on a test machine's 2 cores): CPU parameters with 8-bit
    moments run the native kernel (optim/compact_kernel.py), in the engine and in the reference loop alike; the rest
    runs eagerly."""
    monkeypatch.setattr(compact_adam, "_compile_failure", "eager in tests")


class Int8MomentsLM(ParityLM):
    def configure_optimizers(self):
        return CompactAdamW(self.parameters(), lr=LR, weight_decay=WD, weights="fp32", moments="int8", compile=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_int8_moments_match_plain_lightning_with_compact_adamw(overlap):
    """``host_state="int8_moments"`` runs the module's AdamW as CompactAdamW through the engine's step (overlapped
    or not, accumulation 2, clipping at 0.05): losses, grads and final weights as plain Lightning running that
    CompactAdamW itself, to fp32 re-association (the clipping norm is summed in another order)."""
    ours = run(MegaTrainStrategy(host_state="int8_moments", overlap_optimizer=overlap), "qwen3", accumulate=2,
               clip=0.05)
    reference = run("auto", "qwen3", accumulate=2, clip=0.05, module=lambda: Int8MomentsLM("qwen3"))
    assert_records_close(ours, reference, rtol=1e-5, rtol_updated=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("host_state", ["compact", "compact_kahan"])
def test_compact_layouts_equal_the_bf16_loop_bit_for_bit(host_state, overlap):
    """3 steps of 2 accumulated micro-batches with an LR schedule: bf16 parameters, every loss and the 8-bit states
    equal the reference loop's exactly, serial and overlapped: the bf16 masters are the parameters, the bf16 grads
    are summed as autograd sums them, and each update is the kernel's with the same rounding bits."""
    model, optimizer, losses = fit_engine(host_state, accumulate=2, clip=None, overlap=overlap)
    masters, ref_losses, _ = bf16_loop(host_state, accumulate=2, clip=None)
    assert isinstance(optimizer, CompactAdamW) and optimizer.param_groups[0]["weights"] == WEIGHTS[host_state]
    assert losses == ref_losses and ref_losses[-1] < ref_losses[0]
    for (name, a), b in zip(model.named_parameters(), masters):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    state = optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == torch.int8 and int(state["step"]) == 3
    assert ("compensation" in state) == (host_state == "compact_kahan")


@pytest.mark.parametrize(("host_state", "overlap"), [("compact", False), ("compact_kahan", True)])
def test_compact_layouts_with_clipping_track_the_bf16_loop(host_state, overlap):
    """Clipping at 0.05 (it bites every step): the engine's factor is the reference's to fp32 rounding (its norm is
    summed in another order), and a last-bit difference of the factor flips a few bf16 roundings that the following
    steps spread, so the weights agree to about one bf16 unit (2**-8 relative) instead of bitwise."""
    scales = []
    init = compact_adam.CompactAdamW.update_param

    def recording(self, p, grad, hyper, index, grad_scale=1.0):
        scales.append(grad_scale)
        return init(self, p, grad, hyper, index, grad_scale)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compact_adam.CompactAdamW, "update_param", recording)
        model, _, losses = fit_engine(host_state, accumulate=2, clip=0.05, overlap=overlap)
    masters, ref_losses, coefs = bf16_loop(host_state, accumulate=2, clip=0.05)
    assert all(c < 1 for c in coefs)
    assert scales[0] == pytest.approx(coefs[0], rel=1e-6)
    assert losses[:2] == ref_losses[:2]  # the first step's micro-batches: nothing updated yet
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    error, name = max_relative_error(model, masters)
    assert error < 2**-8, (name, error)


def _fit_one_batch(host_state, root, steps, overlap, ckpt_path=None, checkpoint=False):
    L.seed_everything(0, verbose=False)
    module = ParityLM("qwen3")
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)] if checkpoint else []
    # one batch per epoch: every step sees the same batch, so a resumed run sees what the uninterrupted one does
    # whichever batch Lightning resumes from (the data loader is not resumable)
    trainer = cpu_trainer(strategy=MegaTrainStrategy(host_state=host_state, overlap_optimizer=overlap),
                          max_steps=steps, default_root_dir=root, limit_train_batches=1, precision="bf16-mixed",
                          gradient_clip_val=0.05, enable_checkpointing=checkpoint, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer.optimizers[0]


@pytest.mark.parametrize(("host_state", "overlap"), [("compact", False), ("compact_kahan", True)])
def test_compact_layouts_resume_bit_for_bit(tmp_path, host_state, overlap):
    """2 steps, a Lightning checkpoint, 2 more from it: the bf16 weights, 8-bit moments, scales, compensation and
    step counts equal the uninterrupted 4 steps' bit for bit (the checkpoint holds the bf16 parameters themselves;
    the rounding bits derive from the step count, not from a generator)."""
    module, optimizer = _fit_one_batch(host_state, tmp_path / "full", 4, overlap)
    _fit_one_batch(host_state, tmp_path / "resumed", 2, overlap, checkpoint=True)
    resumed, optimizer2 = _fit_one_batch(host_state, tmp_path / "resumed", 4, overlap,
                                         ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    saved = torch.load(tmp_path / "resumed" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(t.dtype == torch.bfloat16 for name, t in saved.items() if "rotary" not in name)
    for (name, a), b in zip(module.named_parameters(), resumed.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    for a, b in zip(module.parameters(), resumed.parameters()):
        assert optimizer.state[a].keys() == optimizer2.state[b].keys()
        for key, value in optimizer.state[a].items():
            assert value.dtype == optimizer2.state[b][key].dtype and torch.equal(value, optimizer2.state[b][key]), key
    assert int(optimizer2.state[next(resumed.parameters())]["step"]) == 4


class HostBytes(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.sizes = trainer.strategy.host_memory()


@pytest.mark.parametrize("host_state", list(HOST_STATE_BYTES))
def test_host_bytes_per_parameter_are_the_planners(host_state):
    """After a step, the engine's masters and grads are the planner's bytes per parameter times the parameters,
    exactly; masters plus optimizer states are the planner's masters plus moments (the Kahan compensation, which
    the planner counts with the weights, is optimizer state) up to what the planner leaves out: one 4-byte step
    count per tensor and each tensor's last, partial block of 256 (two fp32 scales)."""
    L.seed_everything(0, verbose=False)
    module, sizes = ParityLM("qwen3"), HostBytes()
    cpu_trainer(strategy=MegaTrainStrategy(host_state=host_state, cpu_adam="torch"), precision="bf16-mixed",
                callbacks=[sizes]).fit(module)
    params = list(module.parameters())
    n = sum(p.numel() for p in params)
    planned = HOST_STATE_BYTES[host_state]
    weight_bytes = 4 if host_state in ("fp32", "int8_moments") else 2
    assert sizes.sizes["masters"] == weight_bytes * n
    assert sizes.sizes["grads"] == planned["grads"] * n
    int8 = host_state != "fp32"
    left_out = sum(4 + (8 * n_blocks(p.numel()) - 8 * p.numel() / 256 if int8 else 0) for p in params)
    assert sizes.sizes["masters"] + sizes.sizes["optimizer_states"] == pytest.approx(
        (planned["masters"] + planned["optimizer states"]) * n + left_out, abs=1e-6)


def _save_and_resume(root, host_state, fmt, send) -> None:
    """The child: 2 steps of ``Wide`` (6.8M parameters) with ``host_state``, a ``fmt`` checkpoint, a resume from it;
    sends the peak RSS the load added and the anonymous memory it left (the states the optimizer keeps)."""
    exact_rss()
    precision = "32-true" if host_state == "int8_moments" else "bf16-mixed"
    save = SaveAndMeasure(root / fmt / "last.ckpt")
    strategy = MegaTrainStrategy(layers="blocks", cpu_adam="torch", host_state=host_state, checkpoint_format=fmt)
    cpu_trainer(strategy=strategy, max_steps=2, callbacks=[save], precision=precision).fit(Wide())
    load = LoadAndMeasure()
    strategy = MegaTrainStrategy(layers="blocks", cpu_adam="torch", host_state=host_state)
    cpu_trainer(strategy=strategy, max_steps=3, callbacks=[load], precision=precision).fit(Wide(), ckpt_path=save.path)
    send.send((load.extra, load.kept))


@pytest.mark.skipif(not MEASURABLE, reason="needs Linux's /proc/self/clear_refs and glibc")
@pytest.mark.parametrize(("host_state", "fmt"), [("int8_moments", "file"), ("compact", "sharded")])
def test_a_resume_adds_only_the_states_it_keeps_to_host_ram(tmp_path, host_state, fmt):
    """A resume of the compact layouts reads each 8-bit code, scale and compensation from the mapped checkpoint into
    memory of its own in its own dtype, a chunk at a time ([Note: mapped checkpoint tensors]): the peak RSS rises
    by the states the optimizer keeps and a few MiB more, as for fp32 states (the bound: 12 MiB, for the allocator's
    noise after the tests before it in the same process). Torch's ``load_state_dict`` cast the
    codes to the parameters' dtype first, all at once: 53 MiB more with ``int8_moments`` (fp32: 4 bytes per code),
    26 MiB with ``compact`` (bf16), for 13 MiB kept."""
    loaded, kept = in_child(_save_and_resume, tmp_path, host_state, fmt)
    n_params = sum(p.numel() for p in Wide().parameters())
    assert kept >= 0.9 * 2 * n_params, (loaded, kept)  # the 8-bit moments (and scales) the optimizer keeps
    assert loaded < kept + 12 * 2**20, (loaded, kept)


@pytest.mark.parametrize(("saved", "resumed"), [("compact", "fp32"), ("int8_moments", "fp32"), ("fp32", "compact"),
                                               ("compact", "compact_kahan")])
def test_a_checkpoint_of_another_layout_is_refused_when_it_loads(tmp_path, saved, resumed):
    """A checkpoint's optimizer state in another ``host_state`` layout is refused while it loads, naming both layouts
    (the 8-bit codes loaded into fp32 AdamW used to fail only at the first step, as a kernel error on a [4096]
    state, after the weights had been restored)."""
    def fit(host_state, steps, ckpt_path=None):
        L.seed_everything(0, verbose=False)
        checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
        precision = "bf16-mixed" if host_state.startswith("compact") else "32-true"
        cpu_trainer(strategy=MegaTrainStrategy(host_state=host_state, cpu_adam="torch"), max_steps=steps,
                    limit_train_batches=1, precision=precision, enable_checkpointing=True,
                    callbacks=[checkpoints]).fit(ParityLM("qwen3"), ckpt_path=ckpt_path)

    fit(saved, 1)
    with pytest.raises(ValueError, match=rf"saved with MegaTrainStrategy\(host_state='{saved}'\), this run stores "
                                         rf"host_state='{resumed}'.* HINT: resume with host_state='{saved}'"):
        fit(resumed, 2, ckpt_path=str(tmp_path / "last.ckpt"))


def test_refusals():
    MegaTrainStrategy(host_state="compact", gpu_optimizer_groups=2)  # device groups step compact states too
    with pytest.raises(ValueError, match=r"host_state='int4': choose one of \('fp32', 'int8_moments'"):
        MegaTrainStrategy(host_state="int4")
    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.engine.placement import resolve

    for host_state in ("fp32", "int8_moments", "compact"):  # decided at the first micro-batch, from both memories
        cuda = resolve(EngineConfig(host_state=host_state), torch.device("cuda", 0))
        assert cuda.gpu_optimizer_groups == "auto"
        assert resolve(EngineConfig(host_state=host_state), torch.device("cpu")).gpu_optimizer_groups == 0


@pytest.mark.parametrize(("host_state", "module", "precision", "match"), [
    ("compact", lambda: ParityLM("qwen3"), "32-true",
     r"host_state='compact'\) keeps bf16 masters and grads, which compute in bf16; got precision='32-true'"),
    ("compact_kahan", lambda: ParityLM("qwen3", optimizer="sgd"), "bf16-mixed",
     r"host_state='compact_kahan'\) runs Adam/AdamW as CompactAdamW .* configure_optimizers returned SGD\. HINT"),
    ("compact", lambda: Int8MomentsLM("qwen3"), "bf16-mixed",
     r"stores weights='bf16_sr' and moments='int8', but configure_optimizers returned CompactAdamW\(weights='fp32', "
     r"moments='int8'\)"),
])
def test_fit_refusals(host_state, module, precision, match):
    with pytest.raises(ValueError, match=match):
        cpu_trainer(strategy=MegaTrainStrategy(host_state=host_state), precision=precision).fit(module())
