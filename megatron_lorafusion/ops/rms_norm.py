"""Fused RMSNorm of the frozen base: ``y = x / sqrt(mean(x²) + eps) · w``, forward and dX.

One read of ``x`` and one write of ``y`` per pass, statistics in fp32 (torch's ``rms_norm``
computes in fp32 and casts once, as here); the backward rereads ``x`` with the saved per-row
``rstd`` and writes ``dx = rstd · (dy·w − x̂ · mean(dy·w·x̂))``. The weight is frozen (the base
model never trains its norms), so there is no ``dw``: a weight that requires a gradient is
refused. The residual add before the norm is not fused: Megatron's ``TransformerLayer`` adds
the residual in its bias-dropout-add and hands the norm the sum, with no seam between the two
short of replacing the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        rstd_ptr,
        H,
        eps,
        BLOCK_H: tl.constexpr,
        SAVE_RSTD: tl.constexpr,
    ):
        """One row: ``y = x · rstd · w`` in fp32, cast on store; ``rstd`` saved for backward."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        tl.store(y_ptr + row * H + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        if SAVE_RSTD:
            tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, H, BLOCK_H: tl.constexpr):
        """One row: ``dx = rstd · (g − x̂ · mean(g · x̂))`` with ``g = dy · w``, ``x̂ = x · rstd``."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / H))
        tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# A whole row per program (H ≤ 16384 stays in registers: 64 KiB of fp32 over 16 warps).
_MAX_H = 16384


def _num_warps(block_h: int) -> int:
    return max(1, min(16, block_h // 512))


def _block_h(width: int) -> int:
    if width > _MAX_H:
        raise NotImplementedError(
            f"rms_norm keeps a row in registers: H must be <= {_MAX_H}, got H={width}"
        )
    return triton.next_power_of_2(width)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, save_rstd: bool):
    """Launch the forward on (T, H) ``x``; returns ``y`` (T, H) and ``rstd`` (T,) fp32 or None."""
    tokens, width = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(tokens, dtype=torch.float32, device=x.device) if save_rstd else None
    if tokens:
        block_h = _block_h(width)
        _rms_norm_fwd_kernel[(tokens,)](
            x,
            weight,
            y,
            rstd if save_rstd else y,
            width,
            eps,
            BLOCK_H=block_h,
            SAVE_RSTD=save_rstd,
            num_warps=_num_warps(block_h),
        )
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """Launch the backward: (T, H) ``dx`` from ``dy``, ``x`` and the forward's ``rstd``."""
    tokens, width = x.shape
    dx = torch.empty_like(x)
    if tokens:
        block_h = _block_h(width)
        _rms_norm_bwd_kernel[(tokens,)](
            dy,
            x,
            weight,
            rstd,
            dx,
            width,
            BLOCK_H=block_h,
            num_warps=_num_warps(block_h),
        )
    return dx


class RMSNormFunction(torch.autograd.Function):
    """Autograd of `rms_norm` on (T, H) rows: saves ``x`` and ``rstd`` (T,) fp32; no ``dw``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        """(T, H) normalised ``x``."""
        needs_grad = ctx.needs_input_grad[0]
        y, rstd = rms_norm_fwd(x, weight, eps, needs_grad)
        if needs_grad:
            ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        """(T, H) ``dx``; the frozen weight and ``eps`` get None."""
        x, weight, rstd = ctx.saved_tensors
        return rms_norm_bwd(dy.contiguous(), x, weight, rstd), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dim with a frozen weight (Triton forward and backward).

    Args:
        x: (..., H) contiguous activations (fp16, bf16 or fp32), e.g. ``[s, b, H]``.
        weight: (H,) frozen norm weight, same dtype and device.
        eps: added to ``mean(x²)`` before the square root.

    Returns:
        (..., H) tensor of ``x``'s dtype.

    Raises:
        ValueError: on shape, dtype, device or contiguity mismatch (names the tensor).
        NotImplementedError: for a weight that requires a gradient, or ``H`` > 16384.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError("x must be a tensor of shape (..., H)")
    width = x.shape[-1]
    _utils.check_tensor("x", x, list(x.shape), _utils._KERNEL_DTYPES, x.device)
    _utils.check_tensor("weight", weight, (width,), (x.dtype,), x.device)
    if weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("rms_norm has no weight gradient: freeze weight")
    y = RMSNormFunction.apply(x.view(-1, width), weight, float(eps))  # (T, H)
    return y.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Torch reference of `rms_norm` (``F.rms_norm``, which also computes in fp32)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
