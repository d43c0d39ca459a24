"""`lora_wgrad` (grouped weight gradient, fixed-order reduction) against `lora_wgrad_ref`,
alone and with its fused expand.

CPU: Triton interpreter, fp32 with IEEE dots, so differences are summation order.
"""

import pytest
import torch

from megatron_lorafusion.ops import (
    fused_dropout_keep_mask,
    lora_expand_ref,
    lora_wgrad,
    lora_wgrad_ref,
)
from megatron_lorafusion.ops._utils import mixed_seed
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad_fwd

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize(
    ("counts", "dropouts"),
    [
        ([64, 64], [0.0, 0.0]),
        ([21, 0, 70, 3], [0.2, 0.1, 0.0, 0.5]),  # several chunks per adapter, an empty adapter
    ],
)
def test_lora_wgrad_matches_reference(
    counts, dropouts, expand, dtype, device, make_layout, make_lora
):
    gen = torch.Generator().manual_seed(2)
    layout = make_layout(counts, device, seed=7)
    width, rank = 40, 5
    z = torch.randn(layout.num_tokens, width, generator=gen).to(device, dtype)
    s = torch.randn(layout.num_tokens, rank, generator=gen).to(device, dtype)
    drop = torch.tensor(dropouts, device=device) if any(dropouts) else None
    keep = fused_dropout_keep_mask(layout, dropouts, width, 2, device)
    out = torch.full((len(counts), width, rank), float("nan"), dtype=dtype, device=device)
    m = ex = None
    if expand:
        m, _ = make_lora(8, width, [rank] * len(counts), dtype, device, gen)  # (A, R, D)
        ex = torch.full((layout.num_tokens, width), float("nan"), dtype=dtype, device=device)
    lora_wgrad(
        z, s, out, drop, layout, mixed_seed(layout.dropout_seed, 2), expand_m=m, expand_out=ex
    )
    want = lora_wgrad_ref(z.float(), s.float(), keep, drop, layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol, msg="wgrad")
    if expand:
        want_ex = lora_expand_ref(s.float(), m.float(), None, keep, drop, layout)
        torch.testing.assert_close(
            ex.float(), want_ex.float(), atol=atol, rtol=rtol, msg="fused expand"
        )


def test_lora_wgrad_names_bad_tensor(device, make_layout):
    layout = make_layout([4, 4], device)
    z, s = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match="out has shape"):
        lora_wgrad(z, s, torch.empty(2, 16, 5, device=device), None, layout, 0)
    with pytest.raises(ValueError, match="expand_m and expand_out"):
        lora_wgrad(
            z,
            s,
            torch.empty(2, 16, 4, device=device),
            None,
            layout,
            0,
            expand_m=torch.empty(2, 4, 16, device=device),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_wgrad_shard_uses_rows_and_columns_of_whole_mask(
    dtype, device, make_layout, make_lora
):
    """dA and the fused dX expand of a shard (rows 30:94, columns 8:48 of 64) use that block
    of the whole mask."""
    gen = torch.Generator().manual_seed(3)
    layout = make_layout([21, 0, 70, 3], device, seed=7)
    dropouts = [0.2, 0.1, 0.4, 0.5]
    (start, end), (col_offset, width), full_width = (30, 94), (8, 40), 64
    shard = layout.shard(start, end)
    z = torch.randn(end - start, width, generator=gen).to(device, dtype)
    s = torch.randn(end - start, 5, generator=gen).to(device, dtype)
    m, _ = make_lora(8, width, [5] * 4, dtype, device, gen)  # (A, R, D)
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(layout, dropouts, full_width, 2, device)
    keep = keep[start:end, col_offset : col_offset + width]
    out = torch.full((4, width, 5), float("nan"), dtype=dtype, device=device)
    ex = torch.full((end - start, width), float("nan"), dtype=dtype, device=device)
    lora_wgrad(
        z,
        s,
        out,
        drop,
        shard,
        mixed_seed(layout.dropout_seed, 2),
        expand_m=m,
        expand_out=ex,
        col_offset=col_offset,
        full_width=full_width,
    )
    atol, rtol = TOL[dtype]
    want = lora_wgrad_ref(z.float(), s.float(), keep, drop, shard)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol, msg="wgrad")
    want_ex = lora_expand_ref(s.float(), m.float(), None, keep, drop, shard)
    torch.testing.assert_close(
        ex.float(), want_ex.float(), atol=atol, rtol=rtol, msg="fused expand"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4096, 14336])
def test_lora_wgrad_adding_onto_dx_matches_reference_at_8b_widths(width, make_layout, make_lora):
    """The FP8 base's pass (the fused expand added onto the frozen dX) in its Hopper tiles,
    which differ from those writing dX, on the 8B preset's input widths."""
    gen = torch.Generator().manual_seed(5)
    layout = make_layout([300, 0, 500, 224], "cuda", seed=3)
    dropouts, rank = [0.1, 0.0, 0.1, 0.2], 16
    z = torch.randn(layout.num_tokens, width, generator=gen).cuda().bfloat16()
    s = torch.randn(layout.num_tokens, rank, generator=gen).cuda().bfloat16()
    m, _ = make_lora(8, width, [rank] * 4, torch.bfloat16, "cuda", gen)  # (A, R, D)
    drop = torch.tensor(dropouts, device="cuda")
    keep = fused_dropout_keep_mask(layout, dropouts, width, 2, "cuda")
    frozen = torch.randn(layout.num_tokens, width, generator=gen).cuda().bfloat16()
    ex = frozen.clone()
    out = torch.full((4, width, rank), float("nan"), dtype=torch.bfloat16, device="cuda")
    seed = mixed_seed(layout.dropout_seed, 2)
    lora_wgrad_fwd(z, s, out, drop, layout, seed, m, ex, expand_accumulate=True)
    want = lora_wgrad_ref(z.float(), s.float(), keep, drop, layout)
    want_ex = frozen.float() + lora_expand_ref(s.float(), m.float(), None, keep, drop, layout)
    assert (out.float() - want).norm() / want.norm() < 1e-2, "wgrad"
    torch.testing.assert_close(ex.float(), want_ex, atol=3e-2, rtol=1e-2, msg="dX")
