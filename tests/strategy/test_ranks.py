"""Several ranks on the CPU (gloo): ``MegaTrainStrategy`` with ``devices=N`` trains as single-process training of
the same global batch, and its sharded checkpoints resume on another number of ranks
(engine/sharding.py, [Note: sharded host state]; engine/shard_states.py, [Note: sharded checkpoints]).

Each test forks its ranks (tests/helpers/ranks.py). Tolerance: fp32, ``rtol=1e-5, atol=1e-6``: the ranks sum the
same gradients in another order (a reduce-scatter of per-rank means instead of one mean over the global batch), so
results differ from the reference by fp32 rounding only (measured: at most 1.2e-7 on weights of order 1).
"""

from __future__ import annotations

import pytest
import torch

from helpers.ranks import GLOBAL_BATCH, fit, launch

TOL = {"rtol": 1e-5, "atol": 1e-6}


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
    losses = torch.tensor([r.losses for r in runs]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(reference.losses), **TOL)
    assert len(runs[0].grads) == len(reference.grads) == 3
    for step, want in enumerate(reference.grads):
        if clip is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()]))
            assert norm > 4 * clip, f"step {step}: clipping must bite, the norm is {norm:.3f}"
        for run in runs:
            torch.testing.assert_close(run.grads[step], want, **TOL)
    for run in runs:
        torch.testing.assert_close(run.params, reference.params, **TOL)
        torch.testing.assert_close(run.params, runs[0].params, rtol=0, atol=0)  # gathered, not recomputed


def test_checkpoint_of_two_ranks_resumes_on_one_and_four(tmp_path):
    """Saved by 2 ranks after 2 steps: loaded on 1, 2 and 4 ranks, the optimizer state is the saving run's, and two
    more steps give the same weights on every number of ranks; a checkpoint of one rank loads on 2."""
    ckpt = tmp_path / "two.ckpt"
    saved = launch(2, tmp_path / "save", steps=2, grads=False, ckpt_out=str(ckpt))
    assert sorted(p.name for p in tmp_path.glob("two.ckpt*")) == ["two.ckpt", "two.ckpt-shard0-of-2",
                                                                    "two.ckpt-shard1-of-2"]
    manifest = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert manifest["world_size"] == 2 and "slices" not in manifest

    one = fit(1, steps=4, grads=False, ckpt_in=str(ckpt))
    four = launch(4, tmp_path / "four", steps=4, grads=False, ckpt_in=str(ckpt))
    two = launch(2, tmp_path / "two", steps=4, grads=False, ckpt_in=str(ckpt))
    for run in (one, *four, *two):
        _assert_states_close(run.start_state, saved[0].end_state)
        torch.testing.assert_close(run.params, one.params, **TOL)
    assert not torch.equal(one.params["head.weight"], saved[0].params["head.weight"])  # it trained on

    single = tmp_path / "one.ckpt"
    first = fit(1, steps=2, grads=False, ckpt_out=str(single))
    resumed = launch(2, tmp_path / "from-one", steps=3, grads=False, ckpt_in=str(single))
    for run in resumed:
        _assert_states_close(run.start_state, first.end_state)
