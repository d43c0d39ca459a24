"""Pack one planned microbatch into model inputs: tokens ``[1, T]`` plus its `AdapterLayout`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_lorafusion.data.dataset import TokenizedSample
from megatron_lorafusion.ops import AdapterLayout
from megatron_lorafusion.planner import Microbatch


@dataclass(frozen=True)
class PackedBatch:
    """Tensors of one packed microbatch of ``T`` tokens, samples adapter-major.

    Attributes:
        input_ids: [1, T] int64 token ids.
        position_ids: [1, T] int64, restarting at 0 in every sample.
        labels: [1, T] int64 next-token targets.
        loss_mask: [1, T] float32, 1 where the target is trained on.
        layout: adapter grouping and sample boundaries, shared by all LoRA layers.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    layout: AdapterLayout


def pack_microbatch(
    microbatch: Microbatch,
    samples: Sequence[Sequence[TokenizedSample]],
    orders: Sequence[Sequence[int]],
    num_adapters: int,
    device: torch.device | str,
    dropout_seed: int,
) -> PackedBatch:
    """Gather the planned samples and concatenate them.

    Args:
        microbatch: planned samples (``Sample.index`` is a position in the training order).
        samples: per adapter, its tokenised dataset.
        orders: per adapter, dataset row of each training-order position.
        num_adapters: ``A``.
        device: the model's device.
        dropout_seed: seed of this microbatch's LoRA dropout masks.

    Raises:
        ValueError: for an idle (empty) microbatch, which has nothing to pack.
    """
    if not microbatch.samples:
        raise ValueError("an idle microbatch has no tokens to pack")
    rows = [samples[s.adapter][orders[s.adapter][s.index]] for s in microbatch.samples]
    ids = [t for r in rows for t in r.input_ids]
    positions = [p for r in rows for p in range(len(r))]
    labels = [t for r in rows for t in r.labels]
    mask = [m for r in rows for m in r.loss_mask]
    layout = AdapterLayout.from_samples(
        [s.adapter for s in microbatch.samples], [len(r) for r in rows], num_adapters,
        device=device, dropout_seed=dropout_seed,
    )

    def as_row(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(0)  # (1, T)

    return PackedBatch(as_row(ids, torch.int64), as_row(positions, torch.int64),
                       as_row(labels, torch.int64), as_row(mask, torch.float32), layout)
