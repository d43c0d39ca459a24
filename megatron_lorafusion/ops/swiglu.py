"""Fused SwiGLU of Megatron's ``linear_fc1`` output: ``[gate | up]`` (T, 2F) → ``silu(gate)·up``.

Megatron's unfused GLU chunks the fc1 output, runs ``silu`` (saving its input), multiplies
(saving both factors) and its backward writes the two halves' gradients separately before a
``torch.cat``. Here the forward reads ``[gate | up]`` once and writes ``(T, F)``; only the fc1
output is saved, and the backward recomputes ``sigmoid(gate)`` from it and writes both halves
of ``d[gate | up]`` in one pass (Shazeer, "GLU Variants Improve Transformer", 2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton

if triton is not None:
    import triton.language as tl

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
    def _swiglu_bwd_kernel(dout_ptr, x_ptr, dx_ptr, F_DIM, BLOCK_F: tl.constexpr):
        """One row tile: ``d_up = dout · silu(gate)``, ``d_gate = dout · up · silu'(gate)``."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = cols < F_DIM
        gate = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + row * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        d_gate = dout * up * (sig + silu * (1.0 - sig))
        tl.store(dx_ptr + row * 2 * F_DIM + cols, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(
            dx_ptr + row * 2 * F_DIM + F_DIM + cols,
            (dout * silu).to(dx_ptr.dtype.element_ty),
            mask=mask,
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


def swiglu_bwd(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Launch the backward: (T, 2F) ``d[gate | up]`` from (T, F) ``dout`` and the saved ``x``."""
    tokens, width = dout.shape
    dx = torch.empty_like(x)
    if tokens and width:
        grid, block = _grid(tokens, width, x.device)
        _swiglu_bwd_kernel[grid](dout, x, dx, width, BLOCK_F=block, num_warps=_NUM_WARPS)
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


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``x = [gate | up]`` along the last dim (Triton forward, backward).

    Args:
        x: (..., 2F) contiguous fc1 output (fp16, bf16 or fp32), e.g. ``[s, b, 2F]``.

    Returns:
        (..., F) tensor of ``x``'s dtype.

    Raises:
        ValueError: for an odd last dim, or a dtype or contiguity the kernel does not take.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even last dim [gate | up], got shape {tuple(getattr(x, 'shape', ()))}"
        )
    _utils.check_tensor("x", x, list(x.shape), _utils.KERNEL_DTYPES, x.device)
    out = SwiGLUFunction.apply(x.view(-1, x.shape[-1]))  # (T, F)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of `swiglu`, Megatron's unfused GLU: ``silu(gate) * up``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up
