"""Resolve the ``dataset`` argument into :class:`DatasetSpec` s, following LLaMA-Factory's ``dataset_info.json``.

An entry of ``dataset_info.json`` looks like::

    "my_set": {
        "file_name": "my_set.json",          # relative to dataset_dir; a file or a folder of files
        "formatting": "sharegpt",            # "alpaca" (default) or "sharegpt"
        "columns": {"messages": "conversations", "system": "system", "tools": "tools"},
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                 "assistant_tag": "gpt", "system_tag": "system"}
    }

Alpaca columns are ``prompt``/``query``/``response``/``system``/``history`` (defaults ``instruction``/``input``/
``output``/none/none); sharegpt columns are ``messages``/``system``/``tools`` (defaults ``conversations``/none/none).
Optional ``num_samples`` takes that many rows (repeating rows if the dataset is smaller); ``split`` may only be
``"train"``. ``"ranking": true`` marks a preference dataset (LLaMA-Factory's pairwise form): both formats then also
take the ``chosen`` and ``rejected`` columns (defaults ``chosen``/``rejected``; see ``data/preference.py``). Hub
entries (``hf_hub_url``...) are refused: only local files are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_megatrain.data.readers import SUPPORTED_SUFFIXES, dataset_files, decode_json_cell

DATASET_INFO_FILE = "dataset_info.json"

FORMATTINGS = ("alpaca", "sharegpt")
DEFAULT_COLUMNS: dict[str, dict[str, str | None]] = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None},
    "sharegpt": {"messages": "conversations", "system": None, "tools": None},
}
RANKING_COLUMNS: dict[str, str | None] = {"chosen": "chosen", "rejected": "rejected"}  # with "ranking": true
DEFAULT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "system_tag": "system",
    "observation_tag": "observation",
    "function_tag": "function_call",
}
OPENAI_TAGS = {
    **DEFAULT_TAGS,
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "system_tag": "system",
}
_ENTRY_KEYS = {"file_name", "formatting", "columns", "tags", "ranking", "num_samples", "split"}
_HUB_KEYS = {"hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"}


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset lives and how its rows map onto conversations.

    Attributes:
        name: The registry name, or the path string for a dataset given as a file.
        path: The data file, or a folder of data files.
        formatting: ``"alpaca"`` or ``"sharegpt"``; ``None`` until inferred from the first row (ad-hoc files).
        columns: Canonical column role -> column name in the rows (``None``: not present).
        tags: Sharegpt role/content keys and role names (see :data:`DEFAULT_TAGS`).
        num_samples: Rows to take from the dataset (LLaMA-Factory's ``num_samples``; see
            ``sampling.sample_indices``), or ``None`` for all of them.
        ranking: A preference dataset (``"ranking": true``): rows hold a prompt and a ``chosen`` and a ``rejected``
            response (``data/preference.py``), for ``PreferenceDataModule``; ``SFTDataModule`` refuses it.
    """

    name: str
    path: Path
    formatting: str | None
    columns: Mapping[str, str | None] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TAGS))
    num_samples: int | None = None
    ranking: bool = False


def load_dataset_info(dataset_dir: Path) -> dict[str, Any]:
    """Parse ``dataset_dir/dataset_info.json``.

    Raises:
        ValueError: If the file is missing, not JSON, or not an object of entries.
    """
    info_path = Path(dataset_dir) / DATASET_INFO_FILE
    if not info_path.is_file():
        raise ValueError(f"no {DATASET_INFO_FILE} in dataset_dir={str(dataset_dir)!r}")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{info_path} is not valid JSON ({err})") from err
    if not isinstance(info, dict):
        raise ValueError(f"{info_path} must hold a JSON object mapping dataset names to entries")
    return info


def _str_mapping(value: Any, what: str, allowed: Mapping[str, Any], where: str) -> tuple[dict[str, str], list[str]]:
    """Validate a ``columns``/``tags`` object: known keys, string values."""
    if not isinstance(value, dict):
        return {}, [f"{where}: '{what}' must be an object, found {type(value).__name__}"]
    problems = []
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        problems.append(f"{where}: unsupported {what} key(s) {unknown}; allowed: {sorted(allowed)}")
    bad = sorted(k for k, v in value.items() if not isinstance(v, str))
    if bad:
        problems.append(f"{where}: {what} value(s) for {bad} must be strings")
    return {k: v for k, v in value.items() if k in allowed and isinstance(v, str)}, problems


def parse_entry(name: str, entry: Any, dataset_dir: Path) -> tuple[DatasetSpec | None, list[str]]:
    """Turn one ``dataset_info.json`` entry into a spec, collecting every problem instead of stopping at the first.

    Returns:
        ``(spec, [])`` when the entry is usable, else ``(None, problems)``.
    """
    where = f"{Path(dataset_dir) / DATASET_INFO_FILE} entry '{name}'"
    if not isinstance(entry, dict):
        return None, [f"{where}: must be an object, found {type(entry).__name__}"]
    problems = []
    if hub := sorted(_HUB_KEYS & set(entry)):
        problems.append(f"{where}: loads from a hub/script ({hub}), which is not supported; download the data and "
                        "point 'file_name' at the local file")
    if unknown := sorted(set(entry) - _ENTRY_KEYS - _HUB_KEYS):
        problems.append(f"{where}: unsupported key(s) {unknown}; allowed: {sorted(_ENTRY_KEYS)}")
    num_samples = entry.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or isinstance(num_samples, bool)
                                    or num_samples < 1):
        problems.append(f"{where}: num_samples={num_samples!r} must be an int >= 1 (rows to take, repeating rows "
                        "if the dataset is smaller); leave it out to use every row")
    split = entry.get("split", "train")
    if split != "train":
        problems.append(f"{where}: split={split!r}: a local file or folder has only the 'train' split (as in "
                        "LLaMA-Factory, which loads local files as one 'train' split); register the other split's "
                        "file as its own entry, or hold rows out with val_size")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        problems.append(f"{where}: ranking={ranking!r} must be true (a preference dataset) or false")
        ranking = False
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        problems.append(f"{where}: formatting={formatting!r} is not one of {list(FORMATTINGS)}")
        formatting = "alpaca"
    defaults = {**DEFAULT_COLUMNS[formatting], **(RANKING_COLUMNS if ranking else {})}
    columns, column_problems = _str_mapping(
        entry.get("columns", {}), "columns", {**defaults, **RANKING_COLUMNS}, where
    )
    if not ranking and {"chosen", "rejected"} & set(columns):
        column_problems.append(f"{where}: 'chosen'/'rejected' columns are for preference datasets; add "
                               "'ranking': true")
    tags, tag_problems = _str_mapping(entry.get("tags", {}), "tags", DEFAULT_TAGS, where)
    problems += column_problems + tag_problems
    if tags and formatting != "sharegpt":
        problems.append(f"{where}: 'tags' only apply to formatting='sharegpt'")
    file_name = entry.get("file_name")
    path = None
    if not isinstance(file_name, str) or not file_name:
        problems.append(f"{where}: 'file_name' (a local file or folder relative to dataset_dir) is required")
    else:
        path = Path(dataset_dir) / file_name
        try:
            dataset_files(path)
        except ValueError as err:
            problems.append(f"{where}: {err}")
    if problems:
        return None, problems
    return DatasetSpec(name, path, formatting, {**defaults, **columns}, {**DEFAULT_TAGS, **tags}, num_samples,
                       ranking), []


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.lower().endswith(SUPPORTED_SUFFIXES) or Path(name).exists()


def resolve_datasets(dataset: str, dataset_dir: Path) -> tuple[list[DatasetSpec], list[str]]:
    """Resolve ``dataset`` (comma-separated registry names and/or local file paths) into specs.

    A name that is an existing path, contains a path separator or ends with a data suffix is read as a file
    path (formatting inferred from its first row); any other name is looked up in ``dataset_dir``'s
    ``dataset_info.json`` (read only when needed).

    Returns:
        ``(specs, problems)``: every problem found, each naming the argument, the value and the fix.
    """
    names = [part.strip() for part in dataset.split(",")]
    if not all(names):
        return [], [f"dataset={dataset!r}: contains an empty name; use comma-separated names without blanks"]
    specs, problems = [], []
    info: dict[str, Any] | None = None
    for name in names:
        if _looks_like_path(name):
            path = Path(name).expanduser()
            try:
                dataset_files(path)
            except ValueError as err:
                problems.append(f"dataset={name!r}: {err}")
                continue
            specs.append(DatasetSpec(name, path, None))
            continue
        if info is None:
            try:
                info = load_dataset_info(dataset_dir)
            except ValueError as err:
                problems.append(f"dataset={name!r} is not a file path, so it must be registered, but: {err}; "
                                "set dataset_dir to the folder holding dataset_info.json")
                info = {}
                continue
        if name not in info:
            known = ", ".join(sorted(info)) or "none"
            problems.append(f"dataset={name!r}: not registered in {Path(dataset_dir) / DATASET_INFO_FILE} "
                            f"(registered: {known}) and not an existing file; fix the name or pass a file path")
            continue
        spec, entry_problems = parse_entry(name, info[name], dataset_dir)
        problems += entry_problems
        if spec is not None:
            specs.append(spec)
    return specs, problems


def infer_spec(spec: DatasetSpec, first_row: Mapping[str, Any]) -> DatasetSpec:
    """Fill in formatting/columns/tags of an ad-hoc file dataset from the columns of its first row.

    ``messages`` (OpenAI ``role``/``content`` or sharegpt ``from``/``value``) and ``conversations`` give sharegpt;
    ``instruction`` gives alpaca; a lone ``text`` column gives a pretraining (``mode="pt"``) prompt-only dataset.
    With both ``chosen`` and ``rejected`` columns, sharegpt and alpaca rows are a preference dataset (``ranking``).

    Raises:
        ValueError: If no known column layout matches.
    """
    keys = set(first_row)
    ranking = {"chosen", "rejected"} <= keys
    pairwise = RANKING_COLUMNS if ranking else {}

    def optional(column: str) -> str | None:
        return column if column in keys else None

    for messages_column in ("messages", "conversations"):
        if messages_column in keys:
            messages = decode_json_cell(first_row[messages_column])
            openai = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict) \
                and "role" in messages[0]
            columns = {"messages": messages_column, "system": optional("system"), "tools": optional("tools"),
                       **pairwise}
            tags = OPENAI_TAGS if openai else DEFAULT_TAGS
            return DatasetSpec(spec.name, spec.path, "sharegpt", columns, tags, ranking=ranking)
    if "instruction" in keys:
        columns = {"prompt": "instruction", "query": optional("input"), "response": optional("output"),
                   "system": optional("system"), "history": optional("history"), **pairwise}
        return DatasetSpec(spec.name, spec.path, "alpaca", columns, ranking=ranking)
    if "text" in keys:
        columns = {"prompt": "text", "query": None, "response": None, "system": None, "history": None}
        return DatasetSpec(spec.name, spec.path, "alpaca", columns)
    raise ValueError(
        f"{spec.path}: cannot infer the format from columns {sorted(keys)}; expected 'messages', 'conversations', "
        f"'instruction' (+'input'/'output') or 'text'. Register the file in {DATASET_INFO_FILE} with explicit columns."
    )
