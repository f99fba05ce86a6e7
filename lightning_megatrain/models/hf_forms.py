"""Which HF causal-LM ``forward`` methods the chunked loss reproduces: their source read once per class and matched
against the recognised forms of [Note: HF loss] (models/hf_loss.py), and the MoE router auxiliary loss each adds."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap

from torch import Tensor
from transformers import PreTrainedModel


@dataclasses.dataclass(frozen=True)
class RouterAux:
    """How a recognised ``forward`` adds the MoE router auxiliary loss under ``output_router_logits`` (see [Note: HF
    loss]): ``aux_loss = <function>(outputs.router_logits, self.<num_experts>, self.<top_k>, attention_mask)``, then,
    with labels, ``loss += self.<coef> * aux_loss``."""

    function: str  # a name in the forward's module: HF's ``load_balancing_loss_func`` of that family
    num_experts: str  # attribute names on the model
    top_k: str
    coef: str


@dataclasses.dataclass(frozen=True)
class HeadForm:
    """What a recognised ``forward`` does around its head (see [Note: HF loss])."""

    backbone: str  # attribute of the backbone: ``outputs = self.<backbone>(...)``
    first_output: bool  # hidden states are ``outputs[0]`` (else ``outputs.last_hidden_state``)
    softcap: bool  # caps the logits by ``self.config.final_logit_softcapping`` when it is not None
    vocab_from_config: bool  # the loss reshapes by ``self.config.vocab_size`` (else ``self.vocab_size``)
    router_aux: RouterAux | None  # adds the router auxiliary loss to the loss when ``output_router_logits``


# Statements of the recognised forms as ``ast.unparse`` writes them (formatting and comments do not matter).
_RESOLVE = re.compile(r"(\w+) = \1 if \1 is not None else self\.config\.\1")  # before the backbone call only
_SLICE = "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)"
_SLICE_INDICES = "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep"
_HEAD = re.compile(r"logits = self\.lm_head\(hidden_states\)(?:\.float\(\))?")
_HEAD_INDICES = re.compile(r"logits = self\.lm_head\(hidden_states\[:, slice_indices, :\]\)(?:\.float\(\))?")
_SOFTCAP = (
    "if self.config.final_logit_softcapping is not None:\n"
    "    logits = logits / self.config.final_logit_softcapping\n"
    "    logits = torch.tanh(logits)\n"
    "    logits = logits * self.config.final_logit_softcapping"
)
_LOSS = re.compile(
    r"if labels is not None:\n    loss = self\.loss_function\((?:logits=)?logits, (?:labels=)?labels, "
    r"(?:vocab_size=)?self\.(config\.)?vocab_size, \*\*kwargs\)"
)
_ROUTER_AUX = re.compile(
    r"if output_router_logits:\n"
    r"    aux_loss = (\w+)\((\w+)\.router_logits, self\.(\w+), self\.(\w+), attention_mask\)\n"
    r"    if labels is not None:\n"
    r"        loss \+= self\.(\w+) \* aux_loss\.to\(loss\.device\)"
)


@functools.cache
def head_form(cls: type) -> HeadForm | str:
    """``cls.forward``'s form when [Note: HF loss] reproduces it, else the reason it does not.

    Only the body is read: HF's decorators (``can_return_tuple``, ``deprecate_kwarg``, ``auto_docstring``) handle
    arguments and the output type, and the runtime checks cover ``return_dict``.
    """
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
    except (OSError, TypeError) as err:
        return f"the source of {cls.__name__}.forward is unavailable ({err})"
    body = ast.parse(source).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    while body and (m := _RESOLVE.fullmatch(ast.unparse(body[0]))) and m[1] not in ("labels", "logits_to_keep"):
        body = body[1:]
    call = _backbone_call(body[0]) if body else None
    if call is None:
        return f"its forward does not start with the backbone call (found {_clip(body[:1])})"
    out, backbone = call
    body = body[1:]
    rest = [ast.unparse(stmt) for stmt in body]
    hidden = {f"hidden_states = {out}.last_hidden_state": False, f"hidden_states = {out}[0]": True}
    if rest[:1] == [f"hidden_states = slice_logits_to_keep({out}.last_hidden_state, logits_to_keep)"]:
        first_output, head, n = False, _HEAD, 1
    elif len(rest) >= 2 and rest[0] in hidden and rest[1] in (_SLICE, _SLICE_INDICES):
        first_output, head, n = hidden[rest[0]], _HEAD if rest[1] == _SLICE else _HEAD_INDICES, 2
    else:
        return f"it transforms the backbone's hidden states before its head ({_clip(body[:2])})"
    if len(rest) <= n or not head.fullmatch(rest[n]):
        return f"its head is not a plain lm_head projection ({_clip(body[n : n + 1])})"
    n += 1
    softcap = rest[n : n + 1] == [_SOFTCAP]
    n += softcap
    loss = _LOSS.fullmatch(rest[n + 1]) if rest[n : n + 1] == ["loss = None"] and len(rest) > n + 1 else None
    if loss is None:
        return f"its logits or loss are not HF's plain causal-LM loss ({_clip(body[n : n + 2])})"
    n += 2
    aux = _ROUTER_AUX.fullmatch(rest[n + 1]) if rest[n : n + 1] == ["aux_loss = None"] and len(rest) > n + 1 else None
    router_aux = RouterAux(aux[1], *aux.group(3, 4, 5)) if aux is not None and aux[2] == out else None
    n += 2 if router_aux is not None else 0
    if len(body) != n + 1 or not _returns_loss_and_logits(body[n], aux=router_aux is not None):
        return f"it does more after the loss ({_clip(body[n : n + 2])})"
    return HeadForm(backbone, first_output, softcap, loss[1] is not None, router_aux)


def _backbone_call(stmt: ast.stmt) -> tuple[str, str] | None:
    """``(out, backbone)`` for ``out = self.<backbone>(...)`` (annotated or not), else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        target = stmt.target
    else:
        return None
    call = stmt.value
    if (
        isinstance(target, ast.Name)
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
    ):
        return target.id, call.func.attr
    return None


def _returns_loss_and_logits(stmt: ast.stmt, aux: bool = False) -> bool:
    """``return <Output>(..., loss=loss, logits=logits, ...)`` (and ``aux_loss=aux_loss`` with ``aux``)."""
    if not (isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call)):
        return False
    keywords = {k.arg: k.value for k in stmt.value.keywords}
    names = ("loss", "logits", "aux_loss") if aux else ("loss", "logits")
    return all(isinstance(keywords.get(name), ast.Name) and keywords[name].id == name for name in names)


def _clip(statements: list[ast.stmt], width: int = 100) -> str:
    text = " / ".join(ast.unparse(s).replace("\n", " ") for s in statements) or "nothing"
    return text if len(text) <= width else text[: width - 3] + "..."


def router_aux(cls: type) -> RouterAux | None | str:
    """How ``cls.forward`` adds the MoE router auxiliary loss under ``output_router_logits`` (see :class:`RouterAux`):
    None where its recognised form adds none (DeepSeek-V3's routers balance without one), else the reason its form is
    not one [Note: HF loss] reproduces, in which case nobody can say which loss it adds."""
    form = head_form(cls)
    return form if isinstance(form, str) else form.router_aux


def router_aux_loss(
    model: PreTrainedModel, aux: RouterAux, router_logits: tuple[Tensor, ...], attention_mask: Tensor | None
) -> Tensor:
    """The router auxiliary loss ``model``'s forward computes from ``router_logits`` (one ``[B * T, E]`` tensor per
    MoE layer) and ``attention_mask`` ``[B, T]``, unweighted: by the family's own function (HF's
    ``load_balancing_loss_func`` of its modeling file) on the model's attributes. The forward adds it to the loss
    times ``getattr(model, aux.coef)``."""
    function = inspect.unwrap(type(model).forward).__globals__[aux.function]
    return function(router_logits, getattr(model, aux.num_experts), getattr(model, aux.top_k), attention_mask)
