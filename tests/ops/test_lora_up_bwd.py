"""`lora_up_bwd` (dS and dB from one pass over dY, fixed-order sums) against `lora_up_bwd_ref`.

CPU: Triton interpreter, fp32 with IEEE dots, so fp32 differences are summation order; fp16
results are rounded once on store.
"""

import pytest
import torch

from megatron_lorafusion.ops import lora_up_bwd, lora_up_bwd_ref
from megatron_lorafusion.ops.lora_up_bwd import lora_up_bwd_quantized

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


def _inputs(counts, ranks, width, dtype, device, make_layout, make_lora, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(counts, device, seed=1)
    dy = torch.randn(layout.num_tokens, width, generator=gen).to(device, dtype)
    s = torch.randn(layout.num_tokens, max(ranks), generator=gen).to(device, dtype)
    _, lora_b = make_lora(width, 8, ranks, dtype, device, gen)  # (A, N, R)
    scales = torch.tensor([0.5 + a for a in range(len(counts))], device=device)
    return layout, dy, s, lora_b, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale_db", [False, True])
@pytest.mark.parametrize(
    ("counts", "ranks", "width"),
    [
        ([32, 32], [16, 16], 64),  # round
        (
            [21, 0, 70, 3],
            [3, 8, 5, 1],
            72,
        ),  # ragged, several chunks and column tiles, empty adapter
        ([9, 5], [40, 7], 24),  # BLOCK_R = 64: the two-pass path
    ],
)
def test_lora_up_bwd_matches_reference(
    counts, ranks, width, scale_db, dtype, device, make_layout, make_lora
):
    layout, dy, s, lora_b, scales = _inputs(
        counts, ranks, width, dtype, device, make_layout, make_lora
    )
    ds, db = lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=scale_db)
    want_ds, want_db = lora_up_bwd_ref(dy, s, lora_b, scales, layout, scale_db=scale_db)
    assert ds.dtype == dtype, "dS keeps dY's dtype"
    assert db.dtype == dtype, "dB keeps B's dtype"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ds.float(), want_ds, atol=atol, rtol=rtol, msg="dS")
    torch.testing.assert_close(db.float(), want_db, atol=atol, rtol=rtol, msg="dB")


def test_lora_up_bwd_is_bitwise_repeatable(device, make_layout, make_lora):
    layout, dy, s, lora_b, scales = _inputs(
        [21, 0, 70, 3], [3, 8, 5, 1], 72, torch.float16, device, make_layout, make_lora
    )
    first = lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=True)
    second = lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=True)
    for name, a, b in zip(["dS", "dB"], first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_lora_up_bwd_names_bad_tensor(device, make_layout, make_lora):
    layout, dy, s, lora_b, scales = _inputs(
        [4, 4], [4, 4], 16, torch.float32, device, make_layout, make_lora
    )
    with pytest.raises(ValueError, match="lora_b has shape"):
        lora_up_bwd(dy, s, lora_b[:, :8], scales, layout, scale_db=False)
    with pytest.raises(ValueError, match="s has shape"):
        lora_up_bwd(dy, s[:7], lora_b, scales, layout, scale_db=False)
    with pytest.raises(ValueError, match="scales"):
        lora_up_bwd(dy, s, lora_b, scales[:1], layout, scale_db=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ranks", [[16, 8, 1], [64, 33, 2]])  # one pass; two passes
def test_lora_up_bwd_bf16_close_to_fp32(ranks, make_layout, make_lora):
    """bf16 (wrong in the interpreter, so GPU only): within 1e-2 relative of the fp32 result."""
    layout, dy, s, lora_b, scales = _inputs(
        [700, 0, 333], ranks, 768, torch.bfloat16, "cuda", make_layout, make_lora
    )
    got = lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=True)
    want = lora_up_bwd_ref(dy, s, lora_b, scales, layout, scale_db=True)
    for name, g, w in zip(["dS", "dB"], got, want, strict=True):
        err = float((g.float() - w).norm() / w.norm())
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("counts", "ranks", "width"),
    [([21, 0, 70, 3], [3, 8, 5, 1], 72), ([9, 5], [40, 7], 24)],  # one pass; two passes
    ids=["one-pass", "two-pass"],
)
def test_lora_up_bwd_quantized_writes_quantize_rows_of_dy(
    counts, ranks, width, dtype, device, make_layout, make_lora, assert_quantized
):
    """dS and dB bit for bit `lora_up_bwd`'s; the e4m3 rows and scales `quantize_rows(dy,
    col_scale)`'s, from the row maxima of column blocks that dY's producer found."""
    layout, dy, s, lora_b, scales = _inputs(
        counts, ranks, width, dtype, device, make_layout, make_lora
    )
    dy[5] = 0.0  # an all-zero row: the floor scale
    dy[7, 3] = 8e3  # times its column scale 2^-4: above e4m3's 448 before the row's scale
    gen = torch.Generator().manual_seed(4)
    col_scale = torch.exp2(torch.randint(-9, -3, (width,), generator=gen).float()).to(device)
    col_scale[3] = 2.0**-4
    blocks = torch.nn.functional.pad((dy.float() * col_scale).abs(), (0, -width % 16))
    parts = blocks.view(dy.shape[0], -1, 16).amax(2)  # (T, P): 16-column blocks
    ds, db, q, scale = lora_up_bwd_quantized(
        dy, s, lora_b, scales, layout, col_scale, parts, scale_db=False
    )
    want_ds, want_db = lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=False)
    assert torch.equal(ds, want_ds)
    assert torch.equal(db, want_db)
    assert_quantized(q, scale, dy, col_scale)


def test_lora_up_bwd_quantized_names_bad_maxima(device, make_layout, make_lora):
    layout, dy, s, lora_b, scales = _inputs(
        [8, 8], [4, 4], 32, torch.float32, device, make_layout, make_lora
    )
    col_scale = torch.ones(32, device=device)
    with pytest.raises(ValueError, match="amax_parts"):
        lora_up_bwd_quantized(
            dy,
            s,
            lora_b,
            scales,
            layout,
            col_scale,
            torch.ones(15, 2, device=device),
            scale_db=False,
        )
    with pytest.raises(ValueError, match="col_scale"):
        lora_up_bwd_quantized(
            dy,
            s,
            lora_b,
            scales,
            layout,
            col_scale[:8],
            torch.ones(16, 2, device=device),
            scale_db=False,
        )
