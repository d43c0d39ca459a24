"""Datasets and tokenizers → packed microbatch tensors (no Megatron)."""

from megatron_lorafusion.data.batch import PackedBatch, pack_microbatch
from megatron_lorafusion.data.dataset import (
    DataError,
    TokenizedSample,
    load_adapter_dataset,
    training_order,
)
from megatron_lorafusion.data.synthetic import TASKS, write_task
from megatron_lorafusion.data.tokenizer import ByteTokenizer

__all__ = [
    "TASKS",
    "ByteTokenizer",
    "DataError",
    "PackedBatch",
    "TokenizedSample",
    "load_adapter_dataset",
    "pack_microbatch",
    "training_order",
    "write_task",
]
