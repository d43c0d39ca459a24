"""Grouped LoRA expand: ``out[seg_a] = drop_a(c_a·S[seg_a]·M_a) (+ bias)``, (T, R) → (T, D).

The up-projection of LoRAFusion (arXiv 2510.00206, Sec. 4.1) as a stand-alone kernel: in the
forward it writes ``Δ = S'·Bᵀ + b`` that the frozen GEMM then accumulates onto
(``addmm_``, cuBLAS reads it as C). With dropout it can write ``mask ⊙ (dS'·A)/(1−p)``,
regenerating the forward's mask from the seed; the fused backward gets that term from
`lora_wgrad`'s fused expand instead, which draws the mask once for dA and dX. With per-adapter
scales ``c_a`` it is the forward of `lora_split.lora_up` (``c_a·S·B_aᵀ``, S unscaled).
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
    def _lora_expand_kernel(
        s_ptr,
        m_ptr,
        bias_ptr,
        out_ptr,
        tiles_ptr,
        scale_ptr,
        p_ptr,
        keys_ptr,
        seed,
        D,
        R,
        col_off,
        stride_st,
        stride_ma,
        stride_mr,
        stride_md,
        stride_ot,
        HAS_BIAS: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_DROPOUT: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_d = tl.program_id(1)
        adapter = tl.load(tiles_ptr + pid_t * 3)
        row_start = tl.load(tiles_ptr + pid_t * 3 + 1)
        row_end = tl.load(tiles_ptr + pid_t * 3 + 2)
        rows = row_start + tl.arange(0, BLOCK_T)
        row_ok = rows < row_end
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        s = tl.load(
            s_ptr + rows.to(tl.int64)[:, None] * stride_st + ranks[None, :],
            mask=row_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )  # (BLOCK_T, BLOCK_R)
        m = tl.load(
            m_ptr
            + adapter.to(tl.int64) * stride_ma
            + ranks[:, None] * stride_mr
            + cols[None, :] * stride_md,
            mask=rank_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # (BLOCK_R, BLOCK_D)
        acc = tl.dot(s, m, input_precision=DOT_PRECISION)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + adapter)
        if HAS_DROPOUT:
            p = tl.load(p_ptr + adapter)
            keys = tl.load(keys_ptr + rows, mask=row_ok, other=0)
            keep = keep_mask_tile(seed, keys, pid_d * BLOCK_D + col_off, p, BLOCK_D)
            acc = tl.where(keep, acc * (1.0 / (1.0 - p)), 0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        if ACCUMULATE:  # onto a product already there (an FP8 GEMM's output, which has no C)
            acc += tl.load(out, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Write-bound: one pass writing (T, D). 64x128 tiles, 16 KB stored per program.
_TILE_CONFIGS = [
    TileConfig(block_t=16, block_d=32, num_warps=4, num_stages=1),  # interpreter: many tiles
    TileConfig(block_t=64, block_d=128, num_warps=4, num_stages=1),
    TileConfig(block_t=128, block_d=128, num_warps=8, num_stages=1),
    TileConfig(block_t=64, block_d=256, num_warps=8, num_stages=1),
    TileConfig(block_t=32, block_d=128, num_warps=4, num_stages=1),
]


def _hopper_config(key: tuple) -> TileConfig:
    _, _, block_r = key  # key = (T, D, BLOCK_R)
    return _TILE_CONFIGS[1] if block_r <= 64 else _TILE_CONFIGS[4]


def lora_expand(
    s: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    out_dtype: torch.dtype | None = None,
    *,
    scales: torch.Tensor | None = None,
    col_offset: int = 0,
    full_width: int | None = None,
) -> torch.Tensor:
    """Launch the grouped expand.

    Args:
        s: (T, R) contiguous small tensor (``S' = s·drop(X)·Aᵀ`` or ``dS'``).
        m: (A, R, D) per-adapter matrices, any strides (``lora_b.transpose(1, 2)`` or ``lora_a``).
        bias: (D,) bias added to every row, or None.
        dropouts: (A,) fp32 dropout probabilities (mask applied to the product), or None.
        layout: the microbatch's adapter layout.
        seed: Philox seed of the dropout mask over the ``(T, D)`` output.
        out_dtype: dtype of the result (default ``s.dtype``).
        scales: (A,) fp32 per-adapter scale ``c_a`` on the product, or None for 1.
        col_offset: for a tensor-parallel shard of the output's columns, the index of its
            column 0 in the full width (a multiple of 8): the mask is columns
            ``col_offset:col_offset + D`` of the ``full_width``-wide mask; its rows are keyed by
            ``layout.row_keys``.
        full_width: the full width of the mask (default ``D``).

    Returns:
        (T, D) tensor, every row written.

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor).
        NotImplementedError: for a ``col_offset`` that is not a multiple of 8.
    """
    _utils.check_tensor("s", s, (layout.num_tokens, None), _utils.KERNEL_DTYPES, s.device)
    rank = s.shape[1]
    adapters = layout.num_adapters
    if m.dim() != 3 or m.shape[0] != adapters or m.shape[1] != rank:
        raise ValueError(
            f"m has shape {tuple(m.shape)}, expected (A, R, D)=({adapters}, {rank}, D)"
        )
    if m.dtype != s.dtype or m.device != s.device:
        raise ValueError(f"m is {m.dtype} on {m.device}, expected {s.dtype} on {s.device}")
    width = m.shape[2]
    if bias is not None:
        _utils.check_tensor("bias", bias, (width,), _utils.KERNEL_DTYPES, s.device)
    if scales is not None:
        _utils.check_tensor("scales", scales, (adapters,), (torch.float32,), s.device)
    _utils.check_dropouts(dropouts, adapters, s.device)
    _utils.mask_width(width, col_offset, full_width)
    return lora_expand_fwd(s, m, bias, dropouts, layout, seed, out_dtype, scales, col_offset)


def lora_expand_fwd(
    s: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    out_dtype: torch.dtype | None = None,
    scales: torch.Tensor | None = None,
    col_offset: int = 0,
    accumulate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the expand on inputs already checked (`lora_expand` checks, then calls this).

    The autograd functions check their inputs once and call this in forward and backward
    (``col_offset`` already checked). ``accumulate``: a contiguous (T, D) tensor the result
    is added to in place (and returned), or None for a fresh output.
    """
    tokens, rank = s.shape
    width = m.shape[2]
    block_r = _utils.padded_rank(rank)
    if accumulate is None:
        out = torch.empty(tokens, width, dtype=out_dtype or s.dtype, device=s.device)
    else:
        out = accumulate
    if tokens == 0:
        return out

    def run(cfg: TileConfig, out: torch.Tensor = out) -> None:
        tiles = layout.tiles(cfg.block_t, s.device)
        grid = (tiles.shape[0], _utils.cdiv(width, cfg.block_d))
        _lora_expand_kernel[grid](
            s,
            m,
            bias if bias is not None else s,
            out,
            tiles,
            scales if scales is not None else s,
            dropouts if dropouts is not None else s,
            layout.keys(),
            seed,
            width,
            rank,
            col_offset,
            s.stride(0),
            m.stride(0),
            m.stride(1),
            m.stride(2),
            out.stride(0),
            HAS_BIAS=bias is not None,
            HAS_SCALE=scales is not None,
            HAS_DROPOUT=dropouts is not None,
            ACCUMULATE=accumulate is not None,
            DOT_PRECISION="ieee" if s.dtype == torch.float32 else None,
            BLOCK_T=cfg.block_t,
            BLOCK_D=cfg.block_d,
            BLOCK_R=block_r,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    key = (tokens, width, block_r)
    # Timing candidates (off Hopper) runs the kernel many times: not onto `accumulate`.
    scratch = (lambda: torch.empty_like(out)) if accumulate is not None else (lambda: out)
    cfg = _utils.pick_config(
        "lora_expand",
        key,
        s.device,
        _hopper_config,
        _TILE_CONFIGS,
        lambda cfg: run(cfg, scratch()),
    )
    run(cfg)
    return out


def lora_expand_ref(
    s: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None,
    keep_mask: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `lora_expand` with an explicit ``(T, D)`` bool keep-mask."""
    out = s.new_zeros(s.shape[0], m.shape[2], dtype=torch.float32)
    for adapter, start, end in layout.segments():
        part = s[start:end].float() @ m[adapter].float()  # (T_a, D)
        if scales is not None:
            part = float(scales[adapter]) * part
        if keep_mask is not None and dropouts is not None and float(dropouts[adapter]) > 0:
            part = part * keep_mask[start:end] / (1.0 - float(dropouts[adapter]))
        out[start:end] = part
    if bias is not None:
        out += bias.float()
    return out.to(s.dtype)
