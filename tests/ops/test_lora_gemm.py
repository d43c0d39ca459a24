"""`lora_gemm` (the TMA Triton GEMM with the LoRA term in its epilogue) against
`lora_gemm_ref`, both operand layouts (forward ``Wᵀ``, backward ``W``).

CPU: Triton interpreter (it runs TMA descriptors too), fp32 with IEEE dots, so differences are
summation order; fp16 at half-precision rounding. GPU-only (Hopper): bf16 on a larger ragged
layout, every tile config the kernel can pick, relative error against an fp32 reference.
"""

import sys

import pytest
import torch

from megatron_lorafusion.ops import fused_dropout_keep_mask
from megatron_lorafusion.ops._utils import mixed_seed
from megatron_lorafusion.ops.lora_gemm import (
    _TMA_TILE_CONFIGS,
    lora_gemm,
    lora_gemm_ref,
    tma_supported,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3)}
BF16_REL_ERR = 1e-2  # ||out - ref|| / ||ref|| against the fp32 reference, bf16 operands


def _problem(layout, inner, width, ranks, dtype, device, make_lora, transposed, seed=4):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(layout.num_tokens, inner, generator=gen).to(device, dtype)
    weight = torch.randn(width, inner, generator=gen).to(device, dtype) / inner**0.5
    w = weight.t() if transposed else weight.t().contiguous()  # (K, D), two stride layouts
    s = torch.randn(layout.num_tokens, max(ranks), generator=gen).to(device, dtype)
    m, _ = make_lora(8, width, ranks, dtype, device, gen)  # (A, R, D)
    bias = torch.randn(width, generator=gen).to(device, dtype)
    return z, w, s, m, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("transposed", [True, False])
def test_lora_gemm_matches_reference(transposed, dtype, device, make_layout, make_lora):
    counts, dropouts = [20, 0, 13], [0.2, 0.0, 0.4]
    layout = make_layout(counts, device, seed=8)
    # K not a multiple of BLOCK_K, D not a multiple of BLOCK_N; TMA needs D·itemsize % 16 == 0
    inner, width = 40, 40
    z, w, s, m, bias = _problem(
        layout, inner, width, [6, 2, 4], dtype, device, make_lora, transposed
    )
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(layout, dropouts, width, 1, device)
    got = lora_gemm(z, w, s, m, bias, drop, layout, mixed_seed(layout.dropout_seed, 1))
    want = lora_gemm_ref(z, w, s, m, bias, keep, drop, layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg="gemm")


def test_lora_gemm_shard_draws_whole_microbatch_mask(device, make_layout, make_lora):
    # A shard of rows 5:37 (row_offset = 5) and of columns 8:48 of a 56-wide output.
    whole = make_layout([9, 30], device, seed=3)
    layout = whole.shard(5, 37)
    dropouts = [0.3, 0.5]
    z, w, s, m, _ = _problem(layout, 32, 40, [4, 4], torch.float32, device, make_lora, True)
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(whole, dropouts, 56, 2, device)[5:37, 8:48]
    got = lora_gemm(
        z,
        w,
        s,
        m,
        None,
        drop,
        layout,
        mixed_seed(layout.dropout_seed, 2),
        col_offset=8,
        full_width=56,
    )
    want = lora_gemm_ref(z, w, s, m, None, keep, drop, layout)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg="shard mask")


def test_lora_gemm_names_bad_tensor(device, make_layout):
    layout = make_layout([4, 4], device)
    z, s = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match="w has shape"):
        lora_gemm(
            z,
            torch.randn(15, 8, device=device),
            s,
            torch.randn(2, 4, 8, device=device),
            None,
            None,
            layout,
            0,
        )


def test_lora_gemm_rejects_unaligned_rows(device, make_layout):
    layout = make_layout([4, 4], device)
    z, s = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    w = torch.randn(16, 6, device=device)  # D·4 bytes = 24: not a multiple of 16
    assert not tma_supported(z, w, torch.empty(8, 6, device=device))
    with pytest.raises(ValueError, match="16-byte aligned"):
        lora_gemm(z, w, s, torch.randn(2, 4, 6, device=device), None, None, layout, 0)


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _TMA_TILE_CONFIGS[1:], ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("direction", ["fwd", "dx"])
def test_lora_gemm_tma_bf16_configs(cfg, direction, make_layout, make_lora, monkeypatch):
    # The forward as fused_lora_linear calls it: W = weight.t() with bias and no dropout; the
    # dX form: W = weight with dropout. Ragged: segments not multiples of BLOCK_M, an empty
    # adapter, D not a multiple of 256. Hopper's tile choice is patched to ``cfg``.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tile configs are Hopper's; other GPUs time them (pick_config)")
    monkeypatch.setattr(sys.modules[lora_gemm.__module__], "_hopper_config", lambda key: cfg)
    counts, dropouts = [300, 0, 517, 211], [0.1, 0.0, 0.0, 0.3]
    layout = make_layout(counts, "cuda", seed=5)
    fwd = direction == "fwd"
    z, w, s, m, bias = _problem(
        layout, 320, 384, [16, 8, 16, 4], torch.bfloat16, "cuda", make_lora, transposed=fwd
    )
    bias = bias if fwd else None
    drop = None if fwd else torch.tensor(dropouts, device="cuda")
    keep = None if fwd else fused_dropout_keep_mask(layout, dropouts, 384, 7, "cuda")
    got = lora_gemm(z, w, s, m, bias, drop, layout, mixed_seed(layout.dropout_seed, 7))
    want = lora_gemm_ref(
        z.float(),
        w.float(),
        s.float(),
        m.float(),
        None if bias is None else bias.float(),
        keep,
        drop,
        layout,
    )
    assert got.isfinite().all(), f"{cfg.label()} {direction}: non-finite output"
    err = _rel_err(got, want)
    assert err < BF16_REL_ERR, f"{cfg.label()} {direction}: rel err {err:.2e}"
