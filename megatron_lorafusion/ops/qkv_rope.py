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

With frozen per-head RMSNorm weights (Qwen3's and Gemma 3's ``q_norm``/``k_norm``, over the
``D`` values of each head), each query and key head is normalised before its rotation, in
the same pass: ``rot(w ⊙ x / rms(x))``. The backward then also reads the row itself (saved)
to recompute ``rms(x)``, and applies the norm's input gradient
``(g ⊙ w − x̂·mean(g ⊙ w ⊙ x̂)) / rms(x)`` with ``x̂ = x / rms(x)`` (no weight gradient:
the base is frozen).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    def _inv_rms(x1, x2, DIM, EPS, AXIS: tl.constexpr):
        """``1 / sqrt(mean(x²) + eps)`` over each head's two halves (kept as a size-1 dim)."""
        squares = tl.sum(x1 * x1, axis=AXIS, keep_dims=True)
        squares += tl.sum(x2 * x2, axis=AXIS, keep_dims=True)
        return 1.0 / tl.sqrt(squares / DIM + EPS)

    @triton.jit
    def _head(
        src,
        dst,
        x_src,
        w_ptr,
        mask,
        cols,
        c1,
        c2,
        s1,
        s2,
        HALF,
        EPS,
        AXIS: tl.constexpr,
        BACKWARD: tl.constexpr,
        NORM: tl.constexpr,
    ):
        """Forward: ``dst = rot(norm(src))``; BACKWARD: ``dst = norm'(x)ᵀ·rotᵀ(src)``.

        ``src``/``dst``/``x_src`` are pointer blocks of the heads' first halves (one head: 1-D,
        ``AXIS`` 0; a group's query heads: 2-D, ``AXIS`` 1); ``x_src`` (the saved row) is read
        in backward with NORM only.
        """
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + cols + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
        if BACKWARD:
            x1, x2 = _rotate(x1, x2, c1, c2, s1, s2, True)  # d(normed head)
            if NORM:
                a1 = tl.load(x_src, mask=mask, other=0.0).to(tl.float32)
                a2 = tl.load(x_src + HALF, mask=mask, other=0.0).to(tl.float32)
                inv = _inv_rms(a1, a2, 2 * HALF, EPS, AXIS)
                a1, a2, x1, x2 = a1 * inv, a2 * inv, x1 * w1, x2 * w2  # x̂ and g ⊙ w
                dot = tl.sum(x1 * a1, axis=AXIS, keep_dims=True)
                dot = (dot + tl.sum(x2 * a2, axis=AXIS, keep_dims=True)) / (2 * HALF)
                x1, x2 = (x1 - a1 * dot) * inv, (x2 - a2 * dot) * inv
        else:
            if NORM:
                inv = _inv_rms(x1, x2, 2 * HALF, EPS, AXIS)
                x1, x2 = x1 * inv * w1, x2 * inv * w2
            x1, x2 = _rotate(x1, x2, c1, c2, s1, s2, False)
        tl.store(dst, x1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, x2.to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def _qkv_rope_kernel(
        row_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        x_ptr,
        qw_ptr,
        kw_ptr,
        stride_rt,
        stride_xt,
        stride_ct,
        GROUPS,
        Q_PER_GROUP,
        HALF,
        EPS,
        BACKWARD: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One (token, KV group): its Q query heads, its k and its v.

        Forward: the fused row -> q, k (normalised with NORM, rotated) and v. BACKWARD: dq,
        dk (rotated back, through the norm with NORM, reading the saved row ``x_ptr``) and
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
        # Offsets of this group's heads in the fused row (and the saved row) and in q / k / v.
        in_row = group * (Q_PER_GROUP + 2) * dim
        row = row_ptr + token * stride_rt + in_row
        saved = x_ptr + token * stride_xt + in_row
        heads = tl.arange(0, BLOCK_Q)[:, None]
        q_mask = (heads < Q_PER_GROUP) & col_mask[None, :]
        q_cols = heads * dim + cols[None, :]
        split_q = q_ptr + (token * GROUPS * Q_PER_GROUP + group * Q_PER_GROUP) * dim + q_cols
        k_col = Q_PER_GROUP * dim + cols
        split_kv = (token * GROUPS + group) * dim + cols
        if BACKWARD:
            src_q, dst_q = split_q, row + q_cols
            src_k, dst_k = k_ptr + split_kv, row + k_col
            src_v, dst_v = v_ptr + split_kv, row + k_col + dim
        else:
            src_q, dst_q = row + q_cols, split_q
            src_k, dst_k = row + k_col, k_ptr + split_kv
            src_v, dst_v = row + k_col + dim, v_ptr + split_kv
        cq1, cq2, sq1, sq2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
        _head(src_q, dst_q, saved + q_cols, qw_ptr, q_mask, cols[None, :], cq1, cq2, sq1, sq2,
              HALF, EPS, 1, BACKWARD, NORM)  # fmt: skip
        _head(src_k, dst_k, saved + k_col, kw_ptr, col_mask, cols, c1, c2, s1, s2,
              HALF, EPS, 0, BACKWARD, NORM)  # fmt: skip
        tl.store(dst_v, tl.load(src_v, mask=col_mask), mask=col_mask)
        tl.store(dst_v + HALF, tl.load(src_v + HALF, mask=col_mask), mask=col_mask)


_NUM_WARPS = 4  # one token's group: 4 query heads + k + v of 128 at Llama-3-8B, memory-bound


def _launch(row, q, k, v, cos, sin, groups, q_per_group, norm, backward: bool) -> None:
    """``norm``: None, or ``(saved row, q weight, k weight, eps)``."""
    tokens = row.shape[0]
    if tokens == 0 or groups == 0:
        return
    half = q.shape[-1] // 2
    saved, q_weight, k_weight, eps = norm if norm is not None else (row, cos, cos, 0.0)
    _qkv_rope_kernel[(tokens, groups)](
        row,
        q,
        k,
        v,
        cos,
        sin,
        saved,
        q_weight,
        k_weight,
        row.stride(0),
        saved.stride(0),
        cos.stride(0),
        groups,
        q_per_group,
        half,
        eps,
        BACKWARD=backward,
        NORM=norm is not None,
        BLOCK_Q=triton.next_power_of_2(q_per_group),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=_NUM_WARPS,
    )


def qkv_rope_fwd(row, cos, sin, groups: int, q_per_group: int, head_dim: int, norm=None):
    """``(q, k, v)`` contiguous from the (T, G·(Q+2)·D) fused row (last stride 1).

    ``norm``: None, or ``(row, q weight, k weight, eps)`` of the per-head RMSNorms.
    """
    tokens = row.shape[0]
    q = torch.empty(tokens, groups * q_per_group, head_dim, dtype=row.dtype, device=row.device)
    k = torch.empty(tokens, groups, head_dim, dtype=row.dtype, device=row.device)
    v = torch.empty_like(k)
    _launch(row, q, k, v, cos, sin, groups, q_per_group, norm, backward=False)
    return q, k, v


def qkv_rope_bwd(dq, dk, dv, cos, sin, groups: int, q_per_group: int, norm=None):
    """The fused row's (T, G·(Q+2)·D) gradient from contiguous ``dq, dk, dv``.

    ``norm``: None, or ``(saved row, q weight, k weight, eps)`` of the forward.
    """
    tokens, _, head_dim = dq.shape
    grad_row = torch.empty(
        tokens, groups * (q_per_group + 2) * head_dim, dtype=dq.dtype, device=dq.device
    )
    _launch(grad_row, dq, dk, dv, cos, sin, groups, q_per_group, norm, backward=True)
    return grad_row


class QKVRoPEFunction(torch.autograd.Function):
    """Autograd of `qkv_rope`: saves the tables, and with q/k norms the row and weights."""

    @staticmethod
    def forward(ctx, row, cos, sin, groups, q_per_group, head_dim, q_weight, k_weight, eps):
        """Contiguous rotated ``q``, rotated ``k`` and ``v`` of the fused row."""
        norm = None if q_weight is None else (row, q_weight, k_weight, eps)
        saved = () if norm is None else (row, q_weight, k_weight)
        ctx.save_for_backward(cos, sin, *saved)
        ctx.groups, ctx.q_per_group, ctx.head_dim, ctx.eps = groups, q_per_group, head_dim, eps
        return qkv_rope_fwd(row, cos, sin, groups, q_per_group, head_dim, norm)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        """The fused row's gradient (zeros stand in for an output without gradient)."""
        cos, sin, *saved = ctx.saved_tensors
        norm = (*saved, ctx.eps) if saved else None
        tokens, groups = cos.shape[0], ctx.groups
        shapes = ((groups * ctx.q_per_group, dq), (groups, dk), (groups, dv))
        dq, dk, dv = (
            cos.new_zeros(tokens, heads, ctx.head_dim) if g is None else g.contiguous()
            for heads, g in shapes
        )
        grad_row = qkv_rope_bwd(dq, dk, dv, cos, sin, groups, ctx.q_per_group, norm)
        return grad_row, None, None, None, None, None, None, None, None


def _check(row, cos, sin, groups, q_per_group, head_dim, q_norm, k_norm) -> list[torch.Tensor]:
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
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together, got one of them")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None:
            _utils.check_tensor(name, weight, (head_dim,), _utils.KERNEL_DTYPES, row.device)
            if weight.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{name} must be frozen (the kernel gives it no gradient)")
    return tables


def qkv_rope(
    row: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    groups: int,
    q_per_group: int,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
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
        q_norm: (D,) contiguous frozen weight of an RMSNorm over each query head, applied
            before the rotation (Qwen3, Gemma 3); None: no norm. Given with ``k_norm``.
        k_norm: the same for each key head.
        eps: the norms' epsilon.

    Returns:
        Contiguous ``q`` (T, G·Q, D), ``k`` (T, G, D) rotated and ``v`` (T, G, D), in the
        row's dtype; gradients flow to ``row``.

    Raises:
        ValueError: on a row, table or weight of the wrong shape, dtype, device or layout, one
            norm weight without the other, or a norm weight requiring grad.
    """
    cos, sin = _check(row, cos, sin, groups, q_per_group, head_dim, q_norm, k_norm)
    return QKVRoPEFunction.apply(
        row, cos, sin, groups, q_per_group, head_dim, q_norm, k_norm, float(eps)
    )


def qkv_rope_ref(
    row: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    groups: int,
    q_per_group: int,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `qkv_rope` (same arguments; ``cos``/``sin`` (T, 1, D)).

    The norms are Megatron's path: ``F.rms_norm`` of each head, then RoPE.
    """
    tokens = row.shape[0]
    grouped = row.view(tokens, groups, q_per_group + 2, head_dim)
    query = grouped[:, :, :q_per_group].reshape(tokens, groups * q_per_group, head_dim)
    key, value = grouped[:, :, q_per_group], grouped[:, :, q_per_group + 1]
    if q_norm is not None:
        query = F.rms_norm(query, (head_dim,), q_norm, eps)
        key = F.rms_norm(key, (head_dim,), k_norm, eps)
    query, key = rope_ref(query, key, cos, sin)
    return query, key, value.contiguous()
