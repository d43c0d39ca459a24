"""Tokenised samples, truncation policy, training order and microbatch packing."""

import json

import pytest
import torch

from megatron_lorafusion.config import AdapterConfig, DataConfig, DatasetConfig
from megatron_lorafusion.data import (
    ByteTokenizer,
    DataError,
    load_adapter_dataset,
    pack_microbatch,
    training_order,
)
from megatron_lorafusion.planner import Microbatch, Sample


def _adapter(tmp_path, rows, name="a"):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return AdapterConfig(name=name, dataset=DatasetConfig(path=str(path)))


def test_dataset_loss_mask_covers_response_and_eos_only(tmp_path):
    tok = ByteTokenizer()
    (sample,) = load_adapter_dataset(_adapter(tmp_path, [{"prompt": "ab", "response": "xyz"}]),
                                     DataConfig(), tok)
    assert list(sample.input_ids) == [tok.bos_id, 97, 98, 120, 121, 122]
    assert list(sample.labels) == [97, 98, 120, 121, 122, tok.eos_id]
    assert list(sample.loss_mask) == [0, 0, 1, 1, 1, 1], "targets x, y, z and eos are trained"


def test_dataset_train_on_prompt_masks_nothing(tmp_path):
    (sample,) = load_adapter_dataset(_adapter(tmp_path, [{"prompt": "ab", "response": "c"}]),
                                     DataConfig(train_on_prompt=True), ByteTokenizer())
    assert all(sample.loss_mask)


def test_dataset_truncates_long_samples(tmp_path):
    rows = [{"prompt": "p" * 30, "response": "r"}, {"prompt": "p", "response": "r"}]
    samples = load_adapter_dataset(_adapter(tmp_path, rows), DataConfig(max_seq_length=10),
                                   ByteTokenizer())
    assert [len(s) for s in samples] == [10, 3]


def test_dataset_reject_policy_names_file_and_line(tmp_path):
    rows = [{"prompt": "p", "response": "r"}, {"prompt": "p" * 30, "response": "r"}]
    with pytest.raises(DataError, match=r"a\.jsonl:2: adapter 'a' sample has 32 tokens"):
        load_adapter_dataset(_adapter(tmp_path, rows),
                             DataConfig(max_seq_length=10, truncation="reject"), ByteTokenizer())


def test_dataset_malformed_json_names_line(tmp_path):
    adapter = _adapter(tmp_path, [{"prompt": "p", "response": "r"}])
    with open(adapter.dataset.path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(DataError, match=r"a\.jsonl:2: not valid JSON"):
        load_adapter_dataset(adapter, DataConfig(), ByteTokenizer())


def test_training_order_is_seeded_and_covers_epochs():
    order = training_order(5, 12, seed=1, adapter_id=0, shuffle=True)
    assert order == training_order(5, 12, seed=1, adapter_id=0, shuffle=True)
    assert sorted(order[:5]) == list(range(5))
    assert sorted(order[5:10]) == list(range(5))
    assert order != training_order(5, 12, seed=1, adapter_id=1, shuffle=True)


def test_pack_microbatch_positions_restart_per_sample(tmp_path):
    tok = ByteTokenizer()
    a = load_adapter_dataset(_adapter(tmp_path, [{"prompt": "ab", "response": "c"}], "a"),
                             DataConfig(), tok)
    b = load_adapter_dataset(_adapter(tmp_path, [{"prompt": "x", "response": "yz"}], "b"),
                             DataConfig(), tok)
    # Each sample is [bos] prompt response, 4 tokens.
    mb = Microbatch((Sample(0, 0, 4), Sample(1, 1, 4), Sample(1, 0, 4)), finishes=(1,))
    batch = pack_microbatch(mb, [a, b], [[0], [0, 0]], 2, "cpu", dropout_seed=5)
    assert batch.input_ids.shape == (1, 12)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3] * 3]
    assert batch.layout.seg_offsets.tolist() == [0, 4, 12]
    assert batch.layout.cu_seqlens.tolist() == [0, 4, 8, 12]
    assert batch.loss_mask.dtype == torch.float32
