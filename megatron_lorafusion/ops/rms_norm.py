"""RMSNorm with a frozen weight, fused with what surrounds it in a pre-norm layer.

``y = x / rms(x) · w`` over the last dim, ``rms(x) = sqrt(mean(x²) + eps)``, in fp32 and
rounded once. Two things around the norm are done in its own passes:

- **The residual's gradient.** A pre-norm layer reads its input ``x`` twice: the norm, and
  the residual connection past the block. Autograd then adds the two gradients of ``x`` in
  a kernel of its own (read two, write one). `rms_norm_residual` returns ``x`` again as the
  residual (a view carrying this op's gradient function), so the backward receives both
  gradients and writes ``dx = norm'(dy) + d(residual)`` in its one pass (Megatron's layer
  takes a norm's ``(output, residual)`` pair for this seam).
- **FP8 quantization.** Under an FP8 base the norm's output feeds an FP8 linear, which
  quantizes it per row (`fp8_quant.quantize_rows`). With ``quantize`` the forward writes those
  e4m3 rows and scales too, from the row it holds, and hands them over
  (`fp8_quant.attach_quantized`), bit for bit what the linear would compute. Likewise the
  backward: ``dx`` is the gradient of the residual stream, which is also the incoming
  gradient of the FP8 linear whose output was added to that stream (``linear_proj``,
  ``linear_fc2``); given that linear's weight scales (``grad_col_scale``) the backward writes
  ``quantize_rows(dx, grad_col_scale)`` for its dX GEMM.

A program holds whole rows (``BLOCK_H`` = the next power of two of the width), so each
row is read once in each direction. The weight is frozen: there is no weight gradient, and
``rstd`` is recomputed from ``x`` in backward (the row is read there anyway).
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.fp8_quant import attach_quantized, empty_quantized

MAX_WIDTH = 16384
"""Widest row the kernels hold in registers (the norm's width, ``H``)."""

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops.fp8_quant import pow2_row_scales, store_quantized_rows

    @triton.jit(do_not_specialize=["R"])  # the token count: one compiled kernel for all
    def _rms_norm_fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        q_ptr,
        scale_ptr,
        R,
        H,
        eps,
        QUANTIZE: tl.constexpr,
        HW_CAST: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """``BLOCK_R`` whole rows: ``y``, and with QUANTIZE ``y``'s e4m3 rows and scales."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        ok = (rows < R)[:, None] & (cols < H)[None, :]
        offsets = rows.to(tl.int64)[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
        y = (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offsets, y, mask=ok)
        if QUANTIZE:  # the stored values, quantized as `quantize_rows` does
            v = y.to(tl.float32)
            scale, inv = pow2_row_scales(tl.max(tl.abs(v), axis=1))
            tl.store(scale_ptr + rows, scale, mask=rows < R)
            q_rows = q_ptr + rows.to(tl.int64)[:, None] * H
            store_quantized_rows(q_rows, cols, ok, v, inv, HW_CAST)

    @triton.jit(do_not_specialize=["R"])  # the token count: one compiled kernel for all
    def _rms_norm_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        dres_ptr,
        dx_ptr,
        col_ptr,
        q_ptr,
        scale_ptr,
        R,
        H,
        eps,
        HAS_RESIDUAL_GRAD: tl.constexpr,
        QUANTIZE: tl.constexpr,
        HW_CAST: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """``dx = (dy·w − x̂·mean(dy·w·x̂)) · rstd`` (+ the residual's gradient), whole rows.

        With QUANTIZE also ``dx·diag(col)``'s e4m3 rows and scales.
        """
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        ok = (rows < R)[:, None] & (cols < H)[None, :]
        offsets = rows.to(tl.int64)[:, None] * H + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        dx = (g - x_hat * (tl.sum(g * x_hat, axis=1) / H)[:, None]) * rstd[:, None]
        if HAS_RESIDUAL_GRAD:
            dx += tl.load(dres_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        dx = dx.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offsets, dx, mask=ok)
        if QUANTIZE:  # the stored values times the column scales, as `quantize_rows` does
            v = dx.to(tl.float32) * tl.load(col_ptr + cols, mask=cols < H, other=0.0)[None, :]
            scale, inv = pow2_row_scales(tl.max(tl.abs(v), axis=1))
            tl.store(scale_ptr + rows, scale, mask=rows < R)
            q_rows = q_ptr + rows.to(tl.int64)[:, None] * H
            store_quantized_rows(q_rows, cols, ok, v, inv, HW_CAST)


# Memory-bound row kernels, whole rows per program: (rows, warps) by the row's padded width.
# H200, bf16, µs (device run 2 of the twenty-fourth session; torch's F.rms_norm 46.1 forward,
# 73.1 backward, a residual add 52.8, quantize_rows 49.2 / 31.1 at 4096 / 8192 columns):
# 8192 rows of 4096, one row and 4 warps: forward 37.7, with its quantization 45.9; backward
# 55.6, with the residual 70.1, and dx's quantization 98.9 (8 warps: 37.7, 49.1, 57.9, 73.5,
# 99.4; 2 or 4 rows slower). 4096 rows of 8192, one row and 8 warps: 37.9, 49.6, 63.0, 77.2,
# 109.6 (4 rows and 4 warps spill: 717 µs backward). The interpreter takes 2 rows so that a
# ragged row count leaves a masked row.
_GPU_BLOCKS = {1024: (4, 4), 2048: (2, 4), 4096: (1, 4), 8192: (1, 8), 16384: (1, 16)}
_INTERPRETER_BLOCKS = (2, 4)


def _blocks(width: int, device: torch.device) -> tuple[int, int, int]:
    """(rows, padded width, warps) of a program for rows of ``width`` values."""
    block_h = triton.next_power_of_2(width)
    if device.type != "cuda":
        return _INTERPRETER_BLOCKS[0], block_h, _INTERPRETER_BLOCKS[1]
    rows, warps = _GPU_BLOCKS[max(block_h, 1024)]
    return rows, block_h, warps


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward on (T, H) ``x``: ``y`` (T, H), and e4m3 ``q`` (T, H), ``scale`` (T,).

    ``q`` and ``scale`` are None without ``quantize``.
    """
    rows, width = x.shape
    y = torch.empty_like(x)
    q, scale = empty_quantized(rows, width, x.device) if quantize else (None, None)
    if rows:
        block_r, block_h, warps = _blocks(width, x.device)
        _rms_norm_fwd_kernel[(_utils.cdiv(rows, block_r),)](
            x,
            weight,
            y,
            q if quantize else y,
            scale if quantize else y,
            rows,
            width,
            eps,
            QUANTIZE=quantize,
            HW_CAST=x.is_cuda,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            num_warps=warps,
        )
    return y, q, scale


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_grad: torch.Tensor | None,
    grad_col_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward: (T, H) ``dx`` from ``dy`` and the saved ``x`` (+ ``residual_grad``).

    With ``grad_col_scale`` (H,) fp32 also ``quantize_rows(dx, grad_col_scale)``: e4m3 ``q``
    (T, H) and ``scale`` (T,); else None, None.
    """
    rows, width = x.shape
    dx = torch.empty_like(x)
    quantize = grad_col_scale is not None
    q, scale = empty_quantized(rows, width, x.device) if quantize else (None, None)
    if rows:
        block_r, block_h, warps = _blocks(width, x.device)
        _rms_norm_bwd_kernel[(_utils.cdiv(rows, block_r),)](
            dy,
            x,
            weight,
            residual_grad if residual_grad is not None else dy,
            dx,
            grad_col_scale if quantize else weight,
            q if quantize else dx,
            scale if quantize else dx,
            rows,
            width,
            eps,
            HAS_RESIDUAL_GRAD=residual_grad is not None,
            QUANTIZE=quantize,
            HW_CAST=x.is_cuda,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            num_warps=warps,
        )
    return dx, q, scale


class RMSNormFunction(torch.autograd.Function):
    """Autograd of `rms_norm` / `rms_norm_residual` on (T, H): saves ``x`` (and the weight).

    With ``residual`` it returns ``(y, x)``; the second output's gradient is added to ``x``'s
    in the backward's kernel. With ``quantize`` ``y`` carries its e4m3 rows; with
    ``grad_col_scale`` ``x``'s gradient carries ``quantize_rows(dx, grad_col_scale)``.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, quantize, residual, grad_col_scale):
        """``y`` (T, H), or ``(y, x)`` with ``residual``."""
        ctx.set_materialize_grads(False)
        ctx.eps = eps
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, weight, grad_col_scale)
        y, q, scale = rms_norm_fwd(x, weight, eps, quantize)
        if quantize:
            attach_quantized(y, q, scale)
        return (y, x) if residual else y

    @staticmethod
    def backward(ctx, dy, residual_grad=None):
        """(T, H) gradient of ``x``: the norm's, plus the residual's when given."""
        x, weight, col_scale = ctx.saved_tensors
        if dy is None:
            return residual_grad, *(None,) * 5
        if residual_grad is not None:
            residual_grad = residual_grad.contiguous()
        dx, q, scale = rms_norm_bwd(dy.contiguous(), x, weight, ctx.eps, residual_grad, col_scale)
        if col_scale is not None:
            attach_quantized(dx, q, scale, col_scale)
        return dx, *(None,) * 5


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"x must be a tensor of shape (..., H), got {type(x).__name__}")
    _utils.check_tensor("x", x, list(x.shape), _utils.KERNEL_DTYPES, x.device)
    _utils.check_tensor("weight", weight, (x.shape[-1],), _utils.KERNEL_DTYPES, x.device)
    if x.shape[-1] > MAX_WIDTH:
        raise NotImplementedError(
            f"rms_norm holds rows of at most {MAX_WIDTH} values, got H={x.shape[-1]}"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False
) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim (Triton forward and backward).

    Args:
        x: (..., H) contiguous fp16/bf16/fp32, H <= `MAX_WIDTH`, on a GPU (or the interpreter).
        weight: (H,) frozen scale (no gradient is computed for it).
        eps: added to the mean square.
        quantize: also write the output's per-row e4m3 quantization (`fp8_quant.quantize_rows`)
            and attach it for the FP8 linear that reads the output.

    Returns:
        (..., H) tensor of ``x``'s dtype.

    Raises:
        ValueError: for a dtype, shape, device or contiguity the kernels do not take.
        NotImplementedError: for H above `MAX_WIDTH`.
    """
    _check_inputs(x, weight)
    y = RMSNormFunction.apply(x.view(-1, x.shape[-1]), weight, eps, quantize, False, None)
    return y.view(x.shape)


def rms_norm_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize: bool = False,
    grad_col_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm`, and ``x`` again as the residual connection, both gradients in one kernel.

    Use the second output (a view of ``x``) wherever ``x`` itself would be used past the
    norm: its gradient then joins ``x``'s in the norm's backward pass, not in a separate add.
    With ``grad_col_scale`` (H,) fp32, the weight scales of the FP8 linear whose incoming
    gradient ``x``'s is (`fp8_quant.grad_col_scale` of ``x``), ``x``'s gradient carries
    ``quantize_rows(dx, grad_col_scale)`` for that linear's backward.

    Returns:
        ``(y, residual)``: (..., H) each, ``residual`` equal to ``x``.
    """
    _check_inputs(x, weight)
    if grad_col_scale is not None:
        _utils.check_tensor(
            "grad_col_scale", grad_col_scale, (x.shape[-1],), (torch.float32,), x.device
        )
    y, residual = RMSNormFunction.apply(
        x.view(-1, x.shape[-1]), weight, eps, quantize, True, grad_col_scale
    )
    return y.view(x.shape), residual.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of `rms_norm`: fp32 statistics and products, rounded once."""
    v = x.float()
    y = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)
