"""``megatrain`` on configs/demo.yaml end to end: fit, resume, validate, test, predict, export, optimizer sections."""

from __future__ import annotations

import csv
import math
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_megatrain import MegaTrainPrecision, MegaTrainStrategy
from lightning_megatrain.callbacks import ThroughputLogger
from lightning_megatrain.cli import MegaTrainCLI, main
from lightning_megatrain.data import DEMO_TOKENIZER_DIR
from lightning_megatrain.models import CausalLMModule

from helpers.cli_paths import DEMO_CONFIG, QUIET


def _fit_args(*extra: str) -> list[str]:
    return ["fit", "--config", str(DEMO_CONFIG), *QUIET, *extra]


@pytest.fixture(scope="module")
def demo_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[MegaTrainCLI, Path]:
    """One 2-step ``megatrain fit`` of the demo config, shared by this module's tests, and its folder."""
    root = tmp_path_factory.mktemp("demo_fit")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setattr(sys, "argv", ["megatrain"])
        cli = MegaTrainCLI(args=_fit_args("--trainer.max_steps=2"))
    return cli, root


@pytest.fixture
def in_demo_fit(demo_fit: tuple[MegaTrainCLI, Path], monkeypatch: pytest.MonkeyPatch) -> tuple[MegaTrainCLI, Path]:
    """``demo_fit``, with the test running in its folder (the config's relative paths resolve there)."""
    monkeypatch.chdir(demo_fit[1])
    return demo_fit


def test_test_and_predict_on_the_held_out_rows(in_demo_fit):
    _, root = in_demo_fit
    args = ["--config", str(DEMO_CONFIG), *QUIET, "--ckpt_path", str(root / "checkpoints" / "demo" / "last.ckpt")]
    val_loss = float(MegaTrainCLI(args=["validate", *args]).trainer.callback_metrics["val_loss"])

    # test evaluates the same held-out rows (data.val_size: 20) as validate, with its own metric names.
    metrics = MegaTrainCLI(args=["test", *args]).trainer.callback_metrics
    assert float(metrics["test_loss"]) == pytest.approx(val_loss, rel=1e-6)
    assert float(metrics["test_ppl"]) == pytest.approx(math.exp(val_loss), rel=1e-6)

    # predict scores each held-out row: 20 rows in batches of data.micro_batch_size=8.
    predictions = MegaTrainCLI(args=["predict", *args]).trainer.predict_loop.predictions
    assert [len(batch["loss"]) for batch in predictions] == [8, 8, 4]
    loss = torch.cat([batch["loss"] for batch in predictions])  # [20]
    tokens = torch.cat([batch["tokens"] for batch in predictions])  # [20]
    assert bool((tokens > 0).all()) and bool(torch.isfinite(loss).all())
    assert float((loss * tokens).sum() / tokens.sum()) == pytest.approx(val_loss, rel=1e-5)


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_need_held_out_rows(subcommand, in_tmp):
    with pytest.raises(ValueError, match=rf"val_size=0: {subcommand} runs on the held-out rows.*set val_size > 0"):
        MegaTrainCLI(args=[subcommand, "--config", str(DEMO_CONFIG), *QUIET, "--data.val_size=0"])


def test_fit_resume_export(in_demo_fit):
    cli, in_tmp = in_demo_fit
    trainer = cli.trainer
    assert isinstance(trainer.strategy, MegaTrainStrategy)
    assert isinstance(trainer.strategy.precision_plugin, MegaTrainPrecision)
    if not torch.cuda.is_available():
        assert trainer.strategy.precision_plugin.precision == "32-true"  # precision: null on a CPU
    assert any(isinstance(cb, ThroughputLogger) for cb in trainer.callbacks)
    assert trainer.global_step == 2
    # One tokenizer for model and data (the bundled demo one), also recorded in the hyper-parameters.
    assert cli.model.hparams.tokenizer == cli.datamodule.hparams.tokenizer == str(DEMO_TOKENIZER_DIR)
    last = in_tmp / "checkpoints" / "demo" / "last.ckpt"
    assert last.is_file()
    assert torch.load(last, weights_only=False)["global_step"] == 2
    assert (in_tmp / "lightning_logs" / "demo" / "version_0" / "config.yaml").is_file()  # SaveConfigCallback

    # Resume through the console-script entry point: weights, optimizer and loop state continue to step 4.
    assert main(_fit_args("--trainer.max_steps=4", "--ckpt_path", str(last))) == 0
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == 4

    # validate evaluates the checkpoint on the held-out rows (data.val_size in the demo config).
    validate = MegaTrainCLI(args=["validate", "--config", str(DEMO_CONFIG), *QUIET, "--ckpt_path", str(last)])
    assert float(validate.trainer.callback_metrics["val_loss"]) > 0

    out = in_tmp / "hf"
    assert main(["export", str(last), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    hparams = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
    module = CausalLMModule(**hparams)
    module.configure_model()
    module.load_state_dict(checkpoint["state_dict"])
    module.eval()
    input_ids = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(0))  # [2, 24]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=input_ids).logits, module(input_ids), atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 1024 and tokenizer.chat_template

    # A second export into the same folder needs --overwrite.
    with pytest.raises(SystemExit) as error:
        main(["export", str(last), str(out)])
    assert error.value.code == 2
    assert main(["export", str(last), str(out), "--overwrite", "--max-shard-size", "100000"]) == 0


def test_cli_optimizer_and_scheduler_sections(in_tmp):
    cli = MegaTrainCLI(
        args=_fit_args(
            "--trainer.max_steps=2",
            "--trainer.num_sanity_val_steps=0",
            "--data.val_size=0",
            "--optimizer=torch.optim.AdamW",
            "--optimizer.lr=0.01",
            "--optimizer.weight_decay=0.0",
            "--lr_scheduler=torch.optim.lr_scheduler.StepLR",
            "--lr_scheduler.step_size=1",
            "--lr_scheduler.gamma=0.5",
        )
    )
    trainer = cli.trainer
    (config,) = trainer.lr_scheduler_configs
    assert config.interval == "step"  # not LightningCLI's per-epoch default
    assert isinstance(config.scheduler, torch.optim.lr_scheduler.StepLR)
    (optimizer,) = trainer.optimizers
    # The scheduler stepped after each of the 2 optimizer steps and drives the optimizer that really steps.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**2)
    assert config.scheduler.optimizer is optimizer
    # Built after configure_model: one group over every parameter of the HF model.
    n_params = sum(p.numel() for p in cli.model.parameters())
    assert sum(p.numel() for group in optimizer.param_groups for p in group["params"]) == n_params > 0


def test_lr_scheduler_without_optimizer_is_refused(in_tmp):
    with pytest.raises(ValueError, match="lr_scheduler is set but optimizer is not"):
        MegaTrainCLI(
            args=_fit_args("--lr_scheduler=torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size=1"), run=True
        )


def test_model_and_data_tokenizers_must_agree(in_tmp, tmp_path):
    with pytest.raises(ValueError, match="differ"):
        MegaTrainCLI(args=_fit_args(f"--model.tokenizer={tmp_path}", f"--data.tokenizer={DEMO_TOKENIZER_DIR}"))


def test_full_demo_loss_goes_down(in_tmp):
    """The whole configs/demo.yaml run (60 steps): train and validation loss fall clearly from ln(1024) ~ 6.9."""
    cli = MegaTrainCLI(args=["fit", "--config", str(DEMO_CONFIG), *QUIET])
    assert cli.trainer.global_step == 60
    with open(in_tmp / "lightning_logs" / "demo" / "version_0" / "metrics.csv", newline="") as metrics:
        rows = list(csv.DictReader(metrics))
    train = [float(row["train_loss"]) for row in rows if row["train_loss"]]
    val = [float(row["val_loss"]) for row in rows if row["val_loss"]]
    tokens_per_s = [float(row["tokens_per_s"]) for row in rows if row["tokens_per_s"]]
    assert len(train) == 12 and len(val) == 2  # logged every 5 steps, validated at steps 30 and 60
    assert train[0] - train[-1] > 1.5 and val[-1] < val[0] < 5.0
    assert tokens_per_s and min(tokens_per_s) > 0
    assert (in_tmp / "checkpoints" / "demo" / "step0060.ckpt").is_file()


def test_fit_ckpt_path_last_skips_a_truncated_last_checkpoint(in_tmp):
    # checkpoint_io.py, [Note: resuming from a readable checkpoint]: the CLI's "last" resolves as Trainer.fit's does
    assert main(_fit_args("--trainer.max_steps=2")) == 0
    folder = in_tmp / "checkpoints" / "demo"
    last, kept = folder / "last.ckpt", folder / "kept.ckpt"
    shutil.copy(last, kept)
    old = time.time() - 60
    os.utime(kept, (old, old))
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.warns(UserWarning, match=r"resuming from .*kept\.ckpt, the newest checkpoint that loads"):
        assert main(_fit_args("--trainer.max_steps=3", "--ckpt_path", "last")) == 0
    assert torch.load(last, weights_only=False)["global_step"] == 3
