"""Raw rows from local JSON Lines, JSON, Parquet and CSV files; hub names refused offline."""

import json

import pytest

from megatron_lorafusion.config import DataConfig, DatasetConfig
from megatron_lorafusion.data import DataError
from megatron_lorafusion.data.hf import read_rows

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
