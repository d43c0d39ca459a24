"""Raw rows from local JSON Lines, JSON, Parquet and CSV files; hub names refused offline."""

import json

import pytest

from megatron_lorafusion.config import DataConfig, DatasetConfig
from megatron_lorafusion.data import DataError
from megatron_lorafusion.data.hf import read_first_rows, read_rows

ROWS = [{"prompt": "ab", "response": "c"}, {"prompt": "d", "response": "ef"}]


def _write(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        path.write_text(
            "prompt,response\n" + "".join(f"{r['prompt']},{r['response']}\n" for r in ROWS)
        )
    else:
        pytest.importorskip("pyarrow", reason="datasets' dependency")
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_read_rows_local_formats_agree(tmp_path, suffix):
    path = _write(tmp_path, suffix)
    raw = read_rows(DatasetConfig(path=str(path)), DataConfig(cache_dir=str(tmp_path / "c")))
    assert [dict(r) for r in raw.rows] == ROWS
    assert raw.where[1] in (f"{path}:2", f"{path} row 2")


def test_read_rows_jsonl_skips_and_counts_bad_lines(tmp_path):
    path = _write(tmp_path, ".jsonl")
    with path.open("a") as f:
        f.write("{broken\n\n")
    d = DatasetConfig(path=str(path))
    with pytest.raises(DataError, match=r"rows\.jsonl:3: not valid JSON"):
        read_rows(d, DataConfig())
    raw = read_rows(d, DataConfig(bad_rows="skip"))
    assert (len(raw.rows), raw.skipped) == (2, 1)


def test_read_rows_jsonl_accepts_a_byte_order_mark_on_line_1(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in ROWS).encode())
    raw = read_rows(DatasetConfig(path=str(path)), DataConfig())
    assert [dict(r) for r in raw.rows] == ROWS


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, r"not usable JSON \(nested too deeply\)"),
        (b'{"prompt": "\xff", "response": "x"}', "not valid UTF-8"),
        (b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode(), "not valid JSON"),  # a BOM past line 1
    ],
)
def test_read_rows_jsonl_names_unusable_lines_in_both_modes(tmp_path, line, reason):
    path = _write(tmp_path, ".jsonl")
    with path.open("ab") as f:
        f.write(line + b"\n")
    d = DatasetConfig(path=str(path))
    with pytest.raises(DataError, match=rf"rows\.jsonl:3: {reason}"):
        read_rows(d, DataConfig())
    raw = read_rows(d, DataConfig(bad_rows="skip"))
    assert (len(raw.rows), raw.skipped) == (2, 1), reason


def test_read_rows_offline_refuses_hub_names(tmp_path):
    with pytest.raises(DataError, match="data.offline forbids hub datasets"):
        read_rows(DatasetConfig(path="someone/some-dataset"), DataConfig(offline=True))


def test_read_rows_dataset_folder_by_split(tmp_path):
    """A folder (e.g. a downloaded hub snapshot) goes through the same call as a hub name."""
    (tmp_path / "set").mkdir()
    for split, rows in (("train", ROWS), ("test", ROWS[:1])):
        (tmp_path / "set" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
    d = DatasetConfig(path=str(tmp_path / "set"), split="test")
    raw = read_rows(d, DataConfig(offline=True, cache_dir=str(tmp_path / "c")))
    assert [dict(r) for r in raw.rows] == ROWS[:1]
    assert raw.where == [f"{tmp_path / 'set'}[test] row 1"]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_read_rows_numeric_text_columns_read_as_text(tmp_path, suffix):
    path = tmp_path / f"nums{suffix}"
    if suffix == ".csv":
        path.write_text("question,response,id\n6*7,42,1\n,007,2\n1/2,0.5,3\n")
        expected = [("6*7", "42"), ("", "007"), ("1/2", "0.5")]
    else:
        pytest.importorskip("pyarrow", reason="datasets' dependency")
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.table({"question": [6, 0, 2], "response": [42, 7, 1], "id": [1, 2, 3]}), path
        )
        expected = [("6", "42"), ("0", "7"), ("2", "1")]
    d = DatasetConfig(path=str(path), template="Q: {question}\nA: ")
    raw = read_rows(d, DataConfig(cache_dir=str(tmp_path / "c")))
    assert [(r["question"], r["response"]) for r in raw.rows] == expected, (
        "text fields must come back as the strings written"
    )
    if suffix == ".csv":
        assert [r["id"] for r in raw.rows] == ["1", "2", "3"], "a CSV holds text"
    else:
        assert [r["id"] for r in raw.rows] == [1, 2, 3], "a column no field reads keeps its type"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("c\n", "1 field where the header has 2 (prompt, response): a field is missing"),
        ("c,d,e\n", "3 fields where the header has 2 (prompt, response): an extra field"),
    ],
)
def test_read_rows_csv_record_of_the_wrong_length_is_named_or_skipped(tmp_path, row, problem):
    """Issue 36: a ragged CSV row used to train as an empty response in both modes."""
    path = tmp_path / "rows.csv"
    path.write_text('prompt,response\na,b\n\n"multi\nline",x\n' + row + "f,g\n")
    d = DatasetConfig(path=str(path))
    with pytest.raises(DataError) as info:
        read_rows(d, DataConfig())
    assert str(info.value) == (
        f"{path} row 3 (line 6): {problem}"
        + (" (an unquoted comma?)" if "extra" in problem else "")
        + " (set data.bad_rows: skip to skip such rows)"
    )
    raw = read_rows(d, DataConfig(bad_rows="skip"))
    assert raw.rows == [
        {"prompt": "a", "response": "b"},
        {"prompt": "multi\nline", "response": "x"},
        {"prompt": "f", "response": "g"},
    ]
    assert (raw.where, raw.skipped) == ([f"{path} row 1", f"{path} row 2", f"{path} row 4"], 1)


def test_read_rows_csv_header_problems_are_named(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"rows\.csv:1: the CSV file has no header row"):
        read_rows(DatasetConfig(path=str(path)), DataConfig())
    path.write_text("prompt,response,prompt\na,b,c\n")
    with pytest.raises(DataError, match=r"rows\.csv:1: the CSV header names column 'prompt' twice"):
        read_rows(DatasetConfig(path=str(path)), DataConfig())
    path.write_bytes(b"prompt,response\na,b\nc,\xff\n")
    with pytest.raises(DataError, match=r"rows\.csv:3: not valid UTF-8"):
        read_rows(DatasetConfig(path=str(path)), DataConfig())


def test_read_rows_csv_keeps_a_cell_longer_than_the_csv_module_default(tmp_path):
    path = tmp_path / "long.csv"
    path.write_text("prompt,response\np," + "r" * 200_000 + "\n")
    (row,) = read_rows(DatasetConfig(path=str(path)), DataConfig()).rows
    assert len(row["response"]) == 200_000


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("notes.txt", "has an unknown suffix; set its dataset.format (json, parquet or csv)"),
        ("empty.jsonl", "is empty"),
        ("empty.csv", "is empty"),
        ("pipe.jsonl", "must be a data file or a folder, got a named pipe"),
        ("/dev/null", "must be a data file or a folder, got a character device"),
    ],
)
def test_read_rows_refuses_what_is_not_a_dataset_before_reading(tmp_path, name, problem):
    """A pipe is never opened (it would block); /dev/null and empty files are named."""
    import os

    path = tmp_path / name if not name.startswith("/") else None
    if name == "pipe.jsonl":
        os.mkfifo(path)
    elif path is not None:
        path.write_text("" if name.startswith("empty") else "hello\n")
    d = DatasetConfig(path=str(path or name))
    for read in (read_rows, lambda d, data: read_first_rows(d, data, 10)):
        with pytest.raises(DataError) as info:
            read(d, DataConfig())
        assert problem in str(info.value)
        assert repr(d.path) in str(info.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_read_first_rows_reads_what_read_rows_reads_and_says_if_that_is_all(tmp_path, suffix):
    path = _write(tmp_path, suffix)
    d, data = DatasetConfig(path=str(path)), DataConfig(cache_dir=str(tmp_path / "c"))
    whole = read_rows(d, data)
    first = read_first_rows(d, data, 1)
    assert [dict(r) for r in first.rows] == [dict(r) for r in whole.rows[:1]]
    assert first.where == whole.where[:1]
    assert not first.complete
    assert read_first_rows(d, data, 2).complete
    assert read_first_rows(d, data, 5).rows == [dict(r) for r in whole.rows]


def test_read_first_rows_names_a_json_file_that_is_not_json(tmp_path):
    """Issue 36: a YAML file given as JSON passed validate; train refused it."""
    path = tmp_path / "rows.json"
    path.write_text("\n# a job\nprompt: p\n")
    with pytest.raises(DataError, match=r"rows\.json:2: not JSON .*got '#'"):
        read_first_rows(DatasetConfig(path=str(path)), DataConfig(), 10)
    path.write_text('[{"prompt": "p", "response": "r"},\n {"prompt": }]\n')
    with pytest.raises(DataError, match=r"rows\.json:2: not valid JSON \(Expecting value\)"):
        read_first_rows(DatasetConfig(path=str(path)), DataConfig(), 10)
    path.write_text('{"prompt": ["p", "q"], "response": ["r", "s"]}')  # columns: datasets' call
    assert read_first_rows(DatasetConfig(path=str(path)), DataConfig(), 10) is None
