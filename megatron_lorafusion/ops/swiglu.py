"""Fused SwiGLU of Megatron's ``linear_fc1`` output: ``[gate | up]`` (T, 2F) → ``silu(gate)·up``.

Megatron's unfused GLU chunks the fc1 output, runs ``silu`` (saving its input), multiplies
(saving both factors) and its backward writes the two halves' gradients separately before a
``torch.cat``. Here the forward reads ``[gate | up]`` once and writes ``(T, F)``; only the fc1
output is saved, and the backward recomputes ``sigmoid(gate)`` from it and writes both halves
of ``d[gate | up]`` in one pass (Shazeer, "GLU Variants Improve Transformer", 2020).

Under an FP8 base (`swiglu_fp8`) the kernels also prepare what they write for the FP8 linear
next to them (`fp8_quant.quantize_rows`, bit for bit). The forward quantizes fc2's input: a
program owns whole rows, writes a row and takes its largest magnitude, then reads the row back
(from L2) and writes it in e4m3. The backward stays elementwise (whole rows per program
measured no faster) and stores each tile's largest ``|d[gate | up]·diag(s_w)|``, fc1's weight
scales ``s_w``: with those maxima, fc1's LoRA backward quantizes fc1's incoming gradient in
the pass over it that it makes anyway (`lora_up_bwd_quantized`), and a plain FP8 linear in one
read instead of two (docs/fp8.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.fp8_quant import (
    attach_quantized,
    attach_row_maxima,
    empty_quantized,
)

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops.fp8_quant import pow2_row_scales, quantize_row_blocks

    @triton.jit
    def _swiglu_fwd_kernel(x_ptr, out_ptr, F_DIM, BLOCK_F: tl.constexpr):
        """One row tile: ``out = gate · sigmoid(gate) · up`` in fp32, cast on store."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = cols < F_DIM
        gate = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * F_DIM + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        dout_ptr,
        x_ptr,
        dx_ptr,
        col_ptr,
        parts_ptr,
        F_DIM,
        NUM_PARTS,
        HAS_PARTS: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        """One row tile: ``d_up = dout · silu(gate)``, ``d_gate = dout · up · silu'(gate)``.

        With ``HAS_PARTS`` it also stores the tile's largest ``|d[gate | up]·col_scale|`` in
        ``parts[row, tile]`` (the maxima `quantize_rows_fwd` would otherwise find).
        """
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = cols < F_DIM
        gate = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + row * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        d_gate = (dout * up * (sig + silu * (1.0 - sig))).to(dx_ptr.dtype.element_ty)
        d_up = (dout * silu).to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + row * 2 * F_DIM + cols, d_gate, mask=mask)
        tl.store(dx_ptr + row * 2 * F_DIM + F_DIM + cols, d_up, mask=mask)
        if HAS_PARTS:
            gate_scale = tl.load(col_ptr + cols, mask=mask, other=0.0)
            up_scale = tl.load(col_ptr + F_DIM + cols, mask=mask, other=0.0)
            amax = tl.maximum(
                tl.max(tl.abs(d_gate.to(tl.float32) * gate_scale)),
                tl.max(tl.abs(d_up.to(tl.float32) * up_scale)),
            )
            tl.store(parts_ptr + row * NUM_PARTS + tl.program_id(1), amax)

    @triton.jit(do_not_specialize=["R"])  # the token count: one compiled kernel for all
    def _swiglu_fwd_fp8_kernel(
        x_ptr,
        out_ptr,
        q_ptr,
        scale_ptr,
        R,
        F_DIM,
        HW_CAST: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        """Whole rows: ``out`` as `_swiglu_fwd_kernel`, then ``out`` quantized per row."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * 2 * F_DIM
        out_rows = out_ptr + rows.to(tl.int64)[:, None] * F_DIM
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for f0 in range(0, F_DIM, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            ok = row_ok[:, None] & (cols < F_DIM)[None, :]
            gate = tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_rows + F_DIM + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            out = (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty)
            tl.store(out_rows + cols[None, :], out, mask=ok)
            amax = tl.maximum(amax, tl.max(tl.abs(out.to(tl.float32)), axis=1))
        scale, inv = pow2_row_scales(amax)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        tl.debug_barrier()  # the rows' stores are visible to every thread of the program
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * F_DIM
        quantize_row_blocks(
            out_rows, scale_ptr, q_rows, row_ok, F_DIM, inv, False, HW_CAST, BLOCK_F
        )


# Elementwise: 1024 columns per program (2 KiB of bf16 per half), 4 warps; the interpreter
# uses small tiles so ragged widths cross a tile edge.
_BLOCK_F = {"cuda": 1024, "cpu": 32}
_NUM_WARPS = 4


def _grid(tokens: int, width: int, device: torch.device) -> tuple[tuple[int, int], int]:
    block = _BLOCK_F["cuda" if device.type == "cuda" else "cpu"]
    return (tokens, _utils.cdiv(width, block)), block


def swiglu_fwd(x: torch.Tensor) -> torch.Tensor:
    """Launch the forward on (T, 2F) ``x``; returns (T, F)."""
    tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    if tokens and width:
        grid, block = _grid(tokens, width, x.device)
        _swiglu_fwd_kernel[grid](x, out, width, BLOCK_F=block, num_warps=_NUM_WARPS)
    return out


# The FP8 forward's whole rows per program: (rows, columns per step, warps); the interpreter's
# small steps cross a step edge within a row.
_FP8_BLOCKS = {"cuda": (1, 2048, 8), "cpu": (2, 32, 4)}


def swiglu_fp8_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, F) ``out`` of (T, 2F) ``x``, and ``quantize_rows(out)``: (T, F) e4m3, (T,) fp32."""
    tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    q, scale = empty_quantized(tokens, width, x.device)
    if tokens:
        block_r, block_f, warps = _FP8_BLOCKS["cuda" if x.is_cuda else "cpu"]
        _swiglu_fwd_fp8_kernel[(_utils.cdiv(tokens, block_r),)](
            x,
            out,
            q,
            scale,
            tokens,
            width,
            HW_CAST=x.is_cuda,
            BLOCK_R=block_r,
            BLOCK_F=block_f,
            num_warps=warps,
        )
    return out, q, scale


def swiglu_fp8_bwd(
    dout: torch.Tensor, x: torch.Tensor, col_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, 2F) ``dx`` as `swiglu_bwd`, and the largest ``|dx·col_scale|`` of its rows' tiles.

    The maxima, (T, P) fp32 for P column tiles of a row, are what `quantize_rows_fwd`'s
    ``amax_parts`` and `lora_up_bwd_quantized` take.
    """
    tokens, width = dout.shape
    dx = torch.empty_like(x)
    grid, block = _grid(tokens, width, x.device)
    parts = torch.empty(grid, dtype=torch.float32, device=x.device)  # (T, tiles per half)
    if tokens:
        _swiglu_bwd_kernel[grid](
            dout,
            x,
            dx,
            col_scale,
            parts,
            width,
            grid[1],
            HAS_PARTS=True,
            BLOCK_F=block,
            num_warps=_NUM_WARPS,
        )
    return dx, parts


def swiglu_bwd(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Launch the backward: (T, 2F) ``d[gate | up]`` from (T, F) ``dout`` and the saved ``x``."""
    tokens, width = dout.shape
    dx = torch.empty_like(x)
    if tokens and width:
        grid, block = _grid(tokens, width, x.device)
        _swiglu_bwd_kernel[grid](
            dout, x, dx, dx, dx, width, 0, HAS_PARTS=False, BLOCK_F=block, num_warps=_NUM_WARPS
        )
    return dx


class SwiGLUFunction(torch.autograd.Function):
    """Autograd of `swiglu` on (T, 2F): saves only its input, recomputes the sigmoid."""

    @staticmethod
    def forward(ctx, x):
        """(T, F) ``silu(gate) · up``."""
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x)
        return swiglu_fwd(x)

    @staticmethod
    def backward(ctx, dout):
        """(T, 2F) gradient of ``[gate | up]``."""
        (x,) = ctx.saved_tensors
        return swiglu_bwd(dout.contiguous(), x)


class SwiGLUFp8Function(torch.autograd.Function):
    """`SwiGLUFunction` that also quantizes its output and finds its input gradient's maxima.

    The output's quantization is attached for fc2 (`fp8_quant.attach_quantized`), the
    gradient's row maxima for fc1 (`fp8_quant.attach_row_maxima`; only given fc1's weight
    scales, ``grad_col_scale``).
    """

    @staticmethod
    def forward(ctx, x, grad_col_scale):
        """(T, F) ``silu(gate) · up``, carrying ``quantize_rows`` of itself."""
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, grad_col_scale)
        out, q, scale = swiglu_fp8_fwd(x)
        attach_quantized(out, q, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        """(T, 2F) gradient of ``[gate | up]``, carrying its rows' maxima when asked."""
        x, col_scale = ctx.saved_tensors
        if col_scale is None:
            return swiglu_bwd(dout.contiguous(), x), None
        dx, parts = swiglu_fp8_bwd(dout.contiguous(), x, col_scale)
        attach_row_maxima(dx, parts, col_scale)
        return dx, None


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even last dim [gate | up], got shape {tuple(getattr(x, 'shape', ()))}"
        )
    _utils.check_tensor("x", x, list(x.shape), _utils.KERNEL_DTYPES, x.device)


def swiglu_fp8(x: torch.Tensor, grad_col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`swiglu` for an FP8 base: the output carries its per-token e4m3 quantization.

    The FP8 linear that reads the output (fc2) takes the quantization instead of computing it
    (`fp8_quant.take_quantized`); with ``grad_col_scale`` (fc1's weight scales,
    `fp8_quant.grad_col_scale` of fc1's output) the gradient of ``x`` carries its rows' largest
    ``|dx·grad_col_scale|``, so fc1's backward quantizes it in one read
    (`fp8_quant.attach_row_maxima`). Values equal `swiglu`'s and `quantize_rows`' bit for bit.

    Args:
        x: (..., 2F) contiguous fc1 output (fp16, bf16 or fp32) on a GPU (or the interpreter).
        grad_col_scale: (2F,) fp32, or None: the gradient carries nothing for fc1.

    Returns:
        (..., F) tensor of ``x``'s dtype.

    Raises:
        ValueError: as `swiglu`; for a ``grad_col_scale`` not of shape (2F,) fp32.
    """
    _check_input(x)
    if grad_col_scale is not None:
        _utils.check_tensor(
            "grad_col_scale", grad_col_scale, (x.shape[-1],), (torch.float32,), x.device
        )
    out = SwiGLUFp8Function.apply(x.view(-1, x.shape[-1]), grad_col_scale)  # (T, F)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``x = [gate | up]`` along the last dim (Triton forward, backward).

    Args:
        x: (..., 2F) contiguous fc1 output (fp16, bf16 or fp32), e.g. ``[s, b, 2F]``.

    Returns:
        (..., F) tensor of ``x``'s dtype.

    Raises:
        ValueError: for an odd last dim, or a dtype or contiguity the kernel does not take.
    """
    _check_input(x)
    out = SwiGLUFunction.apply(x.view(-1, x.shape[-1]))  # (T, F)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of `swiglu`, Megatron's unfused GLU: ``silu(gate) * up``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up
