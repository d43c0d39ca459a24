"""Triton GEMM with the LoRA term in its epilogue: ``out = Z·Wop + drop_a(S·M_a) + b``.

Design (a) of issue 3 (LoRAFusion, arXiv 2510.00206, Sec. 4.1): the frozen product and the
LoRA up-projection in one kernel, so the (T, D) output is written once. M-tiles come from
`AdapterLayout.tiles` (each tile inside one adapter's segment), so the epilogue reads a
single adapter's ``M_a`` and dropout. Forward: ``Z = X``, ``Wop = Wᵀ``, ``S = S'``,
``M = Bᵀ``; backward: ``Z = dY``, ``Wop = W``, ``S = dS'``, ``M = A`` with dropout.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.layout import AdapterLayout

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops._utils import keep_mask_tile

    @triton.jit(do_not_specialize=["seed"])
    def _lora_gemm_kernel(
        z_ptr, w_ptr, s_ptr, m_ptr, bias_ptr, out_ptr, tiles_ptr, p_ptr, seed,
        n_tiles, D, K, R,
        stride_zt, stride_wk, stride_wd, stride_st, stride_ma, stride_mr, stride_md, stride_ot,
        HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # Grouped ordering: GROUP_M row tiles sweep the N tiles together, sharing W in L2.
        pid = tl.program_id(0)
        n_cols = tl.cdiv(D, BLOCK_N)
        group = pid // (GROUP_M * n_cols)
        first = group * GROUP_M
        size = min(n_tiles - first, GROUP_M)
        tile = first + (pid % (GROUP_M * n_cols)) % size
        pid_n = (pid % (GROUP_M * n_cols)) // size
        adapter = tl.load(tiles_ptr + tile * 3)
        row_start = tl.load(tiles_ptr + tile * 3 + 1)
        row_end = tl.load(tiles_ptr + tile * 3 + 2)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < D
        ks = tl.arange(0, BLOCK_K)
        z_tile = z_ptr + rows.to(tl.int64)[:, None] * stride_zt + ks[None, :]
        w_tile = w_ptr + ks[:, None].to(tl.int64) * stride_wk + cols[None, :] * stride_wd
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                z = tl.load(z_tile, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + ks) < K
                z = tl.load(z_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(z, w, acc, input_precision=DOT_PRECISION)
            z_tile += BLOCK_K
            w_tile += BLOCK_K * stride_wk
        # Epilogue: the adapter's LoRA term, dropout regenerated from the seed, bias.
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_st + ranks[None, :],
                    mask=row_ok[:, None] & rank_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_R)
        m = tl.load(m_ptr + adapter.to(tl.int64) * stride_ma + ranks[:, None] * stride_mr
                    + cols[None, :] * stride_md,
                    mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_R, BLOCK_N)
        if HAS_DROPOUT:
            lora = tl.dot(s, m, input_precision=DOT_PRECISION)
            p = tl.load(p_ptr + adapter)
            if p > 0:
                keep = keep_mask_tile(seed, rows, cols, D, p)
                lora = tl.where(keep, lora / (1.0 - p), 0.0)
            acc += lora
        else:
            acc = tl.dot(s, m, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); Hopper uses the first after the
# interpreter entry, the others are the autotune fallback for other GPUs.
_TILE_CONFIGS = [
    (16, 32, 16, 4, 1),  # interpreter: several tiles in every direction
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 3),
]
_GROUP_M = 8


def lora_gemm(
    z: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """Launch the GEMM with LoRA epilogue.

    Args:
        z: (T, K) contiguous left operand (X or dY).
        w: (K, D) right operand, any strides (``weight.t()`` or ``weight``).
        s: (T, R) contiguous ``S'`` or ``dS'``.
        m: (A, R, D) per-adapter matrices, any strides.
        bias: (D,) or None.
        dropouts: (A,) fp32 dropout applied to the LoRA term, or None.
        layout: the microbatch's adapter layout.
        seed: Philox seed of the dropout mask over the ``(T, D)`` output.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` to force a tile config.

    Returns:
        (T, D) tensor in ``z``'s dtype.

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor).
    """
    _utils.check_tensor("z", z, (layout.num_tokens, None), _utils._KERNEL_DTYPES, z.device)
    tokens, inner = z.shape
    if w.dim() != 2 or w.shape[0] != inner or w.dtype != z.dtype or w.device != z.device:
        raise ValueError(
            f"w has shape {tuple(w.shape)} {w.dtype}, expected (K={inner}, D) {z.dtype}"
        )
    width = w.shape[1]
    _utils.check_tensor("s", s, (tokens, None), (z.dtype,), z.device)
    rank = s.shape[1]
    if tuple(m.shape) != (layout.num_adapters, rank, width) or m.dtype != z.dtype:
        raise ValueError(
            f"m has shape {tuple(m.shape)} {m.dtype}, "
            f"expected (A, R, D)=({layout.num_adapters}, {rank}, {width}) {z.dtype}"
        )
    block_r = _utils.padded_rank(rank)
    out = torch.empty(tokens, width, dtype=z.dtype, device=z.device)
    if tokens == 0:
        return out

    def run(cfg: tuple[int, int, int, int, int]) -> None:
        block_m, block_n, block_k, warps, stages = cfg
        tiles = layout.tiles(block_m, z.device)
        grid = (tiles.shape[0] * _utils.cdiv(width, block_n),)
        _lora_gemm_kernel[grid](
            z, w, s, m, bias if bias is not None else s, out, tiles,
            dropouts if dropouts is not None else s, seed,
            tiles.shape[0], width, inner, rank,
            z.stride(0), w.stride(0), w.stride(1), s.stride(0),
            m.stride(0), m.stride(1), m.stride(2), out.stride(0),
            HAS_BIAS=bias is not None, HAS_DROPOUT=dropouts is not None,
            EVEN_K=inner % block_k == 0,
            DOT_PRECISION="ieee" if z.dtype == torch.float32 else None, GROUP_M=_GROUP_M,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r,
            num_warps=warps, num_stages=stages,
        )

    if config is None:
        key = (tokens, width, inner, block_r)
        config = _utils.pick_config(
            "lora_gemm", key, z.device, lambda _: _TILE_CONFIGS[1], _TILE_CONFIGS, run
        )
    run(config)
    return out


def lora_gemm_ref(
    z: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None,
    keep_mask: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
) -> torch.Tensor:
    """Torch reference of `lora_gemm` with an explicit ``(T, D)`` bool keep-mask."""
    out = z.float() @ w.float()
    for adapter, start, end in layout.segments():
        part = s[start:end].float() @ m[adapter].float()  # (T_a, D)
        if keep_mask is not None and dropouts is not None and float(dropouts[adapter]) > 0:
            part = part * keep_mask[start:end] / (1.0 - float(dropouts[adapter]))
        out[start:end] += part
    if bias is not None:
        out += bias.float()
    return out.to(z.dtype)
