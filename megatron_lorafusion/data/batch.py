"""Pack one planned microbatch into model inputs: tokens ``[1, T]`` plus its `AdapterLayout`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_lorafusion.data.dataset import TokenizedSample
from megatron_lorafusion.ops import AdapterLayout, copy_to_device
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
    pad_to_multiple: int = 1,
    sample_key: Callable[[int, int], int] | None = None,
) -> PackedBatch:
    """Gather the planned samples and concatenate them.

    With ``pad_to_multiple > 1`` (the TP size under sequence parallelism, which splits the
    ``T`` tokens evenly over TP ranks) a padding sample of fewer than ``pad_to_multiple``
    tokens is appended to the last adapter's segment: its own sequence in ``cu_seqlens`` (no
    other token attends to it), token id 0 and loss mask 0, so it changes no loss and no
    gradient (its rows' output gradients are zero). Loss denominators never count it.

    Args:
        microbatch: planned samples (``Sample.index`` is a position in the training order).
        samples: per adapter, its tokenised dataset.
        orders: per adapter, dataset row of each training-order position.
        num_adapters: ``A``.
        device: the model's device.
        dropout_seed: seed of the LoRA dropout masks (layers mix in their own id).
        pad_to_multiple: make ``T`` a multiple of this many tokens (see above).
        sample_key: ``(adapter, index) -> key`` of each sample's dropout mask (a job keys a
            sample by its adapter's name and training position: `train.job.sample_key`);
            None: rows are keyed by their place in the microbatch.

    Raises:
        ValueError: for an idle (empty) microbatch, which has nothing to pack, or a
            ``pad_to_multiple`` below 1.
    """
    if not microbatch.samples:
        raise ValueError("an idle microbatch has no tokens to pack")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    rows = [samples[s.adapter][orders[s.adapter][s.index]] for s in microbatch.samples]
    ids = [t for r in rows for t in r.input_ids]
    positions = [p for r in rows for p in range(len(r))]
    labels = [t for r in rows for t in r.labels]
    mask = [m for r in rows for m in r.loss_mask]
    adapters = [s.adapter for s in microbatch.samples]
    lengths = [len(r) for r in rows]
    keys = (
        None if sample_key is None else [sample_key(s.adapter, s.index) for s in microbatch.samples]
    )
    pad = -len(ids) % pad_to_multiple
    if pad:  # a loss-free sample of the last adapter (adapter-major order holds)
        ids += [0] * pad
        positions += list(range(pad))
        labels += [0] * pad
        mask += [0] * pad
        adapters.append(adapters[-1])
        lengths.append(pad)
        if keys is not None:
            keys.append(0)  # loss-free padding: its gradient is zero whatever its mask
    layout = AdapterLayout.from_samples(
        adapters,
        lengths,
        num_adapters,
        device=device,
        dropout_seed=dropout_seed,
        sample_keys=keys,
    )

    def as_row(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return copy_to_device(torch.tensor(values, dtype=dtype), device).unsqueeze(0)  # (1, T)

    return PackedBatch(
        as_row(ids, torch.int64),
        as_row(positions, torch.int64),
        as_row(labels, torch.int64),
        as_row(mask, torch.float32),
        layout,
    )
