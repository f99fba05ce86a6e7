"""Harness for CPU parity runs: train a tiny HF causal LM for a few steps under a given
Lightning strategy and record losses, per-step gradients and final weights.

``run("megatrain", fam)`` and ``run("auto", fam)`` must give records that pass
``assert_records_close``. Everything is fp32 on CPU with a fixed seed and fixed data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_megatrain.models.hf_loss import install_chunked_hf_loss

from helpers.families import FAMILIES, SEQ, VOCAB, with_router_aux

MICRO_BATCH = 2
N_SAMPLES = 32  # 16 micro-batches: enough for steps * accumulate <= 16
DATA_SEED = 1234  # data is the same for every run seed; only the init changes with `seed`


def make_data(n: int = N_SAMPLES, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, vocab, (n, seq), generator=g)


class TinyStackLM(LightningModule):
    """Base of the hand-built (non-HF) stacks' test modules: ``embed`` (32 tokens -> 16), ``blocks``, ``head``
    built by the subclass after seeding; trains on 4 batches of 2 x 6 random tokens with fused AdamW at 1e-2."""

    def __init__(self, blocks: torch.nn.Module) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = blocks
        self.head = torch.nn.Linear(16, 32)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


class ParityLM(LightningModule):
    """fp32 ``AutoModelForCausalLM`` built from a ``FAMILIES`` config under ``seed``.

    Its HF loss runs through the chunked cross-entropy under every strategy (``install_chunked_hf_loss``, what
    ``MegaTrainStrategy`` installs by default), so that a run and its reference compute the same loss to the bit;
    ``tests/models/test_models_hf_loss.py`` checks that loss against HF's own. ``chunked_loss=False``: HF's own loss
    (run it with ``MegaTrainStrategy(chunked_hf_loss=False)``). ``router_aux``: an MoE family with its router
    auxiliary loss on (``families.with_router_aux``).
    """

    def __init__(
        self,
        family: str,
        *,
        seed: int = 0,
        optimizer: str = "adamw",
        scheduler: bool = False,
        lr: float | None = None,
        router_aux: bool = False,
        chunked_loss: bool = True,
    ) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.lr = lr
        cfg = FAMILIES[family]()
        if router_aux:
            cfg = with_router_aux(cfg)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        install_chunked_hf_loss(self.model, enabled=chunked_loss)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=MICRO_BATCH, shuffle=False, num_workers=0)

    def configure_optimizers(self):
        params = self.parameters()
        if self.optimizer_name in ("adamw", "adamw_fused"):
            # lr 1e-2 so that weights move visibly in 3 steps; wd exercises decoupled decay.
            # "adamw" is torch's default implementation (single-tensor loop on CPU); "adamw_fused"
            # is torch's fused kernel, the one MegaTrainStrategy(cpu_adam="torch") switches to.
            fused = True if self.optimizer_name == "adamw_fused" else None
            opt = torch.optim.AdamW(params, lr=self.lr or 1e-2, weight_decay=0.1, fused=fused)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(params, lr=self.lr or 1e-1, momentum=0.9, weight_decay=0.01)
        else:
            raise ValueError(f"unknown optimizer {self.optimizer_name!r}")
        if not self.use_scheduler:
            return opt
        # step_size=1 per *optimizer step*: every recorded step sees a different lr.
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@dataclass
class Record:
    accumulate: int = 1  # micro-batches per optimizer step
    losses: list[float] = field(default_factory=list)  # per micro-batch, as Lightning reports it
    lrs: list[list[float]] = field(default_factory=list)  # per optimizer step, per param group
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)  # per optimizer step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after training


def _cpu32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32).clone()


class Recorder(Callback):
    """Records losses, pre-clipping ``.grad`` of every parameter at each optimizer step
    (``None`` kept as ``None``), and all parameters at the end of training."""

    def __init__(self) -> None:
        self.record = Record()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.record.losses.append(float(loss))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.record.lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        self.record.grads.append(
            {n: None if p.grad is None else _cpu32(p.grad) for n, p in pl_module.named_parameters()}
        )

    def on_train_end(self, trainer, pl_module) -> None:
        self.record.params = {n: _cpu32(p) for n, p in pl_module.named_parameters()}


class LossAndWeightRecorder(Recorder):
    """A :class:`Recorder` without the ``on_before_optimizer_step`` hook (no grads, no learning rates): a run in
    which nothing reads ``p.grad`` before the optimizer step."""

    on_before_optimizer_step = Callback.on_before_optimizer_step


class ExpertUsage(Callback):
    """Counts, per router call, how many token slots each expert received.

    Hooks every module whose class name ends in ``TopKRouter`` (Mixtral, Qwen3-MoE and
    gpt-oss routers in transformers 5.x all return ``(logits, scores, indices)``).
    """

    def __init__(self) -> None:
        self.counts: list[tuple[int, str, torch.Tensor]] = []  # (global_step, module, bincount)
        self._handles = []

    def on_train_start(self, trainer, pl_module) -> None:
        for name, mod in pl_module.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):
                self._handles.append(mod.register_forward_hook(self._hook(trainer, name, mod.num_experts)))

    def _hook(self, trainer, name: str, num_experts: int):
        def hook(module, args, output):
            indices = output[2]
            self.counts.append(
                (trainer.global_step, name, torch.bincount(indices.reshape(-1).cpu(), minlength=num_experts))
            )

        return hook

    def on_train_end(self, trainer, pl_module) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def run(
    strategy: str | Strategy,
    family: str | None,
    *,
    steps: int = 3,
    accumulate: int = 1,
    clip: float | None = None,
    optimizer: str = "adamw",
    scheduler: bool = False,
    precision: str = "32-true",
    seed: int = 0,
    callbacks: Sequence[Callback] = (),
    accelerator: str = "cpu",
    module: Callable[[], LightningModule] | None = None,
    record_grads: bool = True,
    router_aux: bool = False,
) -> Record:
    """Train ``family`` (or what ``module`` builds, after seeding) for ``steps`` optimizer steps under ``strategy``
    on ``accelerator`` and return its Record (without grads and learning rates unless ``record_grads``); with
    ``router_aux``, the family's MoE router auxiliary loss on."""
    seed_everything(seed, workers=True, verbose=False)
    if module is not None:
        module = module()
    else:
        module = ParityLM(family, seed=seed, optimizer=optimizer, scheduler=scheduler, router_aux=router_aux)
    recorder = Recorder() if record_grads else LossAndWeightRecorder()
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        precision=precision,
        callbacks=[recorder, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=accelerator == "cpu",  # deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before CUDA init
    )
    trainer.fit(module)
    rec = recorder.record
    rec.accumulate = accumulate
    want = steps if record_grads else 0
    assert len(rec.grads) == want, f"{strategy}/{family}: {len(rec.grads)} optimizer steps recorded, want {want}"
    assert rec.params, f"{strategy}/{family}: final parameters were not recorded"
    return rec


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float32).tiny))


def assert_records_close(
    a: Record, b: Record, rtol: float = 1e-5, atol: float = 1e-8, *, rtol_updated: float | None = None
) -> None:
    """Assert record ``a`` (candidate) matches ``b`` (reference).

    Tolerance: per tensor, ``||a - b|| <= rtol * ||b|| + atol`` (Frobenius norms). A norm-wise
    relative error is used instead of elementwise ``assert_close`` because gradients span many
    orders of magnitude inside one tensor: an elementwise rtol needs an atol to absorb fp32
    re-association noise in near-zero entries, and any fixed atol would either be meaningless for
    small-gradient tensors or too strict for large ones. 1e-5 is ~100x fp32 epsilon, enough for
    a different summation order (e.g. tied-embedding grads accumulated in another order, or
    recompute) and far below any real bug (a wrong mask, missed dropout replay, a dropped expert
    or a missing 1/accumulate all give errors of order 1e-2 or more). ``atol`` (absolute, on the
    norm) only matters for tensors whose reference is exactly zero. Losses use the same rule on
    scalars; learning rates must match exactly; ``None`` grads must match ``None``-ness.

    ``rtol_updated`` (default ``rtol``) applies to everything computed after the first optimizer
    step (later losses and grads, final weights): set it when the two sides run different
    optimizer kernels, whose last-bit differences later steps amplify. All mismatches are
    collected and reported together.
    """
    rtol_updated = rtol if rtol_updated is None else rtol_updated
    errors: list[str] = []

    def check(what: str, x: torch.Tensor, y: torch.Tensor, tol: float) -> None:
        if x.shape != y.shape:
            errors.append(f"{what}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            return
        if not torch.isfinite(x).all():
            errors.append(f"{what}: candidate has non-finite values")
            return
        diff = float((x - y).norm())
        if diff > tol * float(y.norm()) + atol:
            errors.append(f"{what}: |a-b|={diff:.3e} |b|={float(y.norm()):.3e} rel={_rel_err(x, y):.3e} (rtol {tol:g})")

    if a.accumulate != b.accumulate:
        errors.append(f"accumulate: {a.accumulate} vs {b.accumulate}")
    if len(a.losses) != len(b.losses):
        errors.append(f"losses: {len(a.losses)} vs {len(b.losses)} entries")
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        check(f"loss[{i}]", torch.tensor(x), torch.tensor(y), rtol if i < b.accumulate else rtol_updated)

    if a.lrs != b.lrs:
        errors.append(f"lrs: {a.lrs} vs {b.lrs}")

    if len(a.grads) != len(b.grads):
        errors.append(f"grads: {len(a.grads)} vs {len(b.grads)} optimizer steps")
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        if ga.keys() != gb.keys():
            errors.append(f"grad names differ at step {step}: {sorted(ga.keys() ^ gb.keys())}")
        for name in sorted(ga.keys() & gb.keys()):
            x, y = ga[name], gb[name]
            if (x is None) != (y is None):
                errors.append(f"grad[{step}][{name}]: None-ness {x is None} vs {y is None}")
            elif x is not None:
                check(f"grad[{step}][{name}]", x, y, rtol if step == 0 else rtol_updated)

    if a.params.keys() != b.params.keys():
        errors.append(f"param names differ: {sorted(a.params.keys() ^ b.params.keys())}")
    for name in sorted(a.params.keys() & b.params.keys()):
        check(f"param[{name}]", a.params[name], b.params[name], rtol_updated)

    if errors:
        shown = "\n  ".join(errors[:40])
        more = f"\n  ... and {len(errors) - 40} more" if len(errors) > 40 else ""
        raise AssertionError(f"records differ ({len(errors)} mismatches):\n  {shown}{more}")
