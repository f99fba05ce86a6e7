"""Several ranks on the CPU (gloo): ``MegaTrainStrategy`` with ``devices=N`` trains as single-process training of
the same global batch, and its sharded checkpoints resume on another number of ranks, every rank from the same one,
none saved after an exception (engine/sharding.py, [Note: sharded host state]; engine/shard_states.py, [Note:
checkpoints of several ranks]).

Each test forks its ranks (tests/helpers/ranks.py). Tolerance: fp32, the parity tests' rule (helpers/parity.py
``assert_records_close``): per tensor ``||a - b|| <= 1e-5 ||b||`` (+1e-8 for zero references). The ranks sum the same
gradients in another order (a reduce-scatter of per-rank means instead of one mean over the global batch), so
results differ by fp32 rounding only: at most 1.2e-7 on the stack's weights of order 1, 6e-6 on one element of a
tied embedding's gradient (sums with cancellation), which an elementwise rule would need a loose atol for. Optimizer
states are compared elementwise at ``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch.utils.data import DataLoader

from helpers.ranks import GLOBAL_BATCH, SEQ, VOCAB, RankLM, fit, launch, manual_module

TOL = {"rtol": 1e-5, "atol": 1e-6}
RTOL = 1e-5


def _assert_close(got: dict, want: dict, what: str, rtol: float = RTOL) -> None:
    """Norm-wise per tensor (see the module docstring); every mismatch listed."""
    assert got.keys() == want.keys(), f"{what}: {sorted(set(got) ^ set(want))}"
    bad = [f"{name}: |a-b|={float((got[name] - w).norm()):.2e} |b|={float(w.norm()):.2e}"
           for name, w in want.items() if float((got[name] - w).norm()) > rtol * float(w.norm()) + 1e-8]
    assert not bad, f"{what}:\n" + "\n".join(bad)


def _assert_train_as_reference(runs: list, reference, rtol_updated: float = RTOL) -> None:
    """``rtol_updated`` for the grads after the first update and the final weights (see test_hf_models_on_two_ranks)."""
    losses = torch.tensor([r.losses for r in runs]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(reference.losses), **TOL)
    for rank, run in enumerate(runs):
        assert len(run.grads) == len(reference.grads)
        for step, want in enumerate(reference.grads):
            rtol = RTOL if step == 0 else rtol_updated
            _assert_close(run.grads[step], want, f"rank {rank}, grads of step {step}", rtol)
        _assert_close(run.params, reference.params, f"rank {rank}, weights", rtol_updated)
        # every rank's own whole residents agree to the bit (the layers are one all-gather: equal by construction)
        torch.testing.assert_close(run.params, runs[0].params, rtol=0, atol=0)


def _assert_states_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got[name][key].float(), want[name][key].float(), **TOL, msg=f"{name}.{key}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, 0.05)])
def test_ranks_train_as_one_process(tmp_path, world, accumulate, clip):
    """Losses (mean over ranks), global gradients before clipping and weights after every step equal plain
    single-process Lightning on the same global batch; every rank ends with the same weights. ``clip=0.05`` bites
    at every step (the gradient norm is above 0.2)."""
    runs = launch(world, tmp_path, steps=3, accumulate=accumulate, clip=clip)
    reference = fit(1, strategy="auto", steps=3, accumulate=accumulate, clip=clip)
    assert GLOBAL_BATCH % world == 0
    assert len(reference.grads) == 3
    for step, want in enumerate(reference.grads):
        if clip is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()]))
            assert norm > 4 * clip, f"step {step}: clipping must bite, the norm is {norm:.3f}"
    _assert_train_as_reference(runs, reference)


_BLOCKED = [0]  # a forked rank's count of the readers that found their group's update still running


def _blocked_waits(trainer, module) -> int:
    return _BLOCKED[0]


@pytest.mark.parametrize(("world", "accumulate", "clip"), [(2, 1, 0.05), (4, 2, None)])
def test_overlapped_host_step_on_several_ranks(tmp_path, monkeypatch, world, accumulate, clip):
    """``overlap_optimizer=True`` with several ranks ([Note: sharded host state]): each rank steps its owned shares
    on the worker, slowed per group, while the next forward gathers the layers it has stepped. Losses, final weights
    and Adam states equal single-process Lightning's; every rank's readers found updates still running (the recorder
    reads only losses between steps, so nothing but the engine's gates waits for the worker)."""
    from lightning_megatrain.engine.overlap import OverlappedStep

    wait = OverlappedStep.wait

    def counted_wait(self, group):
        _BLOCKED[0] += not self._done[id(group)].is_set()
        wait(self, group)

    monkeypatch.setattr(OverlappedStep, "wait", counted_wait)  # the forked ranks inherit it
    runs = launch(world, tmp_path, steps=3, accumulate=accumulate, clip=clip, grads=False, overlap_optimizer=True,
                  slow_update=0.05, after=_blocked_waits)
    reference = fit(1, strategy="auto", steps=3, accumulate=accumulate, clip=clip, grads=False)
    losses = torch.tensor([r.losses for r in runs]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(reference.losses), **TOL)
    for rank, run in enumerate(runs):
        assert run.after > 0, f"rank {rank}: no reader waited for the overlapped step"
        _assert_close(run.params, reference.params, f"rank {rank}, weights")
        _assert_states_close(run.end_state, reference.end_state)


def test_a_host_too_small_for_its_ranks_refuses_on_every_rank(tmp_path, monkeypatch):
    """The host checks count every rank of the host (engine/first_batch.py ``check_host_state``): rank 1 sees no
    host RAM left for the first step's grads and Adam states and refuses with the numbers of both ranks; rank 0,
    whose own check passes, refuses with it instead of waiting in a collective."""
    from lightning_megatrain.engine import host_store

    monkeypatch.setattr(host_store, "placeable_host_bytes",  # the forked ranks inherit it
                        lambda: (0 if os.environ["LOCAL_RANK"] == "1" else 1 << 40, "a test's limit"))
    runs = launch(2, tmp_path, steps=1, raises=True)
    assert runs[1].error.startswith("RuntimeError: MegaTrainStrategy needs about ")
    assert "for the grads and optimizer states of the first step" in runs[1].error
    assert ", 2 ranks on this host with " in runs[1].error and "but only 0.0 MiB is available" in runs[1].error
    assert runs[0].error == ("RuntimeError: MegaTrainStrategy: another rank refused to start (its error says why); "
                             "every rank stops with it")


_PACKED: list = []  # a forked rank's pack_group calls: whether each group's grads were left unallocated


def _packed(trainer, module) -> list:
    return list(_PACKED)


def test_no_rank_allocates_a_groups_grads_whole(tmp_path, monkeypatch):
    """Every rank packs each group's masters whole before cutting its share, but never its grads: the owned shares
    have their own (4 bytes per parameter per rank less at setup)."""
    from lightning_megatrain.engine import engine

    pack_group = engine.pack_group

    def recorded(*args, **kwargs):
        _PACKED.append(kwargs["lazy_grad"])
        return pack_group(*args, **kwargs)

    monkeypatch.setattr(engine, "pack_group", recorded)
    for run in launch(2, tmp_path, steps=1, grads=False, after=_packed):
        assert run.after == [True] * 4  # 3 layers and the residents


def test_without_reduce_scatter(tmp_path, monkeypatch):
    """A backend without reduce_scatter (older gloo): the all_reduce fallback trains the same (the forked ranks
    inherit the patch)."""
    from lightning_megatrain.engine import collectives

    def missing(*args, **kwargs):
        raise RuntimeError("no reduce_scatter in this backend")

    monkeypatch.setattr(collectives, "_reduce_scatter", missing)
    runs = launch(2, tmp_path, steps=2, accumulate=2, clip=0.05)
    _assert_train_as_reference(runs, fit(1, strategy="auto", steps=2, accumulate=2, clip=0.05))


@pytest.mark.parametrize("family", ["llama_tied", "qwen3_moe"])
def test_hf_models_on_two_ranks(tmp_path, family):
    """An HF Llama with tied embeddings (one parameter, two names) and an MoE (routed experts, router logits), with
    accumulation and clipping.

    Where the CPU GEMM rounds a row differently with the number of rows (MKL on an AVX2 AMD EPYC), each rank's experts
    see other GEMM shapes than the whole batch's: the first grads differ by 4.4e-7, and AdamW, which divides each
    element by its own magnitude, amplifies that where a grad is near eps (the router's, a rarely chosen expert's):
    8.4e-5 on the next grads, 4.4e-5 on the weights (measured; the dense Llama: 3e-6). Hence 1e-3 after the first
    update for the MoE, still ten times below what a real defect gives (a dropped expert or a missing 1/accumulate:
    1e-2 and more)."""
    runs = launch(2, tmp_path, model=family, steps=2, accumulate=2, clip=0.05)
    reference = fit(1, strategy="auto", model=family, steps=2, accumulate=2, clip=0.05)
    _assert_train_as_reference(runs, reference, rtol_updated=1e-3 if family == "qwen3_moe" else RTOL)


def test_checkpoint_of_two_ranks_resumes_on_one_and_four(tmp_path):
    """Saved by 2 ranks after 2 steps: loaded on 1, 2 and 4 ranks, the optimizer state is the saving run's, and two
    more steps give the same weights on every number of ranks; a checkpoint of one rank loads on 2."""
    ckpt = tmp_path / "two.ckpt"
    saved = launch(2, tmp_path / "save", steps=2, grads=False, ckpt_out=str(ckpt))
    assert sorted(p.name for p in tmp_path.glob("two.ckpt*")) == ["two.ckpt", "two.ckpt-shard0-of-2",
                                                                    "two.ckpt-shard1-of-2"]
    main = torch.load(ckpt, weights_only=False)
    manifest = main["optimizer_states"][0]
    assert manifest["world_size"] == 2 and "slices" not in manifest
    # the layers' masters are in the shard files only; the residents whole in the state_dict
    assert not any(k.startswith("blocks.") for k in main["state_dict"]) and "head.weight" in main["state_dict"]

    one = fit(1, steps=4, grads=False, ckpt_in=str(ckpt))
    four = launch(4, tmp_path / "four", steps=4, grads=False, ckpt_in=str(ckpt))
    two = launch(2, tmp_path / "two", steps=4, grads=False, ckpt_in=str(ckpt))
    for run in (one, *four, *two):
        _assert_states_close(run.start_state, saved[0].end_state)
        _assert_close(run.params, one.params, "weights after resuming")
    assert not torch.equal(one.params["head.weight"], saved[0].params["head.weight"])  # it trained on

    single = tmp_path / "one.ckpt"
    first = fit(1, steps=2, grads=False, ckpt_out=str(single))
    resumed = launch(2, tmp_path / "from-one", steps=3, grads=False, ckpt_in=str(single))
    for run in resumed:
        _assert_states_close(run.start_state, first.end_state)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_share_of_the_layer_masters(tmp_path, world):
    """Host masters per rank: the owned master of each layer (``ceil(305 / N)`` fp32 elements of each Block) and the
    residents whole, padded (embed 512 + norm 32 + head 544 = 1088 parameters); owned grads likewise 1/N of every
    group. One process holds 3 * 305 + 1088 = 2003 masters."""
    runs = launch(world, tmp_path, steps=1, grads=False)
    size = -(-305 // world)
    resident = world * -(-1088 // world)
    for run in runs:
        assert run.host_bytes["masters"] == 4 * (3 * size + resident)
        assert run.host_bytes["owned_grads"] == 4 * (3 * size + resident // world)
    assert fit(1, steps=1, grads=False).host_bytes["masters"] == 4 * (3 * 305 + 1088)


# - which checkpoint several ranks resume from, and none saved after an exception


def test_ranks_resume_from_the_newest_checkpoint_that_loads_on_every_rank(tmp_path, monkeypatch):
    """ckpt_path="last" where rank 1 cannot load last.ckpt nor step 4's (as a rank whose view of a shared directory
    lags) and rank 0 can: both ranks resume from step 2's, the newest that loads on every rank, and train on alike."""
    from lightning_megatrain import sharded_load

    ckpts = tmp_path / "ckpts"
    launch(2, tmp_path / "save", steps=4, grads=False, ckpt_dir=str(ckpts))
    assert {"last.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"} <= {p.name for p in ckpts.iterdir()}
    load_any = sharded_load.load_any

    def lagging(path, load_file):
        if os.environ["LOCAL_RANK"] == "1" and Path(path).name != "epoch=0-step=2.ckpt":
            raise FileNotFoundError(f"{path}: not visible on rank 1 yet")
        return load_any(path, load_file)

    monkeypatch.setattr(sharded_load, "load_any", lagging)  # the forked ranks inherit the patch
    runs = launch(2, tmp_path / "resume", timeout=30, steps=5, grads=False, ckpt_dir=str(ckpts), ckpt_in="last")
    for rank, run in enumerate(runs):
        assert float(run.start_state["head.weight"]["step"]) == 2, f"rank {rank}"
        chose, = [w for w in run.warnings if "the newest checkpoint that loads on every rank" in w]
        assert f"resuming from {ckpts / 'epoch=0-step=2.ckpt'}" in chose and "rank 1: FileNotFoundError" in chose
    torch.testing.assert_close(runs[0].params, runs[1].params, rtol=0, atol=0)


def test_a_checkpoint_named_by_path_that_one_rank_cannot_load_fails_on_every_rank(tmp_path, monkeypatch):
    from lightning_megatrain import sharded_load

    ckpt = tmp_path / "two.ckpt"
    launch(2, tmp_path / "save", steps=2, grads=False, ckpt_out=str(ckpt))
    load_any = sharded_load.load_any

    def unreadable_on_rank_1(path, load_file):
        if os.environ["LOCAL_RANK"] == "1":
            raise OSError("Input/output error")
        return load_any(path, load_file)

    monkeypatch.setattr(sharded_load, "load_any", unreadable_on_rank_1)
    runs = launch(2, tmp_path / "resume", timeout=30, raises=True, steps=3, grads=False, ckpt_in=str(ckpt))
    assert runs[1].error == "OSError: Input/output error"
    assert runs[0].error.startswith(f"RuntimeError: MegaTrainStrategy could not load the checkpoint {ckpt} on every "
                                    "rank: rank 1: OSError: Input/output error. HINT")


class FailOnRank(Callback):
    """Raise on one rank only, at the start of one step: the other rank goes on into that step's collectives."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise ValueError(f"a failure on rank {self.rank} only")


def test_no_checkpoint_is_saved_after_an_exception_on_several_ranks(tmp_path):
    """OnExceptionCheckpoint with 2 ranks, rank 1 raising at step 3 while rank 0 trains on: neither rank saves (a
    checkpoint of one rank's shard file never loads), each warns naming the last complete checkpoint, and neither
    waits for the other: both end, rank 0 with the error of its broken collective."""
    ckpts = tmp_path / "ckpts"
    runs = launch(2, tmp_path / "run", timeout=30, raises=True, steps=6, grads=False, ckpt_dir=str(ckpts),
                  callbacks=[OnExceptionCheckpoint(str(ckpts)), FailOnRank(1, 3)])
    assert runs[1].error == "ValueError: a failure on rank 1 only"
    assert runs[0].error  # its collective lost rank 1
    assert not list(ckpts.glob("on_exception*"))
    for rank, run in enumerate(runs):
        unsaved, = [w for w in run.warnings if "after an exception" in w]
        assert unsaved.startswith(f"MegaTrainStrategy with 2 ranks did not save {ckpts / 'on_exception.ckpt'} after "
                                  "an exception"), unsaved
        assert f"The last complete checkpoint of this run is {ckpts / 'last.ckpt'}." in unsaved


def test_one_rank_still_saves_after_an_exception(tmp_path):
    """With one rank the exception-time checkpoint is whole: OnExceptionCheckpoint saves as in Lightning."""
    with pytest.raises(ValueError, match="a failure on rank 0 only"):
        fit(1, steps=4, grads=False, callbacks=[OnExceptionCheckpoint(str(tmp_path)), FailOnRank(0, 2)])
    assert torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["global_step"] == 2


# - after fit, the placeholders; predict; manual optimization


class EvalLM(RankLM):
    """:class:`RankLM` with a validation and test loss over 8 fixed samples and a predict step (per-sample loss over
    ``n_predict`` samples, one per batch)."""

    def __init__(self, micro_batch: int, n_predict: int = 8) -> None:
        super().__init__(micro_batch)
        self.n_predict = n_predict

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def _eval_loader(self, n: int, batch_size: int) -> DataLoader:
        data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))
        return DataLoader(data, batch_size=batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(8, 2)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(8, 2)

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.n_predict, 1)


def _validate_and_test(trainer, module) -> tuple[float, float]:
    val, = trainer.validate(module, verbose=False)
    test, = trainer.test(module, verbose=False)
    return val["val_loss"], test["test_loss"]


def test_validate_and_test_after_fit_use_the_trained_weights(tmp_path):
    """``trainer.fit(model)`` then ``trainer.validate(model)`` / ``trainer.test(model)`` on the same Trainer: the
    layers are placeholders after fit's teardown, so the next setup packed NaN masters; it now takes the owned
    masters fit left. The losses equal one process's."""
    runs = launch(2, tmp_path, steps=2, grads=False, module=lambda world: EvalLM(GLOBAL_BATCH // world),
                  after=_validate_and_test)
    reference = fit(1, strategy="auto", steps=2, grads=False, module=lambda world: EvalLM(GLOBAL_BATCH),
                    after=_validate_and_test)
    for run in runs:
        torch.testing.assert_close(torch.tensor(run.after), torch.tensor(reference.after), **TOL)


def test_manual_optimization_clips_the_residents_too(tmp_path):
    """Manual optimization calls ``clip_gradients`` before ``optimizer.step()``, where the residents' grads were
    still local (reduced only when the step finalized them): the global norm missed them and they were not clipped.
    The weights after two clipped steps equal one process's."""
    runs = launch(2, tmp_path, steps=2, grads=False, module=manual_module)
    reference = fit(1, strategy="auto", steps=2, grads=False, module=manual_module)
    for rank, run in enumerate(runs):
        _assert_close(run.params, reference.params, f"rank {rank}, weights")


def _predict(trainer, module) -> list[float]:
    return [float(loss) for loss in trainer.predict(module)]


def test_predict_on_two_ranks(tmp_path):
    """Lightning splits predict data without padding: 8 samples give each rank 4 batches and predict as one process
    does; 5 samples gave rank 0 a third batch whose layers waited for rank 1, gone (gloo: "Connection closed by
    peer"; NCCL: a hang): refused on both ranks, before any layer runs, naming the counts."""
    runs = launch(2, tmp_path / "even", steps=1, grads=False, module=lambda world: EvalLM(GLOBAL_BATCH // world),
                  after=_predict)
    reference = fit(1, strategy="auto", steps=1, grads=False, module=lambda world: EvalLM(GLOBAL_BATCH),
                    after=_predict)
    torch.testing.assert_close(torch.tensor(runs[0].after + runs[1].after).sort().values,
                               torch.tensor(reference.after).sort().values, **TOL)
    runs = launch(2, tmp_path / "uneven", timeout=30, raises=True, steps=1, grads=False,
                  module=lambda world: EvalLM(GLOBAL_BATCH // world, n_predict=5), after=_predict)
    for run in runs:
        assert run.error.startswith("ValueError: MegaTrainStrategy with 2 ranks runs each layer on every rank "
                                    "together"), run.error
        assert "differ: [[3], [2]]" in run.error


class PartLM(RankLM):
    """An optimizer over every parameter but the last block's gate, the last element of that block's flat buffer:
    only the last rank's shard holds part of what the optimizer leaves out."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for n, p in self.named_parameters() if n != "blocks.2.gate"], lr=1e-2)


def test_clipping_an_optimizer_over_part_of_the_parameters_fails_on_every_rank(tmp_path):
    """Clipping needs the optimizer to hold every parameter; which rank sees that it does not depends on the shards.
    Decided on one rank alone, that rank raised while the other went on into the norm's all-reduce (gloo: "Connection
    closed by peer"; NCCL: a hang): every rank refuses, with the same message."""
    runs = launch(2, tmp_path, timeout=60, raises=True, steps=1, grads=False, clip=1.0,
                  module=lambda world: PartLM(GLOBAL_BATCH // world))
    for run in runs:
        assert run.error.startswith("RuntimeError: MegaTrainStrategy with several ranks clips the global norm of the "
                                    "optimizer's whole shard only"), run.error
