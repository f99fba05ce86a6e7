"""Seeded row sampling (``num_samples``), train/validation split, an epoch-aware shuffling sampler and the training
loader that resumes mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


def validation_count(num_examples: int, val_size: int | float) -> int:
    """How many of ``num_examples`` to hold out: ``val_size`` is a fraction if a float, a count if an int."""
    if isinstance(val_size, float):
        return int(round(num_examples * val_size))
    return int(val_size)


def sample_indices(num_rows: int, num_samples: int, seed: int) -> list[int]:
    """Which of ``num_rows`` rows make up a dataset of ``num_samples`` rows, as LLaMA-Factory's ``num_samples``.

    The first ``min(num_samples, num_rows)`` rows of a seeded permutation, so with ``num_samples >= num_rows`` every
    row appears at least once; the rows still missing are drawn uniformly with replacement (LLaMA-Factory's
    ``np.random.choice``). Deterministic in ``seed``.

    Args:
        num_rows: Rows in the dataset (> 0).
        num_samples: Rows to return (>= 1).
        seed: Seed of the permutation and the draws.

    Returns:
        ``num_samples`` row indices.
    """
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(num_rows, generator=generator)[:num_samples].tolist()
    missing = num_samples - len(indices)
    if missing > 0:
        indices += torch.randint(num_rows, (missing,), generator=generator).tolist()
    return indices


def split_indices(num_examples: int, val_size: int | float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(num_examples)`` into (train, val) index lists with a seeded permutation.

    Args:
        num_examples: Number of examples.
        val_size: Fraction in [0, 1) (float) or count >= 0 (int) to hold out for validation.
        seed: Seed of the permutation; the same seed always gives the same split.

    Returns:
        ``(train, val)``, each in the permuted order.

    Raises:
        ValueError: If the held-out count leaves no training example.
    """
    count = validation_count(num_examples, val_size)
    if count >= num_examples:
        raise ValueError(
            f"val_size={val_size!r} holds out {count} of {num_examples} examples, leaving none to train on; "
            "lower val_size"
        )
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[count:], order[:count]


class EpochShuffleSampler(Sampler[int]):
    """Shuffle ``range(num_samples)`` with a permutation seeded by ``seed + epoch``.

    Lightning calls :meth:`set_epoch` at the start of every epoch, so each epoch gets a fresh order that is
    reproducible from ``(seed, epoch)`` alone, including after resuming from a checkpoint.

    Args:
        num_samples: Dataset length.
        seed: Base seed.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0
        self.start = 0  # positions of the epoch's order already trained on: a resumed epoch (ResumableLoader)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist()[self.start:])

    def __len__(self) -> int:
        return self.num_samples


class ResumableLoader(DataLoader):
    """The training ``DataLoader`` over an :class:`EpochShuffleSampler`, resumable mid-epoch.

    Lightning stores :meth:`state_dict` in every checkpoint (the fit loop's ``combined_loader`` entry: the epoch and
    the batches of it trained on; with a sized loader Lightning fetches no batch ahead, so the count is exact) and
    calls :meth:`load_state_dict` before the resumed run iterates. The resumed epoch then starts at the next batch
    of the same order instead of at its first, so a run resumed mid-epoch sees the batches the uninterrupted run
    sees. A checkpoint taken at the end of an epoch resumes at the next epoch's first batch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trained = 0  # batches of the current epoch handed out (the one in training included)
        self._resume: dict[str, int] | None = None  # a checkpoint's state, applied by the next __iter__

    def __iter__(self) -> Iterator[Any]:
        # a generator: this body runs at the epoch's first next(), after Lightning's set_epoch
        sampler = self.sampler
        assert isinstance(sampler, EpochShuffleSampler) and self.batch_size is not None
        resume, self._resume = self._resume, None
        skip = resume["batches"] if resume is not None and resume["epoch"] == sampler.epoch else 0
        sampler.start = skip * self.batch_size
        self._trained = skip
        for batch in super().__iter__():
            self._trained += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch and how many of its batches were handed out (they are trained on by the time Lightning saves)."""
        return {"epoch": self.sampler.epoch, "batches": self._trained}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at batch ``state["batches"]`` of epoch ``state["epoch"]`` when the next iteration is that epoch."""
        self._resume = dict(state)
