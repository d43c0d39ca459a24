"""Grouped LoRA weight gradient: ``G_a = drop_a(Z[seg_a])ᵀ · S[seg_a]``, (D, R) per adapter.

Gives ``dB_a = dY_aᵀ·S'_a`` (``Z = dY``) and ``dA_aᵀ = drop(X_a)ᵀ·dS'_a`` (``Z = X``, mask
regenerated from the seed) of LoRAFusion's backward (arXiv 2510.00206, Sec. 4.2). The sum over
an adapter's tokens is split into row chunks (one program per chunk × D-tile, fp32 partials),
then reduced in a fixed order: no atomics, so the result is bitwise repeatable.
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
    def _lora_wgrad_kernel(
        z_ptr,
        s_ptr,
        part_ptr,
        chunks_ptr,
        p_ptr,
        m_ptr,
        ex_ptr,
        keys_ptr,
        seed,
        D,
        R,
        col_off,
        stride_zt,
        stride_st,
        stride_ma,
        stride_mr,
        stride_md,
        stride_et,
        HAS_DROPOUT: tl.constexpr,
        EXPAND: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        pid_c = tl.program_id(0)
        pid_d = tl.program_id(1)
        adapter = tl.load(chunks_ptr + pid_c * 3)
        row_start = tl.load(chunks_ptr + pid_c * 3 + 1)
        row_end = tl.load(chunks_ptr + pid_c * 3 + 2)
        cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        p = 0.0
        if HAS_DROPOUT:
            p = tl.load(p_ptr + adapter)
        keep_scale = 1.0 / (1.0 - p)  # inverted dropout: one multiply per element, not a divide
        acc = tl.zeros((BLOCK_D, BLOCK_R), dtype=tl.float32)
        if EXPAND:  # this adapter's M_a tile, (BLOCK_R, BLOCK_D)
            m = tl.load(
                m_ptr
                + adapter.to(tl.int64) * stride_ma
                + ranks[:, None] * stride_mr
                + cols[None, :] * stride_md,
                mask=rank_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
        for t0 in range(row_start, row_end, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            row_ok = rows < row_end
            z = tl.load(
                z_ptr + rows.to(tl.int64)[:, None] * stride_zt + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )  # (BLOCK_T, BLOCK_D)
            if HAS_DROPOUT:  # no run-time `if p > 0`: it would stop load pipelining
                # Mask keyed by the row's key and the column in the whole (unsharded) input.
                keys = tl.load(keys_ptr + rows, mask=row_ok, other=0)
                keep = keep_mask_tile(seed, keys, pid_d * BLOCK_D + col_off, p, BLOCK_D)
                z = tl.where(keep, z, 0.0)
            s = tl.load(
                s_ptr + rows.to(tl.int64)[:, None] * stride_st + ranks[None, :],
                mask=row_ok[:, None] & rank_ok[None, :],
                other=0.0,
            )  # (BLOCK_T, BLOCK_R)
            acc = tl.dot(tl.trans(z), s, acc, input_precision=DOT_PRECISION)
            if EXPAND:  # the same tile of drop(S·M_a), sharing this tile's mask
                lora = tl.dot(s, m, input_precision=DOT_PRECISION)  # (BLOCK_T, BLOCK_D)
                if HAS_DROPOUT:
                    # A 0/1 multiply in the output dtype keeps the mask in the store's layout;
                    # `tl.where` on the fp32 product moved it into the MMA layout instead
                    # (~20 % more instructions per loop step, sm_90, docs/kernels.md).
                    lora = (lora * keep_scale).to(ex_ptr.dtype.element_ty)
                    lora = lora * keep.to(ex_ptr.dtype.element_ty)
                ex = ex_ptr + rows.to(tl.int64)[:, None] * stride_et + cols[None, :]
                if ACCUMULATE:  # onto the frozen dX already there (an FP8 GEMM has no C)
                    lora = lora.to(tl.float32) + tl.load(
                        ex, mask=row_ok[:, None] & col_ok[None, :], other=0.0
                    ).to(tl.float32)
                tl.store(
                    ex, lora.to(ex_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
                )
        if HAS_DROPOUT:
            acc = acc * keep_scale
        part = part_ptr + (pid_c.to(tl.int64) * D + cols[:, None]) * BLOCK_R + ranks[None, :]
        tl.store(part, acc, mask=col_ok[:, None])

    @triton.jit
    def _lora_wgrad_reduce_kernel(
        part_ptr,
        out_ptr,
        ranges_ptr,
        D,
        R,
        stride_oa,
        stride_od,
        stride_or,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        adapter = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        ranks = tl.arange(0, BLOCK_R)
        first = tl.load(ranges_ptr + adapter)
        last = tl.load(ranges_ptr + adapter + 1)
        acc = tl.zeros((BLOCK_D, BLOCK_R), dtype=tl.float32)
        stride_c = D * BLOCK_R  # one chunk's partial, (D, BLOCK_R) fp32
        part = part_ptr + first.to(tl.int64) * stride_c + cols[:, None] * BLOCK_R + ranks[None, :]
        for _ in range(first, last):  # fixed order: deterministic
            acc += tl.load(part, mask=col_ok[:, None], other=0.0)
            part += stride_c
        out = (
            out_ptr
            + adapter.to(tl.int64) * stride_oa
            + cols[:, None] * stride_od
            + ranks[None, :] * stride_or
        )
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & (ranks < R)[None, :])


# Read-bound: one pass over Z. block_t is the row step inside a chunk; chunks are sized at
# launch so that there are ~4 programs per SM.
_TILE_CONFIGS = [
    TileConfig(block_t=16, block_d=32, num_warps=4, num_stages=2),  # interpreter: many tiles
    TileConfig(block_t=64, block_d=128, num_warps=4, num_stages=3),
    TileConfig(block_t=128, block_d=64, num_warps=4, num_stages=3),
    TileConfig(block_t=64, block_d=64, num_warps=4, num_stages=4),
    TileConfig(block_t=32, block_d=128, num_warps=8, num_stages=3),
    TileConfig(block_t=32, block_d=64, num_warps=4, num_stages=3),
    TileConfig(block_t=64, block_d=64, num_warps=8, num_stages=3),
]
_PROGRAMS_PER_SM = 4
_REDUCE_BLOCK_D = 64


def _hopper_config(key: tuple) -> TileConfig:
    _, width, block_r, mask, accumulate = key  # (T, D, BLOCK_R, "none" | "drawn", bool)
    if block_r <= 32:
        if mask == "drawn" and accumulate:
            # The FP8 base's pass, which also reads the frozen dX it adds onto: swept on the
            # H200 at T = 8192, p = 0.1 (docs/fp8.md, twenty-sixth session): 90.0 against
            # 99.0 us for 32x128 / 8 warps at H = 4096, 300.4 against 317.7 for 32x64 at 14336.
            return _TILE_CONFIGS[5] if width < 8192 else _TILE_CONFIGS[6]
        # Swept on the H200 with the fused expand at T = 16384, H = 4096 and 14336
        # (docs/kernels.md): drawing the mask wants 32-row tiles, narrower ones on wide inputs.
        if mask == "drawn":
            return _TILE_CONFIGS[4] if width < 8192 else _TILE_CONFIGS[5]
        return _TILE_CONFIGS[1]
    # Each pipeline stage holds a Z tile and a (block_t, BLOCK_R) tile of S: at BLOCK_R = 256
    # in fp32, 64-row tiles need 3 × 80 KiB of shared memory, over Hopper's 227 KiB
    # (H200: OutOfResources in test_fused_lora_linear's rank-200 case); 32 rows need 2 × 40.
    return _TILE_CONFIGS[3] if block_r <= 128 else _TILE_CONFIGS[5]


def lora_wgrad(
    z: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    expand_m: torch.Tensor | None = None,
    expand_out: torch.Tensor | None = None,
    *,
    col_offset: int = 0,
    full_width: int | None = None,
) -> torch.Tensor:
    """Launch the grouped weight gradient, writing into ``out``.

    Args:
        z: (T, D) contiguous ``dY`` or ``X``.
        s: (T, R) contiguous ``S'`` or ``dS'``.
        out: (A, D, R) view of the gradient to write, any strides (``dB`` itself, or
            ``dA.transpose(1, 2)``); fully overwritten, adapters without tokens get zeros.
        dropouts: (A,) fp32 dropout probabilities applied to ``z``, or None.
        layout: the microbatch's adapter layout.
        seed: Philox seed of the dropout mask over ``z``.
        expand_m: (A, R, D) per-adapter matrices, any strides: when given (with
            ``expand_out``), the same pass also writes ``expand_out = drop(S·M_a)``, the
            `lora_expand` of ``s`` under the same mask (the backward's LoRA part of dX, with
            the mask drawn once for dA and dX).
        expand_out: (T, D) contiguous output of the fused expand, fully overwritten.
        col_offset: for a tensor-parallel shard of ``z``'s columns, the index of its column 0
            in the full-width input (a multiple of 8): the mask is columns
            ``col_offset:col_offset + D`` of the ``full_width``-wide mask; its rows are keyed by
            ``layout.row_keys``.
        full_width: the full input width (default ``D``).

    Returns:
        ``out``.

    Raises:
        ValueError: on shape, dtype or device mismatch (the message names the tensor).
        NotImplementedError: for a ``col_offset`` that is not a multiple of 8.
    """
    _utils.check_tensor("z", z, (layout.num_tokens, None), _utils.KERNEL_DTYPES, z.device)
    tokens, width = z.shape
    _utils.check_tensor("s", s, (tokens, None), (z.dtype,), z.device)
    rank = s.shape[1]
    adapters = layout.num_adapters
    if tuple(out.shape) != (adapters, width, rank) or out.device != z.device:
        raise ValueError(
            f"out has shape {tuple(out.shape)} on {out.device}, "
            f"expected (A, D, R)=({adapters}, {width}, {rank}) on {z.device}"
        )
    _utils.check_dropouts(dropouts, adapters, z.device)
    if (expand_m is None) != (expand_out is None):
        raise ValueError("expand_m and expand_out go together")
    if expand_m is not None:
        if tuple(expand_m.shape) != (adapters, rank, width) or expand_m.dtype != s.dtype:
            raise ValueError(
                f"expand_m has shape {tuple(expand_m.shape)} {expand_m.dtype}, "
                f"expected (A, R, D)=({adapters}, {rank}, {width}) {s.dtype}"
            )
        _utils.check_tensor(
            "expand_out", expand_out, (tokens, width), _utils.KERNEL_DTYPES, z.device
        )
    _utils.mask_width(width, col_offset, full_width)
    return lora_wgrad_fwd(z, s, out, dropouts, layout, seed, expand_m, expand_out, col_offset)


def lora_wgrad_fwd(
    z: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
    seed: int,
    expand_m: torch.Tensor | None = None,
    expand_out: torch.Tensor | None = None,
    col_offset: int = 0,
    expand_accumulate: bool = False,
) -> torch.Tensor:
    """Launch the weight gradient on inputs already checked (`lora_wgrad` checks first).

    The autograd functions check their inputs once and call this in backward (``col_offset``
    already checked). ``expand_accumulate``: the fused expand adds onto ``expand_out``
    instead of writing it.
    """
    tokens, width = z.shape
    rank = s.shape[1]
    adapters = layout.num_adapters
    block_r = _utils.padded_rank(rank)
    if tokens == 0:
        return out.zero_()
    m = expand_m if expand_m is not None else s[None]  # placeholders when not expanding
    expand = expand_out if expand_out is not None else s

    def run(cfg: TileConfig, ex: torch.Tensor = expand) -> None:
        chunk = _utils.chunk_rows(tokens, width, cfg, z.device, _PROGRAMS_PER_SM)
        chunks = layout.tiles(chunk, z.device)
        ranges = layout.tile_ranges(chunk, z.device)
        part = torch.empty(chunks.shape[0], width, block_r, dtype=torch.float32, device=z.device)
        _lora_wgrad_kernel[(chunks.shape[0], _utils.cdiv(width, cfg.block_d))](
            z,
            s,
            part,
            chunks,
            dropouts if dropouts is not None else s,
            m,
            ex,
            layout.keys(),
            seed,
            width,
            rank,
            col_offset,
            z.stride(0),
            s.stride(0),
            m.stride(0),
            m.stride(1),
            m.stride(2),
            ex.stride(0),
            HAS_DROPOUT=dropouts is not None,
            EXPAND=expand_m is not None,
            ACCUMULATE=expand_accumulate,
            DOT_PRECISION="ieee" if z.dtype == torch.float32 else None,
            BLOCK_T=cfg.block_t,
            BLOCK_D=cfg.block_d,
            BLOCK_R=block_r,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        _lora_wgrad_reduce_kernel[(adapters, _utils.cdiv(width, _REDUCE_BLOCK_D))](
            part,
            out,
            ranges,
            width,
            rank,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            BLOCK_D=_REDUCE_BLOCK_D,
            BLOCK_R=block_r,
        )

    mask = "none" if dropouts is None else "drawn"
    key = (tokens, width, block_r, mask, expand_accumulate)
    # Timing candidates (off Hopper) runs the kernel many times: not onto an accumulated dX.
    scratch = (lambda: torch.empty_like(expand)) if expand_accumulate else (lambda: expand)
    cfg = _utils.pick_config(
        "lora_wgrad",
        key,
        z.device,
        _hopper_config,
        _TILE_CONFIGS,
        lambda cfg: run(cfg, scratch()),
    )
    run(cfg)
    return out


def lora_wgrad_ref(
    z: torch.Tensor,
    s: torch.Tensor,
    keep_mask: torch.Tensor | None,
    dropouts: torch.Tensor | None,
    layout: AdapterLayout,
) -> torch.Tensor:
    """Torch reference of `lora_wgrad`: (A, D, R) in ``z``'s dtype."""
    out = z.new_zeros(layout.num_adapters, z.shape[1], s.shape[1], dtype=torch.float32)
    for adapter, start, end in layout.segments():
        z_seg = z[start:end].float()
        if keep_mask is not None and dropouts is not None and float(dropouts[adapter]) > 0:
            z_seg = z_seg * keep_mask[start:end] / (1.0 - float(dropouts[adapter]))
        out[adapter] = z_seg.t() @ s[start:end].float()  # (D, R)
    return out.to(z.dtype)
