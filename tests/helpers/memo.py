"""The attention memo's tests ([Note: attention memo]): counting the attention kernel's runs."""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensor

from lightning_megatrain.engine import attention_memo


def count_kernel_calls(monkeypatch) -> list[int]:
    """A one-element list counting the attention kernel's runs through the memo's op (a forward's, and a
    recompute's where the memo did not serve it)."""
    calls = [0]
    kernel = attention_memo._kernel

    def counting(*args):
        calls[0] += not isinstance(args[0], FakeTensor)  # the op's fake kernel runs it on fake tensors when compiling
        return kernel(*args)

    monkeypatch.setattr(attention_memo, "_kernel", counting)
    return calls
