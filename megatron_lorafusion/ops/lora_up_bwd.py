"""Backward of the LoRA up-projection in one pass over dY: ``dS = c·dY·B`` and ``dB = c'·dYᵀ·S``.

Item (3) of LoRAFusion's backward (arXiv 2510.00206, Sec. 4.2): each (T, N) tile of dY is read
once and feeds both products. A program owns a chunk of one adapter's rows and a tile of N
columns: it accumulates that tile's ``dB`` partial over the chunk (fp32) and writes, for each
row block, that tile's fp32 partial of ``dS``; a second launch sums both kinds of partial in a
fixed order. No atomics, so the result is bitwise repeatable.

Under an FP8 base the same pass can also quantize dY for the frozen dX GEMM
(`lora_up_bwd_quantized`): given the row maxima dY's producer found (SwiGLU's backward, for
fc1), each tile of ``dY·diag(s_w)`` is written in e4m3 as it is read, as `quantize_rows` would
write it, bit for bit, so the quantizer's own read of dY goes.

The ``dS`` partials cost ``2 · (N / BLOCK_N) · BLOCK_R · 4`` bytes per token of extra traffic
against the ``2·N`` bytes (bf16) of the dY read they save, so the one pass only pays for small
ranks; above ``_ONE_PASS_MAX_BLOCK_R`` the launcher uses the two-pass path (`lora_shrink` and
`lora_wgrad`, each reading dY once).
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import TileConfig, triton
from megatron_lorafusion.ops.fp8 import FP8_DTYPE
from megatron_lorafusion.ops.fp8_quant import (
    empty_quantized,
    quantize_rows_fwd,
    row_scales_from_maxima,
)
from megatron_lorafusion.ops.layout import AdapterLayout
from megatron_lorafusion.ops.lora_shrink import lora_shrink_fwd
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad_fwd

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops.fp8_quant import inverse_pow2, store_quantized_rows

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
    def _lora_up_bwd_kernel(
        dy_ptr,
        s_ptr,
        b_ptr,
        scale_ptr,
        ds_part_ptr,
        db_part_ptr,
        chunks_ptr,
        col_ptr,
        row_scale_ptr,
        q_ptr,
        T,
        N,
        R,
        stride_dyt,
        stride_st,
        stride_ba,
        stride_bn,
        stride_br,
        stride_qt,
        SCALE_DB: tl.constexpr,
        QUANTIZE: tl.constexpr,
        HW_CAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        pid_c = tl.program_id(0)
        pid_n = tl.program_id(1)
        adapter = tl.load(chunks_ptr + pid_c * 3)
        row_start = tl.load(chunks_ptr + pid_c * 3 + 1)
        row_end = tl.load(chunks_ptr + pid_c * 3 + 2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        scale = tl.load(scale_ptr + adapter)
        b = tl.load(
            b_ptr
            + adapter.to(tl.int64) * stride_ba
            + cols[:, None] * stride_bn
            + ranks[None, :] * stride_br,
            mask=col_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_R)
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        ds_part = ds_part_ptr + pid_n.to(tl.int64) * T * BLOCK_R  # this tile's (T, BLOCK_R)
        if QUANTIZE:
            col_scale = tl.load(col_ptr + cols, mask=col_ok, other=0.0)
        for t0 in range(row_start, row_end, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            row_ok = rows < row_end
            dy = tl.load(
                dy_ptr + rows.to(tl.int64)[:, None] * stride_dyt + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )  # (BLOCK_T, BLOCK_N)
            if QUANTIZE:  # this tile of dY·diag(col_scale) in e4m3, as `quantize_rows` writes it
                inv = inverse_pow2(tl.load(row_scale_ptr + rows, mask=row_ok, other=1.0))
                store_quantized_rows(
                    q_ptr + rows.to(tl.int64)[:, None] * stride_qt,
                    cols,
                    row_ok[:, None] & col_ok[None, :],
                    dy.to(tl.float32) * col_scale[None, :],
                    inv,
                    HW_CAST,
                )
            s = tl.load(
                s_ptr + rows.to(tl.int64)[:, None] * stride_st + ranks[None, :],
                mask=row_ok[:, None] & rank_ok[None, :],
                other=0.0,
            )  # (BLOCK_T, BLOCK_R)
            acc = tl.dot(tl.trans(dy), s, acc, input_precision=DOT_PRECISION)
            ds = tl.dot(dy, b, input_precision=DOT_PRECISION) * scale  # (BLOCK_T, BLOCK_R)
            tl.store(
                ds_part + rows.to(tl.int64)[:, None] * BLOCK_R + ranks[None, :],
                ds,
                mask=row_ok[:, None],
            )
        if SCALE_DB:
            acc = acc * scale
        part = db_part_ptr + (pid_c.to(tl.int64) * N + cols[:, None]) * BLOCK_R + ranks[None, :]
        tl.store(part, acc, mask=col_ok[:, None])

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
    def _lora_up_bwd_reduce_kernel(
        ds_part_ptr,
        ds_ptr,
        db_part_ptr,
        db_ptr,
        ranges_ptr,
        T,
        N,
        R,
        n_col_tiles,
        db_programs,
        stride_dst,
        stride_dba,
        stride_dbn,
        stride_dbr,
        BLOCK_D: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # One launch for both sums (one host launch less): programs [0, db_programs) reduce
        # dB per (adapter, column tile), the rest reduce dS per row block.
        pid = tl.program_id(0)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        if pid < db_programs:
            col_tiles = tl.cdiv(N, BLOCK_D)
            adapter = pid // col_tiles
            cols = (pid % col_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
            col_ok = cols < N
            first = tl.load(ranges_ptr + adapter)
            last = tl.load(ranges_ptr + adapter + 1)
            acc = tl.zeros((BLOCK_D, BLOCK_R), dtype=tl.float32)
            stride_c = N * BLOCK_R  # one chunk's partial, (N, BLOCK_R) fp32
            part = (
                db_part_ptr
                + first.to(tl.int64) * stride_c
                + cols[:, None] * BLOCK_R
                + ranks[None, :]
            )
            for _ in range(first, last):  # fixed order: deterministic
                acc += tl.load(part, mask=col_ok[:, None], other=0.0)
                part += stride_c
            out = (
                db_ptr
                + adapter.to(tl.int64) * stride_dba
                + cols[:, None] * stride_dbn
                + ranks[None, :] * stride_dbr
            )
            tl.store(out, acc.to(db_ptr.dtype.element_ty), mask=col_ok[:, None] & rank_ok[None, :])
        else:
            rows = (pid - db_programs) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_ok = rows < T
            acc = tl.zeros((BLOCK_ROWS, BLOCK_R), dtype=tl.float32)
            part = ds_part_ptr + rows.to(tl.int64)[:, None] * BLOCK_R + ranks[None, :]
            for _ in range(n_col_tiles):  # fixed order: deterministic
                acc += tl.load(part, mask=row_ok[:, None], other=0.0)
                part += T * BLOCK_R
            out = ds_ptr + rows.to(tl.int64)[:, None] * stride_dst + ranks[None, :]
            tl.store(out, acc.to(ds_ptr.dtype.element_ty), mask=row_ok[:, None] & rank_ok[None, :])


# Read-bound: one pass over dY. Wide column tiles keep the dS partials small (see the module
# docstring); block_t is the row step inside a chunk, chunks give ~4 programs per SM.
_TILE_CONFIGS = [
    TileConfig(block_t=16, block_d=32, num_warps=4, num_stages=2),  # interpreter: many tiles
    TileConfig(block_t=64, block_d=256, num_warps=8, num_stages=3),
    TileConfig(block_t=32, block_d=256, num_warps=8, num_stages=3),
    TileConfig(block_t=64, block_d=128, num_warps=4, num_stages=3),
    TileConfig(block_t=32, block_d=512, num_warps=8, num_stages=2),
]
# One wave of programs: 0.050 / 0.175 ms at N = 4096 / 14336 (T = 16384, H200, graphed)
# against 0.060 / 0.183 at 4 programs per SM and 0.093 / 0.201 at 16 (docs/kernels.md).
_PROGRAMS_PER_SM = 1
_ONE_PASS_MAX_BLOCK_R = 32  # at BLOCK_R = 64 and 256 columns the partials cost the read saved
_REDUCE_BLOCK_D = 64
_REDUCE_BLOCK_ROWS = 64


def _hopper_config(key: tuple) -> TileConfig:
    _, _, block_r = key  # key = (T, N, BLOCK_R)
    return _TILE_CONFIGS[1] if block_r <= 16 else _TILE_CONFIGS[2]


def lora_up_bwd(
    dy: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    layout: AdapterLayout,
    *,
    scale_db: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``Δ[seg_a] = c_a·S[seg_a]·B_aᵀ`` from one read of dY (small ranks).

    Args:
        dy: (T, N) contiguous output gradient, adapter-major rows.
        s: (T, R) contiguous input of the up-projection, ``dy``'s dtype.
        lora_b: (A, N, R) up-projections, ``dy``'s dtype, any strides.
        scales: (A,) fp32 per-adapter scale ``c_a`` on ``dy``'s device.
        layout: the microbatch's adapter layout.
        scale_db: multiply ``dB`` by ``c_a`` too: True when ``s`` is unscaled
            (`lora_split.lora_up`), False when ``s`` already carries the scale (the fused op's
            ``S' = c·drop(X)·Aᵀ``).

    Returns:
        ``(dS, dB)``: (T, R) ``c_a·dY·B_a`` in ``dy``'s dtype, and (A, N, R)
        ``[c_a·]dY_aᵀ·S_a`` in ``lora_b``'s dtype (zeros for adapters without tokens).

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor).
        NotImplementedError: for a rank above 256.
    """
    _check_inputs(dy, s, lora_b, scales, layout)
    return _lora_up_bwd_launch(dy, s, lora_b, scales, layout, scale_db)


def _check_inputs(dy, s, lora_b, scales, layout) -> None:
    _utils.check_tensor("dy", dy, (layout.num_tokens, None), _utils.KERNEL_DTYPES, dy.device)
    tokens, width = dy.shape
    _utils.check_tensor("s", s, (tokens, None), (dy.dtype,), dy.device)
    adapters, rank = layout.num_adapters, s.shape[1]
    if tuple(lora_b.shape) != (adapters, width, rank) or lora_b.dtype != dy.dtype:
        raise ValueError(
            f"lora_b has shape {tuple(lora_b.shape)} {lora_b.dtype}, "
            f"expected (A, N, R)=({adapters}, {width}, {rank}) {dy.dtype}"
        )
    if lora_b.device != dy.device:
        raise ValueError(f"lora_b is on {lora_b.device}, expected {dy.device}")
    _utils.check_tensor("scales", scales, (adapters,), (torch.float32,), dy.device)
    _utils.padded_rank(rank)


def lora_up_bwd_quantized(
    dy: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    layout: AdapterLayout,
    col_scale: torch.Tensor,
    amax_parts: torch.Tensor,
    *,
    scale_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lora_up_bwd`, and ``quantize_rows(dy, col_scale)`` from the same read of dY.

    For an FP8 frozen weight's dX GEMM, whose incoming gradient's producer found its rows'
    maxima (`fp8_quant.attach_row_maxima`): the row scales come from the maxima, then each
    tile of ``dY·diag(col_scale)`` is written in e4m3 as it is read. Ranks that take two
    passes quantize with `quantize_rows_fwd` instead.

    Args:
        dy: (T, N) contiguous output gradient, as `lora_up_bwd`'s.
        s: (T, R) as `lora_up_bwd`'s.
        lora_b: (A, N, R) as `lora_up_bwd`'s.
        scales: (A,) as `lora_up_bwd`'s.
        layout: the microbatch's adapter layout.
        col_scale: (N,) fp32 the frozen weight's channel scales.
        amax_parts: (T, P) fp32 largest ``|dy·col_scale|`` of P column blocks of each row.
        scale_db: as `lora_up_bwd`'s.

    Returns:
        ``(dS, dB, q, scale)``: `lora_up_bwd`'s, then (T, N) e4m3 and (T,) fp32, bit for bit
        `quantize_rows(dy, col_scale)`'s.

    Raises:
        ValueError: as `lora_up_bwd`; for a ``col_scale`` or ``amax_parts`` of the wrong
            shape, dtype or device.
    """
    _check_inputs(dy, s, lora_b, scales, layout)
    tokens, width = dy.shape
    _utils.check_tensor("col_scale", col_scale, (width,), (torch.float32,), dy.device)
    _utils.check_tensor("amax_parts", amax_parts, (tokens, None), (torch.float32,), dy.device)
    q, row_scale = empty_quantized(tokens, width, dy.device)
    if _utils.padded_rank(s.shape[1]) > _ONE_PASS_MAX_BLOCK_R:  # two passes: no tile to share
        quantize_rows_fwd(dy, q, row_scale, col_scale, amax_parts=amax_parts)
        quantize = None
    else:
        row_scales_from_maxima(amax_parts, row_scale)
        quantize = (col_scale, row_scale, q)
    ds, db = _lora_up_bwd_launch(dy, s, lora_b, scales, layout, scale_db, quantize)
    return ds, db, q, row_scale


def _lora_up_bwd_launch(
    dy, s, lora_b, scales, layout, scale_db, quantize=None
) -> tuple[torch.Tensor, ...]:
    """`lora_up_bwd` after its input checks; ``quantize``: ``(col_scale, row_scale, q)``."""
    tokens, width = dy.shape
    rank = s.shape[1]
    block_r = _utils.padded_rank(rank)
    if block_r > _ONE_PASS_MAX_BLOCK_R:
        return _two_pass(dy, s, lora_b, scales, layout, scale_db)
    adapters = layout.num_adapters
    ds = torch.empty(tokens, rank, dtype=dy.dtype, device=dy.device)
    db = torch.empty_like(lora_b)
    if tokens == 0:
        return ds, db.zero_()
    col_scale, row_scale, q = quantize if quantize is not None else (scales, scales, ds)

    def run(cfg: TileConfig) -> None:
        chunk = _utils.chunk_rows(tokens, width, cfg, dy.device, _PROGRAMS_PER_SM)
        chunks = layout.tiles(chunk, dy.device)
        ranges = layout.tile_ranges(chunk, dy.device)
        col_tiles = _utils.cdiv(width, cfg.block_d)
        ds_part = torch.empty(col_tiles, tokens, block_r, dtype=torch.float32, device=dy.device)
        db_part = torch.empty(
            chunks.shape[0], width, block_r, dtype=torch.float32, device=dy.device
        )
        _lora_up_bwd_kernel[(chunks.shape[0], col_tiles)](
            dy,
            s,
            lora_b,
            scales,
            ds_part,
            db_part,
            chunks,
            col_scale,
            row_scale,
            q,
            tokens,
            width,
            rank,
            dy.stride(0),
            s.stride(0),
            lora_b.stride(0),
            lora_b.stride(1),
            lora_b.stride(2),
            q.stride(0),
            SCALE_DB=scale_db,
            QUANTIZE=quantize is not None,
            HW_CAST=dy.is_cuda and q.dtype == FP8_DTYPE,
            DOT_PRECISION="ieee" if dy.dtype == torch.float32 else None,
            BLOCK_T=cfg.block_t,
            BLOCK_N=cfg.block_d,
            BLOCK_R=block_r,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        db_programs = adapters * _utils.cdiv(width, _REDUCE_BLOCK_D)
        grid = (db_programs + _utils.cdiv(tokens, _REDUCE_BLOCK_ROWS),)
        _lora_up_bwd_reduce_kernel[grid](
            ds_part,
            ds,
            db_part,
            db,
            ranges,
            tokens,
            width,
            rank,
            col_tiles,
            db_programs,
            ds.stride(0),
            db.stride(0),
            db.stride(1),
            db.stride(2),
            BLOCK_D=_REDUCE_BLOCK_D,
            BLOCK_ROWS=_REDUCE_BLOCK_ROWS,
            BLOCK_R=block_r,
        )

    key = (tokens, width, block_r)
    cfg = _utils.pick_config("lora_up_bwd", key, dy.device, _hopper_config, _TILE_CONFIGS, run)
    run(cfg)
    return ds, db


def _two_pass(dy, s, lora_b, scales, layout, scale_db) -> tuple[torch.Tensor, torch.Tensor]:
    """Large ranks: `lora_shrink` over dY for dS, `lora_wgrad` over dY for dB."""
    ds = lora_shrink_fwd(dy, lora_b.transpose(1, 2), scales, None, layout, 0)  # (T, R)
    db = lora_wgrad_fwd(dy, s, torch.empty_like(lora_b), None, layout, 0)  # (A, N, R)
    if scale_db:
        db.mul_(scales.to(db.dtype)[:, None, None])
    return ds, db


def lora_up_bwd_ref(
    dy: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    layout: AdapterLayout,
    *,
    scale_db: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `lora_up_bwd`: ``(dS, dB)`` in fp32."""
    ds = torch.zeros(dy.shape[0], s.shape[1], dtype=torch.float32, device=dy.device)
    db = torch.zeros(lora_b.shape, dtype=torch.float32, device=dy.device)
    for adapter, start, end in layout.segments():
        scale = float(scales[adapter])
        dy_seg = dy[start:end].float()  # (T_a, N)
        ds[start:end] = scale * (dy_seg @ lora_b[adapter].float())  # (T_a, R)
        db[adapter] = (scale if scale_db else 1.0) * (dy_seg.t() @ s[start:end].float())
    return ds, db
