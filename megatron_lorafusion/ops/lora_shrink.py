"""Grouped LoRA shrink: ``out[seg_a] = scale_a · drop_a(Z[seg_a]) · M_aᵀ``, (T, D) → (T, R).

One launch serves every adapter: each tile of rows belongs to one adapter (see
`AdapterLayout.tiles`) and reads that adapter's ``M_a``, scale and dropout. It is the
down-projection of LoRAFusion (arXiv 2510.00206, Sec. 4.1) with dropout fused in
(``Z = X``, ``M = A``), and, for ranks above `lora_up_bwd`'s one-pass limit, the backward's
``dS = s·dY·B`` (``Z = dY``, ``M = Bᵀ``, no dropout).
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import TileConfig, triton
from megatron_lorafusion.ops.layout import AdapterLayout

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops._utils import keep_mask_tile

    @triton.jit(do_not_specialize=["seed", "col_off"])
    def _lora_shrink_kernel(
        z_ptr,
        m_ptr,
        out_ptr,
        tiles_ptr,
        scale_ptr,
        p_ptr,
        keys_ptr,
        seed,
        D,
        R,
        col_off,
        stride_zt,
        stride_ma,
        stride_mr,
        stride_md,
        stride_ot,
        HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        pid = tl.program_id(0)
        adapter = tl.load(tiles_ptr + pid * 3)
        row_start = tl.load(tiles_ptr + pid * 3 + 1)
        row_end = tl.load(tiles_ptr + pid * 3 + 2)
        rows = row_start + tl.arange(0, BLOCK_T)
        row_ok = rows < row_end
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        z_rows = z_ptr + rows.to(tl.int64)[:, None] * stride_zt
        m_base = m_ptr + adapter.to(tl.int64) * stride_ma + ranks[None, :] * stride_mr
        p = 0.0
        if HAS_DROPOUT:
            p = tl.load(p_ptr + adapter)
        if HAS_DROPOUT:  # the rows' dropout keys; the mask's columns are the whole input's
            keys = tl.load(keys_ptr + rows, mask=row_ok, other=0)
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            z = tl.load(z_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            if HAS_DROPOUT:
                # No run-time `if p > 0` here: a branch in the loop body stops Triton from
                # pipelining the loads; p = 0 keeps everything anyway.
                keep = keep_mask_tile(seed, keys, d0 + col_off, p, BLOCK_D)
                z = tl.where(keep, z, 0.0)
            m = tl.load(
                m_base + cols[:, None] * stride_md,  # (BLOCK_D, BLOCK_R) = M_aᵀ tile
                mask=col_ok[:, None] & rank_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(z, m, acc, input_precision=DOT_PRECISION)
        scale = tl.load(scale_ptr + adapter)
        if HAS_DROPOUT:
            scale = scale / (1.0 - p)  # inverted dropout, applied once to the fp32 sum
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + ranks[None, :]
        tl.store(
            out, (acc * scale).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & rank_ok[None, :]
        )


# Memory-bound: one pass over Z. 32-row tiles give >= 2 programs per SM at T=8192; wide
# D steps keep 32 KB of Z in flight per stage.
_TILE_CONFIGS = [
    TileConfig(block_t=16, block_d=32, num_warps=4, num_stages=2),  # interpreter: many tiles
    TileConfig(block_t=32, block_d=256, num_warps=4, num_stages=3),
    TileConfig(block_t=32, block_d=128, num_warps=4, num_stages=4),
    TileConfig(block_t=64, block_d=128, num_warps=8, num_stages=3),
    TileConfig(block_t=32, block_d=64, num_warps=8, num_stages=3),
]


def _hopper_config(key: tuple) -> TileConfig:
    _, _, block_r = key  # key = (T, D, BLOCK_R)
    # 32x128: with dropout 0.065 / 0.208 ms against 0.078 / 0.249 for 32x256 at T = 16384,
    # H = 4096 / 14336 (H200, docs/kernels.md); without dropout the tiles tie.
    if block_r <= 128:
        return _TILE_CONFIGS[2]
    return _TILE_CONFIGS[4]


def lora_shrink(
    z: torch.Tensor,
    m: torch.Tensor,
    scales: torch.Tensor,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    out_dtype: torch.dtype | None = None,
    *,
    col_offset: int = 0,
    full_width: int | None = None,
) -> torch.Tensor:
    """Launch the grouped shrink.

    Args:
        z: (T, D) contiguous activations (X) or output gradients (dY), adapter-major rows.
        m: (A, R, D) per-adapter matrices, any strides (``lora_a``, or ``lora_b.transpose(1, 2)``).
        scales: (A,) fp32 per-adapter scale on ``z``'s device.
        dropouts: (A,) fp32 dropout probabilities on ``z``'s device, or None for no dropout.
        layout: the microbatch's adapter layout.
        seed: Philox seed of the dropout mask (see `_utils.mixed_seed`).
        out_dtype: dtype of the result (default ``z.dtype``).
        col_offset: for a tensor-parallel shard of the input's columns, the index of ``z``'s
            column 0 in the full-width input (a multiple of 8): the mask is columns
            ``col_offset:col_offset + D`` of the ``full_width``-wide mask; its rows are keyed by
            ``layout.row_keys``.
        full_width: the full input width (default ``D``).

    Returns:
        (T, R) tensor ``scale_a · drop_a(Z)·M_aᵀ`` per adapter segment.

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor).
        NotImplementedError: for a ``col_offset`` that is not a multiple of 8.
    """
    width = z.shape[1] if z.dim() == 2 else -1
    _utils.check_tensor("z", z, (layout.num_tokens, None), _utils.KERNEL_DTYPES, z.device)
    adapters = layout.num_adapters
    if m.dim() != 3 or m.shape[0] != adapters or m.shape[2] != width:
        raise ValueError(
            f"m has shape {tuple(m.shape)}, expected (A, R, D)=({adapters}, R, {width})"
        )
    if m.dtype != z.dtype or m.device != z.device:
        raise ValueError(f"m is {m.dtype} on {m.device}, expected {z.dtype} on {z.device}")
    _utils.check_tensor("scales", scales, (adapters,), (torch.float32,), z.device)
    _utils.check_dropouts(dropouts, adapters, z.device)
    _utils.mask_width(width, col_offset, full_width)
    return lora_shrink_fwd(z, m, scales, dropouts, layout, seed, out_dtype, col_offset)


def lora_shrink_fwd(
    z: torch.Tensor,
    m: torch.Tensor,
    scales: torch.Tensor,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    out_dtype: torch.dtype | None = None,
    col_offset: int = 0,
) -> torch.Tensor:
    """Launch the shrink on inputs already checked (`lora_shrink` checks, then calls this).

    The autograd functions check their inputs once and call this in forward and backward
    (``col_offset`` already checked).
    """
    tokens, width = z.shape
    rank = m.shape[1]
    block_r = _utils.padded_rank(rank)
    out = torch.empty(tokens, rank, dtype=out_dtype or z.dtype, device=z.device)
    if tokens == 0:
        return out

    def run(cfg: TileConfig) -> None:
        tiles = layout.tiles(cfg.block_t, z.device)
        _lora_shrink_kernel[(tiles.shape[0],)](
            z,
            m,
            out,
            tiles,
            scales,
            dropouts if dropouts is not None else scales,
            layout.keys(),
            seed,
            width,
            rank,
            col_offset,
            z.stride(0),
            m.stride(0),
            m.stride(1),
            m.stride(2),
            out.stride(0),
            HAS_DROPOUT=dropouts is not None,
            DOT_PRECISION="ieee" if z.dtype == torch.float32 else None,
            BLOCK_T=cfg.block_t,
            BLOCK_D=cfg.block_d,
            BLOCK_R=block_r,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    key = (tokens, width, block_r)
    cfg = _utils.pick_config("lora_shrink", key, z.device, _hopper_config, _TILE_CONFIGS, run)
    run(cfg)
    return out


def lora_shrink_ref(
    z: torch.Tensor,
    m: torch.Tensor,
    scales: torch.Tensor,
    keep_mask: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
) -> torch.Tensor:
    """Torch reference of `lora_shrink` with an explicit ``(T, D)`` bool keep-mask."""
    out = z.new_zeros(z.shape[0], m.shape[1])
    for adapter, start, end in layout.segments():
        z_seg = z[start:end].float()
        if keep_mask is not None and dropouts is not None and float(dropouts[adapter]) > 0:
            z_seg = z_seg * keep_mask[start:end] / (1.0 - float(dropouts[adapter]))
        out[start:end] = (float(scales[adapter]) * z_seg @ m[adapter].float().t()).to(z.dtype)
    return out
