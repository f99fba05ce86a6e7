"""MegaTrainStrategy: the Lightning contract only; streaming, buffers and optimizer logic live in engine/ and optim/."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.init import _EmptyInit
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_megatrain._hardware import placeable_host_bytes
from lightning_megatrain.checkpoint_strategy import CheckpointStrategy
from lightning_megatrain.config import (
    Auto,
    CheckpointFormat,
    CpuAdamMode,
    EngineConfig,
    HostState,
    KeepLayers,
    NonFiniteMode,
)
from lightning_megatrain.engine import MegaTrainEngine
from lightning_megatrain.engine.device_state import device_states_kept
from lightning_megatrain.engine.sharding import ShardedState
from lightning_megatrain.hooks import OptimizerBarrier, placement_hooks
from lightning_megatrain.host_memory import HostMemoryWatch, host_memory_by_kind, log_host_memory
from lightning_megatrain.models.document_spans import transfer_binding_spans
from lightning_megatrain.models.hf_loss import ChunkedHFLoss, install_chunked_hf_loss
from lightning_megatrain.precision import MegaTrainPrecision, megatrain_precision
from lightning_megatrain.sharded_checkpoint import layer_layout, strategy_checkpoint_io

log = logging.getLogger(__name__)


class MegaTrainStrategy(CheckpointStrategy):
    """Train a causal LM larger than GPU memory on one GPU: all state in host RAM, decoder layers streamed.

    One optimizer step:

    - **setup** (once): the decoder-layer stack is found, every parameter becomes an fp32 *master* in a pinned flat
      host buffer per layer, S device *slots* and the H2D/D2H streams are created, and each layer's ``forward`` is
      routed through one streamed autograd Function. Adam/AdamW become DeepSpeedCPUAdam (or torch fused AdamW).
    - **forward**: residents (embeddings, norm, lm_head) are uploaded as device compute copies; each layer's
      weights arrive in a slot one layer ahead on the H2D stream, the layer runs without building a graph and only
      its input is kept.
    - **backward**: ``loss.backward()`` reaches each layer in reverse; a kept layer is differentiated from its
      graph, any other has its weights fetched again (i-1 prefetched) and is recomputed with grad; its weight grads
      go to the host on the D2H stream, straight into the fp32 host grads or through pinned slabs that a worker
      thread accumulates in fp32.
    - **optimizer step**: the host waits once for all drains, residents' grads are drained, clipping and the
      optimizer run on the host fp32 masters (with ``overlap_optimizer``, on a GPU by default, layer by layer on a
      worker thread, while the next step's forward waits for each layer's update before uploading it); the groups
      ``gpu_optimizer_groups`` names step on the GPU instead (their masters reach the host when it reads them).

    GPU memory is two layers' weights, the residents, the activations of one layer and at most two layers' saved
    inputs (the others wait in pinned host memory), independent of depth, plus the full activations and a weight
    copy (none for ``gpu_optimizer_groups`` layers) of each layer ``keep_layers`` keeps (by default as many as fit
    in 90-95% of the GPU). Host memory is 16 bytes per parameter with Adam (master, grad, two moments), page-locked at
    its exact size; :meth:`host_memory` reports it by kind, and it is logged at train end.

    Several devices (``devices=N``, ``num_nodes=M``): one process per device, started by Lightning's launcher
    (ranks.py); each rank holds 1/N of every layer's fp32 masters, grads and optimizer states (the residents' masters
    whole), each layer is all-gathered right before it runs and its grads reduce-scattered in backward
    (engine/sharding.py, [Note: sharded host state]; engine/sharded_layers.py, [Note: sharded layer masters]: a
    layer's parameters are NaN placeholders outside its compute); each rank saves its masters' and optimizer states'
    share beside the checkpoint, which resumes on any number of ranks (engine/shard_states.py, [Note: checkpoints of
    several ranks]).
    ``gpu_optimizer_groups`` and ``update_during_backward`` are off there (refused when given), ``host_state`` must
    be ``"fp32"``, ``checkpoint_format`` ``"file"``, and the optimizer elementwise (not Muon or CompactAdamW); each
    rank's host step overlaps the next forward as one rank's does.

    Args:
        accelerator: set by the Trainer (``accelerator="cuda"`` computes on ``cuda:0``, ``"cpu"`` on the host with
            the same engine).
        layers: dotted path of the decoder-layer ``nn.ModuleList`` or ``nn.Sequential`` inside the LightningModule,
            e.g. ``"model.model.layers"``. Default ``None`` discovers it (HF causal LMs, or the largest
            ModuleList/Sequential of same-class modules).
        num_slots: device buffers for layer weights, >= 2 (one computes while the next uploads). More slots cost
            one layer of GPU memory each and only help when layer sizes vary. Default 2.
        keep_layers: decoder layers per training micro-batch whose activations stay on the GPU from forward to
            backward instead of being recomputed (saves one forward of each). ``"auto"`` (default): the first
            micro-batch recomputes every layer and measures one layer's activation memory and the step's peak, later
            micro-batches keep as many layers as fit in 90% of the GPU (the first of them tops up where its measured
            peak left room, up to 95% where the allocator's largest block is small). An int keeps exactly that many
            (the first ones); ``0`` recomputes every layer, the least GPU memory (the paper's scheme). On a CPU
            compute device ``"auto"`` keeps none.
        overlap_optimizer: run the host Adam step of step N layer by layer on a worker thread while step N+1's
            forward starts (each layer's upload waits for that layer's update), instead of between the steps with the
            GPU idle. User code never sees a step mid-update: the next forward, ``zero_grad``, backward, checkpoint
            save or load, validation, epoch end and train end wait for it, and so does every hook between a step and
            the next update that the module or a callback overrides (an EMA callback's ``on_train_batch_end``: see
            hooks.py, [Note: user hooks]). Applies to the host Adam/AdamW (other optimizers step synchronously, with
            a warning). Host grads are complete in ``on_before_optimizer_step`` when a hook implements it; without one
            the last gradient copies land while the next step starts and the step's worker waits for them
            (engine/optimizer_step.py, [Note: late grads]). ``"auto"`` (default): on with a CUDA compute device, off
            on the CPU (engine/placement.py, [Note: auto placement]).
        update_during_backward: start each decoder layer's host Adam/AdamW update during the optimizer step's
            backward, once its grads are final, so the host step hides under backward too, speculating that clipping
            does not fire and the step is not skipped; where either happens the layers are restored from snapshots
            and the step redone, so results are bitwise the same (engine/backward_updates.py, [Note: updates during
            backward]). Snapshots take 12 bytes of host memory per speculated parameter, within what the host has
            free. Not with hooks that read grads or parameters between backward and the step (``on_after_backward``,
            ``on_before_optimizer_step``), manual optimization or clipping by value. ``"auto"`` (default): on with the
            overlapped step on a GPU, except in the step after one whose clipping fired; ``True``: every step.
        gpu_optimizer_groups: how many parameter groups, in the order the forward reads them (first the residents:
            embeddings, final norm, head; then decoder layers 0, 1, ...), also keep their fp32 master, fp32 grad and
            Adam moments on the GPU and take their optimizer step there (torch's fused AdamW kernel): no host Adam
            and no weight upload for them. Costs 18 bytes of GPU memory per layer parameter (16 per resident one),
            taken from the activations ``keep_layers="auto"`` keeps, and saves 8 bytes/param of host RAM (12 when no
            hook reads their grads, which then stay on the GPU). Pays when the host Adam step outlasts a forward
            (``megatrain plan`` says so); the host masters stay the parameters (written back when the host reads
            them: checkpoints, validation, epoch and train end) and checkpoints are unchanged. Needs a CUDA device
            and Adam/AdamW, norm clipping or none. ``"auto"`` (default): before the first training micro-batch, the
            fewest groups that hide the overlapped host Adam behind the forward at that micro-batch's shape and
            still fit, as ``megatrain plan`` computes them; 0 where that does not apply (a CPU device, no overlap,
            another optimizer, clipping by value, no HF config) ([Note: auto placement]). The log says which and why.
        compile_layers: run every decoder layer through ``torch.compile`` (inductor): the elementwise work between
            the matmuls fuses into few kernels, and a layer keeps only its matmul and attention outputs for backward
            (31% fewer bytes for Llama, so ``keep_layers="auto"`` keeps more layers). One graph per layer class and
            grad mode, compiled during the first step (tens of seconds for a large layer on a GPU); dropout masks
            are replayed exactly in the recompute. Needs a working ``torch.compile`` (a C++ compiler on the CPU,
            Triton on CUDA), checked at setup. ``"auto"`` (default): on with a CUDA compute device where Triton is
            usable, else off, and off for gpt-oss with grouped_mm experts ([Note: auto placement]).
        seq_tile: sequence positions per tile for each decoder layer's MLP or MoE block, in forward and recompute, so
            its transient memory follows the tile, not the sequence; ``None`` untiled, ``"auto"`` (default) tiled for
            long sequences only (engine/tiling.py, [Note: sequence tiles]). The block's forward runs once more per
            step (each tile is re-run in backward); results equal the untiled block's to fp32 rounding.
        segment_layers: layers per recompute segment: ``1`` saves every recomputed layer's input; ``k > 1`` saves
            the first input of every ``k`` layers and replays the rest in backward (engine/segments.py, [Note:
            recompute segments]); ``"auto"`` (default): 1 unless the checkpoints fit neither memory.
        sub_segment_layers: nested recompute: a segment's replay keeps every ``m``-th regenerated input, fewer held
            at once for more replayed forwards; ``1`` flat; ``"auto"`` (default): 1 unless no flat placement fits.
        device_checkpoints: saved layer inputs that stay in GPU memory instead of pinned host memory, the last
            layers' first; ``"auto"`` (default): 0 unless the host cannot hold them, then the fewest with which the
            rest fit the host (engine/placement.py).
        attention_memo: keep each recomputed layer's attention output and log-sum-exp from its forward for its
            recompute, which skips the attention kernel (engine/attention_memo.py, [Note: attention memo]); the same
            gradients, for that output's bytes per layer on the GPU. Worth it at long context (the 7B shape at
            131,072 tokens on an H200: 13% less time per step, docs/long-context.md); ``"auto"`` (default): on where
            the planner finds it fits the GPU beside the checkpoints and makes the step 5% faster, decided at the
            first training micro-batch on a GPU (engine/placement.py); an int ``N``: the last ``N`` layers' only,
            for the GPU memory the checkpoints leave (``megatrain plan`` names one where it pays).
        chunked_hf_loss: HF causal LMs in the module called with ``labels`` (``model(..., labels=...).loss``)
            compute HF's loss with the chunked cross-entropy, without materialising ``[B, T, V]`` logits (at 32K
            tokens and a 128K vocabulary a 15.7 GiB block and its gradient), and return ``logits=None``; the same
            loss and gradients (models/hf_loss.py, [Note: HF loss], also lists when HF's own forward runs instead).
            ``False`` leaves HF's forward untouched, for modules that read ``logits`` together with ``labels``.
            Default True.
        cpu_adam: ``"auto"`` (DeepSpeedCPUAdam when DeepSpeed, the optional extra
            ``lightning-megatrain[deepspeed]``, is installed and its extension builds, else torch fused AdamW with a
            warning; with the step overlapped always torch fused AdamW, which releases the GIL while the forward
            thread issues kernels and applies the clipping factor inside its own pass), ``"deepspeed"`` (fail if it
            is not installed or does not build) or ``"torch"`` (always torch fused AdamW). Default ``"auto"``.
        nonfinite: a step whose loss or global gradient norm is inf or NaN updates nothing. ``"skip"`` (default):
            masters, Adam states and step counts stay as they were, a warning names the step, and
            :attr:`skipped_steps` counts it (logged as ``skipped_steps`` on the progress bar once non-zero).
            ``"raise"``: training stops with ``NonFiniteError``. The check reuses clipping's norm, taken from the
            per-layer norms measured on the GPU, and never makes the training thread wait for the device
            (engine/optimizer_step.py, [Note: all-or-nothing steps]). An update that fails (host RAM for the first
            step's Adam states, a gradient or state the kernel cannot take) fails before it writes anything:
            ``StepFailed`` says that masters and optimizer states are as they were.
        host_state: how each parameter's host state is stored (docs/compact-state.md): ``"fp32"`` (default: fp32
            master, grad and Adam moments, 16 bytes/param), ``"int8_moments"`` (8-bit block-quantized moments, 10.03),
            ``"compact_kahan"`` (bf16 master with a bf16 Kahan compensation, bf16 grad, 8-bit moments, 8.03) or
            ``"compact"`` (bf16 master rounded stochastically, bf16 grad, 8-bit moments, 6.03). Other than
            ``"fp32"``, Adam/AdamW from ``configure_optimizers`` runs as ``CompactAdamW`` with the layout's formats
            (overlapped, all or nothing, clipping inside its kernel; optim/compact_update.py, [Note: compact state in
            the engine]); another optimizer is refused, and so is ``gpu_optimizer_groups`` > 0 (``"auto"`` places
            none). The bf16 layouts make the parameters bf16 (checkpoints hold bf16 weights) and need
            ``precision="bf16-mixed"``.
        checkpoint_format: ``"file"`` (default): a checkpoint is one file. ``"sharded"``: a directory of the same name
            holding one safetensors file per decoder layer (its masters and optimizer states) and one for the
            residents, swapped in atomically, loadable by ``ckpt_path`` and ``"last"`` like a file; ``megatrain
            convert`` makes it one file for plain Lightning (sharded_checkpoint.py, [Note: sharded checkpoints]).
            Loading reads either format.
        checkpoint_io: Lightning checkpoint IO plugin (not with ``checkpoint_format="sharded"``). Default: local saves
            are written to a temporary file beside the target and renamed over it, never buffered whole in host RAM
            (checkpoint_io.py, [Note: atomic checkpoints]). With any plugin, ``fit(ckpt_path="last")`` resumes from
            the newest checkpoint that loads when the last one does not, with a warning ([Note: resuming from a
            readable checkpoint]).
        precision_plugin: set by the Trainer from ``precision=``: ``"bf16-mixed"`` (recommended: fp32 masters,
            grads and Adam, bf16 compute) or ``"32-true"`` (Lightning's default: fp32 throughout).
            ``"bf16-true"`` is mapped to ``"bf16-mixed"`` with a warning: masters are never kept in bf16.
        cpu_binding: with several ranks on a host, bind each to physical cores of its own, on its GPU's NUMA node
            where the host has several (cpu_binding.py, [Note: rank CPU binding]); ``"auto"`` (default): under
            Lightning's own cluster environment (its launcher), not under torchrun or SLURM, which bind with their
            own flags; ``True``: always; ``False``: never.

    Note:
        After an exception the parameters are still valid host fp32 masters; ``teardown`` restores each layer's
        own ``forward``, and logs (not raises) an error it meets while that exception propagates, so the error
        raised is the one that stopped the run. A parameter cast, moved or replaced after setup (``self.double()``)
        is refused by name at the next step.
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        layers: str | None = None,
        num_slots: int = 2,
        keep_layers: KeepLayers = "auto",
        overlap_optimizer: bool | Auto = "auto",
        update_during_backward: bool | Auto = "auto",
        gpu_optimizer_groups: int | Auto = "auto",
        compile_layers: bool | Auto = "auto",
        seq_tile: int | Auto | None = "auto",
        segment_layers: int | Auto = "auto",
        sub_segment_layers: int | Auto = "auto",
        device_checkpoints: int | Auto = "auto",
        attention_memo: bool | int | Auto = "auto",
        chunked_hf_loss: bool = True,
        cpu_adam: CpuAdamMode = "auto",
        nonfinite: NonFiniteMode = "skip",
        host_state: HostState = "fp32",
        checkpoint_format: CheckpointFormat = "file",
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        cpu_binding: bool | Auto = "auto",
    ) -> None:
        # validated before anything is allocated; every problem listed in one ValueError (config.py)
        self.config = EngineConfig(
            layers=layers,
            num_slots=num_slots,
            keep_layers=keep_layers,
            overlap_optimizer=overlap_optimizer,
            update_during_backward=update_during_backward,
            gpu_optimizer_groups=gpu_optimizer_groups,
            compile_layers=compile_layers,
            seq_tile=seq_tile,
            segment_layers=segment_layers,
            sub_segment_layers=sub_segment_layers,
            device_checkpoints=device_checkpoints,
            attention_memo=attention_memo,
            chunked_hf_loss=chunked_hf_loss,
            cpu_adam=cpu_adam,
            nonfinite=nonfinite,
            host_state=host_state,
            checkpoint_format=checkpoint_format,
        )
        # checkpoints saved atomically beside their target, streamed ([Note: atomic checkpoints]), or per layer
        # ([Note: sharded checkpoints])
        checkpoint_io = strategy_checkpoint_io(checkpoint_io, checkpoint_format, lambda checkpoint: layer_layout(
            checkpoint, self.lightning_module, self.config.layers, self.optimizers))
        # one process per device; several share the host state ([Note: sharded host state] in engine/sharding.py)
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=None,
                         cpu_binding=cpu_binding)
        # Filled by the Trainer from `accelerator=`/`devices=`; root_device derives from it (see DESIGN.md).
        self.parallel_devices: list[torch.device] | None = None
        self.engine: MegaTrainEngine | None = None
        self._hf_loss: ChunkedHFLoss | None = None  # what install_chunked_hf_loss changed, undone at teardown
        self._unguard_zero_grad: Callable[[], None] | None = None  # undoes the module's waiting zero_grad
        self._host_watch: HostMemoryWatch | None = None  # during fit: warns before the host runs out
        self._skipped: list[int] = []  # the engine's list of steps skipped as non-finite, kept past teardown
        # this rank's shares with several ranks, kept past teardown: the optimizers step their pieces
        self._sharding: ShardedState | None = None
        if precision_plugin is not None:
            self.precision_plugin = precision_plugin

    @property
    @override
    def precision_plugin(self) -> MegaTrainPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = MegaTrainPrecision("32-true", self.root_device.type)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        if precision_plugin is None or isinstance(precision_plugin, MegaTrainPrecision):
            self._precision_plugin = precision_plugin
            return
        self._precision_plugin = megatrain_precision(precision_plugin, self.root_device.type)  # or a TypeError

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        precision.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self.optimizers:  # an earlier fit's, with states it may have kept on the GPU (teardown)
            self.optimizers = []
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        config = self.config.for_stage(fitting, trainer.gradient_clip_algorithm)
        self._hf_loss = install_chunked_hf_loss(self.lightning_module, enabled=config.chunked_hf_loss)
        self.engine = MegaTrainEngine(
            self.lightning_module, self.root_device, precision.compute_dtype, config, ranks=self.ranks
        )
        self.engine.setup(fitting=fitting, previous=self._sharding)  # after fit, validate/test go on from its shares
        self.model_to_device()
        precision.engine = self.engine
        self._skipped = self.engine.step.guard.skipped
        self._sharding = self.engine.sharding
        self.model = self._setup_model(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            step = self.engine.step
            schedulers = [config.scheduler for config in self.lr_scheduler_configs]
            self.optimizers = step.to_host_optimizers(self.optimizers, schedulers)  # Adam/AdamW on the host
            self.engine.check_host_state(self.optimizers)  # their states, before any step allocates them
            if step.steps_after_return:
                if not any(isinstance(c, OptimizerBarrier) for c in trainer.callbacks):  # once per Trainer
                    trainer.callbacks.insert(0, OptimizerBarrier())  # first: waits before hooks that read parameters
                self._unguard_zero_grad = step.guard_module_zero_grad(self.lightning_module)
            self._host_watch = HostMemoryWatch(self.host_memory)  # [Note: host memory watch]
            self._host_watch.start()
        self.setup_precision_plugin()
        # no _optimizers_to_device: optimizer states live with the host masters

    @override
    def model_to_device(self) -> None:
        """Parameters and buffers stay in host RAM (the engine moves each layer to the device only while it
        computes). torchmetrics metrics go to the compute device: their states meet the step's outputs there."""
        from torchmetrics import Metric

        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.to(self.root_device)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Build the model on the host (the base class would build it on the GPU).
        with _EmptyInit(enabled=bool(empty_init)), torch.device("cpu"):
            yield

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since setup for a non-finite loss or gradient norm (``nonfinite="skip"``); a step
        overlapped with the next forward counts once that forward has started."""
        return len(self._skipped)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        transfer = functools.partial(super().batch_to_device, device=device, dataloader_idx=dataloader_idx)
        if self.lightning_module is None or is_overridden("transfer_batch_to_device", self.lightning_module):
            return transfer(batch)  # a module that moves its own batches binds their documents itself, or not at all
        # packed rows' documents read on the host ([Note: host document spans] in models/document_spans.py)
        return transfer_binding_spans(batch, transfer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        if self.engine is not None and self.engine.placement_pending:  # the first micro-batch ([Note: auto placement])
            trainer = self.lightning_module.trainer
            self.engine.place_for_batch(batch, grad_accum=trainer.accumulate_grad_batches, optimizers=self.optimizers,
                                        chunked_loss=self._chunked_loss, **placement_hooks(self.lightning_module))
        elif self.engine is not None and self.engine.checkpoints_outgrown(batch):  # longer than the first
            trainer = self.lightning_module.trainer
            self.engine.place_checkpoints(batch, trainer.accumulate_grad_batches, self.optimizers, self._chunked_loss)
        with self._step_context():
            output = super().training_step(*args, **kwargs)
        if self._skipped:  # the steps before this one are decided by now (an overlapped one during the forward)
            self.lightning_module.log(  # a host tensor: a number would be copied to the device, a sync
                "skipped_steps", torch.tensor(float(len(self._skipped))), prog_bar=True, on_step=True, on_epoch=False,
                batch_size=1,
            )
        return output

    @property
    def _chunked_loss(self) -> bool:
        """Whether the module's HF loss runs chunked (models/hf_loss.py): the planner then counts no full logits."""
        return bool(self._hf_loss is not None and self._hf_loss.models)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().predict_step(*args, **kwargs)

    def _step_context(self) -> contextlib.AbstractContextManager:
        return self.engine.step_context() if self.engine is not None else contextlib.nullcontext()

    def host_memory(self) -> dict[str, int]:
        """Host memory by kind, in bytes: the engine's (fp32 masters, fp32 grads, gradient slabs, the page-locked
        buffers of offloaded layer inputs), the optimizers' states in host memory, the process's resident set
        (``rss``) and the part of it none of those explain (``other``: Python, libraries, the CUDA context, allocator
        slack)."""
        return host_memory_by_kind(self.engine.host_bytes() if self.engine is not None else {}, self.optimizers)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        sizes = self.host_memory()  # sizes only; the barrier's on_train_end already waited for the optimizer
        log_host_memory(sizes, sum(p.numel() for p in self.lightning_module.parameters()))

    @override
    def teardown(self) -> None:
        # Lightning also tears down while an exception propagates (call.py); an error here would replace that one
        # (a failed overlapped step's, or moving a module with meta tensors to the CPU): it is logged instead.
        handling = sys.exc_info()[1]
        try:
            self._teardown()
        except Exception as error:
            if handling is None:
                raise
            log.error("MegaTrain: teardown while handling %s: %s", type(handling).__name__, error)

    def _teardown(self) -> None:
        try:
            if self.engine is not None:
                self.engine.teardown()  # raises a failed overlapped step's error, after restoring the layers
        finally:
            self.engine = None
            for undo in (self._unguard_zero_grad, self._hf_loss.remove if self._hf_loss is not None else None):
                if undo is not None:
                    undo()
            self._unguard_zero_grad = self._hf_loss = None
            # the device groups' moments stay on the GPU where the host cannot take them (measured whatever
            # MEGATRAIN_SKIP_MEMORY_CHECK says: this copy is not a check but an allocation of their size)
            placeable = placeable_host_bytes()
            fit = self._host_watch is not None  # the watch runs during fit only; later stages keep them quietly
            try:
                with device_states_kept(self.optimizers, None if placeable is None else placeable[0], announce=fit):
                    super().teardown()
            finally:
                if self._host_watch is not None:  # after that copy, which it watched
                    self._host_watch.stop()
                    self._host_watch = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])
