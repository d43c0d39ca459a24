"""Raw rows of one adapter's dataset: local JSON/JSONL/Parquet/CSV files, dataset folders, hub.

The only module that calls ``datasets.load_dataset`` (JSON arrays, Parquet, CSV, dataset
folders such as downloaded hub snapshots, hub names).
JSON Lines files are read line by line here instead: a malformed line is then reported with
its line number (or skipped and counted), and rows whose field types differ, which Arrow's
schema inference would refuse as a whole, reach the per-row checks.
"""

from __future__ import annotations

import csv
import json
import logging
import string
from dataclasses import dataclass
from pathlib import Path

from megatron_lorafusion.config import DataConfig, DatasetConfig
from megatron_lorafusion.data._errors import DataError
from megatron_lorafusion.data.templates import PROMPT_TEMPLATES

__all__ = ["RawRows", "dataset_identity", "read_rows"]

logger = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class RawRows:
    """Rows as read, before any field mapping.

    Attributes:
        rows: one mapping per row (a JSON value for JSON Lines, which may not be an object).
        where: per row, its location for messages (``file:line`` or ``file row N``).
        skipped: unreadable lines skipped under ``data.bad_rows: skip``.
    """

    rows: list
    where: list[str]
    skipped: int = 0


def _builder(d: DatasetConfig) -> str:
    if d.format != "auto":
        return d.format
    return _BUILDERS.get(Path(d.path).suffix, "")


def dataset_identity(d: DatasetConfig) -> str:
    """What the rows depend on: local files' resolved paths, sizes and mtimes, or hub name."""
    path = Path(d.path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if path.exists():
        return (
            "|".join(f"file:{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
            + f"|split:{d.split}"
        )
    return f"hub:{d.path}:{d.split}"


def _parse_jsonl_line(raw: bytes, first: bool) -> object:
    """One JSON Lines row from its bytes (a UTF-8 byte-order mark allowed on line 1).

    Raises:
        ValueError: naming why the line is unusable: not UTF-8, not JSON, or nested too
            deeply for the parser.
    """
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid UTF-8 ({err.reason} at byte {err.start})") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg})") from err
    except RecursionError as err:
        raise ValueError("not usable JSON (nested too deeply)") from err


def _read_jsonl(path: Path, data: DataConfig) -> RawRows:
    rows, where, skipped = [], [], 0
    with path.open("rb") as f:  # decoded line by line, so a bad byte names its line
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rows.append(_parse_jsonl_line(raw, first=line_no == 1))
            except ValueError as err:
                if data.bad_rows == "error":
                    raise DataError(f"{path}:{line_no}: {err}") from err
                skipped += 1
                continue
            where.append(f"{path}:{line_no}")
    return RawRows(rows, where, skipped)


def _csv_as_text(path: Path) -> dict:
    """``datasets``' CSV options that keep every cell as written, since a CSV holds text.

    ``42`` stays ``"42"``, ``007`` keeps its zeros, an empty cell is ``""``.
    """
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), [])
    return {"converters": dict.fromkeys(header, str), "keep_default_na": False}


def _text_fields(d: DatasetConfig) -> set[str]:
    """The row keys ``d`` reads as text: prompt and response, or a template's placeholders."""
    fields = {d.response_field}
    if d.template is None:
        fields.add(d.prompt_field)
    for template in PROMPT_TEMPLATES.get(d.template, (d.template,)) if d.template else ():
        try:
            fields.update(name for _, name, _, _ in string.Formatter().parse(template) if name)
        except ValueError:  # a broken template: validation names it
            pass
    return fields


def _numbers_as_text(table, d: DatasetConfig):
    """``table`` with its numeric text-field columns (a typed Parquet file's) cast to strings."""
    import datasets

    for name in sorted(_text_fields(d) & set(table.column_names)):
        feature = table.features[name]
        if isinstance(feature, datasets.Value) and feature.dtype.startswith(
            ("int", "uint", "float", "decimal")
        ):
            table = table.cast_column(name, datasets.Value("string"))
    return table


def read_rows(d: DatasetConfig, data: DataConfig) -> RawRows:
    """Every row of dataset ``d``.

    Args:
        d: the adapter's dataset (path, format, split).
        data: ``bad_rows``, ``cache_dir`` (``datasets``' cache) and ``offline``.

    Raises:
        DataError: for a missing file, a file ``datasets`` cannot read, a hub dataset while
            offline, or (``bad_rows: error``) a JSON Lines line that is not JSON.
    """
    path = Path(d.path)
    builder = _builder(d)
    if not path.exists() and (builder or data.offline):
        raise DataError(
            f"dataset file {d.path!r} not found"
            + (" (data.offline forbids hub datasets)" if data.offline else "")
        )
    if path.is_file() and not builder:
        raise DataError(
            f"dataset file {d.path!r} has an unknown suffix; set its dataset.format "
            f"(json, parquet or csv)"
        )
    if path.is_file() and path.suffix == ".jsonl" and builder == "json":
        return _read_jsonl(path, data)
    import datasets

    cache = None if data.cache_dir is None else str(Path(data.cache_dir) / "datasets")
    try:
        if path.is_file():
            table = datasets.load_dataset(
                builder,
                data_files=str(path),
                split="train",
                cache_dir=cache,
                **(_csv_as_text(path) if builder == "csv" else {}),
            )
            table = _numbers_as_text(table, d)
            label = str(path)
        else:
            table = datasets.load_dataset(d.path, split=d.split, cache_dir=cache)
            label = f"{d.path}[{d.split}]"  # a dataset folder or a hub name
    except Exception as err:  # datasets/pyarrow raise many types for an unreadable source
        raise DataError(f"dataset {d.path!r} cannot be read by datasets: {err}") from err
    rows = list(table)
    return RawRows(rows, [f"{label} row {i + 1}" for i in range(len(rows))])
