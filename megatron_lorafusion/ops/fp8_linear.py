"""Frozen FP8 linear: ``Y = X·Wᵀ + b`` and ``dX = dY·W`` on FP8 tensor cores, W never trained.

Forward: X is quantized per token (`quantize_rows`), W is stored per output channel
(`Fp8Weight`), and ``Y = (X_q·W_qᵀ)·s_x·s_w`` is one row-wise scaled GEMM
(``torch._scaled_mm`` with ``scale_a`` (T, 1) and ``scale_b`` (1, N): cuBLASLt on sm90 with
CUDA >= 12.9, CUTLASS otherwise). Backward: ``dX = dY·W = (dY·diag(s_w))·W_q``, so dY is
multiplied by the channel scales before it is quantized per token, and the GEMM takes W_q as
it is stored, transposed to K-major (Hopper's FP8 MMA reads both operands K-major). No weight
gradient. Where X's or dY's producer already quantized it (the SwiGLU kernels under an FP8
base), its result is taken (`fp8_quant.take_quantized`) instead of quantizing again; the
output carries the weight's scales for dY's producer (`fp8_quant.mark_grad_col_scale`).
`fp8_linear_ref` fake-quantizes the same way in torch (any device, fp32 sums): the oracle of
the kernels and the path an FP8 model takes on CPU. docs/fp8.md has the choices.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops.fp8 import FP8_DTYPE, Fp8Weight, check_fp8_device
from megatron_lorafusion.ops.fp8_quant import (
    mark_grad_col_scale,
    quantize_rows,
    quantize_rows_ref,
    take_quantized,
    unit_scales,
)

FAST_ACCUM_FORWARD = True
"""Forward GEMMs accumulate without cuBLASLt's periodic fp32 promotion (Transformer Engine's
split: fast in forward, promoted in backward); `scripts.bench_fp8` measures both."""


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(A·Bᵀ)·scale_a[:, None]·scale_b[None, :]`` (+ bias), a row-wise scaled FP8 GEMM.

    Args:
        a: (M, K) e4m3, row-major.
        b: (N, K) e4m3, row-major (so ``b.t()`` is the column-major operand cuBLASLt needs).
        scale_a: (M,) fp32.
        scale_b: (N,) fp32, or (1, N) (e.g. `unit_scales`).
        out_dtype: bf16, fp16 or fp32.
        fast_accum: accumulate without periodic fp32 promotion.
        bias: (N,) in ``out_dtype``, or None.

    Returns:
        (M, N) in ``out_dtype``.

    Raises:
        ValueError: when K or N is not a multiple of 16 (the scaled GEMM's alignment).
    """
    if a.shape[1] % 16 or b.shape[0] % 16:
        raise ValueError(
            f"FP8 GEMMs need K and N multiples of 16, got A {tuple(a.shape)}, B {tuple(b.shape)}"
        )
    late_bias = bias is not None and out_dtype == torch.float32  # the GEMM's bias: 16-bit only
    out = torch._scaled_mm(
        a,
        b.t(),
        scale_a=scale_a.reshape(-1, 1),
        scale_b=scale_b.reshape(1, -1),
        bias=None if late_bias else bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    return out.add_(bias) if late_bias else out


def quantized_rows(
    x: torch.Tensor, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(x, col_scale)``: the one ``x``'s producer attached, else computed."""
    taken = take_quantized(x, col_scale)
    return taken if taken is not None else quantize_rows(x, col_scale=col_scale)


def frozen_dgrad(
    dy: torch.Tensor,
    weight: Fp8Weight,
    out_dtype: torch.dtype,
    dy_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``dX = dY·W`` (T, H) through FP8: dY·diag(s_w) quantized per token, times W_q.

    ``dy_quantized``: that quantization, ``(q, scale)``, when the caller already has it.
    """
    dy_q, dy_scale = dy_quantized or quantized_rows(dy, weight.scale)  # (T, N), (T,)
    w_t = weight.transposed()  # (H, N): K-major for this GEMM
    return fp8_matmul(dy_q, w_t, dy_scale, unit_scales(w_t.shape[0], str(dy.device)), out_dtype)


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd of `fp8_linear` on CUDA: saves the weight only (no X: nothing is learned)."""

    @staticmethod
    def forward(ctx, x, data, scale, data_t, bias):
        """``x`` (T, H); ``data``/``scale``/``data_t`` an `Fp8Weight`'s; ``bias`` or None."""
        x_q, x_scale = quantized_rows(x)
        y = fp8_matmul(x_q, data, x_scale, scale, x.dtype, fast_accum=FAST_ACCUM_FORWARD, bias=bias)
        if ctx.needs_input_grad[0]:
            mark_grad_col_scale(y, scale)
        ctx.save_for_backward(data, scale, data_t)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        """``dX`` (and ``db`` for a bias that requires grad)."""
        data, scale, data_t = ctx.saved_tensors
        dy = dy.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = frozen_dgrad(dy, Fp8Weight(data, scale, data_t), dy.dtype)
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return grad_x, None, None, None, grad_bias


class _FakeQuantLinear(torch.autograd.Function):
    """`fp8_linear_ref`: the kernels' quantization in torch, fp32 sums."""

    @staticmethod
    def forward(ctx, x, data, scale, bias):
        x_q, x_scale = quantize_rows_ref(x)
        y = (x_q.float() @ data.float().t()) * x_scale[:, None] * scale[None, :]  # (T, N)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(data, scale)
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        data, scale = ctx.saved_tensors
        dy_q, dy_scale = quantize_rows_ref(dy, col_scale=scale)  # dY·diag(s_w), per token
        grad_x = ((dy_q.float() @ data.float()) * dy_scale[:, None]).to(dy.dtype)  # (T, H)
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias


def fp8_linear_ref(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of `fp8_linear`: the same quantization, fp32 GEMMs, any device.

    Forward ``Y = (X_q·W_qᵀ)·s_x·s_w + b``; backward ``dX = Q(dY·diag(s_w))·W_q`` (the
    gradient with respect to X of the quantized forward is taken to be that of ``X·Wᵀ``,
    straight through the rounding of X, as the kernels do).

    Args:
        x: (T, H) activations, any float dtype.
        weight: the frozen `Fp8Weight` (N, H).
        bias: (N,) or None.

    Returns:
        (T, N) in ``x``'s dtype.
    """
    return _FakeQuantLinear.apply(x, weight.data, weight.scale, bias)


def fp8_linear(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Frozen FP8 linear ``X·Wᵀ + b`` (T, N) from (T, H): scaled GEMMs on CUDA, else the ref.

    Args:
        x: (T, H) bf16/fp16/fp32 activations.
        weight: the frozen `Fp8Weight` (N, H), on ``x``'s device.
        bias: (N,) in ``x``'s dtype, or None.

    Returns:
        (T, N) in ``x``'s dtype.

    Raises:
        RuntimeError: on a GPU without FP8 tensor cores.
        ValueError: on mismatched shapes or dtypes, or H, N not multiples of 16 on CUDA.
    """
    if weight.data.dtype != FP8_DTYPE or x.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"fp8_linear takes x (T, H) and an e4m3 weight (N, H), got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)} {weight.data.dtype}"
        )
    if not (x.is_cuda and _utils.triton is not None):
        return fp8_linear_ref(x, weight, bias)
    check_fp8_device(x.device)
    return Fp8LinearFunction.apply(x.contiguous(), weight.data, weight.scale, weight.data_t, bias)
