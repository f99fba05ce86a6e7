"""Read the rows of a local dataset file (json, jsonl, csv, parquet) into plain Python dicts.

pandas (csv) and pyarrow (parquet) are imported lazily so the json formats work without them.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")

Row = dict[str, Any]


def _import_optional(module: str, pip_name: str, path: Path) -> Any:
    """Import ``module`` or raise an ImportError that says which file needed it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"Reading {path} needs the optional package '{pip_name}', which is not installed: "
            f"run `pip install {pip_name}` or convert the file to json/jsonl."
        ) from err


def _read_json(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON ({err}); a .json dataset holds one list of row objects.") from err
    if not isinstance(data, list):
        raise ValueError(
            f"{path}: expected a JSON list of row objects, found {type(data).__name__}; "
            "use a list `[{...}, {...}]` or one object per line in a .jsonl file."
        )
    return data


def _read_jsonl(path: Path, skipped: list[str] | None = None) -> list[Any]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                if skipped is None:
                    raise ValueError(f"{path}: line {line_number} is not valid JSON ({err}).") from err
                skipped.append(f"{path}, line {line_number}: not valid JSON ({err})")
    return rows


def _read_csv(path: Path) -> list[Any]:
    pandas = _import_optional("pandas", "pandas", path)
    # dtype=str and keep_default_na=False keep every cell a string ("" for empty cells, never NaN).
    frame = pandas.read_csv(path, dtype=str, keep_default_na=False)
    return frame.to_dict(orient="records")


def _read_parquet(path: Path) -> list[Any]:
    parquet = _import_optional("pyarrow.parquet", "pyarrow", path)
    # to_pylist() yields nested lists/dicts as Python objects (pandas would give numpy arrays).
    return parquet.read_table(path).to_pylist()


def decode_json_cell(value: Any) -> Any:
    """Decode a JSON-encoded cell (csv stores nested columns such as messages as strings); other values pass through."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


_READERS = {".json": _read_json, ".jsonl": _read_jsonl, ".csv": _read_csv, ".parquet": _read_parquet}


def dataset_files(path: Path) -> list[Path]:
    """The data files behind ``path``: the file itself, or the supported files of a folder in sorted order.

    Args:
        path: A file with a supported suffix, or a folder holding such files.

    Raises:
        ValueError: If the path is missing, has an unsupported suffix, or is a folder without data files.
    """
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
        if not files:
            raise ValueError(f"{path}: folder holds no {'/'.join(SUPPORTED_SUFFIXES)} files.")
        return files
    if not path.is_file():
        raise ValueError(f"{path}: no such file or folder.")
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        expected = ", ".join(SUPPORTED_SUFFIXES)
        raise ValueError(f"{path}: unsupported suffix '{path.suffix}'; expected one of {expected}.")
    return [path]


def read_rows(file: Path, skipped: list[str] | None = None) -> list[Row]:
    """Read every row of one dataset file (see :func:`dataset_files` to expand folders).

    Args:
        file: A .json (list of objects), .jsonl (one object per line), .csv or .parquet file.
        skipped: If given, rows that are not objects and .jsonl lines that are not JSON are dropped instead of
            raising, with one reason each appended to this list. A file that cannot be parsed at all still raises.

    Returns:
        The rows as dicts, in file order.

    Raises:
        ValueError: If the file cannot be parsed or a row is not an object (the message names file and row).
        ImportError: If a csv/parquet file needs pandas/pyarrow and it is missing.
    """
    file = Path(file)
    if file.is_dir():
        raise ValueError(f"{file}: is a folder; expand it into files with dataset_files() first.")
    dataset_files(file)  # existence and suffix checks
    suffix = file.suffix.lower()
    rows = _read_jsonl(file, skipped) if suffix == ".jsonl" else _READERS[suffix](file)
    kept = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            problem = f"row {index} is a {type(row).__name__}, expected an object with named columns"
            if skipped is None:
                raise ValueError(f"{file}: {problem}.")
            skipped.append(f"{file}, {problem}")
            continue
        kept.append(row)
    return kept
