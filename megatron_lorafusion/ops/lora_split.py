"""The multi-LoRA op split at ``S`` for a tensor-parallel collective between its two halves.

`lora_down` makes the unscaled ``S = drop(X)·Aᵀ`` (T × R), `lora_up` maps it back,
``Δ = s_a·S·B_aᵀ``; LoRAFusion (arXiv 2510.00206, Sec. 4) splits the graph at the same small
tensor. A row-parallel layer shards ``A`` along H, so each rank's `lora_down` gives a partial
``S`` that is all-reduced before `lora_up`; the dropout mask of such a shard is the block
``(layout.row_keys[t], col_offset + h)`` of the full-width mask, so every rank drops what
the unsharded layer would. On CUDA both run autograd functions over the grouped Triton
kernels; elsewhere the torch reference (`lora_down_ref`, `lora_up_ref`). Given an
`InputRebuild`, `lora_down` saves X's sources instead of X on both paths and rebuilds X in
backward, with gradients bit for bit those of the saving path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops.layout import AdapterLayout
from megatron_lorafusion.ops.lora_expand import lora_expand_fwd
from megatron_lorafusion.ops.lora_linear import dropout_keep_mask, lora_down_ref, lora_up_ref
from megatron_lorafusion.ops.lora_shrink import lora_shrink_fwd
from megatron_lorafusion.ops.lora_up_bwd import lora_up_bwd
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad_fwd
from megatron_lorafusion.ops.saved_input import InputRebuild, save_input, saved_input


class LoRADownFunction(torch.autograd.Function):
    """Autograd of the fused `lora_down`; saves A, the dropouts and X, regenerates the mask.

    X is saved only when A needs a gradient (dX needs only dS, A and the mask), and then as
    the sources of ``rebuild`` when one is given: backward rebuilds X from them.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, lora_a, ones, dropouts, layout, seed, col_offset, rebuild):
        """``ones``: (A,) fp32 ones (the shrink's scale); ``dropouts`` None = no mask."""
        s = lora_shrink_fwd(
            x, lora_a, ones, dropouts, layout, seed, col_offset=col_offset
        )  # (T, R)
        inputs = save_input(ctx, x, rebuild) if ctx.needs_input_grad[1] else ()
        ctx.num_input_tensors = len(inputs)
        ctx.save_for_backward(*inputs, lora_a, dropouts)
        ctx.layout, ctx.seed, ctx.col_offset = layout, seed, col_offset
        return s

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, ds):
        """Gives dA = dSᵀ·drop(X) and dX = mask⊙(dS·A)/(1−p), from one pass over X when both."""
        saved = ctx.saved_tensors
        count = ctx.num_input_tensors
        lora_a, dropouts = saved[count:]
        ds = ds.contiguous()
        mask = {"col_offset": ctx.col_offset}
        grad_x = grad_a = None
        if ctx.needs_input_grad[1]:
            x = saved_input(ctx, saved[:count])  # (T, H_l)
            grad_a = torch.empty_like(lora_a)
            grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
            lora_wgrad_fwd(
                x,
                ds,
                grad_a.transpose(1, 2),
                dropouts,
                ctx.layout,
                ctx.seed,
                expand_m=lora_a if grad_x is not None else None,
                expand_out=grad_x,
                **mask,
            )
        elif ctx.needs_input_grad[0]:
            grad_x = lora_expand_fwd(ds, lora_a, None, dropouts, ctx.layout, ctx.seed, **mask)
        return grad_x, grad_a, None, None, None, None, None, None


class LoRADownRebuildFunction(torch.autograd.Function):
    """Autograd of the reference `lora_down` with X rebuilt in backward (`InputRebuild`).

    Saves A and the rebuild's sources, not X, the masked copies of X or the mask. Backward
    rebuilds X, runs the same reference down-projection again (the mask redrawn from its
    seed) and differentiates it: the gradients are bit for bit autograd's through
    `lora_down_ref` on the saved X.
    """

    @staticmethod
    def forward(ctx, x, lora_a, down, rebuild):
        """``down``: ``(x, lora_a) -> S`` (T, R), the reference with its mask arguments bound."""
        with torch.no_grad():
            s = down(x, lora_a)
        ctx.save_for_backward(*save_input(ctx, x, rebuild), lora_a)
        ctx.down = down
        return s

    @staticmethod
    def backward(ctx, ds):
        """Gradients of X and A from the rebuilt X (each only when needed)."""
        *sources, lora_a = ctx.saved_tensors
        needs = ctx.needs_input_grad[:2]
        x = saved_input(ctx, tuple(sources)).requires_grad_(needs[0])
        lora_a = lora_a.detach().requires_grad_(needs[1])
        with torch.enable_grad():
            s = ctx.down(x, lora_a)
        wanted = [t for t, need in zip((x, lora_a), needs, strict=True) if need]
        grads = iter(torch.autograd.grad(s, wanted, ds))
        grad_x, grad_a = (next(grads) if need else None for need in needs)
        return grad_x, grad_a, None, None


class LoRAUpFunction(torch.autograd.Function):
    """Autograd of the fused `lora_up`; saves S, B and the scales."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, s, lora_b, scales, layout):
        """``scales``: (A,) fp32 on ``s``'s device."""
        y = lora_expand_fwd(
            s, lora_b.transpose(1, 2), None, None, layout, 0, scales=scales
        )  # (T, N)
        ctx.save_for_backward(s, lora_b, scales)
        ctx.layout = layout
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        """Gives dS = s·dY·B and dB = s·dYᵀ·S from one pass over dY (`lora_up_bwd`)."""
        s, lora_b, scales = ctx.saved_tensors
        ds, grad_b = lora_up_bwd(dy.contiguous(), s, lora_b, scales, ctx.layout, scale_db=True)
        return ds, grad_b, None, None


def _check_down(x, lora_a, dropouts, layout, col_offset, full_width) -> int:
    """Check `lora_down`'s inputs (both paths); returns the full mask width."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != layout.num_tokens:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x has shape {shape}, expected (T, H_l) with T={layout.num_tokens}")
    width = x.shape[1]
    adapters = layout.num_adapters
    if lora_a.dim() != 3 or lora_a.shape[0] != adapters or lora_a.shape[2] != width:
        raise ValueError(
            f"lora_a has shape {tuple(lora_a.shape)}, expected (A, R, H_l)=({adapters}, R, {width})"
        )
    if lora_a.dtype != x.dtype or lora_a.device != x.device:
        raise ValueError(
            f"lora_a is {lora_a.dtype} on {lora_a.device}, expected {x.dtype} on {x.device} like x"
        )
    if len(dropouts) != adapters or any(not 0.0 <= p < 1.0 for p in dropouts):
        raise ValueError(f"dropouts must be {adapters} values in [0, 1), got {list(dropouts)}")
    full = width if full_width is None else int(full_width)
    if col_offset < 0 or col_offset + width > full:
        raise ValueError(
            f"x's columns [{col_offset}, {col_offset + width}) must lie in [0, full_width={full})"
        )
    return full


def _check_up(s, lora_b, scalings, layout) -> None:
    """Check `lora_up`'s inputs (both paths)."""
    if not isinstance(s, torch.Tensor) or s.dim() != 2 or s.shape[0] != layout.num_tokens:
        shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"s has shape {shape}, expected (T, R) with T={layout.num_tokens}")
    adapters, rank = layout.num_adapters, s.shape[1]
    if lora_b.dim() != 3 or lora_b.shape[0] != adapters or lora_b.shape[2] != rank:
        raise ValueError(
            f"lora_b has shape {tuple(lora_b.shape)}, expected (A, N, R)=({adapters}, N, {rank})"
        )
    if lora_b.dtype != s.dtype or lora_b.device != s.device:
        raise ValueError(
            f"lora_b is {lora_b.dtype} on {lora_b.device}, expected {s.dtype} on {s.device} like s"
        )
    if len(scalings) != adapters:
        raise ValueError(f"scalings has {len(scalings)} entries, expected A={adapters}")


def fused_lora_down(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    dropouts: Sequence[float],
    layout: AdapterLayout,
    *,
    layer_seed: int,
    training: bool,
    col_offset: int = 0,
    full_width: int | None = None,
    rebuild: InputRebuild | None = None,
) -> torch.Tensor:
    """The Triton path of `lora_down` (CUDA, or the CPU interpreter); same arguments.

    Its mask is `fused_dropout_keep_mask` of ``(layout, dropouts, full_width, layer_seed)``,
    columns ``col_offset:col_offset + H_l``.

    Raises:
        ValueError: on bad shapes, dtypes, devices or mask columns (naming the tensor).
        NotImplementedError: for a rank above 256 or a ``col_offset`` not a multiple of 8.
        RuntimeError: when Triton cannot run on ``x``'s device.
    """
    if not _utils.triton_usable(x):
        raise RuntimeError(f"fused_lora_down needs Triton on CUDA, got x on {x.device}")
    _check_down(x, lora_a, dropouts, layout, col_offset, full_width)
    x = x.contiguous()
    _utils.check_tensor("x", x, (layout.num_tokens, None), _utils.KERNEL_DTYPES, x.device)
    _utils.padded_rank(lora_a.shape[1])
    _utils.mask_width(x.shape[1], col_offset, full_width)
    device = str(x.device)
    ones = _utils.device_params((1.0,) * layout.num_adapters, device)
    counts = layout.token_counts()
    use_mask = training and any(p > 0 and n > 0 for p, n in zip(dropouts, counts, strict=True))
    drop = _utils.device_params(tuple(float(p) for p in dropouts), device) if use_mask else None
    seed = _utils.mixed_seed(layout.dropout_seed, layer_seed)
    return LoRADownFunction.apply(x, lora_a, ones, drop, layout, seed, col_offset, rebuild)


def fused_lora_up(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: Sequence[float],
    layout: AdapterLayout,
) -> torch.Tensor:
    """The Triton path of `lora_up` (CUDA, or the CPU interpreter); same arguments.

    Raises:
        ValueError: on bad shapes, dtypes or devices (the message names the tensor).
        NotImplementedError: for a rank above 256.
        RuntimeError: when Triton cannot run on ``s``'s device.
    """
    if not _utils.triton_usable(s):
        raise RuntimeError(f"fused_lora_up needs Triton on CUDA, got s on {s.device}")
    _check_up(s, lora_b, scalings, layout)
    s = s.contiguous()
    _utils.check_tensor("s", s, (layout.num_tokens, None), _utils.KERNEL_DTYPES, s.device)
    _utils.padded_rank(s.shape[1])
    scales = _utils.device_params(tuple(float(v) for v in scalings), str(s.device))
    return LoRAUpFunction.apply(s, lora_b, scales, layout)


def lora_down(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    dropouts: Sequence[float],
    layout: AdapterLayout,
    *,
    layer_seed: int,
    training: bool,
    col_offset: int = 0,
    full_width: int | None = None,
    rebuild: InputRebuild | None = None,
) -> torch.Tensor:
    """Unscaled down-projection ``S[seg_a] = drop_a(X[seg_a])·A_aᵀ``, differentiable in x and A.

    Args:
        x: (T, H_l) activations (a row-parallel rank's columns of the full input), rows grouped
            adapter-major.
        lora_a: (A, R, H_l) down-projections (that rank's columns), ``x``'s dtype.
        dropouts: (A,) dropout probability per adapter, in [0, 1).
        layout: the microbatch's adapter layout; its ``row_keys`` key the mask's rows.
        layer_seed: the layer's seed (keys the mask with ``layout.dropout_seed``).
        training: dropout only when True.
        col_offset: index of ``x``'s column 0 in the full-width input.
        full_width: the full input width (default ``H_l``): the mask is columns
            ``col_offset:col_offset + H_l`` of the ``full_width``-wide mask.
        rebuild: how to rebuild ``x`` in backward (`InputRebuild`); then neither ``x`` nor
            anything derived from it is saved, on either path.

    Returns:
        (T, R) ``S`` in ``x``'s dtype (partial over H when the input is sharded).

    Raises:
        ValueError: on bad shapes, dtypes, devices or mask columns (naming the tensor).
        NotImplementedError: on CUDA, for a rank above 256 or a ``col_offset`` that is not a
            multiple of 8.
    """
    full = _check_down(x, lora_a, dropouts, layout, col_offset, full_width)
    if x.is_cuda and _utils.triton is not None:
        return fused_lora_down(
            x,
            lora_a,
            dropouts,
            layout,
            layer_seed=layer_seed,
            training=training,
            col_offset=col_offset,
            full_width=full,
            rebuild=rebuild,
        )
    down = functools.partial(
        _masked_down_ref,
        dropouts=dropouts,
        layout=layout,
        layer_seed=layer_seed,
        training=training,
        col_offset=col_offset,
        full_width=full,
    )
    if rebuild is None or not torch.is_grad_enabled():
        return down(x, lora_a)
    return LoRADownRebuildFunction.apply(x, lora_a, down, rebuild)


def _masked_down_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    *,
    dropouts: Sequence[float],
    layout: AdapterLayout,
    layer_seed: int,
    training: bool,
    col_offset: int,
    full_width: int,
) -> torch.Tensor:
    """`lora_down`'s reference path: (T, R) ``S`` with the mask columns of ``x`` drawn here."""
    keep = None
    if training:
        keep = dropout_keep_mask(layout, dropouts, full_width, layer_seed, x.device)  # (T, H)
    if keep is not None:
        keep = keep[:, col_offset : col_offset + x.shape[1]]  # (T, H_l)
    return lora_down_ref(x, lora_a, dropouts, layout, keep)


def lora_up(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: Sequence[float],
    layout: AdapterLayout,
) -> torch.Tensor:
    """Up-projection ``Δ[seg_a] = s_a·S[seg_a]·B_aᵀ``, differentiable in s and B.

    Args:
        s: (T, R) output of `lora_down` (all-reduced across a row-parallel group).
        lora_b: (A, N, R) up-projections, ``s``'s dtype.
        scalings: (A,) LoRA scale per adapter.
        layout: the microbatch's adapter layout.

    Returns:
        (T, N) LoRA delta in ``s``'s dtype.

    Raises:
        ValueError: on bad shapes, dtypes or devices (the message names the tensor).
        NotImplementedError: on CUDA, for a rank above 256.
    """
    _check_up(s, lora_b, scalings, layout)
    if s.is_cuda and _utils.triton is not None:
        return fused_lora_up(s, lora_b, scalings, layout)
    return lora_up_ref(s, lora_b, scalings, layout)
