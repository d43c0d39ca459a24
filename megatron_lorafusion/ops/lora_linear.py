"""Multi-adapter LoRA linear: ``Y = X·Wᵀ + b + s_a·(drop_a(X)·A_aᵀ)·B_aᵀ`` per adapter segment.

This file holds the public functional `lora_linear` and its readable torch reference,
split at the small tensor ``S = drop(X)·Aᵀ`` (T × R) as in LoRAFusion (arXiv 2510.00206,
Sec. 4): `lora_down_ref` makes ``S``, `lora_up_ref` maps it back to the output width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops.fp8 import Fp8Weight
from megatron_lorafusion.ops.fp8_linear import fp8_linear_ref
from megatron_lorafusion.ops.layout import AdapterLayout
from megatron_lorafusion.ops.philox import philox_keep_mask
from megatron_lorafusion.ops.saved_input import InputRebuild


def dropout_keep_mask(
    layout: AdapterLayout,
    dropouts: Sequence[float],
    hidden: int,
    layer_seed: int,
    device: torch.device | str,
) -> torch.Tensor | None:
    """Draw the LoRA-input dropout mask of one layer for one microbatch.

    The same counter-based Philox mask the fused kernels draw (`ops.philox`), so both paths
    drop the same elements. It depends only on ``(layout.dropout_seed, layer_seed)`` and the
    rows' dropout keys (``layout.row_keys``: a job keys each token by its adapter, sample and
    position, never by the microbatch), so activation recompute regenerates it exactly and a
    `AdapterLayout.shard` gets the rows of the unsharded mask; a tensor-parallel shard of the
    columns slices them from the full-width mask.

    Args:
        layout: the microbatch's adapter layout.
        dropouts: (A,) dropout probability of each adapter, in [0, 1).
        hidden: ``H``, the layer's (full) in-features.
        layer_seed: a number unique to the layer (its index in the model).
        device: device of the mask.

    Returns:
        (T, H) bool keep-mask (True keeps the element), or None when no adapter with
        tokens in this microbatch uses dropout.
    """
    counts = layout.token_counts()
    if not any(dropouts[a] > 0 and counts[a] > 0 for a in range(layout.num_adapters)):
        return None
    # Drop threshold round(p·65536) per row, rounded in fp32 as the kernels do.
    p = torch.tensor(list(dropouts), dtype=torch.float32)
    thresholds = (p * 65536.0 + 0.5).to(torch.int64)[layout.row_adapter("cpu")]
    seed = _utils.mixed_seed(layout.dropout_seed, layer_seed)
    return philox_keep_mask(seed, layout.keys().to(device), hidden, thresholds.to(device))


def lora_down_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    dropouts: Sequence[float],
    layout: AdapterLayout,
    keep_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Down-projection with inverted dropout: ``S[seg_a] = drop_a(X[seg_a])·A_aᵀ``.

    Args:
        x: (T, H) activations, rows grouped by adapter.
        lora_a: (A, R, H) down-projections, zero-padded beyond each adapter's rank.
        dropouts: (A,) dropout probability per adapter.
        layout: the microbatch's adapter layout.
        keep_mask: (T, H) bool, True keeps; None applies no dropout.

    Returns:
        (T, R) tensor ``S`` in ``x``'s dtype.
    """
    parts = []
    for adapter, start, end in layout.segments():
        x_seg = x[start:end]
        if keep_mask is not None and dropouts[adapter] > 0:
            x_seg = x_seg * keep_mask[start:end] / (1.0 - dropouts[adapter])
        parts.append(x_seg @ lora_a[adapter].t())  # (T_a, R)
    if not parts:
        return x.new_zeros(0, lora_a.shape[1])
    return torch.cat(parts)


def lora_up_ref(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: Sequence[float],
    layout: AdapterLayout,
) -> torch.Tensor:
    """Up-projection: ``Δ[seg_a] = s_a·S[seg_a]·B_aᵀ``.

    Args:
        s: (T, R) output of `lora_down_ref`.
        lora_b: (A, N, R) up-projections, zero-padded beyond each adapter's rank.
        scalings: (A,) LoRA scale per adapter (alpha / r, or alpha / sqrt(r) for rsLoRA).
        layout: the microbatch's adapter layout.

    Returns:
        (T, N) LoRA delta.
    """
    parts = [scalings[a] * (s[start:end] @ lora_b[a].t()) for a, start, end in layout.segments()]
    if not parts:
        return s.new_zeros(0, lora_b.shape[1])
    return torch.cat(parts)


def lora_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: Sequence[float],
    dropouts: Sequence[float],
    layout: AdapterLayout,
    keep_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference multi-LoRA linear, any device and dtype; the oracle for the fused path.

    Args:
        x: (T, H) activations, rows grouped by adapter.
        weight: (N, H) frozen base weight, or an `Fp8Weight` (its frozen product
            fake-quantized as the kernels quantize: `fp8_linear_ref`).
        bias: (N,) base bias or None.
        lora_a: (A, R, H) down-projections.
        lora_b: (A, N, R) up-projections.
        scalings: (A,) LoRA scale per adapter.
        dropouts: (A,) dropout probability per adapter.
        layout: the microbatch's adapter layout.
        keep_mask: (T, H) bool dropout keep-mask, or None for no dropout.

    Returns:
        (T, N) output ``X·Wᵀ + b + LoRA delta``.
    """
    s = lora_down_ref(x, lora_a, dropouts, layout, keep_mask)
    if isinstance(weight, Fp8Weight):
        frozen = fp8_linear_ref(x, weight, bias)
    else:
        frozen = F.linear(x, weight, bias)
    return frozen + lora_up_ref(s, lora_b, scalings, layout)


def _check_shapes(x, weight, lora_a, lora_b, scalings, dropouts, layout) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if len(weight.shape) != 2 or weight.shape[1] != hidden:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected (N, H={hidden})")
    out = weight.shape[0]
    if lora_a.dim() != 3 or lora_a.shape[2] != hidden:
        raise ValueError(f"lora_a has shape {tuple(lora_a.shape)}, expected (A, R, H={hidden})")
    adapters, rank = lora_a.shape[:2]
    if tuple(lora_b.shape) != (adapters, out, rank):
        raise ValueError(
            f"lora_b has shape {tuple(lora_b.shape)}, "
            f"expected (A, N, R)=({adapters}, {out}, {rank})"
        )
    if layout.num_adapters != adapters or len(scalings) != adapters or len(dropouts) != adapters:
        raise ValueError(
            f"layout has {layout.num_adapters} adapters, lora_a {adapters}, "
            f"scalings {len(scalings)}, dropouts {len(dropouts)}; they must agree"
        )
    if layout.num_tokens != tokens:
        raise ValueError(f"layout covers {layout.num_tokens} tokens, x has T={tokens}")


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: Sequence[float],
    dropouts: Sequence[float],
    layout: AdapterLayout,
    *,
    layer_seed: int = 0,
    training: bool = True,
    rebuild: InputRebuild | None = None,
) -> torch.Tensor:
    """Multi-LoRA linear over adapter-major packed tokens (see `lora_linear_ref`).

    On CUDA (with Triton) this runs `fused_lora_linear`; elsewhere the torch reference.
    Dropout is active only when ``training``; its mask is the Philox mask of
    ``(layout.dropout_seed, layer_seed)``, the same on both paths (`dropout_keep_mask` on the
    reference path, drawn inside the kernels on the fused path). ``rebuild`` (how X is
    rebuilt in backward) lets the fused path save its sources instead of X; the reference
    path saves what autograd saves. An `Fp8Weight` makes the frozen product FP8 (both paths
    quantize alike: `fp8_linear_ref`).

    Returns:
        (T, N) output in ``x``'s dtype.

    Raises:
        ValueError: when shapes disagree; the message names the offending tensor.
    """
    _check_shapes(x, weight, lora_a, lora_b, scalings, dropouts, layout)
    if x.is_cuda and _utils.triton is not None:
        # Imported here: the package re-exports a function of the same name as the module.
        from megatron_lorafusion.ops.fused_lora_linear import fused_lora_linear

        return fused_lora_linear(
            x.contiguous(),
            weight if isinstance(weight, Fp8Weight) else weight.contiguous(),
            bias,
            lora_a,  # read through their strides: views of the packed table stay views
            lora_b,
            scalings,
            dropouts,
            layout,
            layer_seed=layer_seed,
            training=training,
            rebuild=rebuild,
        )
    keep_mask = (
        dropout_keep_mask(layout, dropouts, x.shape[1], layer_seed, x.device) if training else None
    )
    return lora_linear_ref(x, weight, bias, lora_a, lora_b, scalings, dropouts, layout, keep_mask)
