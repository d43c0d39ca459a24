"""Row-wise e4m3 quantization: the Triton kernel against `quantize_rows_ref`, bit for bit.

CPU: the interpreter. Its own fp32 -> e4m3 cast rounds wrongly when the mantissa carries into
the exponent (triton 3.8: 126.04 -> 64), which the kernel avoids by rounding to the e4m3 grid
itself; an fp32 ``q`` shows the grid values, an e4m3 ``q`` the stored ones. GPU: an e4m3
``q`` is the hardware's cast, the same bits.
"""

import pytest
import torch

from megatron_lorafusion.ops import FP8_DTYPE, quantize_rows, quantize_rows_ref, quantize_weight
from megatron_lorafusion.ops.fp8_quant import quantize_rows_fwd


def _rows(device, rows=37, width=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-4, 4, rows)[:, None]
    x[3] = 0.0  # an all-zero row
    x[5, : width // 2] = 1e-6  # e4m3 subnormals after scaling
    return x.to(device)


def test_quantize_rows_ref_scales_are_powers_of_two_that_fit():
    x = _rows("cpu")
    q, scale = quantize_rows_ref(x)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5), "scales must be powers of two"
    amax = x.abs().amax(dim=1)
    live = amax > 0
    assert torch.all(amax[live] / scale[live] <= 448.0)
    assert torch.all(amax[live] / scale[live] > 224.0), "the smallest power of two that fits"
    assert q.dtype == FP8_DTYPE
    assert torch.all(q[3].float() == 0.0)
    rel = (q.float() * scale[:, None] - x).abs() / x.abs().clamp(min=1e-30)
    normal = x.abs() / scale[:, None] >= 2.0**-6  # e4m3 normals: 3 mantissa bits
    assert float(rel[normal].max()) <= 2.0**-4, "round to nearest: half a step of 2^-3"


def test_quantize_rows_ref_column_scale_and_given_amax():
    x = _rows("cpu", rows=6, width=32)
    col = torch.rand(32) + 0.5
    q, scale = quantize_rows_ref(x, col_scale=col)
    q2, scale2 = quantize_rows_ref(x * col)
    assert torch.equal(q.float(), q2.float())
    assert torch.equal(scale, scale2)
    _, own = quantize_rows_ref(x)
    wide = x.abs().amax(dim=1) * 4  # a whole row (e.g. all TP shards) 4x larger
    _, scale4 = quantize_rows_ref(x, amax=wide)
    live = wide > 0
    assert torch.equal(scale4[live], own[live] * 4)


@pytest.mark.parametrize("width", [100, 12])  # the interpreter's rows of 16: two passes, one
@pytest.mark.parametrize("with_col_scale", [False, True])
def test_quantize_rows_kernel_equals_reference(with_col_scale, width, device):
    x = _rows(device, width=width)
    col = (torch.rand(x.shape[1]) + 0.5).to(device) if with_col_scale else None
    want_q, want_scale = quantize_rows_ref(x, col)
    grid = torch.empty(x.shape, device=device)  # fp32: the grid values before the cast
    scale = torch.empty(x.shape[0], device=device)
    quantize_rows_fwd(x, grid, scale, col)
    assert torch.equal(scale, want_scale)
    assert torch.equal(grid, want_q.float())
    got_q, got_scale = quantize_rows(x, col)
    assert got_q.dtype == FP8_DTYPE
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.float(), want_q.float())


def test_quantize_rows_kernel_rounds_every_e4m3_step_to_nearest_even(device):
    # One row holding every finite e4m3 value (so its scale is 1), every midpoint between
    # neighbours (ties: to even) and values just either side of each, both signs.
    codes = torch.arange(127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    positive = torch.cat([codes, mids, mids * (1 - 2.0**-20), mids * (1 + 2.0**-20)])
    values = torch.cat([positive, -positive])[None].to(device)
    grid = torch.empty(values.shape, device=device)
    scale = torch.empty(1, device=device)
    quantize_rows_fwd(values, grid, scale, None)
    assert float(scale) == 1.0
    want = values.to(FP8_DTYPE)
    assert torch.equal(grid, want.float()), "torch's cast rounds to nearest even"
    q, _ = quantize_rows(values)  # on a GPU: the hardware's cast
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_rows_kernel_takes_half_inputs(dtype, device):
    x = _rows(device, rows=9, width=64).clamp(-6e4, 6e4).to(dtype)
    want_q, want_scale = quantize_rows_ref(x)
    grid = torch.empty(x.shape, device=device)
    scale = torch.empty(x.shape[0], device=device)
    quantize_rows_fwd(x, grid, scale, None)
    assert torch.equal(scale, want_scale)
    assert torch.equal(grid, want_q.float())


def test_quantize_rows_rejects_strided_rows(device):
    x = torch.randn(8, 32, device=device)
    with pytest.raises(ValueError, match="unit-stride rows"):
        quantize_rows(x.t())
    with pytest.raises(ValueError, match="col_scale has shape"):
        quantize_rows(x, torch.ones(31, device=device))


def test_quantize_weight_keeps_channels_and_the_transpose():
    weight = torch.randn(24, 40) * torch.linspace(0.01, 10, 24)[:, None]
    fp8 = quantize_weight(weight, transposed=True)
    assert fp8.data.shape == (24, 40)
    assert fp8.scale.shape == (24,)
    assert torch.equal(fp8.data_t.float(), fp8.data.float().t())
    assert torch.equal(fp8.transposed().float(), fp8.data.float().t())
    rel = (fp8.dequantize() - weight).norm() / weight.norm()
    assert float(rel) < 0.04, "per-channel e4m3: ~2-3 % relative error"
    assert quantize_weight(weight).data_t is None


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4096 + 24, 14336, 28672 + 8])  # one pass, two passes
def test_quantize_rows_hardware_cast_matches_reference(width):
    x = _rows("cuda", rows=301, width=width, seed=3).bfloat16()
    col = torch.rand(x.shape[1], device="cuda") + 0.5
    for c in (None, col):
        got_q, got_scale = quantize_rows(x, c)
        want_q, want_scale = quantize_rows_ref(x, c)
        assert torch.equal(got_scale, want_scale)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
