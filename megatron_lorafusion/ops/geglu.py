"""Fused GeGLU of Megatron's ``linear_fc1`` output: ``[gate | up]`` (T, 2F) → ``gelu(gate)·up``.

Gemma 3's MLP (Shazeer, "GLU Variants Improve Transformer", 2020) with the tanh
approximation of GELU (transformers' ``gelu_pytorch_tanh``, ``F.gelu(approximate="tanh")``):
``gelu(g) = ½·g·(1 + tanh(z))`` with ``z = √(2/π)·(g + 0.044715·g³)``. The kernels use the
identity ``½·(1 + tanh(z)) = sigmoid(2z)``, so no tanh is needed (none that runs on every
Triton version and in the interpreter) and nothing cancels for large negative ``g``. As
`ops.swiglu`: the forward reads ``[gate | up]`` once and writes ``(T, F)``; only the fc1 output
is saved, and the backward recomputes the gate from it and writes both halves in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gelu_gate(gate):
        """``(gelu_tanh(gate), d gelu_tanh / d gate)`` in fp32."""
        inner = gate * gate
        z = 0.7978845608028654 * gate * (1.0 + 0.044715 * inner)  # √(2/π)·(g + 0.044715·g³)
        # |z| <= 40: σ(±80) is already 1 or 2e-35 in fp32, and exp stays finite
        z = tl.minimum(tl.maximum(z, -40.0), 40.0)
        up_part = tl.sigmoid(2.0 * z)  # ½(1 + tanh z)
        down_part = tl.sigmoid(-2.0 * z)  # 1 − σ(2z) without the cancellation near σ = 1
        dz = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * inner)
        # d/dg [g·σ(2z)] = σ(2z) + g·2σ(2z)σ(−2z)·z'
        slope = up_part + 2.0 * gate * up_part * down_part * dz
        return gate * up_part, slope

    @triton.jit
    def _geglu_fwd_kernel(x_ptr, out_ptr, F_DIM, BLOCK_F: tl.constexpr):
        """One row tile: ``out = gelu_tanh(gate) · up`` in fp32, cast on store."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = cols < F_DIM
        gate = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        activated, _ = _gelu_gate(gate)
        tl.store(
            out_ptr + row * F_DIM + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _geglu_bwd_kernel(dout_ptr, x_ptr, dx_ptr, F_DIM, BLOCK_F: tl.constexpr):
        """One row tile: ``d_up = dout · gelu(gate)``, ``d_gate = dout · up · gelu'(gate)``."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = cols < F_DIM
        gate = tl.load(x_ptr + row * 2 * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * F_DIM + F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + row * F_DIM + cols, mask=mask, other=0.0).to(tl.float32)
        activated, slope = _gelu_gate(gate)
        out_type = dx_ptr.dtype.element_ty
        tl.store(dx_ptr + row * 2 * F_DIM + cols, (dout * up * slope).to(out_type), mask=mask)
        tl.store(
            dx_ptr + row * 2 * F_DIM + F_DIM + cols, (dout * activated).to(out_type), mask=mask
        )


# Elementwise, as `ops.swiglu`: 1024 columns per program, 4 warps; small interpreter tiles so
# ragged widths cross a tile edge.
_BLOCK_F = {"cuda": 1024, "cpu": 32}
_NUM_WARPS = 4


def _grid(tokens: int, width: int, device: torch.device) -> tuple[tuple[int, int], int]:
    block = _BLOCK_F["cuda" if device.type == "cuda" else "cpu"]
    return (tokens, _utils.cdiv(width, block)), block


def geglu_fwd(x: torch.Tensor) -> torch.Tensor:
    """Launch the forward on (T, 2F) ``x``; returns (T, F)."""
    tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    if tokens and width:
        grid, block = _grid(tokens, width, x.device)
        _geglu_fwd_kernel[grid](x, out, width, BLOCK_F=block, num_warps=_NUM_WARPS)
    return out


def geglu_bwd(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Launch the backward: (T, 2F) ``d[gate | up]`` from (T, F) ``dout`` and the saved ``x``."""
    tokens, width = dout.shape
    dx = torch.empty_like(x)
    if tokens and width:
        grid, block = _grid(tokens, width, x.device)
        _geglu_bwd_kernel[grid](dout, x, dx, width, BLOCK_F=block, num_warps=_NUM_WARPS)
    return dx


class GeGLUFunction(torch.autograd.Function):
    """Autograd of `geglu` on (T, 2F): saves only its input, recomputes the gate."""

    @staticmethod
    def forward(ctx, x):
        """(T, F) ``gelu_tanh(gate) · up``."""
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x)
        return geglu_fwd(x)

    @staticmethod
    def backward(ctx, dout):
        """(T, 2F) gradient of ``[gate | up]``."""
        (x,) = ctx.saved_tensors
        return geglu_bwd(dout.contiguous(), x)


def geglu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) · up`` of ``x = [gate | up]`` along the last dim (Triton both ways).

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
    out = GeGLUFunction.apply(x.view(-1, x.shape[-1]))  # (T, F)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def geglu_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of `geglu`, transformers' Gemma MLP: ``gelu(gate, "tanh") * up``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
