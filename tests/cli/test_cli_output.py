"""What a new user sees from ``megatrain``: user errors as one short message, and a demo fit's console output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_megatrain import cli
from lightning_megatrain.cli import DEBUG_ENV, ERROR_MAX_CHARS, main, user_error_message

from helpers.cli_paths import DEMO_CONFIG, QUIET


def _fit(*extra: str) -> list[str]:
    return ["fit", "--config", str(DEMO_CONFIG), *QUIET, "--trainer.max_steps=1", *extra]


def _assert_one_message(err: str, message: str) -> None:
    assert message in err
    assert "Traceback" not in err
    assert len(err) < ERROR_MAX_CHARS + 300 and err.count("\n") <= 8
    assert f"{DEBUG_ENV}=1 or --debug" in err


@pytest.fixture
def bad_rows(in_tmp: Path) -> Path:
    path = in_tmp / "bad.json"
    path.write_text(json.dumps([{"instruction": 5, "output": "x"}]))
    return path


def test_a_bad_dataset_row_is_one_message(bad_rows, capfd):
    assert main(_fit(f"--data.dataset={bad_rows}")) == 1
    _assert_one_message(capfd.readouterr().err, "row 0: column 'instruction' (the prompt) must be a string")


def test_a_missing_dataset_file_is_one_message(in_tmp, capfd):
    assert main(_fit(f"--data.dataset={in_tmp / 'missing.json'}")) == 1
    _assert_one_message(capfd.readouterr().err, "missing.json: no such file or folder")


def test_an_unknown_model_type_is_cut_to_one_short_message(in_tmp, capfd):
    assert main(_fit("--model.config.model_type=lamma")) == 1
    err = capfd.readouterr().err
    _assert_one_message(err, "ValueError: Unrecognized model identifier: lamma")
    assert "more characters]" in err  # transformers lists every model type: ~12,000 characters


@pytest.mark.parametrize("how", ["env", "flag"])
def test_debug_shows_the_traceback(bad_rows, monkeypatch, how):
    args = _fit(f"--data.dataset={bad_rows}")
    if how == "env":
        monkeypatch.setenv(DEBUG_ENV, "1")
    else:
        args.insert(1, "--debug")
    with pytest.raises(ValueError, match="must be a string"):
        main(args)


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "MegaTrainCLI", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["fit"])


def test_user_error_message_cuts_long_messages():
    message = user_error_message(ValueError("x" * 5000), max_chars=100)  # "ValueError: " + 5000 = 5012 characters
    first = message.splitlines()[0]
    assert first.startswith("megatrain: error: ValueError: xxx") and first.endswith("... [4,912 more characters]")


def test_demo_fit_output(in_tmp, capfd, caplog, recwarn):
    """A demo-sized fit with the progress bar and model summary on, as `make demo` runs it."""
    caplog.set_level("INFO")
    assert main(["fit", "--config", str(DEMO_CONFIG), "--trainer.max_steps=3", "--throughput.window=1"]) == 0
    out = capfd.readouterr()
    text = out.out + out.err + caplog.text  # the progress bar prints; info lines are logged
    assert "GPU available: False, used: False" in text  # Lightning's device line stays
    assert "TPU available" not in text and "litlogger" not in text  # its TPU line and its logger advertisement go
    assert not [warning for warning in recwarn if "LeafSpec" in str(warning.message)]  # Lightning's, from torch
    assert "/-2" not in text and "v_num" not in text  # Lightning's "Epoch 0/-2" of a max_steps run
    assert "mfu" not in text  # no known peak FLOP/s on a CPU
    assert "Total FLOPs" not in text and "Setting accelerator to CPU" not in text
    assert "on_before_batch_transfer" not in text
    assert "bytes/param" not in text  # a tiny model: the process, not the parameters, holds the memory
    assert "Epoch 0" in text and "train_loss" in text and "tokens_per_s" in text  # the progress bar is there
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("megatrain: ")]
    assert any(line.startswith("megatrain: train_loss ") and " at step 3" in line for line in lines), lines
    checkpoint = in_tmp / "checkpoints" / "demo" / "last.ckpt"
    assert checkpoint.is_file()
    assert f"megatrain: checkpoint {checkpoint} (resume: --ckpt_path {checkpoint})" in lines
    assert f"megatrain: export to a HuggingFace folder: megatrain export {checkpoint} OUT_DIR" in lines
    assert lines[-1] == "megatrain: logs in lightning_logs/demo/version_0"
