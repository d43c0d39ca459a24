"""`lora_expand` (grouped up-projection, optional mask and bias) against `lora_expand_ref`.

CPU: Triton interpreter, fp32 with IEEE dots, so differences are summation order.
"""

import pytest
import torch

from megatron_lorafusion.ops import fused_dropout_keep_mask, lora_expand, lora_expand_ref
from megatron_lorafusion.ops._utils import mixed_seed

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("counts", "ranks", "dropouts"),
    [
        ([32, 32], [16, 16], [0.0, 0.0]),
        ([21, 0, 40, 3], [3, 8, 5, 1], [0.2, 0.1, 0.0, 0.5]),
    ],
)
def test_lora_expand_matches_reference(
    counts, ranks, dropouts, dtype, device, make_layout, make_lora
):
    gen = torch.Generator().manual_seed(1)
    layout = make_layout(counts, device, seed=5)
    width = 40
    s = torch.randn(layout.num_tokens, max(ranks), generator=gen).to(device, dtype)
    m, _ = make_lora(8, width, ranks, dtype, device, gen)  # (A, R, D)
    bias = torch.randn(width, generator=gen).to(device, dtype)
    drop = torch.tensor(dropouts, device=device) if any(dropouts) else None
    keep = fused_dropout_keep_mask(layout, dropouts, width, 6, device)
    got = lora_expand(s, m, bias, drop, layout, mixed_seed(layout.dropout_seed, 6))
    want = lora_expand_ref(s.float(), m.float(), bias.float(), keep, drop, layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg="expand")


def test_lora_expand_names_bad_tensor(device, make_layout, make_lora):
    layout = make_layout([4, 4], device)
    s = torch.randn(8, 4, device=device)
    m, _ = make_lora(8, 16, [4, 4], torch.float32, device, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="bias"):
        lora_expand(s, m, torch.zeros(15, device=device), None, layout, 0)


def test_lora_expand_shard_with_scales_uses_rows_and_columns_of_whole_mask(
    device, make_layout, make_lora
):
    gen = torch.Generator().manual_seed(2)
    layout = make_layout([21, 0, 40, 3], device, seed=5)
    dropouts = [0.2, 0.1, 0.3, 0.5]
    (start, end), (col_offset, width), full_width = (5, 60), (24, 32), 56
    shard = layout.shard(start, end)
    s = torch.randn(end - start, 8, generator=gen).to(device)
    m, _ = make_lora(8, width, [3, 8, 5, 1], torch.float32, device, gen)  # (A, R, D)
    scales = torch.tensor([0.5, 1.0, 2.0, 3.0], device=device)
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(layout, dropouts, full_width, 6, device)
    keep = keep[start:end, col_offset : col_offset + width]
    got = lora_expand(
        s,
        m,
        None,
        drop,
        shard,
        mixed_seed(layout.dropout_seed, 6),
        scales=scales,
        col_offset=col_offset,
        full_width=full_width,
    )
    want = lora_expand_ref(s, m, None, keep, drop, shard, scales)
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg="sharded expand")
