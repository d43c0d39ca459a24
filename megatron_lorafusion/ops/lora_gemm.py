"""Triton GEMM with the LoRA term in its epilogue: ``Y = X·Wᵀ + S'·B_aᵀ + b``.

LoRAFusion's fused up-projection (arXiv 2510.00206, Sec. 4.1): the frozen product and the
LoRA up-projection in one kernel, so the (T, N) output is written once. `fused_lora_linear`
runs it in the forward (``gemm="triton"``, the default on Hopper); ``S'`` already holds the
dropout and the scale. M-tiles come from `AdapterLayout.tiles` (each tile inside one adapter's
segment), so the epilogue reads a single adapter's ``B_a``. With FP8 operands (an FP8 base,
`ops.fp8_quant`) the epilogue first dequantizes the product by the rows' and columns' scales.

Hopper-style: X, W and Y go through TMA tensor descriptors (host-side ``TensorDescriptor``);
a persistent grid of one program per SM walks the tiles in grouped order; the epilogue runs
on column sub-tiles so the LoRA product needs fewer registers. The dX form (``dY·W`` with a
dropout epilogue) lost to cuBLAS and was removed: docs/kernels.md, "What we tried".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.fp8 import FP8_DTYPE
from megatron_lorafusion.ops.layout import AdapterLayout

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _tile_coords(t, n_tiles, n_cols, GROUP_M: tl.constexpr):
        """Grouped order: GROUP_M row tiles sweep the N tiles together, sharing W in L2."""
        per_group = GROUP_M * n_cols
        first = (t // per_group) * GROUP_M
        size = min(n_tiles - first, GROUP_M)
        return first + (t % per_group) % size, (t % per_group) // size

    @triton.jit
    def _epilogue(
        acc,
        s,
        x_scale,
        y_desc,
        y_ptr,
        b_ptr,
        bias_ptr,
        w_scale_ptr,
        adapter,
        row_start,
        row_end,
        N,
        R,
        col0,
        stride_ba,
        stride_br,
        stride_bn,
        stride_yt,
        HAS_BIAS: tl.constexpr,
        HAS_SCALES: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Add ``s·B_aᵀ`` (and the bias) to one column sub-tile ``acc`` and store it.

        ``s`` is (BLOCK_M, BLOCK_R) rows of ``S'``, ``col0`` the output column of ``acc``'s
        column 0. With FP8 operands (``HAS_SCALES``) ``acc`` is first dequantized by the
        rows' ``x_scale`` (BLOCK_M,) and the columns' weight scales.
        """
        BLOCK_M: tl.constexpr = acc.shape[0]
        SUB_N: tl.constexpr = acc.shape[1]
        BLOCK_R: tl.constexpr = s.shape[1]
        cols = col0 + tl.arange(0, SUB_N)
        col_ok = cols < N
        if HAS_SCALES:
            w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
            acc = acc * x_scale[:, None] * w_scale[None, :]
        ranks = tl.arange(0, BLOCK_R)
        b = tl.load(
            b_ptr
            + adapter.to(tl.int64) * stride_ba
            + ranks[:, None] * stride_br
            + cols[None, :] * stride_bn,
            mask=(ranks < R)[:, None] & col_ok[None, :],
            other=0.0,
        )  # (BLOCK_R, SUB_N)
        acc = tl.dot(s, b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        val = acc.to(y_ptr.dtype.element_ty)
        if row_end - row_start == BLOCK_M:
            y_desc.store([row_start, col0], val)  # TMA clips columns at N
        else:
            # Ragged tile: TMA clips only at the tensor edge, so rows past row_end (the next
            # adapter's) must not be written; a masked pointer store keeps them intact.
            rows = row_start + tl.arange(0, BLOCK_M)
            out = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + cols[None, :]
            tl.store(out, val, mask=(rows < row_end)[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["n_tiles"])  # one compiled kernel for every token count
    def _lora_gemm_tma_kernel(
        x_desc,
        w_desc,
        y_desc,
        s_ptr,
        b_ptr,
        bias_ptr,
        y_ptr,
        x_scale_ptr,
        w_scale_ptr,
        tiles_ptr,
        n_tiles,
        N,
        K,
        R,
        stride_st,
        stride_ba,
        stride_br,
        stride_bn,
        stride_yt,
        HAS_BIAS: tl.constexpr,
        HAS_SCALES: tl.constexpr,
        MAIN_PRECISION: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        GROUP_M: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
        EPI_SPLIT: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
    ):
        n_cols = tl.cdiv(N, BLOCK_N)
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
                x = x_desc.load([row_start, ki * BLOCK_K])  # (BLOCK_M, BLOCK_K)
                w = w_desc.load([col0, ki * BLOCK_K]).T  # W is (N, K) row-major: Wᵀ tile
                acc = tl.dot(x, w, acc, input_precision=MAIN_PRECISION)
            rows = row_start + tl.arange(0, BLOCK_M)
            ranks = tl.arange(0, BLOCK_R)
            s = tl.load(
                s_ptr + rows.to(tl.int64)[:, None] * stride_st + ranks[None, :],
                mask=(rows < row_end)[:, None] & (ranks < R)[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_R)
            x_scale = 1.0
            if HAS_SCALES:  # FP8 X: each row's dequantization scale, (BLOCK_M,)
                x_scale = tl.load(x_scale_ptr + rows, mask=rows < row_end, other=0.0)
            # Sub-tiles of SUB_N columns: the LoRA product lives for one sub-tile at a time.
            if EPI_SPLIT == 1:
                _epilogue(
                    acc,
                    s,
                    x_scale,
                    y_desc,
                    y_ptr,
                    b_ptr,
                    bias_ptr,
                    w_scale_ptr,
                    adapter,
                    row_start,
                    row_end,
                    N,
                    R,
                    col0,
                    stride_ba,
                    stride_br,
                    stride_bn,
                    stride_yt,
                    HAS_BIAS,
                    HAS_SCALES,
                    DOT_PRECISION,
                )
            else:  # EPI_SPLIT == 2
                # (BLOCK_M, BLOCK_N) -> column halves (BLOCK_M, BLOCK_N / 2)
                a0, a1 = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                _epilogue(
                    a0,
                    s,
                    x_scale,
                    y_desc,
                    y_ptr,
                    b_ptr,
                    bias_ptr,
                    w_scale_ptr,
                    adapter,
                    row_start,
                    row_end,
                    N,
                    R,
                    col0,
                    stride_ba,
                    stride_br,
                    stride_bn,
                    stride_yt,
                    HAS_BIAS,
                    HAS_SCALES,
                    DOT_PRECISION,
                )
                _epilogue(
                    a1,
                    s,
                    x_scale,
                    y_desc,
                    y_ptr,
                    b_ptr,
                    bias_ptr,
                    w_scale_ptr,
                    adapter,
                    row_start,
                    row_end,
                    N,
                    R,
                    col0 + SUB_N,
                    stride_ba,
                    stride_br,
                    stride_bn,
                    stride_yt,
                    HAS_BIAS,
                    HAS_SCALES,
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
    # fp32 (tests): TMA stages live in shared memory, 128x256x64 fp32 needs 96 KiB a stage.
    TmaConfig(64, 64, 32, 4, 3, 1),
    # FP8 operands (1-byte X and W): the bf16 tile's bytes per stage with twice the K, 48 KiB
    # a stage; not yet swept on the H200 (`scripts.bench_fp8` times the candidates below).
    TmaConfig(128, 256, 128, 8, 3, 2),
    TmaConfig(128, 256, 128, 8, 4, 2),
    TmaConfig(128, 128, 128, 8, 4, 1),
]
_TMA_HOPPER, _TMA_FP32, _TMA_FP8 = _TMA_TILE_CONFIGS[1], _TMA_TILE_CONFIGS[2], _TMA_TILE_CONFIGS[3]
_GROUP_M = 8
_INTERPRETER_PROGRAMS = 3  # persistent programs in the interpreter: each loops over tiles


def _hopper_config(key: tuple) -> TmaConfig:
    """Hopper's tile for problem ``key`` (ends with the output's and operands' element sizes).

    An fp32 output (tests) takes the small fp32 tile, whose shared memory fits.
    """
    if key[-2] == 4:
        return _TMA_FP32
    return _TMA_FP8 if key[-1] == 1 else _TMA_HOPPER


def tma_supported(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> bool:
    """True when TMA descriptors can cover ``x`` (T, K), ``weight`` (N, K) and ``out`` (T, N).

    TMA needs unit-stride rows, 16-byte aligned bases and 16-byte aligned row strides (so
    ``K·itemsize`` and ``N·itemsize`` multiples of 16). ``out`` None stands for the fresh
    contiguous output `lora_gemm` allocates, in ``out_dtype`` (default ``x``'s).
    """

    def rows_ok(t: torch.Tensor) -> bool:
        return (
            t.stride(1) == 1
            and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0
        )

    out_size = (out_dtype or x.dtype).itemsize
    out_ok = (weight.shape[0] * out_size) % 16 == 0 if out is None else rows_ok(out)
    return rows_ok(x) and rows_ok(weight) and out_ok


def _launch(x, weight, s, b_t, bias, layout, out, cfg: TmaConfig, scales=None):
    """Launch the kernel; returns Triton's compiled kernel (registers, spills).

    ``scales``: ``(x_scale, w_scale)`` of FP8 operands, or None.
    """
    tokens, inner = x.shape
    width = weight.shape[0]
    tiles = layout.tiles(cfg.block_m, x.device)
    x_desc = TensorDescriptor(x, [tokens, inner], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(
        weight, [width, inner], [weight.stride(0), 1], [cfg.block_n, cfg.block_k]
    )
    y_desc = TensorDescriptor(
        out, [tokens, width], [out.stride(0), 1], [cfg.block_m, cfg.block_n // cfg.epi_split]
    )
    work = tiles.shape[0] * _utils.cdiv(width, cfg.block_n)
    programs = _INTERPRETER_PROGRAMS if x.device.type != "cuda" else _utils.sm_count(x.device.index)
    programs = max(1, min(programs, work))
    return _lora_gemm_tma_kernel[(programs,)](
        x_desc,
        w_desc,
        y_desc,
        s,
        b_t,
        bias if bias is not None else s,
        out,
        scales[0] if scales is not None else s,
        scales[1] if scales is not None else s,
        tiles,
        tiles.shape[0],
        width,
        inner,
        s.shape[1],
        s.stride(0),
        b_t.stride(0),
        b_t.stride(1),
        b_t.stride(2),
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALES=scales is not None,
        MAIN_PRECISION="ieee" if x.dtype == torch.float32 else None,
        DOT_PRECISION="ieee" if s.dtype == torch.float32 else None,
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


def _check_inputs(x, weight, s, b_t, layout, scales) -> None:
    fp8 = scales is not None
    dtypes = (FP8_DTYPE,) if fp8 else _utils.KERNEL_DTYPES
    _utils.check_tensor("x", x, (layout.num_tokens, None), dtypes, x.device)
    inner = x.shape[1]
    _utils.check_tensor("weight", weight, (None, inner), (x.dtype,), x.device, contiguous=False)
    compute = (s.dtype,) if fp8 else (x.dtype,)
    _utils.check_tensor("s", s, (x.shape[0], None), compute, x.device)
    if fp8:
        _utils.check_tensor("x_scale", scales[0], (x.shape[0],), (torch.float32,), x.device)
        _utils.check_tensor("w_scale", scales[1], (weight.shape[0],), (torch.float32,), x.device)
    want = (layout.num_adapters, s.shape[1], weight.shape[0])
    if tuple(b_t.shape) != want or b_t.dtype != s.dtype:
        raise ValueError(
            f"b_t has shape {tuple(b_t.shape)} {b_t.dtype}, expected (A, R, N)={want} {s.dtype}"
        )
    _utils.padded_rank(s.shape[1])


def lora_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    s: torch.Tensor,
    b_t: torch.Tensor,
    bias: torch.Tensor | None,
    layout: AdapterLayout,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Y = X·Wᵀ + S'·B_aᵀ + b`` per adapter segment, in one launch.

    With FP8 operands (``x_scale`` and ``w_scale`` given) the frozen product is
    ``(X_q·W_qᵀ)·s_x·s_w`` (`ops.fp8_quant`), dequantized in the epilogue before the LoRA term.

    Args:
        x: (T, K) input, unit-stride rows, 16-byte aligned; e4m3 with scales.
        weight: (N, K) frozen weight, unit-stride rows, 16-byte aligned; ``x``'s dtype.
        s: (T, R) contiguous ``S'`` (scale and dropout already applied), in the compute
            dtype (``x``'s, or the output's with FP8 operands).
        b_t: (A, R, N) every adapter's ``Bᵀ``, any strides, ``s``'s dtype.
        bias: (N,) or None.
        layout: the microbatch's adapter layout.
        x_scale: (T,) fp32 dequantization scale of each row of an e4m3 ``x``, or None.
        w_scale: (N,) fp32 dequantization scale of each row of an e4m3 ``weight``, or None.

    Returns:
        (T, N) tensor in ``s``'s dtype.

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor), one
            scale without the other, or strides TMA cannot describe (the message gives
            them; `tma_supported`).
    """
    if (x_scale is None) != (w_scale is None):
        raise ValueError("x_scale and w_scale go together (FP8 operands), got one of them")
    scales = None if x_scale is None else (x_scale, w_scale)
    _check_inputs(x, weight, s, b_t, layout, scales)
    tokens, width = x.shape[0], weight.shape[0]
    out = torch.empty(tokens, width, dtype=s.dtype, device=x.device)
    if tokens == 0:
        return out
    if not tma_supported(x, weight, out):
        raise ValueError(
            f"lora_gemm needs TMA-describable operands (unit-stride, 16-byte aligned rows): "
            f"x strides {x.stride()}, weight strides {weight.stride()}, out strides "
            f"{out.stride()}, {x.element_size()}-byte elements"
        )
    args = (x, weight, s, b_t, bias, layout, out)
    key = (tokens, width, x.shape[1], _utils.padded_rank(s.shape[1]))
    key += (out.element_size(), x.element_size())
    config = _utils.pick_config(
        "lora_gemm",
        key,
        x.device,
        _hopper_config,
        _TMA_TILE_CONFIGS,
        lambda cfg: _launch(*args, cfg, scales),
    )
    _launch(*args, config, scales)
    return out


def lora_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    s: torch.Tensor,
    b_t: torch.Tensor,
    bias: torch.Tensor | None,
    layout: AdapterLayout,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `lora_gemm` (fp32 accumulation), in ``s``'s dtype."""
    out = x.float() @ weight.float().t()
    if x_scale is not None:
        out = out * x_scale[:, None] * w_scale[None, :]
    for adapter, start, end in layout.segments():
        out[start:end] += s[start:end].float() @ b_t[adapter].float()  # (T_a, N)
    if bias is not None:
        out += bias.float()
    return out.to(s.dtype)
