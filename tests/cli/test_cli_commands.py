"""Help texts, the console-script entry point and the dispatch of ``export`` / ``plan``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from lightning_megatrain import cli
from lightning_megatrain.cli import main

from helpers.cli_paths import REPO


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    assert done.value.code in (0, None)
    return " ".join(capsys.readouterr().out.split())  # undo line wrapping


def test_console_script_entry_point():
    (script,) = entry_points(group="console_scripts", name="megatrain")
    assert script.value == "lightning_megatrain.cli:main"


def test_python_dash_m_runs_the_same_program():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_megatrain", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: megatrain")
    for command in ("fit", "export CKPT OUT_DIR", "plan"):
        assert command in result.stdout


def test_fit_help_shows_option_docstrings(capsys):
    text = _help(capsys, "fit", "--help")
    # SFTDataModule.cutoff_len, CausalLMModule.loss_chunk_size and ThroughputLogger.profile_step docstrings.
    assert "Maximum tokens per example (SFT examples are truncated at the end" in text
    assert "Target tokens per chunk of the LM-head loss" in text
    assert "--throughput.profile_step" in text and "torch.profiler" in text
    assert "--optimizer" in text and "--lr_scheduler" in text
    assert "default: megatrain" in text  # trainer.strategy


def test_strategy_help_shows_num_slots_docstring(capsys):
    text = _help(capsys, "fit", "--trainer.strategy.help", "MegaTrainStrategy")
    assert "--trainer.strategy.num_slots" in text
    assert "device buffers for layer weights, >= 2 (one computes while the next uploads)" in text


def test_export_help(capsys):
    text = _help(capsys, "export", "--help")
    assert "usage: megatrain export" in text and "--max-shard-size" in text and "--overwrite" in text


def test_export_missing_checkpoint_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out")])
    assert error.value.code == 2
    assert "is not a file" in capsys.readouterr().err


def test_plan_dispatches_to_plan_main(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "plan_main", lambda argv, prog: seen.append((argv, prog)) or 7)
    assert main(["plan", "--model", "x", "--gpu-mem", "80"]) == 7
    assert seen == [(["--model", "x", "--gpu-mem", "80"], "megatrain plan")]


def test_plan_help_lists_every_flag(capsys):
    text = _help(capsys, "plan", "--help")
    assert "usage: megatrain plan" in text
    for flag in ("--model", "--seq-len", "--micro-batch", "--grad-accum", "--precision", "--optimizer", "--loss",
                 "--attn-implementation", "--host-ram", "--gpu-mem", "--cpu-cores", "--tflops", "--no-offload",
                 "--num-slots", "--overlap-optimizer", "--update-during-backward", "--gpu-optimizer-groups",
                 "--compile-layers", "--loss-chunk-size", "--seq-tile", "--segment-layers", "--device-checkpoints",
                 "--json"):
        assert flag in text, flag


def test_plan_reports_invalid_options_as_usage_errors(capsys):
    config = json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024})
    for flags, message in ((["--num-slots", "1"], "num_slots=1: need an int >= 2"),
                           (["--cpu-cores", "0"], "cpu_cores=0: need an int >= 1"),
                           (["--gpu-optimizer-groups", "4"], r"gpu_optimizer_groups must be in [0, 3]")):
        with pytest.raises(SystemExit) as error:
            main(["plan", "--model", config, "--seq-len", "64", *flags])
        assert error.value.code == 2
        assert message in capsys.readouterr().err

def test_plan_runs_the_real_planner(capsys):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    assert main(["plan", "--model", json.dumps(config), "--seq-len", "256", "--micro-batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_export_of_a_sharded_checkpoint_names_megatrain_convert(tmp_path, capsys):
    """A checkpoint saved with checkpoint_format="sharded" is a directory: the usage error says how to export it."""
    (tmp_path / "last.ckpt").mkdir()
    with pytest.raises(SystemExit) as error:
        main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "out")])
    assert error.value.code == 2
    assert re.search(r"a sharded checkpoint\)\. HINT: `megatrain\s+convert .*last\.ckpt <file>\.ckpt`",
                     capsys.readouterr().err)
