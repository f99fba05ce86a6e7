"""MegaTrainStrategy's checkpoints: save, resume, and the restored host state against plain Lightning's."""

from __future__ import annotations

import lightning as L
import torch

from lightning_megatrain import MegaTrainStrategy

from helpers.parity import ParityLM
from helpers.trainers import cpu_trainer


def test_checkpoint_resume_restores_exactly_and_matches_plain(tmp_path):
    """Save after 2 steps, resume to 4: the restored masters and Adam states equal the checkpoint bit for bit, the
    states stay on the host, and the resumed run matches plain Lightning's resumed run."""

    def fit(strategy, root, steps, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        module = ParityLM("qwen3")  # no dropout: Lightning checkpoints do not restore RNG states
        trainer = cpu_trainer(
            strategy=strategy,
            max_steps=steps,
            default_root_dir=root,
            enable_checkpointing=True,
            callbacks=list(callbacks),
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        return module

    class CheckRestored(L.Callback):
        def __init__(self, ckpt):
            self.ckpt = torch.load(ckpt, weights_only=False)

        def on_train_start(self, trainer, pl_module):
            for name, p in pl_module.named_parameters():
                torch.testing.assert_close(p, self.ckpt["state_dict"][name], rtol=0, atol=0, msg=name)
            saved = self.ckpt["optimizer_states"][0]["state"]
            for k, state in trainer.optimizers[0].state_dict()["state"].items():
                assert state["exp_avg"].device.type == "cpu"
                torch.testing.assert_close(state["exp_avg_sq"], saved[k]["exp_avg_sq"], rtol=0, atol=0)
            self.checked = True

    finals = []
    for i, strategy in enumerate(("auto", MegaTrainStrategy(cpu_adam="torch"))):
        root = tmp_path / str(i)
        fit(strategy, root, 2, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)])
        check = CheckRestored(root / "last.ckpt")
        strategy = "auto" if i == 0 else MegaTrainStrategy(cpu_adam="torch")
        finals.append(fit(strategy, root, 4, ckpt_path=str(root / "last.ckpt"), callbacks=[check]))
        assert check.checked
    # fused host AdamW against torch's for-loop AdamW: fp32 rounding differs per CPU's vector width, and Adam
    # divides by sqrt(v), so a weight whose grads are ~0 moves by up to ~3e-7 more on one machine than another
    for (name, a), b in zip(finals[1].named_parameters(), finals[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
