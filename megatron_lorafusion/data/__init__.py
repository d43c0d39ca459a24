"""Datasets and tokenizers → packed microbatch tensors (no Megatron)."""

from megatron_lorafusion.data.batch import PackedBatch, pack_microbatch
from megatron_lorafusion.data.dataset import (
    DataError,
    TokenizedSample,
    load_adapter_dataset,
    probe_adapter_dataset,
    probe_job_datasets,
    training_order,
)
from megatron_lorafusion.data.synthetic import TASKS, write_lengths, write_task
from megatron_lorafusion.data.templates import PROMPT_TEMPLATES
from megatron_lorafusion.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "PROMPT_TEMPLATES",
    "TASKS",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "PackedBatch",
    "TokenizedSample",
    "load_adapter_dataset",
    "load_tokenizer",
    "pack_microbatch",
    "probe_adapter_dataset",
    "probe_job_datasets",
    "training_order",
    "write_lengths",
    "write_task",
]
