"""Find the decoder-layer stack of a causal LM inside any LightningModule, and the residents around it.

The *layer stack* is the ``nn.ModuleList`` (or ``nn.Sequential``) of repeated decoder layers whose weights are
streamed; every other parameter or buffer of the LightningModule is a *resident* (embeddings, final norm, lm_head,
rotary tables, heads the user added). See ``engine/__init__.py`` for the glossary.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

# Attribute paths of the decoder stack in HuggingFace causal LMs, relative to the HF model. Tried before the generic
# search because they are unambiguous (a model may hold other ModuleLists, e.g. vision towers).
_HF_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "transformer.layers", "gpt_neox.layers")


@dataclass(frozen=True)
class TensorSlot:
    """Where a parameter or buffer lives: ``owner._parameters[attr]`` (or ``_buffers``) under dotted ``name``."""

    name: str
    owner: nn.Module
    attr: str
    is_param: bool

    def get(self) -> Tensor:
        return (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr]

    def set(self, value: Tensor) -> None:
        # Written into the dict directly: ``register_parameter`` would refuse a plain (GPU compute) tensor.
        (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr] = value


def tensor_slots(module: nn.Module, skip: nn.Module | None = None) -> list[TensorSlot]:
    """Every parameter and buffer slot of ``module`` (tied tensors listed once per slot), excluding ``skip``'s."""
    skipped = {id(m) for m in skip.modules()} if skip is not None else set()
    slots = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in skipped:
            continue
        for attr, value in sub._parameters.items():
            if value is not None:
                slots.append(TensorSlot(f"{prefix}.{attr}" if prefix else attr, sub, attr, True))
        for attr, value in sub._buffers.items():
            if value is not None:
                slots.append(TensorSlot(f"{prefix}.{attr}" if prefix else attr, sub, attr, False))
    return slots


def _get_path(module: nn.Module, path: str) -> nn.Module | None:
    current: object = module
    for part in path.split("."):
        current = getattr(current, part, None)
        if current is None:
            return None
    return current if isinstance(current, nn.Module) else None


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# A stack is indexed, iterated and sized, and each layer's ``forward`` is replaced by the streamed one; an
# ``nn.Sequential`` calls its layers through ``__call__`` in order, so the replaced forwards run there as well.
_STACK_TYPES = (nn.ModuleList, nn.Sequential)


def find_layer_stack(module: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList | nn.Sequential]:
    """Return ``(dotted_path, stack)`` of the decoder layers inside ``module``.

    With ``path`` given, that attribute path is used as is. Otherwise the HuggingFace conventional paths are tried
    under every submodule, then the ``nn.ModuleList`` or ``nn.Sequential`` of at least two same-class modules holding
    the most parameters.

    Raises:
        ValueError: ``path`` does not name an ``nn.ModuleList``/``nn.Sequential``, or no stack can be found.
    """
    if path is not None:
        found = _get_path(module, path)
        if not isinstance(found, _STACK_TYPES) or len(found) == 0:
            raise ValueError(
                f"MegaTrainStrategy(layers={path!r}) does not name a non-empty nn.ModuleList or nn.Sequential in "
                f"{type(module).__name__} (found {type(found).__name__ if found is not None else 'nothing'}). "
                "HINT: pass the dotted attribute path of the decoder-layer list, e.g. layers='model.model.layers'."
            )
        return path, found

    candidates: list[tuple[int, str, nn.ModuleList | nn.Sequential]] = []
    for prefix, sub in module.named_modules():
        for rel in _HF_LAYER_PATHS:
            found = _get_path(sub, rel)
            if isinstance(found, _STACK_TYPES) and len(found) > 0:
                candidates.append((_numel(found), f"{prefix}.{rel}" if prefix else rel, found))
    if not candidates:
        for prefix, sub in module.named_modules():
            if (
                isinstance(sub, _STACK_TYPES)
                and len(sub) >= 2
                and len({type(layer) for layer in sub}) == 1
                and _numel(sub) > 0
            ):
                candidates.append((_numel(sub), prefix, sub))
    if not candidates:
        raise ValueError(
            f"MegaTrainStrategy found no decoder-layer stack in {type(module).__name__}: it looks for a HuggingFace "
            f"causal LM ({', '.join(_HF_LAYER_PATHS)}) or an nn.ModuleList/nn.Sequential of at least two same-class "
            "layers. "
            "HINT: name it explicitly, e.g. Trainer(strategy=MegaTrainStrategy(layers='net.blocks'))."
        )
    _, best_path, best = max(candidates, key=lambda c: c[0])
    return best_path, best


def check_layers_independent(stack: nn.ModuleList | nn.Sequential, resident_slots: list[TensorSlot]) -> None:
    """Streaming needs each layer to own its weights: refuse weights shared between layers or with residents."""
    owner: dict[int, str] = {}
    for i, layer in enumerate(stack):
        for name, p in layer.named_parameters():
            if id(p) in owner and not owner[id(p)].startswith(f"{i}."):
                raise ValueError(
                    f"Parameter '{i}.{name}' of the layer stack is shared with '{owner[id(p)]}'. MegaTrainStrategy "
                    "streams each layer's own weights and cannot stream weights shared across layers."
                )
            owner[id(p)] = f"{i}.{name}"
    for slot in resident_slots:
        if slot.is_param and id(slot.get()) in owner:
            raise ValueError(
                f"Parameter '{slot.name}' outside the layer stack is the same tensor as layer parameter "
                f"'{owner[id(slot.get())]}'. MegaTrainStrategy cannot stream a weight that is also used outside "
                "its layer; untie it or choose a different `layers` path."
            )


def check_on_host(module: nn.Module) -> None:
    """Refuse a parameter or buffer that is not in host memory (never materialized, or placed by the user): the
    engine packs each into host flats."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.device.type == "meta":
            raise ValueError(
                f"MegaTrainStrategy packs every parameter into host RAM, but '{name}' is on the meta device, never "
                "materialized. HINT: load or initialize its weights before fit (from_pretrained, to_empty() and "
                "an init, or load_state_dict(..., assign=True) in configure_model)."
            )
        if tensor.device.type != "cpu":
            raise ValueError(
                f"MegaTrainStrategy keeps all parameters in host RAM, but '{name}' is on {tensor.device}. "
                "HINT: remove manual placement (`.to(device)`, `.cuda()`, `device_map=`) from the model; the "
                "strategy moves each layer to the GPU only while it computes."
            )


def disable_kv_cache(module: nn.Module) -> None:
    """A recompute would append keys twice to a KV cache: streamed training runs with ``use_cache=False``."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
        if getattr(sub, "gradient_checkpointing", False):
            sub.gradient_checkpointing = False  # the engine already recomputes each layer in backward
