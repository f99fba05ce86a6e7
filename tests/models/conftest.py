"""Tiny random-init architectures and random-token data for the model tests."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

VOCAB = 128
_COMMON = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# model_type -> (config dict, attn_implementation)
TINY_ARCHS = {
    "llama": ({"model_type": "llama", **_COMMON}, "sdpa"),
    # A small soft-cap and large-ish init make the final-logit soft-capping matter.
    "gemma2": (
        {
            "model_type": "gemma2",
            **_COMMON,
            "final_logit_softcapping": 2.0,
            "initializer_range": 0.2,
        },
        "eager",
    ),
    "qwen3": ({"model_type": "qwen3", **_COMMON}, "sdpa"),
}


class RandomTokens(Dataset):
    """``n`` random sequences of length ``seq`` as ``{"input_ids": [seq]}`` dicts."""

    def __init__(self, n: int, seq: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, seq), generator=gen)  # [n, seq]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


@pytest.fixture
def token_loader():
    def make(n: int = 8, seq: int = 16, batch_size: int = 2, seed: int = 0) -> DataLoader:
        return DataLoader(RandomTokens(n, seq, seed), batch_size=batch_size)

    return make


@pytest.fixture
def trainer_kwargs(tmp_path):
    """Quiet single-process CPU trainer settings."""
    return {
        "strategy": "auto",
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }


@pytest.fixture
def tiny_archs() -> dict[str, tuple[dict, str]]:
    """``model_type -> (CausalLMModule config dict, attn_implementation)``."""
    return {name: (dict(config), attn) for name, (config, attn) in TINY_ARCHS.items()}


aten = torch.ops.aten
# ops whose host-side result (a value, or an output shape) needs the device's data: on a GPU the host waits for it
_SYNCING = {
    aten.nonzero,  # torch.nonzero, Tensor.nonzero, torch.where(cond), argwhere
    aten._local_scalar_dense,  # .item(), bool(t), int(t), float(t), `if t:`
    aten.is_nonzero,
    aten.equal,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
}


class DeviceSyncs(TorchDispatchMode):
    """Fails, while ``armed``, on an aten op that makes the host wait for a GPU's data: those in ``_SYNCING`` and
    boolean-mask indexing. A copy to the host it cannot tell from a CPU-to-CPU copy; CUDA tests use
    ``torch.cuda.set_sync_debug_mode("error")``, which sees those too."""

    def __init__(self):
        super().__init__()
        self.armed = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())
        )
        if self.armed and (func.overloadpacket in _SYNCING or bool_index):
            raise AssertionError(f"{func} would sync a GPU")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def as_on_a_gpu(monkeypatch) -> type[DeviceSyncs]:
    """``causal_lm_loss(rows=None)`` takes its GPU path on the CPU (all positions, masked: see [Note: target rows]);
    returns :class:`DeviceSyncs`, to run code under ``with DeviceSyncs() as mode: ...``."""
    # by name: importing lightning_megatrain while conftest loads (no root log handler yet) would turn off its
    # loggers' propagation, and caplog with it
    monkeypatch.setattr("lightning_megatrain.models.loss._counting_rows_syncs", lambda device: True)
    return DeviceSyncs
