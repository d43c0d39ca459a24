"""Raw rows of one adapter's dataset: local JSON/JSONL/Parquet/CSV files, dataset folders, hub.

The only module that calls ``datasets.load_dataset`` (JSON arrays, Parquet, dataset folders
such as downloaded hub snapshots, hub names).
JSON Lines and CSV files are read record by record here instead: a malformed line (not JSON,
or a CSV record with more or fewer fields than its header) is then reported with its line
number (or skipped and counted), and rows whose field types differ, which Arrow's schema
inference would refuse as a whole, reach the per-row checks. `read_first_rows` reads only
the first rows of a local file, through the same readers, for ``lorafusion validate``.
"""

from __future__ import annotations

import csv
import json
import logging
import stat
import string
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_lorafusion.config import DataConfig, DatasetConfig
from megatron_lorafusion.data._errors import DataError
from megatron_lorafusion.data.templates import PROMPT_TEMPLATES

__all__ = ["RawRows", "dataset_identity", "read_first_rows", "read_rows"]

logger = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class RawRows:
    """Rows as read, before any field mapping.

    Attributes:
        rows: one mapping per row (a JSON value for JSON Lines, which may not be an object).
        where: per row, its location for messages (``file:line`` or ``file row N``).
        skipped: unreadable lines (or ragged CSV records) skipped under ``data.bad_rows: skip``.
        complete: see below.
    """

    rows: list
    where: list[str]
    skipped: int = 0
    complete: bool = True
    """Whether ``rows`` are all the rows (False: `read_first_rows` stopped early)."""


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


def _read_jsonl(path: Path, data: DataConfig, limit: int | None = None) -> RawRows:
    rows, where, skipped = [], [], 0
    with path.open("rb") as f:  # decoded line by line, so a bad byte names its line
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if limit is not None and len(rows) + skipped == limit:
                return RawRows(rows, where, skipped, complete=False)
            try:
                rows.append(_parse_jsonl_line(raw, first=line_no == 1))
            except ValueError as err:
                if data.bad_rows == "error":
                    raise DataError(f"{path}:{line_no}: {err}") from err
                skipped += 1
                continue
            where.append(f"{path}:{line_no}")
    return RawRows(rows, where, skipped)


_CSV_FIELD_CHARS = min(sys.maxsize, 2**31 - 1)
"""Longest CSV cell read, in characters: the csv module's 131,072 would refuse a long sample."""


def _read_csv(path: Path, data: DataConfig, limit: int | None = None) -> RawRows:
    """Rows of a CSV file, keyed by its header, every cell as written (a CSV holds text).

    ``42`` stays ``"42"``, ``007`` keeps its zeros, an empty cell is ``""``; blank lines are
    skipped. A record with more or fewer fields than the header is a malformed row: an error
    naming file, row and line, or (``data.bad_rows: skip``) skipped and counted.
    """
    rows, where, skipped = [], [], 0
    previous = csv.field_size_limit(_CSV_FIELD_CHARS)
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            try:
                header = next(reader, [])
                if not header:
                    raise DataError(f"{path}:1: the CSV file has no header row")
                if len(set(header)) < len(header):
                    twice = next(h for h in header if header.count(h) > 1)
                    raise DataError(f"{path}:1: the CSV header names column {twice!r} twice")
                for record in reader:
                    if not record:  # a blank line
                        continue
                    if limit is not None and len(rows) + skipped == limit:
                        return RawRows(rows, where, skipped, complete=False)
                    number = len(rows) + skipped + 1
                    if len(record) != len(header):
                        problem = _ragged(record, header, f"{path} row {number}", reader.line_num)
                        if data.bad_rows == "error":
                            raise DataError(
                                f"{problem} (set data.bad_rows: skip to skip such rows)"
                            )
                        skipped += 1
                        continue
                    rows.append(dict(zip(header, record, strict=True)))
                    where.append(f"{path} row {number}")
            except UnicodeDecodeError:  # decoded a block ahead: find the line in the bytes
                raw = path.read_bytes()
                try:
                    raw.decode("utf-8-sig")
                except UnicodeDecodeError as err:
                    line = raw[: err.start].count(b"\n") + 1
                    raise DataError(f"{path}:{line}: not valid UTF-8 ({err.reason})") from None
                raise
            except csv.Error as err:
                raise DataError(f"{path}:{reader.line_num}: not valid CSV ({err})") from None
    finally:
        csv.field_size_limit(previous)
    return RawRows(rows, where, skipped)


def _ragged(record: list[str], header: list[str], where: str, line: int) -> str:
    """Why a CSV record of the wrong length is malformed, naming row, line and header."""
    fields = f"{len(record)} field{'s' if len(record) != 1 else ''}"
    why = (
        "a field is missing" if len(record) < len(header) else "an extra field (an unquoted comma?)"
    )
    return (
        f"{where} (line {line}): {fields} where the header has {len(header)} "
        f"({', '.join(header)}): {why}"
    )


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


def _kind(path: Path) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a folder, else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _source(d: DatasetConfig, data: DataConfig) -> tuple[Path, str]:
    """The dataset's path and ``datasets`` builder, once the checks of every read pass.

    Raises:
        DataError: for a missing file, a device, pipe or socket (never opened: a pipe would
            block), an unknown suffix, or an empty file.
    """
    path = Path(d.path)
    builder = _builder(d)
    if not path.exists() and (builder or data.offline):
        raise DataError(
            f"dataset file {d.path!r} not found"
            + (" (data.offline forbids hub datasets)" if data.offline else "")
        )
    if (kind := _kind(path)) is not None:
        raise DataError(f"dataset {d.path!r} must be a data file or a folder, got {kind}")
    if path.is_file() and not builder:
        raise DataError(
            f"dataset file {d.path!r} has an unknown suffix; set its dataset.format "
            f"(json, parquet or csv)"
        )
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"dataset file {d.path!r} is empty")
    return path, builder


def read_rows(d: DatasetConfig, data: DataConfig) -> RawRows:
    """Every row of dataset ``d``.

    Args:
        d: the adapter's dataset (path, format, split).
        data: ``bad_rows``, ``cache_dir`` (``datasets``' cache) and ``offline``.

    Raises:
        DataError: for a missing, empty or special file (a device, a pipe), a file
            ``datasets`` cannot read, a hub dataset while offline, or (``bad_rows: error``) a
            JSON Lines line that is not JSON or a CSV record whose fields do not match its
            header.
    """
    path, builder = _source(d, data)
    if path.is_file() and path.suffix == ".jsonl" and builder == "json":
        return _read_jsonl(path, data)
    if path.is_file() and builder == "csv":
        return _read_csv(path, data)
    if path.is_file() and builder == "json":
        _json_head(path, 1 << 16)  # YAML or text under a .json name: named, not Arrow's error
    import datasets

    cache = None if data.cache_dir is None else str(Path(data.cache_dir) / "datasets")
    try:
        if path.is_file():
            table = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache
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


_PROBE_JSON_BYTES = 4 << 20
"""A .json file up to this size is parsed whole by `read_first_rows`; past it only its first
character is checked."""


def read_first_rows(d: DatasetConfig, data: DataConfig, limit: int) -> RawRows | None:
    """The first ``limit`` rows of a local data file, read cheaply, as `read_rows` reads them.

    JSON Lines and CSV go through `read_rows`' own readers (the same errors, the same row
    names); a Parquet file gives its first rows (and its row count); a .json file is parsed
    whole up to 4 MiB, and past that only checked to start like JSON. Text fields that hold
    numbers come back as text, as `read_rows` returns them.

    Args:
        d: the adapter's dataset.
        data: ``bad_rows`` and ``offline``.
        limit: rows to read at most (skipped malformed rows count).

    Returns:
        The rows read (``complete`` when they are all the file's), or None when the source
        is not checked this way (a dataset folder, a hub name, a .json file over 4 MiB or
        holding one object).

    Raises:
        DataError: as `read_rows` would for the part of the file read.
    """
    path, builder = _source(d, data)
    if not path.is_file():
        return None
    if path.suffix == ".jsonl" and builder == "json":
        return _read_jsonl(path, data, limit)
    if builder == "csv":
        return _read_csv(path, data, limit)
    raw = (
        _first_parquet_rows(path, limit)
        if builder == "parquet"
        else _first_json_rows(path, data, limit)
    )
    if raw is None:
        return None
    fields = _text_fields(d)
    for row in raw.rows:
        for name in fields & row.keys() if isinstance(row, dict) else ():
            if isinstance(row[name], int | float) and not isinstance(row[name], bool):
                row[name] = str(row[name])
    return raw


def _first_parquet_rows(path: Path, limit: int) -> RawRows | None:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # datasets brings pyarrow; without it train reports the problem
        return None
    try:
        table = pq.ParquetFile(path)
        batch = next(table.iter_batches(batch_size=limit), None)
        total = table.metadata.num_rows
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"dataset {str(path)!r} cannot be read as Parquet: {err}") from err
    rows = [] if batch is None else batch.to_pylist()
    where = [f"{path} row {i + 1}" for i in range(len(rows))]
    return RawRows(rows, where, complete=len(rows) == total)


def _json_head(path: Path, size: int) -> tuple[bytes, str]:
    """The first ``size`` bytes of a .json file and its first character past white space.

    Raises:
        DataError: when that character cannot start a JSON dataset (a YAML or text file
            named .json), naming its line.
    """
    with path.open("rb") as f:
        head = f.read(size)
    text = head.decode("utf-8-sig", errors="replace")
    body = text.lstrip()
    if not body or body[0] not in "[{":
        line = text[: len(text) - len(body)].count("\n") + 1
        got = f"{body[0]!r}" if body else "only white space"
        raise DataError(
            f"{path}:{line}: not JSON (a JSON dataset starts with '[' or '{{'), got {got}"
        )
    return head, body[0]


def _first_json_rows(path: Path, data: DataConfig, limit: int) -> RawRows | None:
    """A .json file's first rows: a JSON array of rows, or JSON Lines under a .json name."""
    head, first = _json_head(path, _PROBE_JSON_BYTES + 1)
    if len(head) > _PROBE_JSON_BYTES:
        return None
    try:
        value = json.loads(head.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        line = head[: err.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({err.reason})") from None
    except RecursionError:
        raise DataError(f"{path}: not usable JSON (nested too deeply)") from None
    except json.JSONDecodeError as err:
        if first == "[":
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        value = None  # JSON Lines, one object a line
    if isinstance(value, dict):  # one object (columns, or a single row): datasets decides
        return None
    if isinstance(value, list):
        rows = value[:limit]
        where = [f"{path} row {i + 1}" for i in range(len(rows))]
        keys = {k for row in rows if isinstance(row, dict) for k in row}
        rows = [{k: row.get(k) for k in keys} if isinstance(row, dict) else row for row in rows]
        return RawRows(rows, where, complete=len(value) <= limit)  # Arrow fills missing keys
    return _read_jsonl(path, data, limit)
