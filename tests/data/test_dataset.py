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
    probe_adapter_dataset,
    probe_job_datasets,
    training_order,
)
from megatron_lorafusion.planner import Microbatch, Sample


def _adapter(tmp_path, rows, name="a"):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return AdapterConfig(name=name, dataset=DatasetConfig(path=str(path)))


def test_dataset_loss_mask_covers_response_and_eos_only(tmp_path):
    tok = ByteTokenizer()
    (sample,) = load_adapter_dataset(
        _adapter(tmp_path, [{"prompt": "ab", "response": "xyz"}]), DataConfig(), tok
    )
    assert list(sample.input_ids) == [tok.bos_id, 97, 98, 120, 121, 122]
    assert list(sample.labels) == [97, 98, 120, 121, 122, tok.eos_id]
    assert list(sample.loss_mask) == [0, 0, 1, 1, 1, 1], "targets x, y, z and eos are trained"


def test_dataset_train_on_prompt_masks_nothing(tmp_path):
    (sample,) = load_adapter_dataset(
        _adapter(tmp_path, [{"prompt": "ab", "response": "c"}]),
        DataConfig(train_on_prompt=True),
        ByteTokenizer(),
    )
    assert all(sample.loss_mask)


def test_dataset_truncates_long_samples(tmp_path):
    rows = [{"prompt": "p" * 30, "response": "r"}, {"prompt": "p", "response": "r"}]
    samples = load_adapter_dataset(
        _adapter(tmp_path, rows), DataConfig(max_seq_length=10), ByteTokenizer()
    )
    assert [len(s) for s in samples] == [10, 3]


def test_dataset_reject_policy_names_file_and_line(tmp_path):
    rows = [{"prompt": "p", "response": "r"}, {"prompt": "p" * 30, "response": "r"}]
    with pytest.raises(DataError, match=r"a\.jsonl:2: adapter 'a' sample has 32 tokens"):
        load_adapter_dataset(
            _adapter(tmp_path, rows),
            DataConfig(max_seq_length=10, truncation="reject"),
            ByteTokenizer(),
        )


def test_dataset_malformed_json_names_line(tmp_path):
    adapter = _adapter(tmp_path, [{"prompt": "p", "response": "r"}])
    with open(adapter.dataset.path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(DataError, match=r"a\.jsonl:2: not valid JSON"):
        load_adapter_dataset(adapter, DataConfig(), ByteTokenizer())


def test_training_order_is_seeded_and_covers_epochs():
    order = training_order(5, 12, seed=1, adapter_name="a", shuffle=True)
    assert order == training_order(5, 12, seed=1, adapter_name="a", shuffle=True)
    assert sorted(order[:5]) == list(range(5))
    assert sorted(order[5:10]) == list(range(5))
    assert order != training_order(5, 12, seed=1, adapter_name="b", shuffle=True)


def test_pack_microbatch_positions_restart_per_sample(tmp_path):
    tok = ByteTokenizer()
    a = load_adapter_dataset(
        _adapter(tmp_path, [{"prompt": "ab", "response": "c"}], "a"), DataConfig(), tok
    )
    b = load_adapter_dataset(
        _adapter(tmp_path, [{"prompt": "x", "response": "yz"}], "b"), DataConfig(), tok
    )
    # Each sample is [bos] prompt response, 4 tokens.
    mb = Microbatch((Sample(0, 0, 4), Sample(1, 1, 4), Sample(1, 0, 4)), finishes=(1,))
    batch = pack_microbatch(mb, [a, b], [[0], [0, 0]], 2, "cpu", dropout_seed=5)
    assert batch.input_ids.shape == (1, 12)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3] * 3]
    assert batch.layout.seg_offsets.tolist() == [0, 4, 12]
    assert batch.layout.cu_seqlens.tolist() == [0, 4, 8, 12]
    assert batch.loss_mask.dtype == torch.float32


def _trained_text(tok, sample):
    return tok.decode([t for t, m in zip(sample.labels, sample.loss_mask, strict=True) if m])


def test_dataset_alpaca_template_trains_on_response_only(tmp_path):
    rows = [
        {"instruction": "Sort.", "input": "cab", "output": "abc"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]
    adapter = _adapter(tmp_path, rows)
    adapter = AdapterConfig(
        name="a",
        dataset=DatasetConfig(
            path=adapter.dataset.path, template="alpaca", response_field="output"
        ),
    )
    tok = ByteTokenizer()
    with_input, without_input = load_adapter_dataset(adapter, DataConfig(), tok)
    assert _trained_text(tok, with_input) == "abc", "loss covers the response (and eos) only"
    assert with_input.labels[-1] == tok.eos_id
    assert with_input.loss_mask[-1] == 1
    prompt = tok.decode(list(with_input.input_ids))
    assert "### Input:\ncab\n\n### Response:\n" in prompt
    assert "### Input:" not in tok.decode(list(without_input.input_ids)), "empty input: short form"


def test_dataset_chat_messages_train_on_assistant_turns(tmp_path):
    from hf_testing import save_tiny_tokenizer

    from megatron_lorafusion.data import HFTokenizer

    save_tiny_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(tmp_path / "tok")
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n")
    adapter = AdapterConfig(
        name="c", dataset=DatasetConfig(path=str(path), messages_field="messages")
    )
    (sample,) = load_adapter_dataset(adapter, DataConfig(tokenizer=str(tmp_path / "tok")), tok)
    assert _trained_text(tok, sample) == "4<|end|>6<|end|>"
    assert tok.decode(list(sample.input_ids)).startswith("<|system|>be brief<|end|><|user|>")


def test_dataset_malformed_row_named_or_skipped_and_counted(tmp_path, caplog):
    rows = [{"prompt": "p", "response": "r"}, {"prompt": "p"}, {"prompt": "p", "response": 3}]
    adapter = _adapter(tmp_path, rows)
    with pytest.raises(DataError, match=r"a\.jsonl:2: adapter 'a': field 'response' is missing"):
        load_adapter_dataset(adapter, DataConfig(), ByteTokenizer())
    with caplog.at_level("WARNING"):
        samples = load_adapter_dataset(adapter, DataConfig(bad_rows="skip"), ByteTokenizer())
    assert len(samples) == 1
    assert "skipped 2 malformed rows" in caplog.text


def test_dataset_cache_is_reused_and_invalidated(tmp_path, monkeypatch):
    from megatron_lorafusion.data import dataset as dataset_module

    adapter = _adapter(tmp_path, [{"prompt": "ab", "response": "c"}])
    data = DataConfig(cache_dir=str(tmp_path / "cache"))
    first = load_adapter_dataset(adapter, data, ByteTokenizer())
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.pt"))) == 1

    def no_read(*args):
        raise AssertionError("a cached dataset must not be read again")

    with monkeypatch.context() as patch:
        patch.setattr(dataset_module, "read_rows", no_read)
        assert load_adapter_dataset(adapter, data, ByteTokenizer()) == first
    again = load_adapter_dataset(
        adapter, DataConfig(cache_dir=data.cache_dir, train_on_prompt=True), ByteTokenizer()
    )
    assert all(again[0].loss_mask), "another loss policy is another cache entry"
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.pt"))) == 2


def test_dataset_truncation_cuts_the_prompt_from_the_left_and_keeps_the_response(tmp_path):
    rows = [{"prompt": "0123456789" * 3, "response": "abc"}]
    tok = ByteTokenizer()
    (sample,) = load_adapter_dataset(_adapter(tmp_path, rows), DataConfig(max_seq_length=10), tok)
    assert len(sample) == 10
    assert _trained_text(tok, sample) == "abc", "the whole response must stay trained"
    kept = tok.decode(list(sample.input_ids))
    assert kept == "3456789abc", f"the prompt's tail must be kept, got {kept!r}"


def test_dataset_truncation_cuts_an_overlong_response_from_the_right(tmp_path):
    rows = [{"prompt": "q", "response": "0123456789" * 2}]
    (sample,) = load_adapter_dataset(
        _adapter(tmp_path, rows), DataConfig(max_seq_length=8), ByteTokenizer()
    )
    assert len(sample) == 8
    assert all(sample.loss_mask), "only response tokens are left, each trained"


def test_dataset_sample_without_trained_token_is_named_or_skipped(tmp_path, monkeypatch, caplog):
    # A chat whose only assistant token opens the sample: it is an input, never a label.
    from megatron_lorafusion.data import dataset

    real = dataset._row_tokens

    def tokens(row, d, tokenizer):
        return ([65, 66, 67], [1, 0, 0]) if row["prompt"] == "bad" else real(row, d, tokenizer)

    monkeypatch.setattr(dataset, "_row_tokens", tokens)
    rows = [{"prompt": "p", "response": "r"}, {"prompt": "bad", "response": "r"}]
    adapter = _adapter(tmp_path, rows)
    with pytest.raises(
        DataError,
        match=r"a\.jsonl:2: adapter 'a': the sample has no trained "
        r"token within data\.max_seq_length=256",
    ):
        load_adapter_dataset(adapter, DataConfig(), ByteTokenizer())
    samples = load_adapter_dataset(adapter, DataConfig(bad_rows="skip"), ByteTokenizer())
    assert len(samples) == 1
    assert "skipped 1 malformed rows" in caplog.text


def test_dataset_csv_number_response_trains_as_its_text(tmp_path):
    path = tmp_path / "sums.csv"
    path.write_text("prompt,response\n6*7=,42\n")
    tok = ByteTokenizer()
    adapter = AdapterConfig(name="a", dataset=DatasetConfig(path=str(path)))
    (sample,) = load_adapter_dataset(adapter, DataConfig(cache_dir=str(tmp_path / "c")), tok)
    trained = [t for t, m in zip(sample.labels, sample.loss_mask, strict=True) if m]
    assert trained == [*b"42", tok.eos_id], "the response is the string '42', then eos"


@pytest.mark.parametrize(
    ("suffix", "bad"),
    [
        (".jsonl", '{"prompt": "p"}\n'),
        (".csv", "p\n"),
        (".jsonl", '{"prompt": "p", "response": 3}\n'),
    ],
)
def test_probe_raises_what_loading_raises_for_the_first_rows(tmp_path, suffix, bad):
    """validate's cheap read: the same readers and row rules, the same message."""
    path = tmp_path / f"a{suffix}"
    head = "prompt,response\n" if suffix == ".csv" else ""
    good = "p,r\n" if suffix == ".csv" else '{"prompt": "p", "response": "r"}\n'
    path.write_text(head + good * 3 + bad + good)
    adapter = AdapterConfig(name="a", dataset=DatasetConfig(path=str(path)))
    with pytest.raises(DataError) as loaded:
        load_adapter_dataset(adapter, DataConfig())
    with pytest.raises(DataError) as probed:
        probe_adapter_dataset(adapter, DataConfig(), rows=10)
    assert str(probed.value) == str(loaded.value)
    assert "row 4" in str(probed.value) or "a.jsonl:4" in str(probed.value)
    assert probe_adapter_dataset(adapter, DataConfig(), rows=3) == (3, False), "not read: fine"
    assert probe_adapter_dataset(adapter, DataConfig(bad_rows="skip"), rows=10) == (4, True)


def test_probe_leaves_folders_and_hub_names_to_training(tmp_path):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "train.jsonl").write_text('{"prompt": "p"}\n')
    for path in (str(tmp_path / "set"), "someone/some-dataset"):
        adapter = AdapterConfig(name="a", dataset=DatasetConfig(path=path))
        assert probe_adapter_dataset(adapter, DataConfig()) is None, path


def test_probe_job_datasets_names_each_adapter_and_the_plan_size_and_writes_nothing(tmp_path):
    from megatron_lorafusion.config import JobConfig, TrainConfig

    good = _adapter(tmp_path, [{"prompt": "p", "response": "r"}] * 20, "good")
    bad = _adapter(tmp_path, [{"prompt": "p"}], "bad")
    held = AdapterConfig(
        name="held", dataset=good.dataset, eval_dataset=DatasetConfig(str(tmp_path / "no.csv"))
    )
    cfg = JobConfig(
        adapters=[good, bad, held],
        data=DataConfig(cache_dir=str(tmp_path / "cache")),
        train=TrainConfig(epochs=6 * 10**6),
    )
    problems = probe_job_datasets(cfg)
    assert problems == [
        f"{bad.dataset.path}:1: adapter 'bad': field 'response' is missing (set "
        "data.bad_rows: skip to skip such rows)",
        f"dataset file {str(tmp_path / 'no.csv')!r} not found",
        "train.epochs × the rows of adapters.0's dataset must be <= 100000000 samples summed "
        "over the adapters (a run holds every planned sample in host memory, ~1024 bytes "
        "apiece), got 6000000 × 20 rows",
    ]
    assert not (tmp_path / "cache").exists(), "a probe writes nothing"
