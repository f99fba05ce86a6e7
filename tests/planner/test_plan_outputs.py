"""Plans whose long-context options resolve to the engine before them (untiled, one segment per layer, every layer
input offloaded) print what was pinned: ``report()`` and the JSON of ``to_dict()``, byte for byte, for the ready
configs and the shapes the other planner tests use. Last regenerated for ``attention_memo="auto"`` (the 7B defaults'
plan at 1 x 32,768 takes the memos: +10% tokens/s for 8.1 GiB of GPU memory); before that for the attention kernel's
measured rates (rows of 32,768 tokens or more: planner/constants.py ``ATTN_FWD_TFLOPS``; the 7B plan at 1 x 32,768 is
slower, every plan names them in its assumptions); before that for the host updates during backward
(``update_during_backward``, planner/timing.py ``host_after_backward``): the overlapped plans gain their snapshots
and a shorter host step (the suggested device groups are counted without them), the serial ones a new overlapped
step in their warning.

The expected outputs are in ``plan_outputs.json`` beside this file. Regenerate them only for a change that is meant
to change these plans: ``PYTHONPATH=. python tests/planner/test_plan_outputs.py`` from the repository root, and say
why in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_megatrain import planner
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import Machine

from helpers.shapes import LLAMA_3B

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "plan_outputs.json"
HF = HERE.parents[1] / "configs" / "hf"

LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}
H200 = Machine(host_ram_gib=125, gpu_mem_gib=139, cpu_cores=16)
BIG = Machine(host_ram_gib=1024, gpu_mem_gib=139, cpu_cores=16)
SERIAL = EngineConfig(overlap_optimizer=False, compile_layers=False, gpu_optimizer_groups=0)
# ready config -> (seq_len, micro_batch, grad_accum, loss_chunk_size, attn_implementation): their header commands
READY = {
    "gemma3-27b": (4096, 21, 1, 1024, "eager"), "gpt-oss-120b": (2048, 31, 4, 2048, "eager"),
    "gpt-oss-20b": (2048, 51, 3, 2048, "eager"), "llama3-8b": (4096, 93, 1, 4096, None),
    "mixtral-8x7b": (4096, 46, 1, 4096, None), "qwen2.5-7b": (4096, 85, 1, 2048, None),
    "qwen3-8b": (4096, 91, 1, 2048, None), "qwen3.5-27b": (4096, 28, 1, 2048, None),
}


def _cases() -> dict[str, tuple[dict, dict]]:
    """name -> (model config dict, plan() keyword arguments)."""
    cases = {}
    for name, (seq, mb, accum, chunk, attn) in READY.items():
        cases[f"ready {name}"] = (json.loads((HF / f"{name}.json").read_text()), dict(
            seq_len=seq, micro_batch=mb, grad_accum=accum, loss_chunk_size=chunk, attn_implementation=attn,
            config=SERIAL, machine=H200.replace(host_ram_gib=1 << 20)))
    kw = dict(config=SERIAL, machine=BIG)
    on = lambda **m: dict(config=SERIAL, machine=BIG.replace(**m))
    cases |= {
        "3b 8x4096": (LLAMA_3B, dict(seq_len=4096, micro_batch=8, **kw)),
        "3b 8x4096 accum 4": (LLAMA_3B, dict(seq_len=4096, micro_batch=8, grad_accum=4, **kw)),
        "3b 1x512": (LLAMA_3B, dict(seq_len=512, micro_batch=1, **kw)),
        "3b host 32": (LLAMA_3B, dict(seq_len=4096, micro_batch=8, **on(host_ram_gib=32))),
        "3b host 64": (LLAMA_3B, dict(seq_len=4096, micro_batch=1, **on(host_ram_gib=64))),
        "3b gpu 24": (LLAMA_3B, dict(seq_len=4096, micro_batch=64, **on(gpu_mem_gib=24))),
        "3b naive": (LLAMA_3B, dict(seq_len=4096, micro_batch=8, loss="naive", **kw)),
        "3b 2 cores": (LLAMA_3B, dict(seq_len=4096, micro_batch=8, **on(cpu_cores=2))),
        "3b groups 6": (LLAMA_3B, dict(seq_len=1024, micro_batch=32, loss="naive", machine=BIG,
                                       config=SERIAL.replace(overlap_optimizer=True, gpu_optimizer_groups=6))),
        "3b compiled overlap": (LLAMA_3B, dict(seq_len=1024, micro_batch=32, loss="naive", machine=BIG,
                                               config=SERIAL.replace(overlap_optimizer=True, compile_layers=True))),
        "3b 32-true": (LLAMA_3B, dict(seq_len=1024, micro_batch=32, precision="32-true", **kw)),
        "3b pow2": (LLAMA_3B | {"num_hidden_layers": 2}, dict(seq_len=4096, micro_batch=8, config=SERIAL,
                                                              machine=BIG.replace(pinned_pow2_rounding=True))),
        "3b no offload": (LLAMA_3B, dict(seq_len=4096, micro_batch=4, offload_activations=False, **kw)),
        "3b defaults": (LLAMA_3B, dict(seq_len=4096, micro_batch=8, config=EngineConfig(), machine=H200)),
        "7b 4x4096": (LLAMA_7B, dict(seq_len=4096, micro_batch=4, config=EngineConfig(), machine=H200)),
        "7b 1x32768": (LLAMA_7B, dict(seq_len=32768, micro_batch=1, config=EngineConfig(), machine=H200)),
    }
    return cases


def _outputs(model: dict, kwargs: dict) -> dict[str, str]:
    p = planner.plan(model, **kwargs)
    return {"report": p.report(), "json": json.dumps(p.to_dict(), indent=1, sort_keys=True)}


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, str]]:
    return json.loads(EXPECTED.read_text())


def test_every_case_has_an_expected_output(expected):
    assert sorted(expected) == sorted(_cases())
    assert len(expected) == 24


@pytest.mark.parametrize("name", sorted(_cases()))
def test_plan_output_is_unchanged(name, expected):
    if name == "ready qwen3.5-27b":
        pytest.importorskip("transformers", minversion="5.0")
        import transformers

        if not hasattr(transformers, "Qwen3_5TextConfig"):
            pytest.skip("this transformers has no Qwen3.5 (qwen3_5_text)")
    model, kwargs = _cases()[name]
    got = _outputs(model, kwargs)
    assert got["report"] == expected[name]["report"]
    assert got["json"] == expected[name]["json"]


if __name__ == "__main__":  # regenerate plan_outputs.json (see the module docstring)
    EXPECTED.write_text(json.dumps({n: _outputs(*case) for n, case in _cases().items()}, indent=1) + "\n")
    print(f"wrote {len(_cases())} plans to {EXPECTED}", file=sys.stderr)
