"""Per-adapter checkpoint files: the state file commits, damage is detected, rotation keeps the
newest and the best, TP shards merge, per-projection B is stored without its zero blocks."""

import json
from dataclasses import dataclass

import pytest
import torch

from megatron_lorafusion.train.checkpoint import (
    TABLES,
    AdapterCheckpoints,
    CheckpointError,
    Shard,
    _header,
    full_adapter_tensors,
    row_packing,
    rows_to_tensors,
    table_tensors,
)


@dataclass(frozen=True)
class _Slot:
    """Stands in for `mcore.context.SlotView` (the same fields and `view`)."""

    name: str
    start: int
    rows: int
    cols: int
    kind: str
    rank: int
    live: torch.Tensor | None = None

    def view(self, row):
        slot = row[self.start : self.start + self.rows * self.cols].view(self.rows, self.cols)
        return slot[: self.rank] if self.kind == "lora_A" else slot[:, : self.rank]


# A (rank 2 of a slot of 3 rows x 4 columns), then a per-projection B (5 x 2) whose entries
# off its blocks are zero: rows 0-2 use rank column 0, rows 3-4 column 1.
_LIVE = torch.tensor([[1, 0], [1, 0], [1, 0], [0, 1], [0, 1]], dtype=torch.bool)
_SLOTS = [
    _Slot("decoder.layers.0.mlp.linear_fc2.lora_A", 0, 3, 4, "lora_A", 2),
    _Slot("decoder.layers.0.mlp.linear_fc2.lora_B", 12, 5, 2, "lora_B", 2, _LIVE),
]
_WIDTH = 22
_PACKING = row_packing(_SLOTS, _WIDTH)


def _rows(seed: int = 0) -> torch.Tensor:
    rows = torch.randn(len(TABLES), _WIDTH, generator=torch.Generator().manual_seed(seed))
    b = rows[:, 12:22].view(3, 5, 2)
    b.masked_fill_(~_LIVE, 0.0)  # off-block entries are exactly zero in training
    return rows


def _state(step: int) -> dict:
    return {"job": {"step": step}, "identity": {"name": "a"}, "sharding": {}}


def _tensors(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return rows_to_tensors(rows.index_select(1, _PACKING.columns), _PACKING)


def _save(store: AdapterCheckpoints, step: int, seed: int = 0) -> torch.Tensor:
    rows = _rows(seed)
    store.save(step, _tensors(rows), _state(step))
    return rows


def test_checkpoint_round_trip_stores_b_without_zero_blocks(tmp_path):
    store = AdapterCheckpoints(tmp_path / "a", "a", Shard())
    rows = _save(store, 3)
    tensors = _tensors(rows)
    assert _PACKING.width == 2 * 4 + int(_LIVE.sum()), "A's rank rows, B's live entries"
    b_name = f"weight/{_SLOTS[1].name}"
    assert tensors[b_name].shape == (int(_LIVE.sum()),), "B must be stored as its live entries"
    loaded, state = store.load(3)
    assert state["job"] == {"step": 3}
    assert state["adapter"] == "a"
    for table, row in zip(TABLES, rows, strict=True):
        got = table_tensors(loaded, table)
        for slot in _SLOTS:
            torch.testing.assert_close(
                got[slot.name], slot.view(row), atol=0, rtol=0, msg=f"{table} {slot.name}"
            )


def test_packed_rows_are_written_as_two_chunks():
    """A save's fp32 values are one buffer and its live masks another: two writes."""
    _, chunks = _header(_tensors(_rows()))
    assert [len(c) for c in chunks] == [4 * 3 * _PACKING.width, _LIVE.numel()]


def test_checkpoint_without_its_state_file_is_never_listed(tmp_path):
    store = AdapterCheckpoints(tmp_path / "a", "a", Shard())
    _save(store, 2)
    (store.step_folder(2) / "shard_tp0_pp0.json").unlink()  # killed before the commit
    (store.step_folder(2) / ".shard_tp0_pp0.json.tmp").write_text("{")  # mid-write
    _save(store, 3)
    (store.step_folder(3) / ".shard_tp0_pp1.safetensors.tmp").write_bytes(b"x")  # not ours
    assert store.steps() == [3]
    store.clean_leftovers()
    assert not store.step_folder(2).exists(), "an uncommitted save is removed"
    assert store.steps() == [3], "a complete checkpoint is kept"
    assert (store.step_folder(3) / ".shard_tp0_pp1.safetensors.tmp").exists(), (
        "another shard's files are its writer's"
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_checkpoint_damage_is_named(tmp_path, damage):
    store = AdapterCheckpoints(tmp_path / "a", "a", Shard())
    _save(store, 4)
    path = store.step_folder(4) / "shard_tp0_pp0.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    with pytest.raises(CheckpointError, match="shard_tp0_pp0.safetensors"):
        store.load(4)


def test_checkpoint_of_another_adapter_or_layout_is_refused(tmp_path):
    _save(AdapterCheckpoints(tmp_path / "a", "b", Shard()), 1)  # b's files in a's folder
    with pytest.raises(CheckpointError, match="belongs to adapter 'b', not 'a'"):
        AdapterCheckpoints(tmp_path / "a", "a", Shard()).read_state(1)
    _save(AdapterCheckpoints(tmp_path / "c", "c", Shard()), 1)
    with pytest.raises(CheckpointError, match="TP × PP layout"):
        AdapterCheckpoints(tmp_path / "c", "c", Shard(0, 2, 0, 1)).read_state(1)


def test_checkpoint_with_non_finite_values_is_refused(tmp_path):
    store = AdapterCheckpoints(tmp_path / "a", "a", Shard())
    rows = _rows()
    rows[1, 0] = float("nan")  # an exp_avg entry
    store.save(5, _tensors(rows), _state(5))
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        store.load(5)


def test_checkpoint_rotation_keeps_the_newest_and_the_best(tmp_path):
    store = AdapterCheckpoints(tmp_path / "a", "a", Shard(), keep_last=2)
    for step in (1, 2, 3, 4, 5):
        _save(store, step)
        store.rotate(keep=(2,))
    assert store.steps() == [5, 4, 2], store.steps()
    assert not store.step_folder(1).exists(), "a rotated step's folder is removed"


def test_checkpoint_rotation_waits_for_every_shard(tmp_path):
    """A shard deletes its old files only once a newer checkpoint is complete everywhere."""
    tp0 = AdapterCheckpoints(tmp_path / "a", "a", Shard(0, 2, 0, 1), keep_last=1)
    tp1 = AdapterCheckpoints(tmp_path / "a", "a", Shard(1, 2, 0, 1), keep_last=1)
    for store in (tp0, tp1):
        _save(store, 1)
    _save(tp0, 2)  # tp1 has not written step 2 yet
    tp0.rotate()
    assert tp0.steps() == [2, 1], "step 1 is the only complete checkpoint: it must stay"
    _save(tp1, 2)
    tp0.rotate()
    tp1.rotate()
    assert tp0.steps() == tp1.steps() == [2]


def test_checkpoint_tp2_shards_merge_to_full_tensors(tmp_path):
    """Column-parallel B split on dim 0, row-parallel A on dim 1, as `LoRAContext.sharding`."""
    full_a, full_b = torch.randn(2, 8), torch.randn(6, 2)
    sharding = {"l.lora_A": [1, 1], "l.lora_B": [0, 1]}
    for t in range(2):
        store = AdapterCheckpoints(tmp_path / "a", "a", Shard(t, 2, 0, 1))
        tensors = {}
        for table in TABLES:
            tensors[f"{table}/l.lora_A"] = full_a[:, 4 * t : 4 * t + 4].contiguous()
            tensors[f"{table}/l.lora_B"] = full_b[3 * t : 3 * t + 3].contiguous()
        store.save(7, tensors, {**_state(7), "sharding": sharding})
    merged = full_adapter_tensors(tmp_path / "a" / "step_00000007", "a")
    torch.testing.assert_close(merged["l.lora_A"], full_a, atol=0, rtol=0, msg="A unsharded")
    torch.testing.assert_close(merged["l.lora_B"], full_b, atol=0, rtol=0, msg="B unsharded")


def test_checkpoint_done_marker_round_trip(tmp_path):
    store = AdapterCheckpoints(tmp_path / "a", "a", Shard())
    assert store.read_done() is None
    store.write_done({"job": {"status": "done"}})
    assert store.read_done()["job"] == {"status": "done"}
    (tmp_path / "a" / "done.json").write_text(json.dumps({"adapter": "zz"}))
    with pytest.raises(CheckpointError, match="belongs to adapter 'zz'"):
        store.read_done()
