"""Triton GEMM with the LoRA term in its epilogue: ``out = Z·Wop + drop_a(S·M_a) + b``.

LoRAFusion's fused up-projection (arXiv 2510.00206, Sec. 4.1): the frozen product and the
LoRA up-projection in one kernel, so the (T, D) output is written once. M-tiles come from
`AdapterLayout.tiles` (each tile inside one adapter's segment), so the epilogue reads a
single adapter's ``M_a`` and dropout. `fused_lora_linear` calls it in the forward: ``Z = X``,
``Wop = Wᵀ``, ``S = S'``, ``M = Bᵀ``, no dropout; the kernel also takes ``Wop = W`` and a
dropout epilogue (the dX form ``Z = dY``, ``S = dS'``, ``M = A``, docs/kernels.md).

Hopper-style: Z, W and the output go through TMA tensor descriptors (host-side
``TensorDescriptor``; before Hopper Triton rewrites them into pointer loads); a persistent
grid of one program per SM walks the tiles in grouped order; the epilogue runs on column
sub-tiles so the LoRA product and the dropout RNG need fewer registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.layout import AdapterLayout

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from megatron_lorafusion.ops._utils import keep_mask_tile

    @triton.jit
    def _tile_coords(t, n_tiles, n_cols, GROUP_M: tl.constexpr):
        """Grouped order: GROUP_M row tiles sweep the N tiles together, sharing W in L2."""
        per_group = GROUP_M * n_cols
        first = (t // per_group) * GROUP_M
        size = min(n_tiles - first, GROUP_M)
        return first + (t % per_group) % size, (t % per_group) // size

    @triton.jit
    def _add_lora_term(
        acc,
        s,
        m,
        p,
        seed,
        rows,
        col0,
        row_offset,
        col_offset,
        mask_d,
        HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """``acc + drop(s·m)`` for one fp32 output tile ``acc``, the LoRA term of the epilogue.

        ``s`` is (BLOCK_M, BLOCK_R) rows of ``S'``, ``m`` (BLOCK_R, BLOCK_N) columns of the
        adapter's ``Bᵀ`` (or ``A``), ``col0`` the output column of ``acc``'s column 0. The
        dropout mask is regenerated from the seed, keyed by whole-microbatch rows and
        full-width columns, so a shard draws its part of it.
        """
        if HAS_DROPOUT:
            lora = tl.dot(s, m, input_precision=DOT_PRECISION)
            if p > 0:
                keep = keep_mask_tile(
                    seed, row_offset + rows, col_offset + col0, mask_d, p, acc.shape[1]
                )
                lora = tl.where(keep, lora * (1.0 / (1.0 - p)), 0.0)
            acc += lora
        else:
            acc = tl.dot(s, m, acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def _tma_epilogue(
        acc,
        s,
        out_desc,
        out_ptr,
        m_ptr,
        bias_ptr,
        adapter,
        p,
        seed,
        row_offset,
        col_offset,
        mask_d,
        row_start,
        row_end,
        D,
        R,
        col0,
        stride_ma,
        stride_mr,
        stride_md,
        stride_ot,
        HAS_BIAS: tl.constexpr,
        HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Add the LoRA term (and bias) to one column sub-tile ``acc`` and store it."""
        BLOCK_M: tl.constexpr = acc.shape[0]
        SUB_N: tl.constexpr = acc.shape[1]
        BLOCK_R: tl.constexpr = s.shape[1]
        cols = col0 + tl.arange(0, SUB_N)
        col_ok = cols < D
        ranks = tl.arange(0, BLOCK_R)
        m = tl.load(
            m_ptr
            + adapter.to(tl.int64) * stride_ma
            + ranks[:, None] * stride_mr
            + cols[None, :] * stride_md,
            mask=(ranks < R)[:, None] & col_ok[None, :],
            other=0.0,
        )  # (BLOCK_R, SUB_N)
        rows = row_start + tl.arange(0, BLOCK_M)
        acc = _add_lora_term(
            acc,
            s,
            m,
            p,
            seed,
            rows,
            col0,
            row_offset,
            col_offset,
            mask_d,
            HAS_DROPOUT,
            DOT_PRECISION,
        )
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        val = acc.to(out_ptr.dtype.element_ty)
        if row_end - row_start == BLOCK_M:
            out_desc.store([row_start, col0], val)  # TMA clips columns at D
        else:
            # Ragged tile: TMA clips only at the tensor edge, so rows past row_end (the next
            # adapter's) must not be written; a masked pointer store keeps them intact.
            out = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
            tl.store(out, val, mask=(rows < row_end)[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["seed", "row_offset", "col_offset"])
    def _lora_gemm_tma_kernel(
        z_desc,
        w_desc,
        out_desc,
        s_ptr,
        m_ptr,
        bias_ptr,
        out_ptr,
        tiles_ptr,
        p_ptr,
        seed,
        row_offset,
        col_offset,
        mask_d,
        n_tiles,
        D,
        K,
        R,
        stride_st,
        stride_ma,
        stride_mr,
        stride_md,
        stride_ot,
        HAS_BIAS: tl.constexpr,
        HAS_DROPOUT: tl.constexpr,
        W_BY_ROWS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        GROUP_M: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
        EPI_SPLIT: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
    ):
        n_cols = tl.cdiv(D, BLOCK_N)
        k_steps = tl.cdiv(K, BLOCK_K)
        SUB_N: tl.constexpr = BLOCK_N // EPI_SPLIT
        # flatten=True (one pipeline across tiles) fails in triton 3.6's TritonGPUFuseNestedLoops
        # on this loop (the epilogue's scf.if), measured; so each tile drains its pipeline.
        for t in tl.range(tl.program_id(0), n_tiles * n_cols, NUM_PROGRAMS):
            tile, pid_n = _tile_coords(t, n_tiles, n_cols, GROUP_M)
            adapter = tl.load(tiles_ptr + tile * 3)
            row_start = tl.load(tiles_ptr + tile * 3 + 1)
            row_end = tl.load(tiles_ptr + tile * 3 + 2)
            col0 = pid_n * BLOCK_N
            # A ragged tile loads rows of the next adapter (or zeros past T): rows of a
            # product are independent, and the epilogue never stores them. K past the
            # tensor edge reads as zeros, so there is no K mask.
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_steps):
                z = z_desc.load([row_start, ki * BLOCK_K])  # (BLOCK_M, BLOCK_K)
                if W_BY_ROWS:
                    w = w_desc.load([col0, ki * BLOCK_K]).T  # Wop = Wᵀ: (N, K) row-major
                else:
                    w = w_desc.load([ki * BLOCK_K, col0])  # (BLOCK_K, BLOCK_N)
                acc = tl.dot(z, w, acc, input_precision=DOT_PRECISION)
            rows = row_start + tl.arange(0, BLOCK_M)
            ranks = tl.arange(0, BLOCK_R)
            s = tl.load(
                s_ptr + rows.to(tl.int64)[:, None] * stride_st + ranks[None, :],
                mask=(rows < row_end)[:, None] & (ranks < R)[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_R)
            p = 0.0
            if HAS_DROPOUT:
                p = tl.load(p_ptr + adapter)
            # Sub-tiles of SUB_N columns: the LoRA product and the RNG live for one
            # sub-tile at a time (the full-width epilogue spilled: 105 TFLOP/s, docs/kernels.md).
            if EPI_SPLIT == 1:
                _tma_epilogue(
                    acc,
                    s,
                    out_desc,
                    out_ptr,
                    m_ptr,
                    bias_ptr,
                    adapter,
                    p,
                    seed,
                    row_offset,
                    col_offset,
                    mask_d,
                    row_start,
                    row_end,
                    D,
                    R,
                    col0,
                    stride_ma,
                    stride_mr,
                    stride_md,
                    stride_ot,
                    HAS_BIAS,
                    HAS_DROPOUT,
                    DOT_PRECISION,
                )
            else:  # EPI_SPLIT == 2
                # (BLOCK_M, BLOCK_N) -> column halves (BLOCK_M, BLOCK_N / 2)
                a0, a1 = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                _tma_epilogue(
                    a0,
                    s,
                    out_desc,
                    out_ptr,
                    m_ptr,
                    bias_ptr,
                    adapter,
                    p,
                    seed,
                    row_offset,
                    col_offset,
                    mask_d,
                    row_start,
                    row_end,
                    D,
                    R,
                    col0,
                    stride_ma,
                    stride_mr,
                    stride_md,
                    stride_ot,
                    HAS_BIAS,
                    HAS_DROPOUT,
                    DOT_PRECISION,
                )
                _tma_epilogue(
                    a1,
                    s,
                    out_desc,
                    out_ptr,
                    m_ptr,
                    bias_ptr,
                    adapter,
                    p,
                    seed,
                    row_offset,
                    col_offset,
                    mask_d,
                    row_start,
                    row_end,
                    D,
                    R,
                    col0 + SUB_N,
                    stride_ma,
                    stride_mr,
                    stride_md,
                    stride_ot,
                    HAS_BIAS,
                    HAS_DROPOUT,
                    DOT_PRECISION,
                )


class TmaConfig(NamedTuple):
    """Tile config of the kernel (block sizes in elements)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    epi_split: int  # epilogue column sub-tiles: 1 or 2

    def label(self) -> str:
        """Compact name for tables: ``128x256x64 w8 s3 e2``."""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} "
            f"s{self.num_stages} e{self.epi_split}"
        )


# The configs the kernel runs: the interpreter's first (small blocks, several tiles per
# program), then Hopper's and fp32's below. `fused_lora_linear` runs the kernel on Hopper
# only; `_utils.pick_config` would time these on another GPU. The ten-config H200 sweep that
# chose them is in docs/kernels.md.
_TMA_TILE_CONFIGS = [
    TmaConfig(16, 32, 16, 4, 1, 2),
    TmaConfig(128, 256, 64, 8, 3, 2),
    TmaConfig(256, 128, 64, 8, 3, 2),
    # fp32 (tests): TMA stages live in shared memory, 128x256x64 fp32 needs 96 KiB a stage.
    TmaConfig(64, 64, 32, 4, 3, 1),
]
# Hopper's tiles for 2-byte dtypes, keyed by (W read by rows, i.e. the forward's Wᵀ; dropout
# epilogue): the best of the sweep summed over (16384, 4096, 14336) and (16384, 14336, 4096)
# on the H200 (docs/kernels.md, "Design choices").
_TMA_HOPPER = {
    (True, False): _TMA_TILE_CONFIGS[1],
    (True, True): _TMA_TILE_CONFIGS[1],
    (False, False): _TMA_TILE_CONFIGS[2],  # 256x128: the dX form without dropout
    (False, True): _TMA_TILE_CONFIGS[1],
}
_TMA_FP32 = _TMA_TILE_CONFIGS[3]
_GROUP_M = 8
_INTERPRETER_PROGRAMS = 3  # persistent programs in the interpreter: each loops over tiles


def _hopper_config(key: tuple) -> TmaConfig:
    """Hopper's tile for problem ``key`` (ends with element size, W by rows, dropout)."""
    return _TMA_HOPPER[key[-2:]] if key[-3] == 2 else _TMA_FP32


def tma_supported(z: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """True when TMA descriptors can cover ``z``, ``w`` and ``out``.

    TMA needs a unit stride in one dimension, 16-byte aligned bases and 16-byte aligned
    strides in the other (so ``D·itemsize`` and ``K·itemsize`` multiples of 16). ``out``
    None stands for the fresh contiguous (T, D) output `lora_gemm` allocates.
    """

    def aligned(t: torch.Tensor, other_stride: int) -> bool:
        return t.data_ptr() % 16 == 0 and (other_stride * t.element_size()) % 16 == 0

    w_ok = (w.stride(1) == 1 and aligned(w, w.stride(0))) or (
        w.stride(0) == 1 and aligned(w, w.stride(1))
    )
    out_ok = (
        (w.shape[1] * z.element_size()) % 16 == 0
        if out is None
        else out.stride(1) == 1 and aligned(out, out.stride(0))
    )
    return z.stride(1) == 1 and aligned(z, z.stride(0)) and w_ok and out_ok


def _launch_tma(
    z,
    w,
    s,
    m,
    bias,
    dropouts,
    layout,
    seed,
    out,
    cfg: TmaConfig,
    col_offset=0,
    mask_d=None,
):
    """Launch the TMA kernel; returns Triton's compiled kernel (registers, spills)."""
    tokens, inner = z.shape
    width = w.shape[1]
    tiles = layout.tiles(cfg.block_m, z.device)
    z_desc = TensorDescriptor(z, [tokens, inner], [z.stride(0), 1], [cfg.block_m, cfg.block_k])
    by_rows = w.stride(1) != 1  # w = weight.t(): describe weight (D, K) and transpose tiles
    if by_rows:
        w_desc = TensorDescriptor(w, [width, inner], [w.stride(1), 1], [cfg.block_n, cfg.block_k])
    else:
        w_desc = TensorDescriptor(w, [inner, width], [w.stride(0), 1], [cfg.block_k, cfg.block_n])
    out_desc = TensorDescriptor(
        out, [tokens, width], [out.stride(0), 1], [cfg.block_m, cfg.block_n // cfg.epi_split]
    )
    work = tiles.shape[0] * _utils.cdiv(width, cfg.block_n)
    programs = _INTERPRETER_PROGRAMS if z.device.type != "cuda" else _utils.sm_count(z.device.index)
    programs = max(1, min(programs, work))
    return _lora_gemm_tma_kernel[(programs,)](
        z_desc,
        w_desc,
        out_desc,
        s,
        m,
        bias if bias is not None else s,
        out,
        tiles,
        dropouts if dropouts is not None else s,
        seed,
        layout.row_offset,
        col_offset,
        mask_d or width,
        tiles.shape[0],
        width,
        inner,
        s.shape[1],
        s.stride(0),
        m.stride(0),
        m.stride(1),
        m.stride(2),
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_DROPOUT=dropouts is not None,
        W_BY_ROWS=by_rows,
        DOT_PRECISION="ieee" if z.dtype == torch.float32 else None,
        GROUP_M=_GROUP_M,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_R=_utils.padded_rank(s.shape[1]),
        EPI_SPLIT=cfg.epi_split,
        NUM_PROGRAMS=programs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _check_inputs(z, w, s, m, layout) -> None:
    _utils.check_tensor("z", z, (layout.num_tokens, None), _utils.KERNEL_DTYPES, z.device)
    inner = z.shape[1]
    if w.dim() != 2 or w.shape[0] != inner or w.dtype != z.dtype or w.device != z.device:
        raise ValueError(
            f"w has shape {tuple(w.shape)} {w.dtype}, expected (K={inner}, D) {z.dtype}"
        )
    _utils.check_tensor("s", s, (z.shape[0], None), (z.dtype,), z.device)
    want = (layout.num_adapters, s.shape[1], w.shape[1])
    if tuple(m.shape) != want or m.dtype != z.dtype:
        raise ValueError(
            f"m has shape {tuple(m.shape)} {m.dtype}, expected (A, R, D)={want} {z.dtype}"
        )
    _utils.padded_rank(s.shape[1])


def lora_gemm(
    z: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    m: torch.Tensor,
    bias: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    *,
    col_offset: int = 0,
    full_width: int | None = None,
) -> torch.Tensor:
    """Launch the GEMM with LoRA epilogue.

    Args:
        z: (T, K) contiguous left operand (X or dY), rows 16-byte aligned.
        w: (K, D) right operand, unit stride in one dimension (``weight.t()`` or ``weight``),
            the other stride 16-byte aligned.
        s: (T, R) contiguous ``S'`` or ``dS'``.
        m: (A, R, D) per-adapter matrices, any strides.
        bias: (D,) or None.
        dropouts: (A,) fp32 dropout applied to the LoRA term, or None.
        layout: the microbatch's adapter layout; the mask's rows are keyed by
            ``layout.row_offset + t``.
        seed: Philox seed of the dropout mask over the ``(T, D)`` output.
        col_offset: for a tensor-parallel shard of the output's columns, the index of its
            column 0 in the full width (a multiple of 8): the mask is columns
            ``col_offset:col_offset + D`` of the ``full_width``-wide mask.
        full_width: the full width of the mask (default ``D``).

    Returns:
        (T, D) tensor in ``z``'s dtype.

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor), or on
            strides TMA cannot describe (the message gives them; `tma_supported`).
        NotImplementedError: for a ``col_offset`` that is not a multiple of 8.
    """
    _check_inputs(z, w, s, m, layout)
    mask_d = _utils.mask_width(w.shape[1], col_offset, full_width)
    tokens, width = z.shape[0], w.shape[1]
    out = torch.empty(tokens, width, dtype=z.dtype, device=z.device)
    if tokens == 0:
        return out
    if not tma_supported(z, w, out):
        raise ValueError(
            f"lora_gemm needs TMA-describable operands (a unit stride, 16-byte aligned base "
            f"and rows): z strides {z.stride()}, w strides {w.stride()}, out strides "
            f"{out.stride()}, {z.element_size()}-byte elements"
        )
    args = (z, w, s, m, bias, dropouts, layout, seed, out)
    offsets = {"col_offset": col_offset, "mask_d": mask_d}
    key = (
        tokens,
        width,
        z.shape[1],
        _utils.padded_rank(s.shape[1]),
        z.element_size(),
        w.stride(1) != 1,
        dropouts is not None,
    )
    config = _utils.pick_config(
        "lora_gemm",
        key,
        z.device,
        _hopper_config,
        _TMA_TILE_CONFIGS,
        lambda cfg: _launch_tma(*args, cfg, **offsets),
    )
    _launch_tma(*args, config, **offsets)
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
