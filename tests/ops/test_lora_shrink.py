"""`lora_shrink` (grouped down-projection, dropout fused) against `lora_shrink_ref`.

CPU: Triton interpreter, fp32 with IEEE dots, so differences are summation order.
"""

import pytest
import torch

from megatron_lorafusion.ops import fused_dropout_keep_mask, lora_shrink, lora_shrink_ref
from megatron_lorafusion.ops._utils import mixed_seed

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("counts", "ranks", "dropouts"),
    [
        ([32, 32], [16, 16], [0.0, 0.0]),  # round, no dropout
        ([21, 0, 40, 3], [3, 8, 5, 1], [0.2, 0.1, 0.0, 0.5]),  # ragged, zero-token adapter
    ],
)
def test_lora_shrink_matches_reference(
    counts, ranks, dropouts, dtype, device, make_layout, make_lora
):
    gen = torch.Generator().manual_seed(0)
    layout = make_layout(counts, device, seed=3)
    width = 72
    z = torch.randn(layout.num_tokens, width, generator=gen).to(device, dtype)
    m, _ = make_lora(8, width, ranks, dtype, device, gen)  # (A, R, D)
    scales = torch.tensor([0.5 + a for a in range(len(counts))], device=device)
    drop = torch.tensor(dropouts, device=device) if any(dropouts) else None
    keep = fused_dropout_keep_mask(layout, dropouts, width, 4, device)
    got = lora_shrink(z, m, scales, drop, layout, seed=mixed_seed(layout.dropout_seed, 4))
    want = lora_shrink_ref(z.float(), m.float(), scales, keep, drop, layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol, msg="S")


def test_lora_shrink_names_bad_tensor(device, make_layout, make_lora):
    layout = make_layout([4, 4], device)
    z = torch.randn(8, 16, device=device)
    m, _ = make_lora(8, 16, [4, 4], torch.float32, device, torch.Generator().manual_seed(0))
    scales = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="scales"):
        lora_shrink(z, m, scales.double(), None, layout, 0)
    with pytest.raises(ValueError, match="m has shape"):
        lora_shrink(z, m[:, :, :8], scales, None, layout, 0)
    with pytest.raises(ValueError, match="z has shape"):
        lora_shrink(z[:7], m, scales, None, layout, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_shrink_shard_uses_rows_and_columns_of_whole_mask(
    dtype, device, make_layout, make_lora
):
    """A shard of rows 9:50 and columns 16:56 of a 72-wide input draws that block of the mask."""
    gen = torch.Generator().manual_seed(5)
    layout = make_layout([21, 0, 40, 3], device, seed=3)
    dropouts = [0.2, 0.1, 0.3, 0.5]
    (start, end), (col_offset, width), full_width = (9, 50), (16, 40), 72
    shard = layout.shard(start, end)
    z = torch.randn(end - start, width, generator=gen).to(device, dtype)
    m, _ = make_lora(8, width, [3, 8, 5, 1], dtype, device, gen)
    scales = torch.tensor([0.5, 1.0, 2.0, 1.5], device=device)
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(layout, dropouts, full_width, 4, device)
    keep = keep[start:end, col_offset : col_offset + width]
    got = lora_shrink(
        z,
        m,
        scales,
        drop,
        shard,
        mixed_seed(layout.dropout_seed, 4),
        col_offset=col_offset,
        full_width=full_width,
    )
    want = lora_shrink_ref(z.float(), m.float(), scales, keep, drop, shard)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol, msg="sharded S")


def test_lora_shrink_rejects_bad_mask_columns(device, make_layout, make_lora):
    layout = make_layout([4, 4], device)
    z = torch.randn(8, 16, device=device)
    m, _ = make_lora(8, 16, [4, 4], torch.float32, device, torch.Generator().manual_seed(0))
    scales, drop = torch.ones(2, device=device), torch.full((2,), 0.1, device=device)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        lora_shrink(z, m, scales, drop, layout, 0, col_offset=4, full_width=32)
    with pytest.raises(ValueError, match=r"columns \[24, 40\)"):
        lora_shrink(z, m, scales, drop, layout, 0, col_offset=24, full_width=32)
