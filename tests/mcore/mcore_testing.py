"""Helpers of the mcore tests: a tiny model config, a few adapters, packed microbatches."""

from dataclasses import dataclass

import torch
from model_testing import MCORE_MODEL as TINY

from megatron_lorafusion.config import AdapterConfig

# Mixed ranks, scales and targets; adapter 1 skips linear_proj and linear_fc1.
ADAPTERS = [
    AdapterConfig(name="a0", rank=4, alpha=8.0),
    AdapterConfig(name="a1", rank=2, alpha=4.0, target_modules=["linear_qkv", "linear_fc2"]),
    AdapterConfig(name="a2", rank=8, alpha=16.0, use_rslora=True),
]


@dataclass
class PackedBatch:
    """One packed microbatch: tokens [1, T], restarting positions, THD params, layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object
    layout: object
    lengths: list[int]
    adapters: list[int]

    def sample(self, i: int) -> slice:
        start = sum(self.lengths[:i])
        return slice(start, start + self.lengths[i])


def make_packed_batch(
    sample_adapters,
    lengths,
    num_adapters,
    *,
    input_ids=None,
    seed=0,
    dropout_seed=0,
    device="cpu",
) -> PackedBatch:
    """Random tokens (or the given ones) for samples already ordered adapter-major."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_lorafusion.ops import AdapterLayout

    layout = AdapterLayout.from_samples(
        sample_adapters, lengths, num_adapters, device=device, dropout_seed=dropout_seed
    )
    if input_ids is None:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, TINY.vocab_size, (1, sum(lengths)), generator=generator)
        input_ids = input_ids.to(device)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = layout.cu_seqlens
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return PackedBatch(
        input_ids, position_ids, params, layout, list(lengths), list(sample_adapters)
    )


def run_model(model, context, batch: PackedBatch, labels=None) -> torch.Tensor:
    """Set the layout and run a packed forward: logits [1, T, V], or loss [1, T] with labels."""
    if context is not None:
        context.layout = batch.layout
    return model(
        batch.input_ids,
        batch.position_ids,
        None,
        labels=labels,
        packed_seq_params=batch.packed_seq_params,
    )


def randomize_lora_b(context, seed: int, std: float = 0.05) -> None:
    """Give every adapter's B (zero at init) random values, so the adapters change the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in range(context.num_adapters):
            for name, factor in context.adapter_tensors(a).items():
                if name.endswith("lora_B"):
                    factor.copy_(torch.randn(factor.shape, generator=generator) * std)
