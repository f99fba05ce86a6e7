"""Harness for runs over several CPU ranks (gloo): one process per rank, started as torchrun would start them.

Each rank is a ``torch.multiprocessing`` process (forked: torch and Lightning are imported once, in the test's process)
with ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` set, so
Lightning's ``LightningEnvironment`` sees processes created externally and its launcher starts none; the Trainer in
each is ``Trainer(strategy=MegaTrainStrategy(...), devices=N, accelerator="cpu")``. Every rank writes what it
recorded to ``out/rank<r>.pt``; :func:`launch` returns the list. The model is a small hand-built stack (no
transformers import: four processes start within seconds on two cores).
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import lightning_megatrain  # noqa: F401  (imported before the fork: the ranks inherit it)

GLOBAL_BATCH = 4  # samples per optimizer step and micro-batch over all ranks
N_SAMPLES = 32
VOCAB, SEQ, WIDTH = 32, 6, 16


def ordered_loader(trainer: Trainer, data: torch.Tensor, micro_batch: int) -> DataLoader:
    """``data`` in order, split over the ranks: Lightning's own sampler shuffles training data over ranks; in order,
    rank r's micro-batch k is samples r, r + N, ... of the single-process run's micro-batch k."""
    world = trainer.world_size
    sampler = DistributedSampler(data, world, trainer.global_rank, shuffle=False) if world > 1 else None
    return DataLoader(data, batch_size=micro_batch, shuffle=False, sampler=sampler)


def make_module(model: str, world: int) -> LightningModule:
    """:class:`RankLM` (``model="stack"``) or an HF causal LM of a tests/helpers/families.py family, with
    ``GLOBAL_BATCH // world`` samples per micro-batch, in order."""
    if model == "stack":
        return RankLM(GLOBAL_BATCH // world)
    from helpers.parity import ParityLM, make_data

    class RankParityLM(ParityLM):
        def train_dataloader(self) -> DataLoader:
            return ordered_loader(self.trainer, make_data(), GLOBAL_BATCH // world)

    return RankParityLM(model)


class Block(nn.Module):
    """A residual block with a matrix, a norm and a 1-element gate: 305 parameters, so shards cut through
    parameters and every world size pads."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * torch.tanh(self.linear(self.norm(x)))  # [B, T, W]


class RankLM(LightningModule):
    """``embed`` -> 3 ``Block`` -> ``norm`` -> ``head``; next-token loss over fixed random tokens; AdamW with a
    decayed and an undecayed param group. ``manual``: manual optimization, clipping the grads at 0.05 (norm) between
    ``manual_backward`` and ``optimizer.step()``, before the engine finalizes them."""

    def __init__(self, micro_batch: int, manual: bool = False) -> None:
        super().__init__()
        self.micro_batch = micro_batch
        self.automatic_optimization = not manual
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        h = self.embed(batch[:, :-1])  # [B, T-1, W]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))  # [B, T-1, V]
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.automatic_optimization:
            return self.loss(batch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        return loss

    def train_dataloader(self) -> DataLoader:
        data = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=torch.Generator().manual_seed(1234))
        return ordered_loader(self.trainer, data, self.micro_batch)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and p.dim() == 2]
        rest = [p for n, p in self.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)


def manual_module(world: int) -> RankLM:
    """The manual-optimization :class:`RankLM` of one of ``world`` ranks on the global batch: a module factory for
    :func:`fit` and :func:`launch`, top-level so that spawned ranks can unpickle it."""
    return RankLM(GLOBAL_BATCH // world, manual=True)


@dataclass
class Run:
    """What one rank recorded."""

    losses: list[float] = field(default_factory=list)  # per micro-batch, this rank's
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step, the global grads before clipping
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after training
    start_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # optimizer state at train start
    end_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # and at train end
    host_bytes: dict[str, int] = field(default_factory=dict)  # the engine's host memory by kind, at train end
    error: str = ""  # what fit raised (``launch(raises=True)``), as "Type: message"
    warnings: list[str] = field(default_factory=list)  # every warning's message
    after: Any = None  # what ``fit(after=...)`` returned


def full_grads(trainer: Trainer, module: LightningModule) -> dict[str, torch.Tensor]:
    """The whole model's grads by name: the parameters' own on one rank, the owned grads summed into whole
    buffers on several (a collective)."""
    sharding = getattr(getattr(trainer.strategy, "engine", None), "sharding", None)
    if sharding is None:
        return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    out = {}
    for shard in sharding.shards:
        buf = torch.zeros(sharding.ranks.world * shard.size)
        if shard.owned.grad_nbytes:
            buf.view(sharding.ranks.world, -1)[sharding.ranks.rank] = shard.owned.grad
        sharding.ranks.all_reduce_(buf)  # host tensors: the host group (gloo) also under NCCL
        for p, offset in zip(shard.group.params, shard.group.offsets):
            out[sharding.names[id(p)]] = buf[offset : offset + p.numel()].view(p.shape).clone()
    return out


def full_optimizer_state(trainer: Trainer, module: LightningModule) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's Adam moments and step by parameter name, whole (summed from the pieces on several ranks)."""
    optimizer = trainer.optimizers[0]
    sharding = getattr(getattr(trainer.strategy, "engine", None), "sharding", None)
    names = {id(p): n for n, p in module.named_parameters()}
    if sharding is None:
        return {names[id(p)]: {k: torch.as_tensor(v).detach().cpu().clone().float() for k, v in s.items()}
                for p, s in optimizer.state.items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in module.named_parameters():
        out[name] = {"exp_avg": torch.zeros(p.numel()), "exp_avg_sq": torch.zeros(p.numel()), "step": torch.zeros(())}
    for group in optimizer.param_groups:
        for piece in group["params"]:
            name, start, end, _ = sharding.piece_keys[id(piece)]
            state = optimizer.state.get(piece, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    out[name][key][start:end] = state[key]
            if "step" in state:
                out[name]["step"] = torch.as_tensor(state["step"], dtype=torch.float32).cpu()  # one per parameter
    for name, state in out.items():
        for key in ("exp_avg", "exp_avg_sq"):
            sharding.ranks.all_reduce_(state[key])
        step = sharding.ranks.all_reduce_(state["step"].reshape(1).clone(), op=dist.ReduceOp.MAX)
        shape = dict(module.named_parameters())[name].shape
        out[name] = {"exp_avg": state["exp_avg"].view(shape), "exp_avg_sq": state["exp_avg_sq"].view(shape),
                     "step": step[0]}
    return out


def whole_params(trainer: Trainer, module: LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter whole by name: the module's own on one rank, gathered on several (a collective: a sharded
    layer's parameters are placeholders outside its compute)."""
    sharding = getattr(getattr(trainer.strategy, "engine", None), "sharding", None)
    if sharding is None:
        return {n: p.detach().clone() for n, p in module.named_parameters()}
    return sharding.gathered_params()


class RankRecorder(Callback):
    """Records a :class:`Run`. Without ``grads`` it reads only the loss between steps, and says so
    (``megatrain_reads_state``, lightning_megatrain/hooks.py): an overlapped step then runs on beside the next forward
    as in a run without callbacks."""

    def __init__(self, grads: bool) -> None:
        self.run = Run()
        self.grads = grads
        self.megatrain_reads_state = grads

    def on_train_start(self, trainer, pl_module) -> None:
        self.run.start_state = full_optimizer_state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.run.losses.append(float(loss))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.grads:
            self.run.grads.append(full_grads(trainer, pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        self.run.params = whole_params(trainer, pl_module)
        self.run.end_state = full_optimizer_state(trainer, pl_module)
        engine = getattr(trainer.strategy, "engine", None)
        self.run.host_bytes = engine.host_bytes() if engine is not None else {}


def fit(world: int, *, strategy: Any = "megatrain", steps: int = 3, accumulate: int = 1, clip: float | None = None,
        grads: bool = True, ckpt_in: str | None = None, ckpt_out: str | None = None, accelerator: str = "cpu",
        model: str = "stack", ckpt_dir: str | None = None, callbacks: Sequence[Callback] = (),
        module: Callable[[int], LightningModule] | None = None,
        after: Callable[[Trainer, LightningModule], Any] | None = None, slow_update: float = 0.0,
        **strategy_args: Any) -> Run:
    """Train ``model`` (:func:`make_module`) on ``world`` ranks (this process is one of them, or the only one) with
    ``GLOBAL_BATCH`` samples per micro-batch over all ranks; resume from ``ckpt_in``, save ``ckpt_out`` at the end;
    with ``ckpt_dir``, a ``ModelCheckpoint`` there saves every 2 steps (all kept) and ``last.ckpt``; ``module(world)``
    builds the module instead of ``model``'s; ``after(trainer, module)`` runs after ``fit`` (and the save), its result
    in ``Run.after``; ``slow_update``: seconds each host update of a group sleeps first (an overlapped step still
    running when the next forward reads; set in the process, so spawned ranks get it too)."""
    from lightning_megatrain import MegaTrainStrategy
    from lightning_megatrain.optim.host_optimizer import HostUpdate

    if slow_update:
        update = HostUpdate.__call__

        def slowed(self, params):
            time.sleep(slow_update)
            update(self, params)

        HostUpdate.__call__ = slowed  # this rank's process only: a test's ranks end with it

    seed_everything(0, verbose=False)
    module = make_module(model, world) if module is None else module(world)
    if strategy == "megatrain":
        strategy = MegaTrainStrategy(cpu_adam="torch", **strategy_args)
    recorder = RankRecorder(grads)
    saving = [] if ckpt_dir is None else [ModelCheckpoint(ckpt_dir, every_n_train_steps=2, save_top_k=-1,
                                                          save_last=True)]
    checkpointing = any(isinstance(c, Checkpoint) for c in [*saving, *callbacks])  # else Lightning refuses them
    trainer = Trainer(
        accelerator=accelerator, devices=world, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip, callbacks=[recorder, *saving, *callbacks], logger=False,
        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    if after is not None:
        recorder.run.after = after(trainer, module)
    return recorder.run


def _rank_main(rank: int, world: int, port: int, out: str, kwargs: dict, raises: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # [Note: test children] in helpers/forked.py
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run = fit(world, **kwargs)
        except Exception as error:
            if not raises:
                raise
            run = Run(error=f"{type(error).__name__}: {error}")
    run.warnings = [str(w.message) for w in caught]
    torch.save(run.__dict__, Path(out) / f"rank{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, out: Path, timeout: float = 120.0, start_method: str = "fork", raises: bool = False,
           **kwargs: Any) -> list[Run]:
    """Run :func:`fit` on ``world`` ranks (one process each, forked unless ``start_method``: CUDA needs "spawn")
    and return each rank's :class:`Run`; with ``raises``, a rank whose ``fit`` raises records the error in its run.

    Raises:
        TimeoutError: a rank still runs after ``timeout`` seconds (a collective one rank missed); all are killed.
    """
    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_rank_main, args=(world, free_port(), str(out), kwargs, raises), nprocs=world,
                                 join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world} ranks still running after {timeout:.0f} s: a rank waits in a collective")
    return [Run(**torch.load(out / f"rank{r}.pt", weights_only=False)) for r in range(world)]
