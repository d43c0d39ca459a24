"""One fused AdamW step for any subset of adapters whose factors are packed row by row.

Every adapter's factors (all its LoRA A and B of every layer on this rank) live in row ``a``
of one ``(A, S)`` fp32 tensor, and so do their gradients and both Adam moments. A step of
the ``k`` adapters that finished a global batch is one launch over their ``k`` rows: row
``rows[j]`` is updated with its own learning rate, betas, epsilon, weight decay and bias
corrections from ``hyper[j]``; the other rows are not read. The update is torch's AdamW
(decoupled weight decay, Loshchilov & Hutter 2019)::

    g ← c·g                          c = min(max_norm / (‖g‖ + 1e-6), 1), or 1 unclipped
    p ← p·(1 − lr·wd)
    m ← β1·m + (1 − β1)·g            v ← β2·v + (1 − β2)·g²
    p ← p − (lr / bc1)·m / (√v / √bc2 + ε)          bc_i = 1 − β_i^step
    g ← 0

so 64 adapters step in one kernel instead of 64 optimizers of one tensor per factor, and
clipping (``torch.nn.utils.clip_grad_norm_``'s rule) costs no pass of its own.

The step is gated on the device: a row whose squared gradient norm or loss is NaN or
infinite is left as it is, so the host never waits for the GPU to decide whether to step
(the caller reads the norms back later and raises; `train.optim.AdapterAdamW.check`).

LoRA+ (Hayou et al., 2024): with a per-column ``lr_groups`` mask, the columns it marks (every
B and DoRA magnitude) step with ``hyper[j, LR_B]`` instead of ``hyper[j, LR]``, in the update
and the decay alike; without it (or with ``LR_B = LR``) the step is bit for bit the plain one.
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops._utils import tl, triton, triton_usable

# Columns of the (k, HYPER_COLUMNS) fp32 hyper-parameter table, one row per stepping adapter.
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2, STEP = range(8)
LR_B, MAX_NORM = 8, 9  # LoRA+'s learning rate of B; the clipping norm (0: no clipping)
HYPER_COLUMNS = 10
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s

if triton is not None:

    @triton.jit
    def _not_finite(x):
        return (x != x) | (tl.abs(x) == float("inf"))

    @triton.jit
    def _adapter_adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        rows_ptr,
        hyper_ptr,
        groups_ptr,
        norms_ptr,
        loss_ptr,
        S,
        HYPER: tl.constexpr,
        HAS_GROUPS: tl.constexpr,
        HAS_NORMS: tl.constexpr,
        HAS_LOSSES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(1)
        row = hyper_ptr + j * HYPER
        adapter = tl.load(rows_ptr + j)
        skip = tl.load(row + 7) == 0.0  # STEP unset: this row is not touched
        if HAS_LOSSES:
            skip = skip | _not_finite(tl.load(loss_ptr + j))
        scale = 1.0
        if HAS_NORMS:
            squared = tl.load(norms_ptr + adapter)
            skip = skip | _not_finite(squared)
            max_norm = tl.load(row + 9)
            clip = tl.minimum(tl.div_rn(max_norm, tl.sqrt_rn(squared) + 1e-6), 1.0)
            scale = tl.where(max_norm > 0.0, clip, 1.0)
        if skip:
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
        g = tl.load(g_ptr + offs, mask=mask) * scale  # clipped (1.0: exact)
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


def _check(weights, grads, exp_avg, exp_avg_sq, rows, hyper, lr_groups, squared_norms, losses):
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
    if rows.dim() != 1 or rows.dtype != torch.int64 or not rows.is_contiguous():
        raise ValueError(
            f"rows must be contiguous (k,) int64, got {tuple(rows.shape)} {rows.dtype}, "
            f"strides {rows.stride()}"
        )
    expected = (rows.shape[0], HYPER_COLUMNS)
    if tuple(hyper.shape) != expected or hyper.dtype != torch.float32:
        raise ValueError(
            f"hyper must be fp32 of shape {expected}, got {tuple(hyper.shape)} {hyper.dtype}"
        )
    if squared_norms is not None and (
        tuple(squared_norms.shape) != (weights.shape[0],)
        or squared_norms.dtype != torch.float32
        or not squared_norms.is_contiguous()
    ):
        raise ValueError(
            f"squared_norms must be contiguous fp32 of shape ({weights.shape[0]},), got "
            f"{tuple(squared_norms.shape)} {squared_norms.dtype}, strides {squared_norms.stride()}"
        )
    if losses is not None and (
        tuple(losses.shape) != expected[:1]
        or not losses.is_floating_point()
        or not losses.is_contiguous()
    ):
        raise ValueError(
            f"losses must be contiguous floating point of shape {expected[:1]}, got "
            f"{tuple(losses.shape)} {losses.dtype}, strides {losses.stride()}"
        )
    if lr_groups is not None and (
        tuple(lr_groups.shape) != (weights.shape[1],) or lr_groups.dtype != torch.bool
    ):
        raise ValueError(
            f"lr_groups must be bool of shape ({weights.shape[1]},), got "
            f"{tuple(lr_groups.shape)} {lr_groups.dtype}"
        )
    others = {
        "grads": grads,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "rows": rows,
        "hyper": hyper,
        "lr_groups": lr_groups,
        "squared_norms": squared_norms,
        "losses": losses,
    }
    for name, t in others.items():
        if t is not None and t.device != weights.device:
            raise ValueError(f"{name} is on {t.device}, weights on {weights.device}")


def adapter_adamw_fwd(
    weights,
    grads,
    exp_avg,
    exp_avg_sq,
    rows,
    hyper,
    lr_groups=None,
    squared_norms=None,
    losses=None,
) -> None:
    """Launch `_adapter_adamw_kernel` over the ``k`` stepping rows of the table (in place)."""
    width = weights.shape[1]
    grid = (triton.cdiv(width, _BLOCK), rows.shape[0])
    _adapter_adamw_kernel[grid](
        weights,
        grads,
        exp_avg,
        exp_avg_sq,
        rows,
        hyper.contiguous(),
        weights if lr_groups is None else lr_groups.view(torch.uint8),  # unread when None
        weights if squared_norms is None else squared_norms,
        weights if losses is None else losses,
        width,
        HYPER=HYPER_COLUMNS,
        HAS_GROUPS=lr_groups is not None,
        HAS_NORMS=squared_norms is not None,
        HAS_LOSSES=losses is not None,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )


def adapter_adamw_(
    weights: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    hyper: torch.Tensor,
    lr_groups: torch.Tensor | None = None,
    *,
    squared_norms: torch.Tensor | None = None,
    losses: torch.Tensor | None = None,
) -> None:
    """Step the adapters ``rows`` whose ``hyper[j, STEP]`` is set, in place; zero their grads.

    Args:
        weights: (A, S) fp32, row ``a`` every factor of adapter ``a``; updated in place.
        grads: (A, S) fp32 accumulated gradients; the stepped rows are zeroed in place.
        exp_avg: (A, S) fp32 first moments; updated in place.
        exp_avg_sq: (A, S) fp32 second moments; updated in place.
        rows: (k,) int64 the adapters of this step, each once, each in ``[0, A)`` (not
            checked: that would read them back).
        hyper: (k, HYPER_COLUMNS) fp32, per adapter ``rows[j]`` its ``LR, BETA1, BETA2, EPS,
            WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2`` (``1 − β^step`` of this step),
            ``STEP`` (1: step, 0: leave its row as it is), ``LR_B`` (the learning rate of the
            ``lr_groups`` columns) and ``MAX_NORM`` (clip its gradient to this norm; 0: no
            clipping, which needs ``squared_norms``).
        lr_groups: (S,) bool, True on the columns stepped at ``LR_B`` (LoRA+: every B and
            DoRA magnitude), or None: every column at ``LR``.
        squared_norms: (A,) fp32 every adapter's squared gradient norm (over every rank that
            holds its factors), or None: no clipping. A row whose norm is not finite does
            not step.
        losses: (k,) the loss each adapter ``rows[j]`` steps on, or None; a row whose loss is
            not finite does not step.

    Raises:
        ValueError: naming the tensor of the wrong shape, dtype, layout or device.
    """
    _check(weights, grads, exp_avg, exp_avg_sq, rows, hyper, lr_groups, squared_norms, losses)
    args = (weights, grads, exp_avg, exp_avg_sq, rows, hyper, lr_groups, squared_norms, losses)
    with torch.no_grad():  # ``weights`` may be an autograd leaf (`LoRAContext.weights`)
        if triton_usable(weights):
            adapter_adamw_fwd(*args)
            for table in (weights, grads, exp_avg, exp_avg_sq):  # as torch's in-place ops do
                torch.autograd.graph.increment_version(table)
        else:
            adapter_adamw_ref(*args)


def adapter_adamw_ref(
    weights,
    grads,
    exp_avg,
    exp_avg_sq,
    rows,
    hyper,
    lr_groups=None,
    squared_norms=None,
    losses=None,
) -> None:
    """Torch reference of `adapter_adamw_` (same arguments, same in-place effects)."""
    go = hyper[:, STEP] != 0
    if losses is not None:
        go &= torch.isfinite(losses)
    scale = torch.ones_like(hyper[:, MAX_NORM])
    if squared_norms is not None:
        squared = squared_norms[rows]
        go &= torch.isfinite(squared)
        max_norm = hyper[:, MAX_NORM]
        clip = (max_norm / (squared.sqrt() + CLIP_EPS)).clamp(max=1.0)
        scale = torch.where(max_norm > 0, clip, scale)
    rows, col, scale = rows[go], hyper[go].unsqueeze(-1).unbind(1), scale[go, None]  # (k', 1)
    lr = col[LR] if lr_groups is None else torch.where(lr_groups, col[LR_B], col[LR])  # (k', S)
    p, g, m, v = (t[rows] for t in (weights, grads, exp_avg, exp_avg_sq))  # (k', S) copies
    g = g * scale
    m = col[BETA1] * m + (1.0 - col[BETA1]) * g
    v = col[BETA2] * v + (1.0 - col[BETA2]) * g * g
    denom = v.sqrt() / col[BIAS_CORRECTION2].sqrt() + col[EPS]
    p = p * (1.0 - lr * col[WEIGHT_DECAY]) - (lr / col[BIAS_CORRECTION1]) * m / denom
    for table, value in ((weights, p), (exp_avg, m), (exp_avg_sq, v), (grads, 0.0)):
        table[rows] = value
