"""Reference log-probabilities for DPO and IPO: computed once with the policy's initial weights, kept per pair.

[Note: reference log-probabilities]
DPO compares each response's log-probability under the policy with its log-probability under the reference model,
the policy before training. Both the reference and the data are fixed, so the reference's part is a table of two
numbers per pair (chosen, rejected). ``DPOModule`` computes it in one pass over every split before the first
optimizer step, when the policy's weights still are the reference's: batch by batch through
``trainer.strategy.predict_step`` (under MegaTrain the layers stream as in any forward, at the run's precision), in
eval mode and without gradients. No second copy of the weights exists anywhere: the reference costs no host or GPU
bytes per parameter, 8 bytes per pair, and one forward of each pair per run, where a reference model beside the policy
costs a forward of each pair at every step and, streamed from a bf16 host copy, 2 more host bytes per parameter.

Each split's table is tied to its data by :func:`fingerprint`, a SHA-256 of the split's pairs in order, unpadded
(so ``micro_batch_size`` and ``pad_to_multiple_of`` do not change it). The tables and their fingerprints are saved in
checkpoints, so resuming reads them instead of recomputing them from weights that have moved on, and a resumed run
whose data fingerprint differs (another dataset, seed, split, tokenizer or ``cutoff_len``) is refused. With
``DPOModule(reference_cache=PATH)`` the tables are also written to a file, keyed by the model (with the seed of a
randomly initialised one), the precision and the fingerprints: a later run with the same key reads it and skips the
pass; a different key is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.utils.data import DataLoader

log = logging.getLogger(__name__)

PAIR_INDEX = "pair_index"  # batch key: [B] each pair's position in its split (data/collate.py's PairCollator)
REFERENCE_LOGPS = "reference_logps"  # batch key: [B, 2] the reference's (chosen, rejected) summed log-probabilities
CACHE_VERSION = 2
_KEY_FIELDS = ("model", "seed", "precision")  # what a cache must match beside the data fingerprints
_PAIR_END = b"\xffpair"  # written after each pair, so that no two splits' byte streams coincide


def _int64(values: Any) -> bytes:
    return array("q", values).tobytes()  # int64 in the host's byte order


def fingerprint(loader: DataLoader) -> str:
    """SHA-256 of a split's pairs in order, before padding: each pair's chosen and rejected ``input_ids`` and
    ``labels`` as int64 bytes (each sequence led by its length), then a separator. The batch shape
    (``micro_batch_size``, ``pad_to_multiple_of``) does not change it. A dataset of items other than pairs (with
    ``chosen``/``rejected`` ``input_ids`` and ``labels``): the loader's batches instead, each tensor key by key."""
    digest = hashlib.sha256()
    dataset = loader.dataset
    if all(hasattr(item, "chosen") and hasattr(item, "rejected") for item in dataset):
        for pair in dataset:
            for sequence in (pair.chosen, pair.rejected):
                digest.update(_int64([len(sequence.input_ids)]))
                digest.update(_int64(sequence.input_ids))
                digest.update(_int64(sequence.labels))
            digest.update(_PAIR_END)
        return digest.hexdigest()
    for batch in loader:
        for key in sorted(batch):
            value = batch[key]
            if isinstance(value, Tensor):
                digest.update(key.encode())
                digest.update(str(tuple(value.shape)).encode())
                digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def compute_reference(module: LightningModule, loaders: Mapping[str, DataLoader]) -> dict[str, Tensor]:
    """The ``[N, 2]`` fp32 (chosen, rejected) log-probabilities of every pair of each split, from ``module``'s
    ``predict_step`` run through its trainer's strategy (see [Note: reference log-probabilities]).

    Raises:
        ValueError: A loader's batches lack ``pair_index``, or leave a pair of its split without a value.
    """
    strategy = module.trainer.strategy
    was_training = module.training
    module.eval()
    tables = {}
    try:
        # inference_mode(False): the table must be a normal tensor even when an evaluation loop calls this
        with torch.inference_mode(False), torch.no_grad():
            for split, loader in loaders.items():
                table = torch.full((len(loader.dataset), 2), float("nan"))  # [N, 2]
                rows, found = [], []  # each batch's pair indices (host) and [B, 2] values (device): read at the end
                for batch_idx, batch in enumerate(loader):
                    if PAIR_INDEX not in batch:
                        raise ValueError(f"reference log-probabilities: the {split!r} loader's batches have no "
                                         f"{PAIR_INDEX!r}; collate pairs with PairCollator (PreferenceDataModule)")
                    output = strategy.predict_step(strategy.batch_to_device(batch), batch_idx)
                    rows.append(batch[PAIR_INDEX])
                    found.append(torch.stack([output["chosen_logps"], output["rejected_logps"]], dim=1).float())
                if found:  # one read of the device for the split, not one per batch (8 bytes per pair)
                    table[torch.cat(rows)] = torch.cat(found).cpu()
                missing = int(table.isnan().any(1).sum())
                if missing:
                    raise ValueError(f"reference log-probabilities: {missing} of {len(table)} {split!r} pairs got "
                                     f"no value; each pair_index of the split must appear once in 0..{len(table) - 1}")
                tables[split] = table
                log.info("DPO: reference log-probabilities of %d %s pairs computed (mean chosen %.3f, rejected %.3f)",
                         len(table), split, float(table[:, 0].mean()), float(table[:, 1].mean()))
    finally:
        module.train(was_training)
    return tables


def load_cache(path: Path, key: Mapping[str, Any]) -> dict[str, Tensor]:
    """The tables of ``path`` whose split fingerprint matches ``key["fingerprints"]`` (``{}`` without a file).

    Raises:
        ValueError: The file is not a reference cache, or was computed for another model, seed or precision, or its
            split holds other data.
    """
    if not path.is_file():
        return {}
    try:
        cache = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated file, another format: pickle and zip raise several types
        raise ValueError(f"reference_cache={str(path)!r} is not a reference cache ({err}); delete it or point "
                         "reference_cache elsewhere") from err
    if not isinstance(cache, dict) or cache.get("version") != CACHE_VERSION:
        raise ValueError(f"reference_cache={str(path)!r} is not a version-{CACHE_VERSION} reference cache; delete it "
                         "or point reference_cache elsewhere")
    for field in _KEY_FIELDS:
        if cache[field] != key[field]:
            raise ValueError(f"reference_cache={str(path)!r} was computed with {field}={cache[field]!r}, this run has "
                             f"{field}={key[field]!r}; delete it (it is recomputed) or point reference_cache elsewhere")
    tables = {}
    for split, expected in key["fingerprints"].items():
        found = cache["fingerprints"].get(split)
        if found is not None and found != expected:
            raise ValueError(f"reference_cache={str(path)!r} holds other {split!r} pairs (data fingerprint "
                             f"{found[:12]}..., this run's {expected[:12]}...): the dataset, split, tokenizer or "
                             "cutoff_len changed; delete it (it is recomputed) or point reference_cache elsewhere")
        if found is not None:
            tables[split] = cache["logps"][split]
    return tables


def save_cache(path: Path, key: Mapping[str, Any], tables: Mapping[str, Tensor]) -> None:
    """Write the tables of the splits ``key["fingerprints"]`` names to ``path`` (a temporary file renamed over it),
    beside the other splits the file holds (:func:`load_cache` has checked that it is for the same model)."""
    cache = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else {}
    fingerprints = {**cache.get("fingerprints", {}), **key["fingerprints"]}
    logps = {**cache.get("logps", {}), **{split: tables[split] for split in key["fingerprints"]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save({"version": CACHE_VERSION, **{field: key[field] for field in _KEY_FIELDS},
                "fingerprints": fingerprints, "logps": logps}, temporary)
    temporary.replace(path)
    log.info("DPO: reference log-probabilities written to %s", path)
