"""DoRA's epilogue: each token's output columns scaled by its adapter's magnitude ratio.

DoRA (Liu et al., 2024) writes an adapted linear as ``Y = (m / ‖W + s·B·A‖_row) ⊙ (X·Wᵀ +
s·drop(X)·Aᵀ·Bᵀ)`` with the row norm detached (PEFT's rule), so on the fused multi-LoRA
output ``out`` (T, N) it is a per-(adapter, output column) scale: ``Y[t] = out[t] ⊙
scale[a(t)]``, ``scale = m / norm`` (A, N). `dora_scale` applies it (one pass over ``out``),
and its backward gives ``dOut = dY ⊙ scale[a(t)]`` and ``dScale[a] = Σ_{t ∈ seg a} dY ⊙ out``
in a deterministic two-kernel reduction (per-tile partials, then each adapter's tiles summed
in order), so ``dm = dScale / norm`` reaches the magnitudes through torch.

`dora_weight_norm` computes ``‖W + s·B·A‖_row`` without forming ``W + s·B·A``:
``‖W_n‖² + 2s·Σ_r B[n,r]·(W·Aᵀ)[n,r] + s²·B_n·(A·Aᵀ)·B_nᵀ`` from the frozen ``‖W_n‖²``
(computed once), one (N, H) × (H, R) GEMM and an (R, R) Gram matrix per adapter.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import tl, triton
from megatron_lorafusion.ops.layout import AdapterLayout

if triton is not None:

    @triton.jit
    def _dora_scale_fwd_kernel(
        out_ptr, scale_ptr, y_ptr, tiles_ptr, N, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """One (tile, column block): ``y = out · scale[adapter]`` in fp32, cast on store."""
        tile = tl.program_id(0)
        adapter = tl.load(tiles_ptr + tile * 3).to(tl.int64)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        end = tl.load(tiles_ptr + tile * 3 + 2)
        rows = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = (rows[:, None] < end) & col_mask[None, :]
        scale = tl.load(scale_ptr + adapter * N + cols, mask=col_mask, other=0.0)
        offs = rows[:, None] * N + cols[None, :]
        out = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = out * scale[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dora_scale_bwd_kernel(
        dy_ptr,
        out_ptr,
        scale_ptr,
        dout_ptr,
        partial_ptr,
        tiles_ptr,
        N,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One (tile, column block): ``dOut = dY · scale``, and the tile's ``Σ_t dY · out``."""
        tile = tl.program_id(0)
        adapter = tl.load(tiles_ptr + tile * 3).to(tl.int64)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        end = tl.load(tiles_ptr + tile * 3 + 2)
        rows = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = (rows[:, None] < end) & col_mask[None, :]
        scale = tl.load(scale_ptr + adapter * N + cols, mask=col_mask, other=0.0)
        offs = rows[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dout_ptr + offs, (dy * scale[None, :]).to(dout_ptr.dtype.element_ty), mask=mask)
        tl.store(
            partial_ptr + tile.to(tl.int64) * N + cols, tl.sum(dy * out, axis=0), mask=col_mask
        )

    @triton.jit
    def _dora_scale_reduce_kernel(
        partial_ptr, dscale_ptr, tile_ranges_ptr, N, BLOCK_N: tl.constexpr
    ):
        """One (adapter, column block): ``dScale[a] = Σ`` of its tiles' partials, in tile order."""
        adapter = tl.program_id(0)
        first = tl.load(tile_ranges_ptr + adapter)
        last = tl.load(tile_ranges_ptr + adapter + 1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ptrs = partial_ptr + first.to(tl.int64) * N + cols
        for _ in range(first, last):
            acc += tl.load(ptrs, mask=col_mask, other=0.0)
            ptrs += N
        tl.store(dscale_ptr + adapter.to(tl.int64) * N + cols, acc, mask=col_mask)


# (BLOCK_T, BLOCK_N, num_warps): elementwise over (T, N); 64 × 128 fp32 per program on CUDA
# (32 KiB in flight), small tiles in the interpreter so ragged shapes cross tile edges.
_TILES = {"cuda": (64, 128, 4), "cpu": (4, 16, 1)}


def _tiles(device: torch.device) -> tuple[int, int, int]:
    return _TILES["cuda" if device.type == "cuda" else "cpu"]


def _check(out: torch.Tensor, scale: torch.Tensor, layout: AdapterLayout) -> None:
    if out.dim() != 2:
        raise ValueError(f"out must be (T, N), got shape {tuple(out.shape)}")
    tokens, width = out.shape
    if layout.num_tokens != tokens:
        raise ValueError(f"layout covers {layout.num_tokens} tokens, out has T={tokens}")
    expected = (layout.num_adapters, width)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(
            f"scale has shape {tuple(scale.shape)} {scale.dtype}, expected (A, N)={expected} "
            "float32"
        )
    if scale.device != out.device:
        raise ValueError(f"scale is on {scale.device}, out on {out.device}")


def dora_scale_fwd(out: torch.Tensor, scale: torch.Tensor, layout: AdapterLayout) -> torch.Tensor:
    """Launch the forward: (T, N) ``out`` (contiguous), (A, N) fp32 ``scale`` -> (T, N)."""
    block_t, block_n, warps = _tiles(out.device)
    y = torch.empty_like(out)
    tiles = layout.tiles(block_t, out.device)
    if tiles.shape[0] and out.shape[1]:
        grid = (tiles.shape[0], _utils.cdiv(out.shape[1], block_n))
        _dora_scale_fwd_kernel[grid](
            out, scale, y, tiles, out.shape[1], BLOCK_T=block_t, BLOCK_N=block_n, num_warps=warps
        )
    return y


def dora_scale_bwd(
    dy: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, layout: AdapterLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward: ``dOut`` (T, N) in ``out``'s dtype and ``dScale`` (A, N) fp32."""
    block_t, block_n, warps = _tiles(out.device)
    tokens, width = out.shape
    dout = torch.empty_like(out)
    dscale = torch.zeros(layout.num_adapters, width, dtype=torch.float32, device=out.device)
    tiles = layout.tiles(block_t, out.device)
    if not (tiles.shape[0] and width):
        return dout, dscale
    partial = torch.empty(tiles.shape[0], width, dtype=torch.float32, device=out.device)
    col_blocks = _utils.cdiv(width, block_n)
    _dora_scale_bwd_kernel[(tiles.shape[0], col_blocks)](
        dy,
        out,
        scale,
        dout,
        partial,
        tiles,
        width,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    _dora_scale_reduce_kernel[(layout.num_adapters, col_blocks)](
        partial,
        dscale,
        layout.tile_ranges(block_t, out.device),
        width,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return dout, dscale


class DoRAScaleFunction(torch.autograd.Function):
    """Autograd of `dora_scale`: saves ``out`` (T, N) and ``scale`` (A, N), recomputes nothing.

    ``out`` is the only activation DoRA adds per adapted linear (``dScale`` needs it).
    """

    @staticmethod
    def forward(ctx, out, scale, layout):
        """(T, N) ``out ⊙ scale[a(t)]``."""
        ctx.layout = layout
        ctx.save_for_backward(out, scale)
        return dora_scale_fwd(out, scale, layout)

    @staticmethod
    def backward(ctx, dy):
        """``dOut`` (T, N) and ``dScale`` (A, N) fp32; no gradient for the layout."""
        out, scale = ctx.saved_tensors
        dout, dscale = dora_scale_bwd(dy.contiguous(), out, scale, ctx.layout)
        return dout, dscale, None


def dora_scale(out: torch.Tensor, scale: torch.Tensor, layout: AdapterLayout) -> torch.Tensor:
    """``Y[t] = out[t] ⊙ scale[a(t)]``, each token scaled by its adapter's row of ``scale``.

    Triton kernels on CUDA (and in the interpreter), the torch reference elsewhere.

    Args:
        out: (T, N) the fused LoRA linear's output without bias, rows grouped by adapter.
        scale: (A, N) fp32 per-adapter column scale (DoRA's ``m / ‖W + s·B·A‖``, 1 for
            adapters and rows without DoRA); its gradient is ``Σ_t dY ⊙ out`` per adapter.
        layout: the microbatch's adapter layout.

    Returns:
        (T, N) in ``out``'s dtype (computed in fp32).

    Raises:
        ValueError: when shapes, dtype or devices disagree; the message names the tensor.
    """
    _check(out, scale, layout)
    if _utils.triton_usable(out):
        return DoRAScaleFunction.apply(out.contiguous(), scale.contiguous(), layout)
    return dora_scale_ref(out, scale, layout)


def dora_scale_ref(out: torch.Tensor, scale: torch.Tensor, layout: AdapterLayout) -> torch.Tensor:
    """Torch reference of `dora_scale`, any device and dtype, deterministic.

    One broadcast product per adapter segment, so ``dScale[a]`` is a plain column sum (an
    index gather's backward accumulates in a varying order on the CPU, and resume must
    reproduce a run bit for bit).
    """
    parts = [
        (out[start:end].float() * scale[a]).to(out.dtype) for a, start, end in layout.segments()
    ]
    return torch.cat(parts) if parts else out.clone()


def dora_weight_norm(
    weight: torch.Tensor,
    weight_sq_norm: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float | torch.Tensor,
) -> torch.Tensor:
    """``‖W + s·B·A‖`` of each output row, without forming ``W + s·B·A``; no grad.

    ``‖W_n‖² + 2s·Σ_r B[n,r]·(W·Aᵀ)[n,r] + s²·B_n·(A·Aᵀ)·B_nᵀ``: one GEMM of W against every
    adapter's A at once (k adapters in one launch), the rest rank-sized.

    Args:
        weight: (N, H) frozen base weight (any float dtype; the GEMM runs in its dtype).
        weight_sq_norm: (N,) fp32 ``‖W_n‖²``, computed once (`weight_sq_norm`).
        lora_a: (R, H) fp32 down-projection, or (k, R, H) for k adapters (rows past an
            adapter's rank zero).
        lora_b: (N, R) fp32 up-projection, or (k, N, R).
        scaling: the LoRA scale ``s``, or (k,) fp32 on the factors' device.

    Returns:
        (N,) fp32, or (k, N) for batched factors.
    """
    if lora_a.dim() == 2:
        return dora_weight_norm(
            weight, weight_sq_norm, lora_a[None], lora_b[None], torch.tensor([scaling])
        )[0]
    with torch.no_grad():
        # Fresh (aligned) copies: CPU matmul rounds differently at another 16-byte alignment
        # of its input, so a view into the packed table would make the norm depend on where
        # the adapter's slot sits in it.
        adapters, rank, hidden = lora_a.shape
        lora_a = lora_a.clone(memory_format=torch.contiguous_format)
        lora_b = lora_b.clone(memory_format=torch.contiguous_format)
        flat_a = lora_a.reshape(adapters * rank, hidden).to(weight.dtype)
        wa = (weight @ flat_a.t()).float().view(-1, adapters, rank).transpose(0, 1)  # (k, N, R)
        gram = lora_a @ lora_a.transpose(1, 2)  # (k, R, R)
        scale = torch.as_tensor(scaling, dtype=torch.float32, device=lora_a.device)[:, None]
        sq = (
            weight_sq_norm[None]
            + 2.0 * scale * (lora_b * wa).sum(-1)
            + scale * scale * ((lora_b @ gram) * lora_b).sum(-1)
        )
        return sq.clamp_min(0.0).sqrt()


def weight_sq_norm(weight: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 ``‖W_n‖²`` of each row of a frozen (N, H) weight."""
    with torch.no_grad():
        return weight.float().square().sum(1)


def dora_weight_norm_ref(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Torch reference of `dora_weight_norm`: the row norm of ``W + s·B·A`` formed in fp32."""
    with torch.no_grad():
        return torch.linalg.vector_norm(weight.float() + scaling * (lora_b @ lora_a), dim=1)
