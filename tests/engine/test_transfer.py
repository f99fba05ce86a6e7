"""Transfer backends (engine/transfer.py): both satisfy the one protocol the engine and the streamed Function call."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from lightning_megatrain.engine.discovery import tensor_slots
from lightning_megatrain.engine.host_store import pack_group
from lightning_megatrain.engine.transfer import CudaTransfer, HostTransfer, Transfer

_METHODS = [name for name, member in vars(Transfer).items() if inspect.isfunction(member) and not name.startswith("_")]


def test_the_protocol_names_every_call_the_engine_and_the_streamed_function_make():
    assert set(_METHODS) == {
        "prefetch", "acquire", "release", "persistent", "invalidate",
        "stash", "prefetch_stash", "unstash", "trim_stash_cache",
        "drain", "take_host_added", "wait_drained", "host_bytes", "close",
    }


@pytest.mark.parametrize("backend", [HostTransfer, CudaTransfer])
def test_each_backend_implements_every_member_with_the_protocol_s_signature(backend):
    # the CUDA backend cannot be built without a GPU: its class is held to the protocol here, its behaviour in
    # tests/engine/test_gpu_transfer.py and the other GPU tests
    for name in _METHODS:
        assert name in vars(backend), name
        ours = list(inspect.signature(getattr(backend, name)).parameters)
        assert ours == list(inspect.signature(getattr(Transfer, name)).parameters), name
    assert isinstance(vars(CudaTransfer)["device_grads_to_host"], property)
    assert vars(CudaTransfer)["device_grads_to_host"].fset is not None  # engine.set_grads_read sets it


def test_host_backend_is_a_transfer_with_no_host_buffers_of_its_own():
    module = nn.ParameterList([nn.Parameter(torch.randn(3, 2))])
    group = pack_group(tensor_slots(module))
    transfer = HostTransfer([group], torch.bfloat16)
    assert isinstance(transfer, Transfer) and transfer.device == torch.device("cpu")
    assert transfer.host_bytes() == {}
    transfer.device_grads_to_host = False  # engine.set_grads_read: nothing reads it on the host
    weights = transfer.acquire(0)
    assert weights.dtype == torch.bfloat16 and torch.equal(weights, group.master.to(torch.bfloat16))
    x = torch.randn(4)
    assert transfer.unstash(transfer.stash(x)) is x
