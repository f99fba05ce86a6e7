"""The engine facade the strategy talks to: setup, per-step binding, teardown; it builds the optimizer step
(engine/optimizer_step.py) and hands it out as :attr:`MegaTrainEngine.step`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lightning_megatrain._hardware import GIB
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.backward_updates import BackwardUpdates
from lightning_megatrain.engine.collectives import Ranks
from lightning_megatrain.engine.compiled import check_compilable
from lightning_megatrain.engine.device_state import DeviceGroup, gpu_bytes_per_param
from lightning_megatrain.engine.discovery import (
    check_layers_independent,
    check_on_host,
    disable_kv_cache,
    find_layer_stack,
    tensor_slots,
)
from lightning_megatrain.engine.first_batch import FirstBatchPlacement
from lightning_megatrain.engine.host_store import (
    FlatGroup,
    check_host_memory,
    check_layout_compute,
    check_packed,
    pack_group,
)
from lightning_megatrain.engine.optimizer_step import OptimizerStep
from lightning_megatrain.engine.overlap import OverlappedStep, overlapped_step
from lightning_megatrain.engine.pinned import HostRegistry
from lightning_megatrain.engine.placement import module_hf_config, resolve
from lightning_megatrain.engine.recompute import RecomputePolicy
from lightning_megatrain.engine.recorded import find_recorded
from lightning_megatrain.engine.residents import Residents
from lightning_megatrain.engine.sharded_layers import ShardedTransfer
from lightning_megatrain.engine.sharded_step import ShardedOptimizerStep
from lightning_megatrain.engine.sharding import ShardedState, sharded_config
from lightning_megatrain.engine.streamed import StreamedLayers
from lightning_megatrain.engine.tiling import SequenceTiles
from lightning_megatrain.engine.transfer import CudaTransfer, HostTransfer, Transfer
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS

log = logging.getLogger(__name__)


class MegaTrainEngine(FirstBatchPlacement):
    """Host-resident state, layer streaming and gradient drain for one module on one compute device; :meth:`setup`
    also builds the optimizer step over them (:attr:`step`). What it decides at the first training micro-batch
    (:meth:`place_for_batch`, :meth:`place_checkpoints`) is engine/first_batch.py's, inherited.

    Args:
        module: the LightningModule (or any ``nn.Module``) whose parameters become host masters (fp32, or bf16 for a
            compact ``host_state``).
        device: the compute device (``cuda:N`` or ``cpu``).
        compute_dtype: dtype layers are streamed and computed in (``bfloat16`` or ``float32``).
        config: the options (lightning_megatrain/config.py, one documented field each).
        ranks: the process group when several ranks train together (engine/sharding.py, [Note: sharded host
            state]); ``None``: one rank, nothing sharded.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        compute_dtype: torch.dtype,
        config: EngineConfig = EngineConfig(),
        ranks: Ranks | None = None,
    ) -> None:
        self.module = module
        self.device = device
        self.compute_dtype = compute_dtype
        self.config = config
        self.ranks = ranks
        self.sharding: ShardedState | None = None  # this rank's shares of the flat groups, when ranks
        self._step: OptimizerStep | None = None  # built by setup
        # the overlapped host step's per-group wait, for every reader of host masters (engine/overlap.py)
        self._gate: Callable[[FlatGroup], None] | None = None
        self.device_groups: list[DeviceGroup] = []  # in forward order: the residents' (if any) first
        self.groups: list[FlatGroup] = []  # one per layer of the stack
        self.resident_group: FlatGroup | None = None  # the residents' masters (CPU and CUDA backends alike)
        self.streamed: StreamedLayers | None = None
        self.tiles: SequenceTiles | None = None  # the layers' tiled position-wise blocks, unless seq_tile=None
        self.residents: Residents | None = None
        self.transfer: Transfer | None = None  # engine/transfer.py: HostTransfer or CudaTransfer
        self.registry: HostRegistry | None = None  # page-locked host buffers (CUDA only)
        self._overlap: OverlappedStep | None = None  # the host step's worker, when overlap_optimizer
        self.backward_updates: BackwardUpdates | None = None  # when update_during_backward (and overlap_optimizer)
        self._policy: RecomputePolicy | None = None  # keep or recompute, per layer (engine/recompute.py)
        # gpu_optimizer_groups="auto" and fitting: place_for_batch decides before the first training micro-batch
        self.placement_pending = False
        self._unsettled: list[torch.optim.Optimizer] = []  # their loaded states wait for the device groups

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def step(self) -> OptimizerStep:
        """The optimizer step (engine/optimizer_step.py): gradient finalization, clipping, the update, its waits.

        Raises:
            RuntimeError: before :meth:`setup` or after :meth:`teardown`.
        """
        if self._step is None:
            raise RuntimeError("MegaTrainEngine.step exists between setup() and teardown(). HINT: call setup first.")
        return self._step

    @property
    def flat_groups(self) -> list[FlatGroup]:
        """Every host flat group: the layers', then the residents' (if any)."""
        return self.groups + ([self.resident_group] if self.resident_group is not None else [])

    def setup(self, fitting: bool, previous: ShardedState | None = None) -> None:
        """Discover the stack, move every parameter into host flats, allocate slots, install streamed forwards.
        ``previous``: with several ranks, the last setup's shares of this module, whose owned masters the layers'
        placeholders stand for (:meth:`ShardedState.adopt`).

        Raises:
            ValueError: no layer stack, shared layer weights, or parameters placed off the host by the user.
            RuntimeError: host RAM or GPU memory too small, or ``compile_layers`` without a working
                ``torch.compile`` (before any large allocation).
        """
        module = self.module
        if self.ranks is not None:  # what several ranks do not support yet is refused here, "auto" settled
            self.config = sharded_config(self.config, self.ranks.world)
        layout = HOST_STATE_LAYOUTS[self.config.host_state]
        check_layout_compute(self.config.host_state, self.compute_dtype)
        # the "auto" options ([Note: auto placement])
        self.config = resolve(self.config, self.device, module_hf_config(module))
        path, stack = find_layer_stack(module, self.config.layers)
        resident_slots = tensor_slots(module, skip=stack)
        check_layers_independent(stack, resident_slots)
        check_on_host(module)
        if self.config.compile_layers:
            check_compilable(self.device)

        n_params = sum(p.numel() for p in module.parameters())
        layer_slots = [tensor_slots(layer) for layer in stack]
        layer_numels = [sum(p.numel() for p in layer.parameters()) for layer in stack]
        max_layer = max(layer_numels)
        n_resident = sum(p.numel() for p in {id(s.get()): s.get() for s in resident_slots if s.is_param}.values())
        n_device = self._check_gpu_optimizer_groups(len(stack))
        device_numel = ([n_resident] + layer_numels)[:n_device]
        # host grads (forward order: the residents, then the layers) are allocated now, except the device groups'
        # (only if code reads them) and, while "auto" is undecided, every group's: the split of the state between
        # host and GPU is decided at the first training micro-batch, before the host allocations it saves
        # ([Note: memory pool] in planner/pool.py; engine/first_batch.py's _choose_device_groups
        # allocates the host groups' then)
        self._grads_deferred = fitting and self.config.gpu_optimizer_groups == "auto"
        # several ranks never hold a group's grads whole: each holds its owned share ([Note: sharded host state]),
        # and the residents' are reduced from the device (CUDA) or from the parameters' own grads (CPU)
        lazy = [self._grads_deferred or self.ranks is not None or k < n_device for k in range(len(stack) + 1)]

        def check() -> None:  # the optimizer states: check_host_state, once the optimizers exist
            check_host_memory(
                layer_numels + [n_resident],
                pinned=self.on_cuda,
                slab_bytes=max_layer * self.compute_dtype.itemsize if self.on_cuda else 0,
                master_bytes=layout.weight_dtype.itemsize,
                grad_bytes=layout.grad_dtype.itemsize,
                grad_numels=[0 if off else n for n, off in zip(layer_numels + [n_resident], lazy[1:] + lazy[:1])],
                host_state=self.config.host_state,
            )
            if self.on_cuda:
                self._check_gpu_memory(max_layer, n_resident, device_numel)

        if self.ranks is None:
            check()
        else:  # all refuse where one does: a rank stopping alone would leave the others in a collective
            self.ranks.refuse_together(check)

        pin = self.on_cuda
        registry = self.registry = HostRegistry() if pin else None
        dtypes = dict(master_dtype=layout.weight_dtype, grad_dtype=layout.grad_dtype)  # the host_state's
        self.groups = [pack_group(slots, registry, lazy_grad=lazy[i + 1], **dtypes)
                       for i, slots in enumerate(layer_slots)]
        resident_group = self.resident_group = pack_group(resident_slots, registry, lazy_grad=lazy[0], **dtypes)
        layer_buffers = [[s for s in slots if not s.is_param] for slots in layer_slots]
        if self.ranks is not None:  # each rank owns 1/N of every group ([Note: sharded host state])
            names = {id(p): name for name, p in module.named_parameters()}
            self.sharding = ShardedState(self.flat_groups, self.ranks, registry, names, whole=[resident_group],
                                         device=self.device)
            self.sharding.adopt(previous)  # a layer packed from its placeholders is NaN ([Note: sharded layer masters])
        # several ranks step (and readers wait for) each group's owned share ([Note: sharded host state])
        sharding = self.sharding
        owned = None if sharding is None else lambda group: sharding.shard_of(group).owned
        overlap, gate = overlapped_step([resident_group, *self.groups], owned) if self.config.overlap_optimizer \
            else (None, None)
        self._overlap, self._gate = overlap, gate
        if registry is not None:
            # several ranks drain each layer's reduced grads into its owned share ([Note: sharded layer masters])
            owned = None if self.sharding is None else [self.sharding.shard_of(g).owned for g in self.groups]
            self.transfer = CudaTransfer(
                self.groups, self.device, self.compute_dtype, self.config.num_slots, registry, gate, owned
            )
            resident_buffers = [s for s in resident_slots if not s.is_param]
            self.residents = Residents(
                resident_group, resident_buffers, self.device, registry, self.transfer.d2h_stream, gate
            )
            buffers = [[(s, s.get().to(self.device)) for s in slots] for slots in layer_buffers]
        else:
            self.transfer = HostTransfer(self.groups, self.compute_dtype, gate)
            buffers = [[] for _ in layer_buffers]
        if self.sharding is not None:
            self.transfer = ShardedTransfer(self.transfer, self.sharding, self.groups)
            self._step = ShardedOptimizerStep(
                self.sharding, resident_group, self.config, self.device, self.transfer, self.residents, overlap
            )
        else:
            speculate = overlap is not None and self.config.update_during_backward is not False
            self.backward_updates = BackwardUpdates(self.groups, self.transfer) if speculate else None
            self._step = OptimizerStep(
                self.config, self.device, self.flat_groups, overlap, self.transfer, self.residents,
                self.backward_updates,
            )
        disable_kv_cache(module)
        layer_bytes = max_layer * self.compute_dtype.itemsize
        self._policy = RecomputePolicy(self.config.keep_layers, self.device, layer_bytes)
        self.streamed = StreamedLayers(
            stack, self.groups, self.transfer, buffers, self._policy, self.config.compile_layers,
            self.config.memo_layers(len(stack)),  # "auto": none until the first training micro-batch decides
        )
        self.streamed.backward_updates = self.backward_updates
        # what transformers records inside the layers (router logits) leaves their nodes ([Note: recorded outputs])
        self.streamed.recorded = find_recorded(module, path, stack)
        self.streamed.install(self.device.type)
        # "auto" starts as one checkpoint per layer, all offloaded ([Note: recompute segments]); placed (and
        # checked) for the first training micro-batch's tokens, again for any longer one
        self._memo_option = self.config.attention_memo
        self._checkpoint_options = (
            self.config.segment_layers, self.config.device_checkpoints, self.config.sub_segment_layers
        )
        self._placed_tokens = 0
        self.streamed.segments.configure(*self.config.checkpoints_unplanned())
        if self.config.seq_tile is not None:  # tiled per call, from each row's length ([Note: sequence tiles])
            self.tiles = SequenceTiles(stack, self.config.seq_tile)
            self.tiles.install()
        # decided (and checked) at the first training micro-batch, whose shape they need ([Note: auto placement])
        self.placement_pending = fitting and (self.config.gpu_optimizer_groups == "auto" or self.on_cuda)
        self._place_device_groups(n_device)
        log.info(
            "MegaTrain: streaming %d layers of '%s' (%.2fM params each, largest), %.2fM resident params, "
            "%.2fB params in host RAM (%s, host_state %s), compute %s on %s with %d slots%s",
            len(stack),
            path,
            max_layer / 1e6,
            n_resident / 1e6,
            n_params / 1e9,
            "pinned" if pin else "pageable",
            self.config.host_state,
            str(self.compute_dtype).replace("torch.", ""),
            self.device,
            self.config.num_slots,
            ", layers compiled (torch.compile)" if self.config.compile_layers else "",
        )

    def _place_device_groups(self, n: int) -> None:
        """Make the first ``n`` groups the forward reads (the residents, then layers 0, 1, ...) device groups
        ([Note: device groups]): at setup for an int ``gpu_optimizer_groups``, before the first training micro-batch
        for ``"auto"`` (:meth:`place_for_batch`). No-op for ``n == 0``; needs no device groups yet and no step in
        flight (nothing has stepped)."""
        if n == 0:
            return
        assert not self.device_groups, "device groups are placed once"
        forward_order = [self.resident_group, *self.groups]
        numels = [g.numel for g in forward_order[:n]]
        self.device_groups = [
            # the residents compute in their masters' dtype (residents.py), the layers in the compute dtype
            DeviceGroup(g, self.device, g.master.dtype if k == 0 else self.compute_dtype, own_grad=k != 0,
                        host_state=self.config.host_state)
            for k, g in enumerate(forward_order[:n])
        ]
        on_device = {id(d.group): d for d in self.device_groups}
        if self._overlap is not None:
            self._overlap.set_groups([g for g in forward_order if id(g) not in on_device])
        layer_device_groups = {i: on_device[id(g)] for i, g in enumerate(self.groups) if id(g) in on_device}
        self.transfer.set_device_groups(layer_device_groups)
        if self.residents is not None:
            self.residents.set_device_group(on_device.get(id(self.resident_group)))
        self._step.set_device_groups(self.device_groups)
        for device_group in self.device_groups:  # placed late ("auto"): the host grads setup allocated go back
            device_group.group.release_grad(self.registry.free if self.registry is not None else None)
        self._policy.persistent_layers = len(layer_device_groups)  # their weights stay on the device
        log.info(
            "MegaTrain: %d groups (%.2fB params) keep their master, grad and Adam states (host_state %s) on %s "
            "and take their optimizer step there; the host keeps their masters",
            n,
            sum(numels) / 1e9,
            self.config.host_state,
            self.device,
        )

    def _check_gpu_optimizer_groups(self, n_layers: int) -> int:
        """Validate ``gpu_optimizer_groups`` against the device and the model; returns it (0 for ``"auto"``, which
        :meth:`place_for_batch` decides)."""
        n = self.config.gpu_optimizer_groups
        if n == "auto":
            return 0
        if n and not self.on_cuda:
            raise ValueError(
                f"MegaTrainStrategy(gpu_optimizer_groups={n}) keeps optimizer states on a CUDA device, but the compute "
                f"device is {self.device}. HINT: use accelerator='cuda', or gpu_optimizer_groups=0."
            )
        if n > n_layers + 1:
            raise ValueError(
                f"MegaTrainStrategy(gpu_optimizer_groups={n}): the model has {n_layers + 1} groups (the residents and "
                f"{n_layers} decoder layers). HINT: use at most {n_layers + 1}."
            )
        return n

    def _check_gpu_memory(self, max_layer: int, n_resident: int, device_numel: list[int]) -> None:
        free, _ = torch.cuda.mem_get_info(self.device)
        master = HOST_STATE_LAYOUTS[self.config.host_state].weight_dtype  # what a slot's upload reads
        per_slot = max_layer * (master.itemsize + (self.compute_dtype.itemsize if self.compute_dtype != master else 0))
        # slots + resident compute copies and their grads (the masters' dtype) + a packed grad buffer for one layer
        slots = self.config.num_slots
        need = slots * per_slot + n_resident * 2 * master.itemsize + max_layer * self.compute_dtype.itemsize
        if self.ranks is not None and self.ranks.world > 1:  # fp32 [N x share]: the layer gather's buffer
            need += 2 * 4 * self.ranks.world * -(-max_layer // self.ranks.world)  # and the padded reduce-scatter
        # device groups (engine/device_state.py): the residents' moments, the layers' whole device state
        itemsize = self.compute_dtype.itemsize
        device_bytes = sum(gpu_bytes_per_param(itemsize, resident=k == 0, host_state=self.config.host_state) * n
                           for k, n in enumerate(device_numel))
        if need + device_bytes > free:
            raise RuntimeError(
                f"MegaTrainStrategy needs {(need + device_bytes) / GIB:.1f} GiB of GPU memory for {slots} "
                f"layer slots of {max_layer / 1e6:.0f}M parameters, {n_resident / 1e6:.0f}M resident parameters"
                f"{f' and {len(device_numel)} groups with their optimizer on the GPU' if device_numel else ''}, "
                f"before any activations, but only {free / GIB:.1f} GiB is free on {self.device}. HINT: one decoder "
                "layer must fit on the GPU; use precision='bf16-mixed', fewer slots (num_slots=2), fewer "
                "gpu_optimizer_groups or a smaller model."
            )

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """Bind the residents' compute copies for one ``training_step``/``validation_step``/... call."""
        assert self.transfer is not None
        check_packed(self.flat_groups, self.module)  # a .double() or .to(...) after setup: refused by name
        self.transfer.invalidate()  # the user may have changed masters between steps (callbacks, load_state_dict)
        if self.residents is None:
            if self._gate is not None and self.resident_group is not None:
                self._gate(self.resident_group)  # the CPU backend computes on the resident masters
            yield
            return
        with self.residents.bound():
            yield

    def set_grads_read(self, read: bool) -> None:
        """Before a backward: whether code may read ``p.grad`` before the optimizer step. When not, the device
        groups' grads stay on the device (engine/device_state.py): the device step and clipping read them there."""
        if self.transfer is not None:
            self.transfer.device_grads_to_host = read
        if self.residents is not None:
            self.residents.grads_to_host = read

    def wait_for_optimizer(self) -> None:
        """:meth:`OptimizerStep.wait_for_optimizer` (a no-op before setup and after teardown)."""
        if self._step is not None:
            self._step.wait_for_optimizer()

    def refuse_torn(self, what: str) -> None:
        """:meth:`OptimizerStep.refuse_torn` (a no-op before setup and after teardown)."""
        if self._step is not None:
            self._step.guard.refuse_torn(what)

    def reload_masters(self) -> None:
        """The host masters were loaded (``load_state_dict``): refresh everything derived from them."""
        for device_group in self.device_groups:
            device_group.upload()
        self.masters_updated()

    def masters_updated(self) -> None:
        """The optimizer stepped the host masters: slots and resident compute copies are stale, and so are the
        grads' device norms (the next step measures its own). With several ranks, every rank's updated shares are
        gathered first ([Note: sharded host state])."""
        if self.sharding is not None:
            self.sharding.gather(self._gate)
        owned = self.sharding.owned_groups if self.sharding is not None else []  # the drain's groups with ranks
        for group in (*self.flat_groups, *owned):
            group.device_norm_sq = None
        if self.transfer is not None:
            self.transfer.invalidate()
        if self.residents is not None:
            self.residents.invalidate()

    def host_bytes(self) -> dict[str, int]:
        """Host memory the engine holds, by kind: the masters, the grad buffers allocated so far (fp32, or bf16 for a
        compact ``host_state``), the
        drain's pinned slabs and, on CUDA, the stash pool's page-locked buffers of offloaded layer inputs. Sizes only:
        no sync, callable any time after :meth:`setup`."""
        groups = self.flat_groups
        sizes = {
            "masters": sum(g.master.nbytes for g in groups),
            "grads": sum(g.grad_nbytes for g in groups),
        }
        if self.transfer is not None:
            sizes.update(self.transfer.host_bytes())
        if self.sharding is not None:
            sizes.update(self.sharding.host_bytes())
        if self.backward_updates is not None:
            sizes["backward_snapshots"] = self.backward_updates.host_bytes()
        return sizes

    def teardown(self) -> None:
        """Wait for the step in flight, restore each layer's and each tiled block's own ``forward`` and free the
        engine's resources; a failed overlapped step's error is raised after that, so an exception leaves a restored
        module."""
        try:
            self.wait_for_optimizer()
        finally:
            if self.streamed is not None:
                self.streamed.uninstall()
            if self.tiles is not None:
                self.tiles.uninstall()
            if self.backward_updates is not None:
                self.backward_updates.shutdown()
            if self.transfer is not None:
                self.transfer.close()  # the layers' queued drains land in their host grads
            if self.residents is not None:
                self.residents.wait_landed()  # and so does a residents' drain no optimizer step landed
            if self.registry is not None:
                torch.cuda.synchronize(self.device)  # no copy may still touch a region being unregistered
                self.registry.release()
            self.transfer = self.residents = self.streamed = self.tiles = self.registry = self._step = None
            self.backward_updates = None
