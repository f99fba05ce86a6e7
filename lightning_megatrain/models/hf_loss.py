"""HF causal LMs called with ``labels``: HF's loss computed by the chunked cross-entropy, without ``[B, T, V]`` logits.

[Note: HF loss]
A LightningModule written for plain Lightning calls its HF model as ``model(input_ids=..., attention_mask=...,
labels=...)`` and returns ``out.loss``. HF's forward then projects every position onto the vocabulary and its
``ForCausalLMLoss`` upcasts the ``[B, T, V]`` logits to fp32: at 32 x 1024 tokens and V = 128K a 15.7 GiB block, and
as much again for its gradient. :func:`install_chunked_hf_loss` gives each such model a ``forward`` (an instance
attribute shadowing the class's, as engine/streamed.py does for decoder layers) that, for a call with ``labels``:

1. runs the class's own forward with ``labels=None`` and ``logits_to_keep`` an empty position tensor, so HF's body
   (embeddings, backbone, masks, caches, ``**kwargs``) runs unchanged, its head projects no position and it computes
   no loss;
2. takes the backbone's last hidden states ``[B, T, H]`` from a forward hook on the backbone;
3. computes the loss with :func:`~lightning_megatrain.models.loss.causal_lm_loss` from them and ``lm_head.weight``
   (at most ``[chunk_size, V]`` logits at a time), soft-capped by ``config.final_logit_softcapping`` where the
   forward caps its logits;
4. returns HF's own output (same type, same ``hidden_states``, ``attentions``, cache) with ``loss`` set and
   ``logits=None``: **logits are not materialised when labels are given.**

Same loss, same gradients. HF pads ``labels`` with one ``ignore_index`` column, shifts it left and takes
``cross_entropy(logits, shifted, ignore_index)``: the mean over the N targets that are not ``ignore_index``, or, with
``num_items_in_batch``, their sum divided by it. ``causal_lm_loss`` shifts the same way and returns the same mean; with
``num_items_in_batch`` this returns ``mean * N / num_items_in_batch``. With ``output_router_logits`` on (as argument or
config) HF's forward, run without labels, still computes the router auxiliary loss and returns it as ``aux_loss``; this
adds ``self.<coef> * aux_loss`` to the loss as HF's forward does with labels (under the streamed engine the router
logits it is computed from lead back into the layers: [Note: recorded outputs] in engine/recorded.py). With no target
and no ``num_items_in_batch`` HF's mean is ``0 / 0``: NaN, with zero gradients; this returns the same, a ``masked_fill``
of ``causal_lm_loss``'s value for no target (0, zero gradients). ``N`` is counted on the device, so neither case reads a
value on the host. The hidden states are HF's own tensors, so in fp32 loss and every gradient agree to rounding
(tests/models/test_models_hf_loss.py states the tolerances). Under bf16 autocast both project in bf16; this soft-caps
and takes the log-softmax in fp32 where HF soft-caps the bf16 logits, so the two are close, not bitwise equal.

Where it applies, decided once per model at install: a ``PreTrainedModel`` whose class (or a base class) is named
``*ForCausalLM``, whose ``forward`` takes ``labels`` and ``logits_to_keep`` and whose code, read with ``inspect`` and
compared statement by statement after ``ast.unparse`` (:func:`head_form`), is exactly: optional ``x = x if x is not
None else self.config.x`` lines; ``outputs = self.<backbone>(...)``; hidden states ``outputs.last_hidden_state`` or
``outputs[0]``, sliced by ``logits_to_keep``; ``logits = self.lm_head(hidden_states)`` (optionally ``.float()``);
optionally Gemma's soft-cap by ``self.config.final_logit_softcapping``; ``loss = None`` and, with labels, ``loss =
self.loss_function(logits, labels, vocab_size, **kwargs)``; optionally the MoE router auxiliary loss (``aux_loss =
None``, then under ``output_router_logits``: ``aux_loss = f(outputs.router_logits, self.a, self.b, attention_mask)``
and, with labels, ``loss += self.coef * aux_loss.to(loss.device)``, as Mixtral, Qwen2/3-MoE, gpt-oss and 19 more causal
LMs add HF's load-balancing loss); ``return <Output>(loss=loss, logits=logits, ...)`` (with ``aux_loss=aux_loss`` where
it adds one). In transformers 5.24 that is 101 causal LMs (Llama, Mistral, Qwen2/3/3.5 and their MoE, Gemma 1-3, Phi3,
Mixtral, gpt-oss, DeepSeek V2/V3, OLMo, ...). A forward that does anything else to the hidden states, logits or loss is
left alone, with one INFO line naming the reason: Cohere's ``logit_scale``, Granite's ``logits_scaling``, MiniCPM3's and
Falcon-H1's multipliers, Bamba's z-loss, the Bart-style decoders' unshifted loss, a user subclass that overrides
``forward``.

Per call it falls back to the class's forward, with the caller's arguments untouched, when: there are no labels
(generation, logits for metrics; no log line); ``logits_to_keep`` is not 0; ``shift_labels`` is given; the output would
be a tuple (``return_dict=False``, as argument or config); ``loss_function`` is not HF's ``ForCausalLMLoss``;
``lm_head`` is not a bias-free ``nn.Linear`` without hooks or a replaced ``forward``; the backbone is not the module
hooked at install; the vocabulary size the loss reshapes by is not the head's row count; the soft-cap is not positive;
the labels are not an integer ``[B, T]`` tensor matching the inputs; ``ignore_index`` is not an int; or
``num_items_in_batch`` has more than one element. Each reason is logged once per model at INFO. None of these reads a
tensor's values: deciding costs no device sync.

Why ``logits=None`` and not logits computed lazily on first read: the point is the memory, and a lazy value would
materialise the same ``[B, T, V]`` block wherever it is read (after the loss, so at the step's peak) and keep the
hidden states alive until then; under the streamed engine the head weight is a compute copy bound only during the
step (engine/residents.py), so a later read would project with the host master or fail on the device mismatch; and
the outputs are dataclasses, so a lazy field needs a subclass or a tensor proxy: not the same output type, and a
proxy defeats ``torch.compile`` and ``isinstance``. ``None`` fails at the first use, where the opt-out can be named.
A module that needs logits together with labels (accuracy metrics, a z-loss, distillation) turns the mechanism off
(``enabled=False``; ``MegaTrainStrategy(chunked_hf_loss=False)``), or calls the model without labels and computes
its loss itself.

Costs and what stays untouched: the wrapper adds no device sync. It only sees device tensors, so it cannot count the
targets on the host as ``CausalLMModule`` does; on a GPU ``causal_lm_loss`` therefore chunks all ``B * T`` positions
with the ignored ones masked ([Note: target rows] in models/loss.py): the head's FLOPs on every position, as HF's own
loss spends them, instead of on the targets only. On the CPU it selects the target rows (a ``nonzero`` waits for
nothing there). Parameters, buffers, ``state_dict``, ``save_pretrained`` and the class are unchanged (the hook and the
instance attribute are not state; deep copies and pickles carry a working wrapper of their own model);
``inspect.signature(model.forward)`` is the original's (``generate`` reads it). ``torch.compile`` traces through the
wrapper: off the CPU HF's forward and the chunked loss (its chunk loop unrolled from the shapes) make one graph; on the
CPU the target rows' ``nonzero`` breaks the graph around HF's forward, which compiles as usual.
:meth:`ChunkedHFLoss.remove` deletes the attribute and the hook; installing twice wraps nothing twice.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from lightning_megatrain.models.hf_forms import HeadForm, head_form
from lightning_megatrain.models.loss import IGNORE_INDEX, causal_lm_loss

log = logging.getLogger(__name__)


class _Call(NamedTuple):
    """A call the chunked loss reproduces: its arguments by name and what the loss needs."""

    named: dict[str, Any]  # the call's arguments, positional ones by their parameter names
    inputs: Tensor  # [B, T] input_ids or [B, T, H] inputs_embeds
    labels: Tensor  # [B, T]
    ignore_index: int
    softcap: float | None
    num_items_in_batch: Tensor | float | None


class _ChunkedLossForward:
    """One HF causal LM's ``forward`` (an instance attribute): the class's forward, or, for calls with ``labels``
    that [Note: HF loss] covers, that forward without labels and logits plus the chunked loss."""

    def __init__(self, model: PreTrainedModel, form: HeadForm, chunk_size: int) -> None:
        self.model = model
        self.form = form
        self.backbone: nn.Module = getattr(model, form.backbone)
        self.chunk_size = chunk_size
        self.active = True  # False once removed (a forward wrapped over this one may still call it)
        # names of the class forward's positional parameters after ``self``, to read positional arguments
        self.arg_names = tuple(
            p.name
            for p in inspect.signature(type(model).forward).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        )[1:]
        self.capturing = False  # set while a chunked call runs the class's forward
        self.hidden: Tensor | None = None  # [B, T, H] the backbone's last hidden states, only while capturing
        self.reported: set[str] = set()  # fallback reasons already logged

    @property
    def __signature__(self) -> inspect.Signature:  # the original's: ``generate`` inspects ``model.forward``
        return inspect.signature(types.MethodType(type(self.model).forward, self.model))

    def capture(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook on the backbone."""
        if self.capturing:
            self.hidden = output[0] if self.form.first_output else output.last_hidden_state  # [B, T, H]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        call = self._plan(args, kwargs)
        if not isinstance(call, _Call):
            if call is not None and call not in self.reported:
                self.reported.add(call)
                log.info(
                    "%s called with labels and %s: HF's own forward computes the loss (materialising the [B, T, V] "
                    "logits); see [Note: HF loss] in lightning_megatrain/models/hf_loss.py",
                    type(model).__name__,
                    call,
                )
            return type(model).forward(model, *args, **kwargs)
        named = dict(call.named)
        named["labels"] = None  # HF computes no loss ...
        named["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=call.inputs.device)  # ... nor any logits
        self.capturing = True
        try:
            out = type(model).forward(model, **named)
            hidden = self.hidden  # [B, T, H]
        finally:
            self.capturing = False
            self.hidden = None
        if hidden is None:
            raise RuntimeError(
                f"{type(model).__name__}.forward ran without calling its backbone {self.form.backbone!r} hooked by "
                "install_chunked_hf_loss (was the hook removed?). HINT: reinstall, or pass enabled=False."
            )
        labels = call.labels.to(hidden.device, non_blocking=True)  # [B, T]
        loss = causal_lm_loss(
            hidden,
            model.lm_head.weight,  # [V, H] looked up per call: the engine binds its compute copy during a step
            labels,
            chunk_size=self.chunk_size,
            softcap=call.softcap,
            ignore_index=call.ignore_index,
        )  # [] mean over the N targets, 0 when N = 0; no device sync (see [Note: target rows] in models/loss.py)
        n_targets = (labels[:, 1:] != call.ignore_index).sum()  # [] N, on the device
        num = call.num_items_in_batch
        if num is not None:  # HF: sum / num_items_in_batch; a host tensor is copied without waiting for the device
            loss = loss * n_targets / (num.to(loss.device, non_blocking=True) if isinstance(num, Tensor) else num)
        else:  # HF: sum / N, NaN (0 / 0) with zero gradients when N = 0
            loss = loss.masked_fill(n_targets == 0, float("nan"))  # []
        aux = self.form.router_aux
        if aux is not None and getattr(out, "aux_loss", None) is not None:  # HF computed it: output_router_logits
            loss = loss + getattr(model, aux.coef) * out.aux_loss.to(loss.device)  # HF's ``loss += coef * aux_loss``
        return dataclasses.replace(out, loss=loss, logits=None)

    def _plan(self, args: tuple, kwargs: dict[str, Any]) -> _Call | str | None:
        """What the chunked loss needs for this call, or why HF's forward runs instead (see [Note: HF loss]): None
        when that needs no log line (removed, or no labels: generation, logits for metrics)."""
        if not self.active:
            return None
        if len(args) > len(self.arg_names) or any(name in kwargs for name in self.arg_names[: len(args)]):
            return "arguments HF's forward would reject"
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        labels = named.get("labels")
        if labels is None:
            return None
        model, form = self.model, self.form
        keep = named.get("logits_to_keep", 0)
        if isinstance(keep, Tensor) or keep != 0:
            return "logits_to_keep (logits are wanted)"
        if named.get("shift_labels") is not None:
            return "shift_labels (pre-shifted labels)"
        return_dict = named.get("return_dict")
        if not (model.config.return_dict if return_dict is None else return_dict):
            return "return_dict=False (a tuple output)"
        if model.loss_function is not ForCausalLMLoss:
            return "a loss_function other than HF's ForCausalLMLoss"
        if getattr(model, form.backbone) is not self.backbone:
            return f"a backbone {form.backbone!r} replaced since install"
        head = model.lm_head
        if (
            type(head) is not nn.Linear
            or head.bias is not None
            or head._forward_hooks
            or head._forward_pre_hooks
            or head._backward_hooks
            or head._backward_pre_hooks
            or "forward" in head.__dict__
        ):
            return "an lm_head that is not a bias-free nn.Linear without hooks"
        vocab = model.config.vocab_size if form.vocab_from_config else model.vocab_size
        if vocab != head.weight.shape[0]:
            return f"vocab_size={vocab} but lm_head has {head.weight.shape[0]} rows"
        softcap = model.config.final_logit_softcapping if form.softcap else None
        if softcap is not None and not softcap > 0:
            return f"final_logit_softcapping={softcap}"
        inputs = named.get("input_ids") if named.get("input_ids") is not None else named.get("inputs_embeds")
        if (
            not isinstance(labels, Tensor)
            or labels.dtype.is_floating_point
            or labels.dtype.is_complex
            or labels.dtype == torch.bool
            or inputs is None
            or labels.shape != inputs.shape[:2]
        ):
            return "labels that are not an integer [B, T] tensor matching the inputs"
        ignore_index = named.get("ignore_index", IGNORE_INDEX)
        if type(ignore_index) is not int:
            return f"ignore_index={ignore_index!r}"
        num = named.get("num_items_in_batch")
        if isinstance(num, Tensor) and num.numel() != 1:
            return "a num_items_in_batch of several elements"
        return _Call(named, inputs, labels, ignore_index, softcap, num)


@dataclasses.dataclass
class ChunkedHFLoss:
    """What :func:`install_chunked_hf_loss` changed; :meth:`remove` undoes it."""

    models: dict[str, str]  # module name ("" for the root) -> class of each HF causal LM given the chunked loss
    skipped: dict[str, str]  # module name -> why an HF causal LM keeps HF's own loss
    _installed: list[tuple[PreTrainedModel, _ChunkedLossForward, torch.utils.hooks.RemovableHandle]] = (
        dataclasses.field(default_factory=list, repr=False)
    )

    def remove(self) -> None:
        """Restores each model's own ``forward`` and removes the backbone hooks; idempotent."""
        for model, forward, hook in self._installed:
            forward.active = False
            hook.remove()
            if model.__dict__.get("forward") is forward:
                del model.forward
        self._installed.clear()


def install_chunked_hf_loss(module: nn.Module, *, enabled: bool = True, chunk_size: int = 4096) -> ChunkedHFLoss:
    """Compute the loss of HF causal LMs inside ``module`` called with ``labels`` without ``[B, T, V]`` logits.

    Every HF ``*ForCausalLM`` in ``module`` (``module`` itself included) whose forward passes the form check of
    [Note: HF loss] gets a ``forward`` that, called with ``labels``, returns HF's output with the same ``loss`` (by the
    chunked cross-entropy) and ``logits=None``; without labels, and for the calls listed in the note, HF's own
    forward runs. Installing again wraps nothing twice (the new handle lists no models).

    Args:
        module: The LightningModule (or any module) holding the HF models.
        enabled: ``False`` changes nothing (the opt-out) and returns an empty handle. Default True.
        chunk_size: Target tokens per chunk of the loss; its extra memory is a few ``[chunk_size, V]`` fp32 buffers.
            Default 4096 (as ``CausalLMModule``'s ``loss_chunk_size``).

    Returns:
        A :class:`ChunkedHFLoss`; call its ``remove()`` to restore the original forwards.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``enabled`` is not a bool or ``chunk_size`` not a positive int (all problems in one message).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"install_chunked_hf_loss needs an nn.Module (e.g. the LightningModule), got {type(module)}.")
    problems = []
    if not isinstance(enabled, bool):
        problems.append(f"enabled={enabled!r}: need True or False")
    if type(chunk_size) is not int or chunk_size < 1:
        problems.append(f"chunk_size={chunk_size!r}: need a positive int, e.g. 4096")
    if problems:
        raise ValueError("Invalid install_chunked_hf_loss arguments:\n- " + "\n- ".join(problems))
    handle = ChunkedHFLoss(models={}, skipped={})
    if not enabled:
        return handle
    for name, model in module.named_modules():
        if not isinstance(model, PreTrainedModel) or not _is_causal_lm(type(model)):
            continue
        present = model.__dict__.get("forward")
        if isinstance(present, _ChunkedLossForward) and present.active:
            continue  # installed before
        reason = _refusal(model)
        if reason is not None:
            handle.skipped[name] = reason
            log.info("%s (%s) keeps HF's own loss: %s.", name or "the module", type(model).__name__, reason)
            continue
        forward = _ChunkedLossForward(model, head_form(type(model)), chunk_size)
        hook = forward.backbone.register_forward_hook(forward.capture)
        model.forward = forward  # instance attribute shadows the class method
        handle._installed.append((model, forward, hook))
        handle.models[name] = type(model).__name__
        log.info(
            "%s (%s): calls with labels compute the loss chunk by chunk and return logits=None.",
            name or "the module",
            type(model).__name__,
        )
    return handle


def _is_causal_lm(cls: type) -> bool:
    """A ``*ForCausalLM`` class, or a subclass of one (a user's ``MyLlama(LlamaForCausalLM)``)."""
    return any(base.__name__.endswith("ForCausalLM") for base in cls.__mro__)


def _refusal(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot get the chunked loss at all, or None."""
    if "forward" in model.__dict__:
        present = model.__dict__["forward"]
        return f"its forward is already replaced on the instance (by {getattr(present, '__qualname__', type(present))})"
    parameters = inspect.signature(type(model).forward).parameters
    missing = [p for p in ("labels", "logits_to_keep") if p not in parameters]
    if missing:
        return f"its forward takes no {' or '.join(missing)}"
    form = head_form(type(model))
    if isinstance(form, str):
        return form
    if not isinstance(getattr(model, form.backbone, None), nn.Module):
        return f"self.{form.backbone} is not a module"
    return None
