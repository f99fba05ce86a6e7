"""The engine facade the strategy talks to: setup, per-step binding, gradient finalization, teardown.

[Note: late grads]
At the end of backward the last layers' grads (and the residents', one ~1.6 GB D2H at 3B) are still on their way
to the host. Waiting for them on the training thread idles the GPU (~0.1 s per step at 3B, 64K tokens/step,
benchmarks/results kernel_gaps) and then the host queues the next forward into an empty GPU. When nothing can read
``p.grad`` before the optimizer step (no ``on_before_optimizer_step`` hook in the module or a callback and no
``configure_gradient_clipping`` of its own: precision.py ``grads_read_by_hooks``) and the host step is overlapped,
:meth:`MegaTrainEngine.finalize_gradients` leaves them landing instead:

- the residents' D2H stays in flight on the D2H stream (its event: ``Residents.wait_landed``);
- clipping takes the global norm from the per-layer norms measured on the device and computes the factor there;
  the device groups' step reads it on the device, and one 4-byte D2H into a pinned scalar (its event
  ``_clip_copied``, recorded by the compute stream) hands it to the host step;
- the host step's worker (engine/overlap.py) first waits for every drain and the residents' copy, then for that
  factor, and only then reads ``p.grad``;
- the next ``zero_grad`` and backward wait for the whole host step, as always, so they find the grads landed.

Where a drain left a host add behind (an expert without tokens, a busy layer under accumulation) the device norms
are incomplete and the step waits as before.

Measured (3B, 64K tokens/step, 8 device groups, benchmarks/results kernel_gaps): with the engine's waits gone the
copies still ran at the end of the step, and a read of the loss right after it (``.item()``: a progress bar showing a
logged loss, the benchmark's recorder) queued its 4 bytes behind them on the D2H copy engine and waited as long
(73 + 30 ms). Those copies were the device groups' grads and updated masters, which nothing on the host read: they
now stay on the GPU unless code reads ``p.grad`` before the step, and the masters go to the host when it reads them
(engine/device_state.py). The step's end then has no copy left to wait for (1459861: no gap at the step end).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.device_state import DeviceGroup, gpu_bytes_per_param
from lightning_megatrain.engine.discovery import check_layers_independent, find_layer_stack, tensor_slots
from lightning_megatrain.engine.host_store import FlatGroup, check_host_memory, pack_group
from lightning_megatrain.engine.overlap import OverlappedStep
from lightning_megatrain.engine.pinned import HostRegistry
from lightning_megatrain.engine.recompute import RecomputePolicy
from lightning_megatrain.engine.residents import Residents
from lightning_megatrain.engine.streamed import StreamedLayers, check_compilable
from lightning_megatrain.engine.transfer import CudaTransfer, HostTransfer
from lightning_megatrain.optim.host_optimizer import Hyper, device_update, hyper_snapshot, overlappable, snapshot_update

log = logging.getLogger(__name__)

_GIB = 1024**3


class MegaTrainEngine:
    """Host-resident state, layer streaming and gradient drain for one module on one compute device.

    Args:
        module: the LightningModule (or any ``nn.Module``) whose parameters become host fp32 masters.
        device: the compute device (``cuda:N`` or ``cpu``).
        compute_dtype: dtype layers are streamed and computed in (``bfloat16`` or ``float32``).
        config: the options (lightning_megatrain/config.py, one documented field each).
    """

    def __init__(
        self, module: nn.Module, device: torch.device, compute_dtype: torch.dtype, config: EngineConfig = EngineConfig()
    ) -> None:
        self.module = module
        self.device = device
        self.compute_dtype = compute_dtype
        self.config = config
        self.overlap: OverlappedStep | None = None  # set up when overlap_optimizer
        self._deferred_grad_scale: torch.Tensor | None = None  # clipping factor the optimizer step applies
        self._late_grads = False  # this step's host grads are still landing ([Note: late grads])
        self._clip_host: torch.Tensor | None = None  # pinned 0-dim fp32: the device clip factor, for the host step
        # - CUDA event for stream synchronization
        self._clip_copied: torch.cuda.Event | None = None  # recorded by compute after the factor's D2H; host waits
        self.device_groups: list[DeviceGroup] = []  # in forward order: the residents' (if any) first
        self._device_param_ids: frozenset[int] = frozenset()
        self.groups: list[FlatGroup] = []  # one per layer of the stack
        self.resident_group: FlatGroup | None = None  # the residents' masters (CPU and CUDA backends alike)
        self.streamed: StreamedLayers | None = None
        self.residents: Residents | None = None
        self.transfer: HostTransfer | CudaTransfer | None = None
        self.registry: HostRegistry | None = None  # page-locked host buffers (CUDA only)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def setup(self, fitting: bool) -> None:
        """Discover the stack, move every parameter into host flats, allocate slots, install streamed forwards.

        Raises:
            ValueError: no layer stack, shared layer weights, or parameters placed off the host by the user.
            RuntimeError: host RAM or GPU memory too small, or ``compile_layers`` without a working
                ``torch.compile`` (before any large allocation).
        """
        module = self.module
        path, stack = find_layer_stack(module, self.config.layers)
        resident_slots = tensor_slots(module, skip=stack)
        check_layers_independent(stack, resident_slots)
        self._check_placement()
        if self.config.compile_layers:
            check_compilable(self.device)

        n_params = sum(p.numel() for p in module.parameters())
        layer_slots = [tensor_slots(layer) for layer in stack]
        layer_numels = [sum(p.numel() for p in layer.parameters()) for layer in stack]
        max_layer = max(layer_numels)
        n_resident = sum(p.numel() for p in {id(s.get()): s.get() for s in resident_slots if s.is_param}.values())
        n_device = self._check_gpu_optimizer_groups(len(stack))
        device_numel = ([n_resident] + layer_numels)[:n_device]
        check_host_memory(
            layer_numels + [n_resident],
            fitting=fitting,
            pinned=self.on_cuda,
            slab_bytes=max_layer * self.compute_dtype.itemsize if self.on_cuda else 0,
            device_numel=sum(device_numel),
        )
        if self.on_cuda:
            self._check_gpu_memory(max_layer, n_resident, device_numel)

        pin = self.on_cuda
        registry = self.registry = HostRegistry() if pin else None
        # device groups (the residents, then the first layers) allocate host grads only if code reads them
        self.groups = [pack_group(slots, registry, lazy_grad=i + 1 < n_device) for i, slots in enumerate(layer_slots)]
        resident_group = self.resident_group = pack_group(resident_slots, registry, lazy_grad=n_device > 0)
        layer_buffers = [[s for s in slots if not s.is_param] for slots in layer_slots]
        # the order the next forward reads masters in: residents (the embedding) first, then the layers
        forward_order = [resident_group, *self.groups]
        self.device_groups = [
            DeviceGroup(g, self.device, torch.float32 if g is resident_group else self.compute_dtype,
                        own_grad=g is not resident_group)
            for g in forward_order[:n_device]
        ]
        on_device = {id(d.group): d for d in self.device_groups}
        self._device_param_ids = frozenset(id(p) for d in self.device_groups for p in d.group.params)
        host_order = [g for g in forward_order if id(g) not in on_device]
        self.overlap = OverlappedStep(host_order) if self.config.overlap_optimizer else None
        gate = self.overlap.wait if self.overlap is not None else None
        if registry is not None:
            layer_device_groups = {i: on_device[id(g)] for i, g in enumerate(self.groups) if id(g) in on_device}
            self.transfer = CudaTransfer(
                self.groups, self.device, self.compute_dtype, self.config.num_slots, registry, gate, layer_device_groups
            )
            resident_buffers = [s for s in resident_slots if not s.is_param]
            self.residents = Residents(
                resident_group, resident_buffers, self.device, registry, self.transfer.d2h_stream, gate,
                on_device.get(id(resident_group)),
            )
            buffers = [[(s, s.get().to(self.device)) for s in slots] for slots in layer_buffers]
        else:
            self.transfer = HostTransfer(self.groups, self.compute_dtype, gate)
            buffers = [[] for _ in layer_buffers]
        self._disable_kv_cache()
        persistent = sum(1 for i in range(len(stack)) if self.transfer.persistent(i))  # the first layers, if any
        layer_bytes = max_layer * self.compute_dtype.itemsize
        policy = RecomputePolicy(self.config.keep_layers, self.device, layer_bytes, persistent)
        self.streamed = StreamedLayers(stack, self.groups, self.transfer, buffers, policy, self.config.compile_layers)
        self.streamed.install(self.device.type)
        if self.device_groups:
            log.info(
                "MegaTrain: %d groups (%.2fB params) keep their fp32 master, grad and Adam states on %s too and take "
                "their optimizer step there",
                n_device,
                sum(device_numel) / 1e9,
                self.device,
            )
        log.info(
            "MegaTrain: streaming %d layers of '%s' (%.2fM params each, largest), %.2fM resident params, "
            "%.2fB params in host RAM (%s), compute %s on %s with %d slots%s",
            len(stack),
            path,
            max_layer / 1e6,
            n_resident / 1e6,
            n_params / 1e9,
            "pinned" if pin else "pageable",
            str(self.compute_dtype).replace("torch.", ""),
            self.device,
            self.config.num_slots,
            ", layers compiled (torch.compile)" if self.config.compile_layers else "",
        )

    def _check_placement(self) -> None:
        for name, tensor in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"MegaTrainStrategy keeps all parameters in host RAM, but '{name}' is on {tensor.device}. "
                    "HINT: remove manual placement (`.to(device)`, `.cuda()`, `device_map=`) from the model; the "
                    "strategy moves each layer to the GPU only while it computes."
                )

    def _check_gpu_optimizer_groups(self, n_layers: int) -> int:
        """Validate ``gpu_optimizer_groups`` against the device and the model; returns it."""
        n = self.config.gpu_optimizer_groups
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
        per_slot = max_layer * (4 + (self.compute_dtype.itemsize if self.compute_dtype != torch.float32 else 0))
        # slots + resident compute copies and their grads (fp32) + a packed grad buffer for one layer
        slots = self.config.num_slots
        need = slots * per_slot + n_resident * 8 + max_layer * self.compute_dtype.itemsize
        # device groups (engine/device_state.py): the residents' moments, the layers' whole device state
        itemsize = self.compute_dtype.itemsize
        device_bytes = sum(gpu_bytes_per_param(itemsize, resident=k == 0) * n for k, n in enumerate(device_numel))
        if need + device_bytes > free:
            raise RuntimeError(
                f"MegaTrainStrategy needs {(need + device_bytes) / _GIB:.1f} GiB of GPU memory for {slots} "
                f"layer slots of {max_layer / 1e6:.0f}M parameters, {n_resident / 1e6:.0f}M resident parameters"
                f"{f' and {len(device_numel)} groups with their optimizer on the GPU' if device_numel else ''}, "
                f"before any activations, but only {free / _GIB:.1f} GiB is free on {self.device}. HINT: one decoder "
                "layer must fit on the GPU; use precision='bf16-mixed', fewer slots (num_slots=2), fewer "
                "gpu_optimizer_groups or a smaller model."
            )

    def _disable_kv_cache(self) -> None:
        """A recompute would append keys twice to a KV cache: streamed training runs with ``use_cache=False``."""
        for sub in self.module.modules():
            config = getattr(sub, "config", None)
            if getattr(config, "use_cache", False):
                config.use_cache = False
            if getattr(sub, "gradient_checkpointing", False):
                sub.gradient_checkpointing = False  # the engine already recomputes each layer in backward

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """Bind the residents' compute copies for one ``training_step``/``validation_step``/... call."""
        assert self.transfer is not None
        self.transfer.invalidate()  # the user may have changed masters between steps (callbacks, load_state_dict)
        if self.residents is None:
            if self.overlap is not None and self.resident_group is not None:
                self.overlap.wait(self.resident_group)  # the CPU backend computes on the resident masters
            yield
            return
        with self.residents.bound():
            yield

    def set_grads_read(self, read: bool) -> None:
        """Before a backward: whether code may read ``p.grad`` before the optimizer step. When not, the device
        groups' grads stay on the device (engine/device_state.py): the device step and clipping read them there."""
        if isinstance(self.transfer, CudaTransfer):
            self.transfer.device_grads_to_host = read
        if self.residents is not None:
            self.residents.grads_to_host = read

    def grads_zeroed(self) -> None:
        """``optimizer.zero_grad()`` ran: the device groups' next grads start a new sum."""
        for device_group in self.device_groups:
            device_group.clear_grads()

    def wait_for_host_step(self) -> None:
        """Block until the overlapped host optimizer step is done with the host grads and the host groups' masters.

        What backward's drains, ``zero_grad`` and gradient finalization wait for: they write host grads, which only
        the host step reads (device groups step from their device grads).
        """
        if self.overlap is not None:
            self.overlap.wait_all()

    def wait_for_optimizer(self) -> None:
        """Block until the optimizer step in flight has updated every host master and optimizer state: the host
        step, and the device groups' masters written back (for readers of host parameters: checkpoints, hooks)."""
        self.wait_for_host_step()
        for device_group in self.device_groups:
            device_group.wait_written_back(self.transfer.d2h_stream)

    def finalize_gradients(self, grads_read: bool = True) -> None:
        """Drain the residents and make every host fp32 grad final, or leave the last copies landing for the
        overlapped host step when nothing reads them before it ([Note: late grads]).

        Args:
            grads_read: code may read ``p.grad`` before the optimizer step (hooks, or a step that is not overlapped).
        """
        assert self.transfer is not None
        self._deferred_grad_scale = self._clip_copied = None
        self.wait_for_host_step()  # the residents' drain below writes grads an overlapped step may still read
        host_added = self.transfer.take_host_added()
        self._late_grads = self.overlap is not None and not grads_read and not host_added
        if self.residents is not None:
            self.residents.drain(wait=not self._late_grads)
        if not self._late_grads:
            self.transfer.wait_drained()

    def _land_grads(self) -> None:
        """Wait for the host grads left landing by :meth:`finalize_gradients` (any thread; no-op when none)."""
        assert self.transfer is not None
        self.transfer.wait_drained()
        if self.residents is not None:
            self.residents.wait_landed()

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, defer: bool = False) -> bool:
        """Clip the host grads of ``params`` to a global L2 norm of ``max_norm``, as ``clip_grad_norm_`` does.

        The norm comes from the per-layer norms taken on the device during backward (a host pass only where those
        are not valid); the scaling is one vectorized pass per flat grad buffer, or, with ``defer`` (the optimizer
        step will be overlapped), left to the overlapped step, group by group. Returns False (nothing done) when
        ``params`` is not exactly the set of parameters the engine holds grads for, so the caller falls back to
        torch.
        """
        groups = self.groups + ([self.resident_group] if self.resident_group is not None else [])
        held = {id(p) for g in groups for p in g.params}
        wanted = {id(p) for p in params}
        if self._late_grads and wanted != held:
            self._late_grads = False  # torch's clipping may read p.grad below: land them now
            self._land_grads()
        if not wanted <= held or any(p.grad is not None and id(p) not in wanted for g in groups for p in g.params):
            return False
        if self._late_grads:
            self._clip_on_device(groups, max_norm)
            return True
        partial = [g.grad_norm_sq() for g in groups]  # device norms from backward where valid, else host passes
        on_device = [n for n in partial if n.device.type != "cpu"]
        on_host = [n for n in partial if n.device.type == "cpu"]
        if on_device:  # one small D2H at the step boundary, where the host waits anyway
            on_host.append(torch.stack(on_device).sum().cpu())
        total = torch.stack(on_host).sum().sqrt()
        # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total + 1e-6), clamped to 1 (a no-op multiply we skip)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef.item() != 1.0:  # host tensors: no device sync
            if defer:
                self._deferred_grad_scale = coef
            else:
                for g in groups:
                    g.scale_grads(coef)
        return True

    def _clip_on_device(self, groups: list[FlatGroup], max_norm: float) -> None:
        """The clipping factor from the device norms, left on the device with a copy on its way to the host.

        Grads still landing have their norm measured on the device (a group with a host add makes the grads wait,
        :meth:`finalize_gradients`); a group without one has no grads this step, or grads final on the host (the
        residents' host add). See [Note: late grads].
        """
        device_sq = [g.device_norm_sq for g in groups if g.device_norm_sq is not None]
        host_sq = [g.grad_norm_sq() for g in groups if g.device_norm_sq is None]  # zeros where there are no grads
        total_sq = torch.stack(device_sq).sum() if device_sq else torch.zeros((), device=self.device)
        total = (total_sq + float(torch.stack(host_sq).sum()) if host_sq else total_sq).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_, on the device
        self._deferred_grad_scale = coef  # the device step reads it there
        if self._clip_host is None:
            self._clip_host = torch.empty((), dtype=torch.float32, pin_memory=True)
        self._clip_host.copy_(coef, non_blocking=True)
        self._clip_copied = torch.cuda.Event()
        self._clip_copied.record(torch.cuda.current_stream(self.device))

    def _landed_update(
        self, optimizer: torch.optim.Optimizer, hyper: Hyper, clip_copied: torch.cuda.Event | None
    ) -> Callable[[list[torch.Tensor]], None]:
        """The host step's update, built on its worker once the grads and the clipping factor have landed."""
        self._land_grads()
        scale = None
        if clip_copied is not None:
            assert self._clip_host is not None
            clip_copied.synchronize()
            if self._clip_host.item() != 1.0:  # a pinned host scalar: no device sync
                scale = self._clip_host.clone()
        update = snapshot_update(optimizer, scale, skip=self._device_param_ids, snapshot=hyper)
        assert update is not None
        return update

    def takes_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`optimizer_step` runs ``optimizer``'s step (overlapped and/or split with the device)."""
        return (self.overlap is not None or bool(self.device_groups)) and overlappable(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s step with the deferred clipping: device groups on the compute stream now, the host
        groups on the overlap worker (engine/overlap.py) or now."""
        scale, self._deferred_grad_scale = self._deferred_grad_scale, None
        if self.device_groups:
            self._device_step(optimizer, scale)
        copied, self._clip_copied = self._clip_copied, None
        if self._late_grads:
            assert self.overlap is not None
            self._late_grads = False  # the worker waits for them; zero_grad and backward wait for the worker
            self.overlap.launch(functools.partial(self._landed_update, optimizer, hyper_snapshot(optimizer), copied))
        else:
            update = snapshot_update(optimizer, scale, skip=self._device_param_ids)
            assert update is not None
            if self.overlap is not None:
                self.overlap.launch(lambda: update)
            else:
                with torch.no_grad():
                    update([p for group in optimizer.param_groups for p in group["params"]])
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check (optimizer.step ran)

    def _device_step(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
        """The update of every device group, queued on the compute stream (see [Note: device groups])."""
        assert isinstance(self.transfer, CudaTransfer)
        update = device_update(optimizer, grad_scale)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        compute = torch.cuda.current_stream(self.device)
        with torch.no_grad(), torch.profiler.record_function("megatrain::device_optimizer_step"):
            for device_group in self.device_groups:
                resident = self.residents is not None and self.residents.device_group is device_group
                grads = self.residents.grads() if resident else device_group.present_grads()
                bind = [g is not None and id(p) in in_optimizer for p, g in zip(device_group.group.params, grads)]
                device_group.bind_states(optimizer, bind)
                compute.wait_event(device_group.written_back)  # the last write-back may still read the mirror
                update(device_group.group.params, device_group.group.views(device_group.master), grads)
                device_group.updated()
        if self.residents is not None:
            self.residents.clear_grads()

    def reload_masters(self) -> None:
        """The host masters were loaded (``load_state_dict``): refresh everything derived from them."""
        for device_group in self.device_groups:
            device_group.upload()
        self.masters_updated()

    def masters_updated(self) -> None:
        """The optimizer stepped the host masters: slots and resident compute copies are stale, and so are the
        grads' device norms (the next step measures its own)."""
        for group in self.groups + ([self.resident_group] if self.resident_group is not None else []):
            group.device_norm_sq = None
        if self.transfer is not None:
            self.transfer.invalidate()
        if self.residents is not None:
            self.residents.invalidate()

    def host_bytes(self) -> dict[str, int]:
        """Host memory the engine holds, by kind: the fp32 masters, the fp32 grad buffers allocated so far, the
        drain's pinned slabs and, on CUDA, the stash pool's page-locked buffers of offloaded layer inputs. Sizes only:
        no sync, callable any time after :meth:`setup`."""
        groups = self.groups + ([self.resident_group] if self.resident_group is not None else [])
        sizes = {
            "masters": sum(g.master.nbytes for g in groups),
            "grads": sum(g.grad_nbytes for g in groups),
        }
        if isinstance(self.transfer, CudaTransfer):
            sizes["grad_slabs"] = self.transfer.slab_nbytes
            sizes["offload_cache"] = self.transfer.stash_pool.nbytes
        return sizes

    def teardown(self) -> None:
        self.wait_for_optimizer()
        if self.streamed is not None:
            self.streamed.uninstall()
        if self.transfer is not None:
            self.transfer.close()
        if self.registry is not None:
            torch.cuda.synchronize(self.device)  # no copy may still touch a region being unregistered
            self.registry.release()
        self.transfer = self.residents = self.streamed = self.registry = None
