"""What ``megatrain plan`` answers: the verdict line, the largest micro-batch in words, the host RAM left to the OS,
the overlap_optimizer advice given only where it is faster, and a one-line error for a --model that is not there
(CPU, no downloads)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from lightning_megatrain import planner
from lightning_megatrain.cli import plan_main
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.planner import HOST_OS_RESERVE_FRACTION, HOST_OS_RESERVE_MIN_GIB, Machine
from lightning_megatrain.planner.shape import _path_like

from helpers.shapes import LLAMA_3B

GIB = 2**30
BIG = Machine(host_ram_gib=1024, gpu_mem_gib=139, cpu_cores=16)
SERIAL = EngineConfig(overlap_optimizer=False, compile_layers=False, gpu_optimizer_groups=0)


def _plan(**kwargs) -> planner.Plan:
    kwargs.setdefault("config", SERIAL)
    kwargs.setdefault("machine", BIG)
    return planner.plan(LLAMA_3B, **kwargs)


def _line(p: planner.Plan, start: str) -> str:
    return next(line for line in p.report().splitlines() if line.startswith(start))


def test_verdict_fits_names_the_tighter_limit_and_its_spare():
    gpu_bound = _plan(seq_len=4096, micro_batch=8)
    assert gpu_bound.fits and gpu_bound.to_dict()["fits"] is True
    spare = (gpu_bound.gpu_limit - gpu_bound.gpu_total) / GIB
    assert gpu_bound.report().splitlines()[1] == (
        f"  FITS: GPU peak {gpu_bound.gpu_total / GIB:.1f} of 139.0 GiB, host RAM {gpu_bound.host_total / GIB:.1f} of "
        f"{gpu_bound.host_usable / GIB:.1f} GiB usable; the tighter is GPU memory, {spare:.1f} GiB spare")
    host_bound = _plan(seq_len=4096, micro_batch=1, machine=BIG.replace(host_ram_gib=64))
    assert host_bound.fits
    spare = (host_bound.host_usable - host_bound.host_total) / GIB
    assert _line(host_bound, "  FITS:").endswith(f"; the tighter is host RAM, {spare:.1f} GiB spare")


def test_verdict_does_not_fit_says_which_limit_and_by_how_much():
    host = _plan(seq_len=4096, micro_batch=8, machine=BIG.replace(host_ram_gib=32))
    assert not host.fits and host.to_dict()["fits"] is False
    over = (host.host_total - host.host_usable) / GIB
    assert _line(host, "  DOES NOT FIT:").endswith(f"; over: host RAM by {over:.1f} GiB")
    gpu = _plan(seq_len=4096, micro_batch=64, machine=BIG.replace(gpu_mem_gib=24))
    over = (gpu.gpu_total - gpu.gpu_limit) / GIB
    assert _line(gpu, "  DOES NOT FIT:").endswith(f"; over: GPU memory by {over:.1f} GiB")
    # a long sequence whose checkpoints no placement fits says so too
    long = planner.plan(LLAMA_3B, seq_len=2_097_152, machine=Machine(host_ram_gib=125, gpu_mem_gib=141, cpu_cores=16))
    assert not long.long_context["fits"] and not long.fits
    assert "no placement of the layer-input checkpoints fits" in _line(long, "  DOES NOT FIT:")


def test_largest_micro_batch_in_words():
    p = _plan(seq_len=4096, micro_batch=1, machine=BIG.replace(host_ram_gib=64))
    assert 0 < p.max_micro_batch_host < p.max_micro_batch
    report = p.report()
    assert (f"    largest micro-batch: {p.max_micro_batch} by GPU memory, {p.max_micro_batch_host} by host RAM "
            "(at seq 4096)") in report.splitlines()
    assert "largest micro-batch that fits:" not in report and "(host RAM:" not in report
    none = _plan(seq_len=4096, micro_batch=1, machine=BIG.replace(host_ram_gib=40))
    assert none.max_micro_batch_host == 0
    assert ", none (not even 1) by host RAM (at seq 4096)" in none.report()


def test_host_ram_leaves_a_reserve_to_the_os():
    assert HOST_OS_RESERVE_MIN_GIB == 2.0 and HOST_OS_RESERVE_FRACTION == 0.03
    assert planner.host_os_reserve(16 * GIB) == 2 * GIB  # the floor
    assert planner.host_os_reserve(128 * GIB) == int(0.03 * 128 * GIB)  # 3.84 GiB
    assert planner.host_os_reserve(GIB) == GIB  # never more than the limit
    # without offload no placement of checkpoints moves host RAM to the GPU: 1 GiB above what the plan needs used to
    # fit, the reserve (2 GiB or more) makes it not fit
    need = _plan(seq_len=4096, micro_batch=1, offload_activations=False).host_total
    tight = _plan(seq_len=4096, micro_batch=1, offload_activations=False,
                  machine=BIG.replace(host_ram_gib=need / GIB + 1))
    assert tight.host_total == need and tight.host_total < tight.host_limit
    assert tight.host_usable == tight.host_limit - tight.host_reserve == tight.host_limit - 2 * GIB
    assert not tight.fits and tight.max_micro_batch_host == 0
    [warning] = [w for w in tight.warnings if w.startswith("host RAM too small")]
    assert f"but {tight.host_usable / GIB:.1f} GiB of the {tight.host_limit / GIB:.1f} GiB limit are usable" in warning
    assert (f"    usable: the {tight.host_limit / GIB:.1f} GiB limit less 2.0 GiB left to the OS and other processes "
            "(max(2 GiB, 3%))") in tight.report().splitlines()
    # the largest micro-batch by host RAM fits the usable RAM; the next (every checkpoint offloaded, as the search
    # plans it) fits the limit only
    machine = BIG.replace(host_ram_gib=64)
    n = _plan(seq_len=4096, micro_batch=1, machine=machine).max_micro_batch_host
    at = _plan(seq_len=4096, micro_batch=n, machine=machine)
    offloaded = SERIAL.replace(device_checkpoints=0, segment_layers=1)
    above = _plan(seq_len=4096, micro_batch=n + 1, machine=machine, config=offloaded)
    assert at.host_total <= at.host_usable < above.host_total <= above.host_limit


def test_long_context_checkpoints_get_the_usable_host_ram():
    machine = Machine(host_ram_gib=125, gpu_mem_gib=141, cpu_cores=16)
    p = planner.plan(LLAMA_3B, seq_len=262_144, machine=machine)
    lc = p.long_context
    others = p.host_total - p.host["activation offload"]
    assert lc["host_free_for_checkpoints"] == p.host_usable - others
    assert lc["device_checkpoints"] == 5 and p.host_total <= p.host_usable  # 4 with the whole 125 GiB


@pytest.mark.parametrize("seq_len, micro_batch, faster", [(4096, 8, True), (512, 1, False)])
def test_overlap_optimizer_recommended_only_where_its_step_is_faster(seq_len, micro_batch, faster):
    """At 8 x 4096 the overlapped step is shorter; at 1 x 512 the overlapped host Adam (torch fused, slower than
    DeepSpeedCPUAdam) outlasts the short forward, so the overlapped step is longer (as for Qwen3-30B-A3B)."""
    serial = _plan(seq_len=seq_len, micro_batch=micro_batch)
    overlapped = _plan(seq_len=seq_len, micro_batch=micro_batch, config=SERIAL.replace(overlap_optimizer=True))
    a, b = serial.time["step total"], overlapped.time["step total"]
    assert (b < a) == faster
    [warning] = [w for w in serial.warnings if w.startswith("the CPU optimizer")]
    if faster:
        assert (f"overlap_optimizer=True lets the next forward hide it: {b:.2f} s per step planned instead of "
                f"{a:.2f}; or raise tokens per step") in warning
    else:
        assert (f"overlap_optimizer=True does not help here: {b:.2f} s per step planned with it instead of {a:.2f}, "
                "its host step outlasting the next forward; raise tokens per step") in warning
        assert "lets the next forward hide it" not in warning
    assert not any(w.startswith("the CPU optimizer") for w in overlapped.warnings)


def test_path_like_models():
    for name in ("/abs/config.json", "./cfg", "../cfg", "~/cfg", "cfg.json", "a/b/c", "a\\b", "configs/missing"):
        assert _path_like(name), name
    for name in ("Qwen/Qwen3-30B-A3B", "gpt2", "meta-llama/Llama-3.1-8B"):
        assert not _path_like(name), name


@pytest.mark.parametrize("model", ["configs/hf/no-such-model.json", "MISSING_DIR/sub/dir", "./no-such-dir"])
def test_missing_model_path_is_no_such_file(model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "hf").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"no such file or directory: .*HINT: pass a local directory"):
        planner.load_config(model)
    with pytest.raises(SystemExit) as error:
        plan_main(["--model", model, "--seq-len", "64"])
    err = capsys.readouterr().err
    assert error.value.code == 2
    assert f"error: no such file or directory: {model}. HINT:" in err and "Repo id" not in err


def test_unreachable_hub_name_is_one_line(capsys, monkeypatch):
    def offline(name, *args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.\nCheck your internet connection or see how to run the library in offline mode")

    monkeypatch.setattr(AutoConfig, "from_pretrained", offline)
    with pytest.raises(OSError, match="'org/model' is not a local path and its config could not be loaded"):
        planner.load_config("org/model")
    with pytest.raises(SystemExit) as error:
        plan_main(["--model", "org/model", "--seq-len", "64"])
    err = capsys.readouterr().err
    assert error.value.code == 2
    [message] = [line for line in err.splitlines() if "error:" in line]
    assert "We couldn't connect to 'https://huggingface.co'" in message and "HINT: download its config.json" in message
    assert "Check your internet" not in err


def test_an_existing_local_config_still_loads(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    (tmp_path / "c.json").write_text(json.dumps(config))
    assert planner.load_config(str(tmp_path / "c.json")).num_hidden_layers == 2
