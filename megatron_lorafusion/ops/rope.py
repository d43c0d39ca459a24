"""Fused rotary position embedding of packed q and k, Megatron's non-interleaved (halves) layout.

``rot(x) = x · cos + [−x₂ | x₁] · sin`` per head, with ``x = [x₁ | x₂]`` split in halves of the
head dim and one ``(cos, sin)`` row per packed token (its position inside its sample, as
``mcore.model._PortableRotaryEmbedding.packed_cos_sin`` builds them; Su et al., RoFormer,
arXiv 2104.09864). The torch form costs a ``chunk``, a negation, a ``torch.cat`` and three
products per tensor, each a full pass; the kernel reads each head row once and writes it once,
straight from the strided q/k views of the QKV split (no copy to make them contiguous). The
backward is the inverse rotation (``sin`` negated, halves swapped).
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rope_fwd_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        HEADS,
        HALF,
        stride_xt,
        stride_xh,
        stride_ct,
        BACKWARD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One token, all its heads: ``out₁ = x₁c₁ − x₂s₁``, ``out₂ = x₂c₂ + x₁s₂``.

        With BACKWARD it applies the transpose: ``dx₁ = dy₁c₁ + dy₂s₂``, ``dx₂ = dy₂c₂ − dy₁s₁``.
        ``out`` is contiguous (T, HEADS, 2·HALF).
        """
        token = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < HEADS) & (cols < HALF)
        x_row = x_ptr + token * stride_xt + heads * stride_xh + cols  # (BLOCK_H, BLOCK_D)
        x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
        c_row = token * stride_ct + cols
        c1 = tl.load(cos_ptr + c_row, mask=cols < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_row, mask=cols < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
        if BACKWARD:
            out1 = x1 * c1 + x2 * s2
            out2 = x2 * c2 - x1 * s1
        else:
            out1 = x1 * c1 - x2 * s1
            out2 = x2 * c2 + x1 * s2
        o_row = out_ptr + token * HEADS * 2 * HALF + heads * 2 * HALF + cols
        tl.store(o_row, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


_NUM_WARPS = 4  # a token's heads: 32 × 64 fp32 pairs at Llama-3-8B, memory-bound


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False):
    """Rotate (T, heads, D) ``x`` (last stride 1) into a new contiguous tensor.

    ``cos``/``sin`` are (T, D) with last stride 1; ``backward`` applies the inverse rotation.
    """
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens and heads:
        half = dim // 2
        _rope_fwd_kernel[(tokens,)](
            x,
            cos,
            sin,
            out,
            heads,
            half,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            BACKWARD=backward,
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_D=triton.next_power_of_2(half),
            num_warps=_NUM_WARPS,
        )
    return out


class RoPEFunction(torch.autograd.Function):
    """Autograd of `rope`: saves the tables only; the backward is the inverse rotation."""

    @staticmethod
    def forward(ctx, query, key, cos, sin):
        """Rotated contiguous copies of (T, np, D) ``query`` and (T, ng, D) ``key``."""
        ctx.save_for_backward(cos, sin)
        return rope_fwd(query, cos, sin), rope_fwd(key, cos, sin)

    @staticmethod
    def backward(ctx, d_query, d_key):
        """Gradients of ``query`` and ``key`` (None where the output had none)."""
        cos, sin = ctx.saved_tensors
        dq = None if d_query is None else rope_fwd(_last_dim_dense(d_query), cos, sin, True)
        dk = None if d_key is None else rope_fwd(_last_dim_dense(d_key), cos, sin, True)
        return dq, dk, None, None


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(name: str, t: torch.Tensor, tokens: int, dim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != tokens or t.shape[2] != dim:
        raise ValueError(
            f"{name} has shape {tuple(getattr(t, 'shape', ()))}, expected "
            f"(T, heads, D)=({tokens}, ?, {dim})"
        )
    if t.dtype not in _utils.KERNEL_DTYPES or t.device != device:
        raise ValueError(f"{name} is {t.dtype} on {t.device}, expected a float on {device}")


def rope(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of packed q and k with per-token tables, halves rotated (Triton, out of place).

    Args:
        query: (T, np, D) queries, any token/head strides (last dim dense or copied).
        key: (T, ng, D) keys, same dtype and device.
        cos: (T, 1, D) or (T, D) cosines of each token's angles (``[θ | θ]`` halves).
        sin: sines, same shape.

    Returns:
        Contiguous rotated ``(query, key)``, in their dtype; gradients flow to both.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or an odd head dim.
    """
    tokens, _, dim = query.shape if query.dim() == 3 else (-1, -1, -1)
    if dim % 2:
        raise ValueError(f"rope needs an even head dim, got query shape {tuple(query.shape)}")
    _check("query", query, tokens, dim, query.device)
    _check("key", key, tokens, dim, query.device)
    if key.dtype != query.dtype:
        raise ValueError(f"key has dtype {key.dtype}, expected {query.dtype}")
    tables = []
    for name, table in (("cos", cos), ("sin", sin)):
        flat = table.reshape(table.shape[0], -1) if table.dim() == 3 else table
        _utils.check_tensor(
            name, _last_dim_dense(flat), (tokens, dim), _utils.KERNEL_DTYPES, query.device
        )
        tables.append(_last_dim_dense(flat))
    return RoPEFunction.apply(_last_dim_dense(query), _last_dim_dense(key), *tables)


def rope_ref(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rope` (``cos``/``sin`` (T, 1, D)): ``x · cos + [−x₂ | x₁] · sin``."""

    def rotate(t: torch.Tensor) -> torch.Tensor:
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-second, first), dim=-1) * sin

    return rotate(query), rotate(key)
