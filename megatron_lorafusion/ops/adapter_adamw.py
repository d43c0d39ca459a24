"""One fused AdamW step for any subset of adapters whose factors are packed row by row.

Every adapter's factors (all its LoRA A and B of every layer on this rank) live in row ``a``
of one ``(A, S)`` fp32 tensor, and so do their gradients and both Adam moments. A step of
the adapters that finished a global batch is one launch over the whole table: row ``a`` is
updated with its own learning rate, betas, epsilon, weight decay and bias corrections when
``hyper[a, STEP]`` is set, and left untouched (not even read) otherwise. The update is
torch's AdamW (decoupled weight decay, Loshchilov & Hutter 2019)::

    g ← c·g                          (c: the adapter's gradient-clipping factor, or 1)
    p ← p·(1 − lr·wd)
    m ← β1·m + (1 − β1)·g            v ← β2·v + (1 − β2)·g²
    p ← p − (lr / bc1)·m / (√v / √bc2 + ε)          bc_i = 1 − β_i^step
    g ← 0

so 64 adapters step in one kernel instead of 64 optimizers of one tensor per factor, and
clipping costs no pass of its own over the gradients.

LoRA+ (Hayou et al., 2024): with a per-column ``lr_groups`` mask, the columns it marks (every
B and DoRA magnitude) step with ``hyper[a, LR_B]`` instead of ``hyper[a, LR]``, in the update
and the decay alike; without it (or with ``LR_B = LR``) the step is bit for bit the plain one.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops._utils import tl, triton, triton_usable

# Columns of the (A, HYPER_COLUMNS) fp32 hyper-parameter table, one row per adapter.
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2, STEP = range(8)
LR_B, GRAD_SCALE = 8, 9  # LoRA+'s learning rate of B; the gradient's clipping factor
HYPER_COLUMNS = 10

if triton is not None:

    @triton.jit
    def _adapter_adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        hyper_ptr,
        groups_ptr,
        S,
        HYPER: tl.constexpr,
        HAS_GROUPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        adapter = tl.program_id(1)
        row = hyper_ptr + adapter * HYPER
        if tl.load(row + 7) == 0.0:  # this adapter does not step: its row is not touched
            return
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < S
        lr = tl.load(row + 0)
        if HAS_GROUPS:  # LoRA+: B's columns at LR_B
            group = tl.load(groups_ptr + cols, mask=mask, other=0)
            lr = tl.where(group != 0, tl.load(row + 8), lr)
        beta1 = tl.load(row + 1)
        beta2 = tl.load(row + 2)
        eps = tl.load(row + 3)
        decay = 1.0 - lr * tl.load(row + 4)
        step_size = lr / tl.load(row + 5)
        inv_sqrt_bc2 = 1.0 / tl.sqrt(tl.load(row + 6))
        offs = adapter.to(tl.int64) * S + cols  # A·S passes 2**31 at 8B scale
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask) * tl.load(row + 9)  # clipped (1.0: exact)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * decay - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(g_ptr + offs, tl.zeros_like(g), mask=mask)


_BLOCK = 2048  # elements per program: 4 fp32 streams of 8 KiB, enough in flight per SM
_NUM_WARPS = 8


def _check(weights, grads, exp_avg, exp_avg_sq, hyper, lr_groups) -> None:
    if weights.dim() != 2 or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(
            f"weights must be a contiguous (A, S) fp32 tensor, got shape {tuple(weights.shape)} "
            f"{weights.dtype}"
        )
    for name, t in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != weights.shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous fp32 of shape {tuple(weights.shape)}, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device}, weights on {weights.device}")
    expected = (weights.shape[0], HYPER_COLUMNS)
    if tuple(hyper.shape) != expected or hyper.dtype != torch.float32:
        raise ValueError(
            f"hyper must be fp32 of shape {expected}, got {tuple(hyper.shape)} {hyper.dtype}"
        )
    if hyper.device != weights.device:
        raise ValueError(f"hyper is on {hyper.device}, weights on {weights.device}")
    if lr_groups is not None and (
        tuple(lr_groups.shape) != (weights.shape[1],)
        or lr_groups.dtype != torch.bool
        or lr_groups.device != weights.device
    ):
        raise ValueError(
            f"lr_groups must be bool of shape ({weights.shape[1]},) on {weights.device}, got "
            f"{tuple(lr_groups.shape)} {lr_groups.dtype} on {lr_groups.device}"
        )


def adapter_adamw_fwd(weights, grads, exp_avg, exp_avg_sq, hyper, lr_groups=None) -> None:
    """Launch `_adapter_adamw_kernel` over the ``(A, S)`` table (in place)."""
    adapters, width = weights.shape
    grid = (triton.cdiv(width, _BLOCK), adapters)
    _adapter_adamw_kernel[grid](
        weights,
        grads,
        exp_avg,
        exp_avg_sq,
        hyper.contiguous(),
        weights if lr_groups is None else lr_groups.view(torch.uint8),  # unread without groups
        width,
        HYPER=HYPER_COLUMNS,
        HAS_GROUPS=lr_groups is not None,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )


def adapter_adamw_(
    weights: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: torch.Tensor,
    lr_groups: torch.Tensor | None = None,
) -> None:
    """Step the adapters whose ``hyper[a, STEP]`` is non-zero, in place; zero their grads.

    Args:
        weights: (A, S) fp32, row ``a`` every factor of adapter ``a``; updated in place.
        grads: (A, S) fp32 accumulated gradients; the stepped rows are zeroed in place.
        exp_avg: (A, S) fp32 first moments; updated in place.
        exp_avg_sq: (A, S) fp32 second moments; updated in place.
        hyper: (A, HYPER_COLUMNS) fp32, per adapter ``LR, BETA1, BETA2, EPS, WEIGHT_DECAY,
            BIAS_CORRECTION1, BIAS_CORRECTION2`` (``1 − β^step`` of this step), ``STEP``
            (1: step this adapter, 0: leave its row as it is), ``LR_B`` (the learning rate
            of the ``lr_groups`` columns) and ``GRAD_SCALE`` (the factor its gradient is
            multiplied by first: clipping's, or 1.0), on the tensors' device.
        lr_groups: (S,) bool, True on the columns stepped at ``LR_B`` (LoRA+: every B and
            DoRA magnitude), or None: every column at ``LR``.

    Raises:
        ValueError: naming the tensor of the wrong shape, dtype, layout or device.
    """
    _check(weights, grads, exp_avg, exp_avg_sq, hyper, lr_groups)
    with torch.no_grad():  # ``weights`` may be an autograd leaf (`LoRAContext.weights`)
        if triton_usable(weights):
            adapter_adamw_fwd(weights, grads, exp_avg, exp_avg_sq, hyper, lr_groups)
            for table in (weights, grads, exp_avg, exp_avg_sq):  # as torch's in-place ops do
                torch.autograd.graph.increment_version(table)
        else:
            adapter_adamw_ref(weights, grads, exp_avg, exp_avg_sq, hyper, lr_groups)


def adapter_adamw_ref(weights, grads, exp_avg, exp_avg_sq, hyper, lr_groups=None) -> None:
    """Torch reference of `adapter_adamw_` (same arguments, same in-place effects)."""
    rows = torch.nonzero(hyper[:, STEP]).flatten()  # the stepping adapters
    col = hyper[rows].unsqueeze(-1).unbind(1)  # each (k, 1)
    lr = col[LR] if lr_groups is None else torch.where(lr_groups, col[LR_B], col[LR])  # (k, S)
    p, g, m, v = (t[rows] for t in (weights, grads, exp_avg, exp_avg_sq))  # (k, S) copies
    g = g * col[GRAD_SCALE]
    m = col[BETA1] * m + (1.0 - col[BETA1]) * g
    v = col[BETA2] * v + (1.0 - col[BETA2]) * g * g
    denom = v.sqrt() / col[BIAS_CORRECTION2].sqrt() + col[EPS]
    p = p * (1.0 - lr * col[WEIGHT_DECAY]) - (lr / col[BIAS_CORRECTION1]) * m / denom
    for table, value in ((weights, p), (exp_avg, m), (exp_avg_sq, v), (grads, 0.0)):
        table[rows] = value
