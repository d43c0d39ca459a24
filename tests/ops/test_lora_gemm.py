"""`lora_gemm` (the TMA Triton GEMM with the LoRA term in its epilogue) against `lora_gemm_ref`.

CPU: Triton interpreter (it runs TMA descriptors too), fp32 with IEEE dots, so differences are
summation order; fp16 at half-precision rounding. GPU-only (Hopper): bf16 on a larger ragged
layout, every tile config the kernel can pick, relative error against an fp32 reference.
"""

import sys

import pytest
import torch

from megatron_lorafusion.ops.lora_gemm import (
    _TMA_TILE_CONFIGS,
    lora_gemm,
    lora_gemm_ref,
    tma_supported,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3)}
BF16_REL_ERR = 1e-2  # ||out - ref|| / ||ref|| against the fp32 reference, bf16 operands


def _problem(layout, inner, width, ranks, dtype, device, make_lora, seed=4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.num_tokens, inner, generator=gen).to(device, dtype)
    weight = torch.randn(width, inner, generator=gen).to(device, dtype) / inner**0.5
    s = torch.randn(layout.num_tokens, max(ranks), generator=gen).to(device, dtype)
    b_t, _ = make_lora(8, width, ranks, dtype, device, gen)  # (A, R, N)
    bias = torch.randn(width, generator=gen).to(device, dtype)
    return x, weight, s, b_t, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_lora_gemm_matches_reference(with_bias, dtype, device, make_layout, make_lora):
    layout = make_layout([20, 0, 13], device, seed=8)  # ragged segments, an empty adapter
    # K not a multiple of BLOCK_K, N not a multiple of BLOCK_N; TMA needs N·itemsize % 16 == 0
    x, weight, s, b_t, bias = _problem(layout, 40, 40, [6, 2, 4], dtype, device, make_lora)
    bias = bias if with_bias else None
    got = lora_gemm(x, weight, s, b_t, bias, layout)
    want = lora_gemm_ref(x, weight, s, b_t, bias, layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg="gemm")


def test_lora_gemm_names_bad_tensor(device, make_layout):
    layout = make_layout([4, 4], device)
    x, s = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    b_t = torch.randn(2, 4, 8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(8, 15\)"):
        lora_gemm(x, torch.randn(8, 15, device=device), s, b_t, None, layout)
    with pytest.raises(ValueError, match=r"b_t has shape \(2, 4, 7\)"):
        lora_gemm(x, torch.randn(8, 16, device=device), s, b_t[..., :7], None, layout)


def test_lora_gemm_rejects_unaligned_rows(device, make_layout):
    layout = make_layout([4, 4], device)
    x, s = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    weight = torch.randn(6, 16, device=device)  # N·4 bytes = 24: not a multiple of 16
    assert not tma_supported(x, weight)
    with pytest.raises(ValueError, match="16-byte aligned"):
        lora_gemm(x, weight, s, torch.randn(2, 4, 6, device=device), None, layout)
    assert not tma_supported(x, torch.randn(16, 8, device=device).t()), "W needs unit-stride rows"


_FP8_CONFIGS = _TMA_TILE_CONFIGS[3:]  # the tiles of 1-byte operands


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [c for c in _TMA_TILE_CONFIGS[1:] if c not in _FP8_CONFIGS],  # FP8's: 1-byte operands only
    ids=lambda c: c.label().replace(" ", "-"),
)
def test_lora_gemm_tma_bf16_configs(cfg, make_layout, make_lora, monkeypatch):
    # As fused_lora_linear calls it, with bias. Ragged: segments not multiples of BLOCK_M, an
    # empty adapter, N not a multiple of 256. Hopper's tile choice is patched to ``cfg``.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tile configs are Hopper's; other GPUs time them (pick_config)")
    monkeypatch.setattr(sys.modules[lora_gemm.__module__], "_hopper_config", lambda key: cfg)
    layout = make_layout([300, 0, 517, 211], "cuda", seed=5)
    x, weight, s, b_t, bias = _problem(
        layout, 320, 384, [16, 8, 16, 4], torch.bfloat16, "cuda", make_lora
    )
    got = lora_gemm(x, weight, s, b_t, bias, layout)
    want = lora_gemm_ref(x.float(), weight.float(), s.float(), b_t.float(), bias.float(), layout)
    assert got.isfinite().all(), f"{cfg.label()}: non-finite output"
    err = _rel_err(got, want)
    assert err < BF16_REL_ERR, f"{cfg.label()}: rel err {err:.2e}"


def _fp8_problem(layout, inner, width, ranks, dtype, device, make_lora):
    """e4m3 X and W with their row scales, ``S'``, Bᵀ and the bias in ``dtype``."""
    from megatron_lorafusion.ops import quantize_rows_ref, quantize_weight

    x, weight, s, b_t, bias = _problem(layout, inner, width, ranks, dtype, device, make_lora)
    x_q, x_scale = quantize_rows_ref(x)
    w = quantize_weight(weight)
    return x_q, x_scale, w.data, w.scale, s, b_t, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_gemm_fp8_operands_match_reference(dtype, device, make_layout, make_lora):
    layout = make_layout([20, 0, 13], device, seed=8)
    x_q, x_scale, w_q, w_scale, s, b_t, bias = _fp8_problem(
        layout, 48, 40, [6, 2, 4], dtype, device, make_lora
    )
    got = lora_gemm(x_q, w_q, s, b_t, bias, layout, x_scale=x_scale, w_scale=w_scale)
    want = lora_gemm_ref(x_q, w_q, s, b_t, bias, layout, x_scale=x_scale, w_scale=w_scale)
    assert got.dtype == dtype, "the output takes the compute dtype of S'"
    # A GPU's tensor cores multiply e4m3 operands and accumulate in less than fp32 (an fp32
    # output ~1e-3 off on the H200): there fp32 is held to fp16's tolerance.
    atol, rtol = TOL[dtype] if device == "cpu" else TOL[torch.float16]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg="fp8 gemm")
    with pytest.raises(ValueError, match="x_scale and w_scale go together"):
        lora_gemm(x_q, w_q, s, b_t, bias, layout, x_scale=x_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _FP8_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
def test_lora_gemm_tma_fp8_configs(cfg, make_layout, make_lora, monkeypatch):
    # The FP8 candidates, as fused_lora_linear calls them (bf16 S', B, bias); ragged layout.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tile configs are Hopper's; other GPUs time them (pick_config)")
    monkeypatch.setattr(sys.modules[lora_gemm.__module__], "_hopper_config", lambda key: cfg)
    layout = make_layout([300, 0, 517, 211], "cuda", seed=5)
    x_q, x_scale, w_q, w_scale, s, b_t, bias = _fp8_problem(
        layout, 512, 384, [16, 8, 16, 4], torch.bfloat16, "cuda", make_lora
    )
    got = lora_gemm(x_q, w_q, s, b_t, bias, layout, x_scale=x_scale, w_scale=w_scale)
    want = lora_gemm_ref(
        x_q,
        w_q,
        s.float(),
        b_t.float(),
        bias.float(),
        layout,
        x_scale=x_scale,
        w_scale=w_scale,
    )
    assert got.isfinite().all(), f"{cfg.label()}: non-finite output"
    err = _rel_err(got, want)
    assert err < BF16_REL_ERR, f"{cfg.label()}: rel err {err:.2e}"
