"""A layer's packed LoRA factor out of the adapters' weight table, and its gradient back in.

Every adapter factor of a rank is row ``a`` of one (A, S) fp32 table, so a layer's packed
factor is a strided (A, R, C) view whose adapter stride is ``S``. A forward needs it
contiguous in the compute dtype (`packed_factor_fwd`), and its backward adds the (A, R, C)
gradient into the same view of the gradient table (`packed_factor_bwd`). torch's copy and
add index such a view in 32 bits and split into several launches once ``A·S`` passes 2³¹
bytes (16 adapters of rank 64 on a 1B model, 64 of rank 8 on an 8B one: +28 launches per
linear measured at A = 64, r = 64, 1B); these kernels are one launch each with 64-bit offsets.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops._utils import tl, triton, triton_usable

if triton is not None:

    @triton.jit
    def _packed_factor_fwd_kernel(table_ptr, out_ptr, row_stride, width, BLOCK: tl.constexpr):
        adapter = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        value = tl.load(table_ptr + adapter * row_stride + cols, mask=mask)
        tl.store(out_ptr + adapter * width + cols, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _packed_factor_bwd_kernel(table_ptr, grad_ptr, row_stride, width, BLOCK: tl.constexpr):
        adapter = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        offs = table_ptr + adapter * row_stride + cols
        grad = tl.load(grad_ptr + adapter * width + cols, mask=mask).to(tl.float32)
        tl.store(offs, tl.load(offs, mask=mask) + grad, mask=mask)


_BLOCK = 4096  # elements per program


def _check_view(name: str, view: torch.Tensor) -> None:
    """Refuse anything but an (A, R, C) fp32 view with contiguous (R, C) blocks."""
    if view.dim() != 3 or view.dtype != torch.float32:
        raise ValueError(
            f"{name} must be an (A, R, C) fp32 view, got shape {tuple(view.shape)} {view.dtype}"
        )
    if view.stride(2) != 1 or view.stride(1) != view.shape[2]:
        raise ValueError(f"{name} must have contiguous (R, C) blocks, got strides {view.stride()}")


def _grid(view: torch.Tensor) -> tuple[int, int]:
    return (triton.cdiv(view.shape[1] * view.shape[2], _BLOCK), view.shape[0])


def packed_factor_fwd(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``factor`` (A, R, C) fp32 strided view -> a contiguous copy in ``dtype`` (one launch)."""
    _check_view("factor", factor)
    out = torch.empty(factor.shape, dtype=dtype, device=factor.device)
    if factor.numel():
        _packed_factor_fwd_kernel[_grid(factor)](
            factor, out, factor.stride(0), factor.shape[1] * factor.shape[2], BLOCK=_BLOCK
        )
    return out


def packed_factor_bwd(grad_table_view: torch.Tensor, grad: torch.Tensor) -> None:
    """``grad_table_view += grad`` in place: (A, R, C) fp32 view, (A, R, C) contiguous grad."""
    _check_view("grad_table_view", grad_table_view)
    if grad.shape != grad_table_view.shape or grad.device != grad_table_view.device:
        raise ValueError(
            f"grad has shape {tuple(grad.shape)} on {grad.device}, expected "
            f"{tuple(grad_table_view.shape)} on {grad_table_view.device}"
        )
    grad = grad.contiguous()
    if grad.numel():
        _packed_factor_bwd_kernel[_grid(grad)](
            grad_table_view,
            grad,
            grad_table_view.stride(0),
            grad.shape[1] * grad.shape[2],
            BLOCK=_BLOCK,
        )


class PackedFactorFunction(torch.autograd.Function):
    """A packed factor copied contiguous in ``dtype``; backward adds into its grad view.

    ``table`` (the (A, S) weight table, which requires grad) is an input only so autograd
    reaches this node; no gradient flows to it: backward adds into ``grad_view`` in place.
    """

    @staticmethod
    def forward(ctx, table, factor, grad_view, dtype):
        """(A, R, C) contiguous copy of ``factor`` in ``dtype``."""
        ctx.grad_view = grad_view
        if triton_usable(factor):
            return packed_factor_fwd(factor, dtype)
        return packed_factor_ref(factor, dtype)

    @staticmethod
    def backward(ctx, grad_out):
        """Add ``grad_out`` into the gradient view; nothing flows to the inputs."""
        if triton_usable(grad_out):
            packed_factor_bwd(ctx.grad_view, grad_out)
        else:
            ctx.grad_view.add_(grad_out)
        return None, None, None, None


def packed_factor(
    table: torch.Tensor, factor: torch.Tensor, grad_view: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """One layer's packed factor, contiguous in ``dtype``, its gradient added to ``grad_view``.

    Args:
        table: (A, S) fp32 weight table requiring grad (connects the graph, gets no grad).
        factor: (A, R, C) fp32 view of ``table`` (a wrapper's ``lora_A`` or ``lora_B``).
        grad_view: the same view of the gradient table; backward adds into it in place.
        dtype: the compute dtype.

    Returns:
        (A, R, C) contiguous tensor in ``dtype``.
    """
    return PackedFactorFunction.apply(table, factor, grad_view, dtype)


def packed_factor_ref(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the forward: a contiguous copy of ``factor`` in ``dtype``."""
    return factor.to(dtype, memory_format=torch.contiguous_format, copy=True)
