"""Split of the fused QKV projection into rotated q, rotated k and v, in one pass each way.

Megatron's ``linear_qkv`` writes each token's row grouped by KV head:
``[q₀ … q_{Q−1} | k | v]`` for each of the ``G`` groups (``Q`` query heads per group, head dim
``D``). Megatron then splits the row into strided views, copies the query heads into their
own tensor, and RoPE (`ops.rope`) copies q and k once more; in backward autograd rotates the
gradients back and concatenates them into the row again. Here one kernel reads each row once
and writes contiguous ``q`` (T, G·Q, D) and ``k`` (T, G, D) rotated by the token's
``(cos, sin)`` (halves layout, as `ops.rope`) and ``v`` (T, G, D) copied; the backward kernel
reads ``dq, dk, dv`` once and writes the row's gradient directly (inverse rotation). Grouped
query attention stays grouped: ``k`` and ``v`` keep ``G`` heads.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.rope import rope_ref

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
        """``(x₁c₁ − x₂s₁, x₂c₂ + x₁s₂)``; with BACKWARD its transpose."""
        if BACKWARD:
            return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _qkv_rope_kernel(
        row_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        stride_rt,
        stride_ct,
        GROUPS,
        Q_PER_GROUP,
        HALF,
        BACKWARD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One (token, KV group): its Q query heads, its k and its v.

        Forward: the fused row -> q, k (rotated) and v. BACKWARD: dq, dk (rotated back) and
        dv -> the fused row's gradient.
        """
        token = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        cols = tl.arange(0, BLOCK_D)
        col_mask = cols < HALF
        c_row = token * stride_ct + cols
        c1 = tl.load(cos_ptr + c_row, mask=col_mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_row + HALF, mask=col_mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_row, mask=col_mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_row + HALF, mask=col_mask, other=0.0).to(tl.float32)
        dim = 2 * HALF
        # Row offsets of this group's heads in the fused row and in q / k / v.
        row = row_ptr + token * stride_rt + group * (Q_PER_GROUP + 2) * dim
        heads = tl.arange(0, BLOCK_Q)[:, None]
        q_mask = (heads < Q_PER_GROUP) & col_mask[None, :]
        row_q = row + heads * dim + cols[None, :]
        split_q = q_ptr + (token * GROUPS * Q_PER_GROUP + group * Q_PER_GROUP + heads) * dim
        split_q += cols[None, :]
        row_k = row + Q_PER_GROUP * dim + cols
        row_v = row_k + dim
        split_kv = (token * GROUPS + group) * dim + cols
        if BACKWARD:
            src_q, dst_q = split_q, row_q
            src_k, dst_k = k_ptr + split_kv, row_k
            src_v, dst_v = v_ptr + split_kv, row_v
            out_dtype = row_ptr.dtype.element_ty
        else:
            src_q, dst_q = row_q, split_q
            src_k, dst_k = row_k, k_ptr + split_kv
            src_v, dst_v = row_v, v_ptr + split_kv
            out_dtype = q_ptr.dtype.element_ty
        x1 = tl.load(src_q, mask=q_mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_q + HALF, mask=q_mask, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], BACKWARD)
        tl.store(dst_q, o1.to(out_dtype), mask=q_mask)
        tl.store(dst_q + HALF, o2.to(out_dtype), mask=q_mask)
        x1 = tl.load(src_k, mask=col_mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_k + HALF, mask=col_mask, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, BACKWARD)
        tl.store(dst_k, o1.to(out_dtype), mask=col_mask)
        tl.store(dst_k + HALF, o2.to(out_dtype), mask=col_mask)
        tl.store(dst_v, tl.load(src_v, mask=col_mask), mask=col_mask)
        tl.store(dst_v + HALF, tl.load(src_v + HALF, mask=col_mask), mask=col_mask)


_NUM_WARPS = 4  # one token's group: 4 query heads + k + v of 128 at Llama-3-8B, memory-bound


def _launch(row, q, k, v, cos, sin, groups: int, q_per_group: int, backward: bool) -> None:
    tokens = row.shape[0]
    if tokens == 0 or groups == 0:
        return
    half = q.shape[-1] // 2
    _qkv_rope_kernel[(tokens, groups)](
        row,
        q,
        k,
        v,
        cos,
        sin,
        row.stride(0),
        cos.stride(0),
        groups,
        q_per_group,
        half,
        BACKWARD=backward,
        BLOCK_Q=triton.next_power_of_2(q_per_group),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=_NUM_WARPS,
    )


def qkv_rope_fwd(row, cos, sin, groups: int, q_per_group: int, head_dim: int):
    """``(q, k, v)`` contiguous from the (T, G·(Q+2)·D) fused row (last stride 1)."""
    tokens = row.shape[0]
    q = torch.empty(tokens, groups * q_per_group, head_dim, dtype=row.dtype, device=row.device)
    k = torch.empty(tokens, groups, head_dim, dtype=row.dtype, device=row.device)
    v = torch.empty_like(k)
    _launch(row, q, k, v, cos, sin, groups, q_per_group, backward=False)
    return q, k, v


def qkv_rope_bwd(dq, dk, dv, cos, sin, groups: int, q_per_group: int):
    """The fused row's (T, G·(Q+2)·D) gradient from contiguous ``dq, dk, dv``."""
    tokens, _, head_dim = dq.shape
    grad_row = torch.empty(
        tokens, groups * (q_per_group + 2) * head_dim, dtype=dq.dtype, device=dq.device
    )
    _launch(grad_row, dq, dk, dv, cos, sin, groups, q_per_group, backward=True)
    return grad_row


class QKVRoPEFunction(torch.autograd.Function):
    """Autograd of `qkv_rope`: saves the tables only."""

    @staticmethod
    def forward(ctx, row, cos, sin, groups, q_per_group, head_dim):
        """Contiguous rotated ``q``, rotated ``k`` and ``v`` of the fused row."""
        ctx.save_for_backward(cos, sin)
        ctx.groups, ctx.q_per_group, ctx.head_dim = groups, q_per_group, head_dim
        return qkv_rope_fwd(row, cos, sin, groups, q_per_group, head_dim)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        """The fused row's gradient (zeros stand in for an output without gradient)."""
        cos, sin = ctx.saved_tensors
        tokens, groups = cos.shape[0], ctx.groups
        shapes = ((groups * ctx.q_per_group, dq), (groups, dk), (groups, dv))
        dq, dk, dv = (
            cos.new_zeros(tokens, heads, ctx.head_dim) if g is None else g.contiguous()
            for heads, g in shapes
        )
        grad_row = qkv_rope_bwd(dq, dk, dv, cos, sin, groups, ctx.q_per_group)
        return grad_row, None, None, None, None, None


def _check(row, cos, sin, groups: int, q_per_group: int, head_dim: int) -> list[torch.Tensor]:
    if head_dim % 2 or groups < 1 or q_per_group < 1:
        raise ValueError(
            f"qkv_rope needs an even head_dim and positive groups, got head_dim={head_dim}, "
            f"groups={groups}, q_per_group={q_per_group}"
        )
    width = groups * (q_per_group + 2) * head_dim
    if row.dim() != 2 or row.shape[1] != width or row.stride(-1) != 1:
        raise ValueError(
            f"row has shape {tuple(row.shape)} (last stride {row.stride(-1)}), expected a "
            f"(T, G·(Q+2)·D)=(T, {width}) tensor with last stride 1"
        )
    if row.dtype not in _utils.KERNEL_DTYPES:
        raise ValueError(f"row has dtype {row.dtype}, expected one of {_utils.KERNEL_DTYPES}")
    tables = []
    for name, table in (("cos", cos), ("sin", sin)):
        flat = table.reshape(table.shape[0], -1) if table.dim() == 3 else table
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        _utils.check_tensor(name, flat, (row.shape[0], head_dim), _utils.KERNEL_DTYPES, row.device)
        tables.append(flat)
    return tables


def qkv_rope(
    row: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    groups: int,
    q_per_group: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a packed fused-QKV output into rotated q, rotated k and v (Triton).

    Args:
        row: (T, G·(Q+2)·D) ``linear_qkv`` output, Megatron's per-group ``[q… | k | v]``
            order; any token stride, last stride 1.
        cos: (T, 1, D) or (T, D) cosines of each token's angles (``[θ | θ]`` halves).
        sin: sines, same shape.
        groups: KV heads ``G`` (of this TP rank).
        q_per_group: query heads per KV head ``Q``.
        head_dim: ``D``, even.

    Returns:
        Contiguous ``q`` (T, G·Q, D), ``k`` (T, G, D) rotated and ``v`` (T, G, D), in the
        row's dtype; gradients flow to ``row``.

    Raises:
        ValueError: on a row or table of the wrong shape, dtype, device or layout.
    """
    cos, sin = _check(row, cos, sin, groups, q_per_group, head_dim)
    return QKVRoPEFunction.apply(row, cos, sin, groups, q_per_group, head_dim)


def qkv_rope_ref(
    row: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    groups: int,
    q_per_group: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `qkv_rope` (same arguments; ``cos``/``sin`` (T, 1, D))."""
    tokens = row.shape[0]
    grouped = row.view(tokens, groups, q_per_group + 2, head_dim)
    query = grouped[:, :, :q_per_group].reshape(tokens, groups * q_per_group, head_dim)
    key, value = grouped[:, :, q_per_group], grouped[:, :, q_per_group + 1]
    query, key = rope_ref(query, key, cos, sin)
    return query, key, value.contiguous()
