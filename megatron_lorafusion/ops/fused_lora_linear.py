"""Fused multi-LoRA linear: autograd over the grouped Triton kernels and the frozen GEMM.

``Y = X·Wᵀ + b + s_a·(drop_a(X)·A_aᵀ)·B_aᵀ`` per adapter segment, split at the small tensor
``S' = s·drop(X)·Aᵀ`` (T × R) as in LoRAFusion (arXiv 2510.00206, Sec. 4):

- forward: ``S'`` by `lora_shrink` (dropout fused, one pass over X); then the frozen product
  with the LoRA term (``gemm``), either ``"triton"``: one Triton GEMM that adds ``S'·Bᵀ + b``
  in its epilogue (`lora_gemm`, the default on Hopper), or ``"cublas"``: ``Y = S'·Bᵀ + b`` by
  `lora_expand` followed by cuBLAS ``Y += X·Wᵀ`` (``addmm_``, beta = 1: Y is written by the
  expand and read once as C);
- backward: ``dS' = s·dY·B`` and ``dB = dYᵀ·S'`` from one pass over dY (`lora_up_bwd`), then one
  pass over X (`lora_wgrad` with its fused expand) gives ``dA = dS'ᵀ·drop(X)`` and the LoRA
  part of dX, ``mask⊙(dS'·A)/(1−p)``, drawing the mask once; cuBLAS adds ``dY·W`` onto it
  (``addmm_``). Weight gradients are reduced in a fixed order: no atomics, bitwise repeatable.

Saved for backward: X, S' (T × R) and the weights; the backward regenerates the dropout mask
from the Philox seed ``(layout.dropout_seed, layer_seed)``.
Given an `InputRebuild`, X is not saved: its sources are, and the backward rebuilds X from them
(selective recompute: a norm's output from the norm's input, which the norm saves anyway).
docs/kernels.md records the designs measured on the H200 and why these two were kept.

With an FP8 frozen weight (`Fp8Weight`, ``model.base_precision: fp8``) X is quantized per token
for the frozen product only (the LoRA passes read X as it is): ``"triton"`` runs `lora_gemm` on
the e4m3 operands (dequantized in its epilogue), ``"scaled_mm"`` runs ``torch._scaled_mm`` and
the expand adds the LoRA term onto its output; the backward's frozen dX is a scaled GEMM too
(`fp8_linear.frozen_dgrad`) that the fused expand of `lora_wgrad` adds onto. X's and dY's
quantization is taken from their producer where it attached one (`fp8_linear.quantized_rows`:
the SwiGLU and norm kernels of an FP8 base); where dY's producer attached only its rows'
maxima (SwiGLU's backward, for fc1), `lora_up_bwd_quantized` writes dY's quantization in the
pass over dY that gives dS' and dB. docs/fp8.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops.fp8 import FP8_DTYPE, Fp8Weight, check_fp8_device
from megatron_lorafusion.ops.fp8_linear import (
    FAST_ACCUM_FORWARD,
    fp8_matmul,
    frozen_dgrad,
    quantized_rows,
)
from megatron_lorafusion.ops.fp8_quant import mark_grad_col_scale, take_row_maxima
from megatron_lorafusion.ops.layout import AdapterLayout
from megatron_lorafusion.ops.lora_expand import lora_expand_fwd
from megatron_lorafusion.ops.lora_gemm import lora_gemm, tma_supported
from megatron_lorafusion.ops.lora_shrink import lora_shrink_fwd
from megatron_lorafusion.ops.lora_up_bwd import lora_up_bwd, lora_up_bwd_quantized
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad_fwd
from megatron_lorafusion.ops.saved_input import InputRebuild, save_input, saved_input

# The forward's frozen GEMM: "triton" (`lora_gemm`, the LoRA term in its epilogue),
# "cublas" (`lora_expand`, then cuBLAS accumulates onto it; bf16/fp16/fp32 weights) or
# "scaled_mm" (FP8 weights: torch._scaled_mm, then the expand adds onto it); "auto" picks
# one. The backward's dX GEMM is cuBLAS (a scaled GEMM for FP8) for all of them.
_GEMMS = ("auto", "cublas", "scaled_mm", "triton")


def _resolve_fp8_gemm(gemm: str, x: torch.Tensor, weight: Fp8Weight) -> str:
    """`resolve_gemm` for an FP8 weight: ``"auto"`` is Triton on Hopper, ``"cublas"`` refused.

    ``"auto"`` is ``"scaled_mm"`` elsewhere. On the H200 the op with `lora_gemm`'s FP8 tile
    ran 4-10 % faster than with ``torch._scaled_mm`` on each 8B projection (forward +
    backward, 4 adapters r 16, T = 8192; `scripts.bench_fp8 --sections op`, docs/fp8.md).
    """
    if gemm == "cublas":
        raise ValueError(
            "gemm='cublas' runs cuBLAS addmm, which takes no FP8 operands; with an FP8 weight "
            "use gemm='scaled_mm', 'triton' or 'auto'"
        )
    if gemm == "triton" and x.is_cuda and not _utils.is_hopper(x.device):
        raise ValueError(
            f"gemm='triton' with FP8 operands runs on Hopper GPUs only (its TMA tiles were "
            f"built there), got {torch.cuda.get_device_name(x.device)}; use gemm='scaled_mm' "
            f"or 'auto'"
        )
    if gemm == "auto":
        return "triton" if x.is_cuda and _utils.is_hopper(x.device) else "scaled_mm"
    return gemm


def resolve_gemm(gemm: str, x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> str:
    """The forward GEMM ``"auto"`` stands for; the others stay as they are (or are refused).

    ``"triton"`` on Hopper when TMA can describe X and W: it beat or tied cuBLAS + expand on
    the H200 (docs/kernels.md). ``"cublas"`` elsewhere: the Triton GEMM's tiles were measured
    on Hopper only (on the H200 its pointer-load predecessor ran 25-35 % behind cuBLAS).

    With an `Fp8Weight`, ``"auto"`` is ``"triton"`` on Hopper (else ``"scaled_mm"``) and
    ``"cublas"`` is refused.

    Raises:
        ValueError: for ``"triton"`` on a GPU other than Hopper, or on strides TMA cannot
            describe (the message gives them); for a GEMM that cannot take the weight's
            dtype (``"cublas"`` with FP8, ``"scaled_mm"`` without).
    """
    if isinstance(weight, Fp8Weight):
        return _resolve_fp8_gemm(gemm, x, weight)
    if gemm == "scaled_mm":
        raise ValueError(
            f"gemm='scaled_mm' is the GEMM of FP8 weights (torch._scaled_mm), got a "
            f"{weight.dtype} weight; use gemm='auto', 'cublas' or 'triton'"
        )
    if gemm == "auto":
        hopper = _utils.is_hopper(x.device)
        return "triton" if hopper and tma_supported(x, weight) else "cublas"
    if gemm == "triton" and x.is_cuda and not _utils.is_hopper(x.device):
        raise ValueError(
            f"gemm='triton' runs on Hopper GPUs only (its TMA tiles were built and measured "
            f"there), got {torch.cuda.get_device_name(x.device)}; use gemm='cublas' or 'auto'"
        )
    if gemm == "triton" and not tma_supported(x, weight):
        raise ValueError(
            f"gemm='triton' needs operands TMA can describe (16-byte aligned rows): x strides "
            f"{x.stride()}, weight strides {weight.stride()}, {x.element_size()}-byte "
            f"elements; use gemm='cublas' or 'auto'"
        )
    return gemm


def _check_inputs(x, weight, bias, lora_a, lora_b, layout) -> None:
    _utils.check_tensor("x", x, (layout.num_tokens, None), _utils.KERNEL_DTYPES, x.device)
    tokens, hidden = x.shape
    if isinstance(weight, Fp8Weight):
        _utils.check_tensor("weight.data", weight.data, (None, hidden), (FP8_DTYPE,), x.device)
        out = weight.shape[0]
        _utils.check_tensor("weight.scale", weight.scale, (out,), (torch.float32,), x.device)
        if weight.data_t is not None:
            _utils.check_tensor(
                "weight.data_t", weight.data_t, (hidden, out), (FP8_DTYPE,), x.device
            )
        if hidden % 16 or out % 16:
            raise ValueError(
                f"FP8 weights need in- and out-features that are multiples of 16 (the "
                f"scaled GEMMs' alignment), got weight {tuple(weight.shape)}"
            )
    else:
        _utils.check_tensor("weight", weight, (None, hidden), (x.dtype,), x.device)
    out = weight.shape[0]
    adapters = layout.num_adapters  # the factors may be strided views (`ops.packed_factors`)
    _utils.check_tensor("lora_a", lora_a, (adapters, None, hidden), (x.dtype,), x.device, False)
    rank = lora_a.shape[1]
    _utils.check_tensor("lora_b", lora_b, (adapters, out, rank), (x.dtype,), x.device, False)
    if bias is not None:
        _utils.check_tensor("bias", bias, (out,), _utils.KERNEL_DTYPES, x.device)
    _utils.padded_rank(rank)


class LoRALinearFunction(torch.autograd.Function):
    """Autograd of the fused path; W and b are frozen unless they require grad.

    With an `InputRebuild` (``rebuild``) it saves the rebuild's sources in X's place and
    rebuilds X at the start of backward (one more pass of X's producer). With ``w_scale``
    (and optionally ``w_t``) the weight is an `Fp8Weight`'s e4m3 data (never trained).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx,
        x,
        weight,
        bias,
        lora_a,
        lora_b,
        scales,
        dropouts,
        layout,
        seed,
        gemm,
        rebuild,
        w_scale=None,
        w_t=None,
    ):
        """``scales``/``dropouts``: (A,) fp32 on x's device; ``dropouts`` None = no mask."""
        s = lora_shrink_fwd(x, lora_a, scales, dropouts, layout, seed)  # (T, R)
        b_t = lora_b.transpose(1, 2)  # (A, R, N)
        if w_scale is not None:  # FP8: X quantized per token for the frozen product only
            x_q, x_scale = quantized_rows(x)  # (T, H) e4m3, (T,)
            if gemm == "triton":
                y = lora_gemm(x_q, weight, s, b_t, bias, layout, x_scale=x_scale, w_scale=w_scale)
            else:  # "scaled_mm": no C operand, so the expand adds the LoRA term onto Y
                y = fp8_matmul(
                    x_q, weight, x_scale, w_scale, x.dtype, fast_accum=FAST_ACCUM_FORWARD
                )
                lora_expand_fwd(s, b_t, bias, None, layout, seed, accumulate=y)
            if ctx.needs_input_grad[0]:
                mark_grad_col_scale(y, w_scale)
        elif gemm == "triton":
            y = lora_gemm(x, weight, s, b_t, bias, layout)
        else:
            y = lora_expand_fwd(s, b_t, bias, None, layout, seed)
            y.addmm_(x, weight.t())  # cuBLAS, reads the LoRA term + bias as C: (T, N)
        ctx.save_for_backward(
            *save_input(ctx, x, rebuild),
            weight,
            lora_a,
            lora_b,
            s,
            scales,
            dropouts,
            w_scale,
            w_t,
        )
        ctx.layout = layout
        ctx.seed = seed
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        """Regenerates the dropout mask from the seed (X rebuilt first when it was not saved)."""
        saved = ctx.saved_tensors
        count = ctx.num_input_tensors
        weight, lora_a, lora_b, s, scales, dropouts, w_scale, w_t = saved[count:]
        x = saved_input(ctx, saved[:count])  # (T, H), rebuilt from its sources if they were saved
        layout, seed = ctx.layout, ctx.seed
        dy = dy.contiguous()
        # One read of dY gives dS' = s·dY·B (T, R) and dB = dYᵀ·S' (S' already carries s);
        # under FP8, given dY's row maxima (SwiGLU's backward, for fc1), also dY in e4m3 for
        # the frozen dX.
        fp8_dgrad = ctx.needs_input_grad[0] and w_scale is not None
        maxima = take_row_maxima(dy, w_scale) if fp8_dgrad else None
        dy_quantized = None
        if maxima is None:
            ds, grad_b = lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=False)
        else:
            ds, grad_b, dy_q, dy_scale = lora_up_bwd_quantized(
                dy, s, lora_b, scales, layout, w_scale, maxima, scale_db=False
            )
            dy_quantized = (dy_q, dy_scale)
        grad_a = torch.empty_like(lora_a)
        grad_x = grad_w = grad_bias = None
        if fp8_dgrad:
            # FP8: the frozen dX first (a scaled GEMM has no C), the LoRA part added onto it
            # by the one pass over X that also gives dA.
            grad_x = frozen_dgrad(dy, Fp8Weight(weight, w_scale, w_t), x.dtype, dy_quantized)
            lora_wgrad_fwd(
                x,
                ds,
                grad_a.transpose(1, 2),
                dropouts,
                layout,
                seed,
                expand_m=lora_a,
                expand_out=grad_x,
                expand_accumulate=True,
            )
        elif ctx.needs_input_grad[0]:
            # One pass over X gives dA and the LoRA part of dX, drawing the mask once.
            grad_x = torch.empty_like(x)
            lora_wgrad_fwd(
                x,
                ds,
                grad_a.transpose(1, 2),
                dropouts,
                layout,
                seed,
                expand_m=lora_a,
                expand_out=grad_x,
            )
            grad_x.addmm_(dy, weight)  # cuBLAS: (T, H), reads the LoRA part as C
        else:
            lora_wgrad_fwd(x, ds, grad_a.transpose(1, 2), dropouts, layout, seed)
        if ctx.needs_input_grad[1]:
            grad_w = dy.t() @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(0)
        return (grad_x, grad_w, grad_bias, grad_a, grad_b) + (None,) * 8


def fused_lora_linear(
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
    gemm: str = "auto",
    rebuild: InputRebuild | None = None,
) -> torch.Tensor:
    """Fused multi-LoRA linear (same function as `lora_linear_ref`, Triton + cuBLAS).

    Args:
        x: (T, H) fp16/bf16/fp32 activations, rows grouped adapter-major, contiguous.
        weight: (N, H) frozen base weight, ``x``'s dtype, or an `Fp8Weight` (N, H and
            multiples of 16; a GPU with FP8 tensor cores).
        bias: (N,) base bias or None.
        lora_a: (A, R, H) down-projections, zero-padded beyond each adapter's rank
            (R in 1..256; an adapter not targeting this layer has all-zero A and B); any
            strides (the kernels read it through them).
        lora_b: (A, N, R) up-projections, any strides.
        scalings: (A,) LoRA scale per adapter.
        dropouts: (A,) dropout probability per adapter, in [0, 1).
        layout: the microbatch's adapter layout.
        layer_seed: the layer's seed; the mask is `fused_dropout_keep_mask` of
            ``(layout, dropouts, H, layer_seed)``, whose rows are those of the whole
            microbatch (its rows keep their ``layout.row_keys``) for a sharded layout.
        training: dropout only when True; all-zero dropouts take a path with no mask.
        gemm: the forward's frozen GEMM: ``"triton"`` (`lora_gemm`, the LoRA term in its
            epilogue; needs 16-byte aligned rows), ``"cublas"`` (LoRA term written first,
            cuBLAS accumulates the frozen product onto it), ``"scaled_mm"`` (FP8 weights:
            ``torch._scaled_mm``, the LoRA term added onto it) or ``"auto"``: ``"triton"`` on
            Hopper when TMA can describe ``x`` and ``weight``, else ``"cublas"``; with an FP8
            weight ``"scaled_mm"``. The dX GEMM is cuBLAS in every case (a scaled GEMM for
            FP8). docs/kernels.md and docs/fp8.md have the H200 numbers.
        rebuild: how to rebuild ``x`` in backward (`InputRebuild`); then ``x`` is not saved.

    Returns:
        (T, N) output in ``x``'s dtype.

    Raises:
        ValueError: on bad shapes, dtypes or devices (the message names the tensor), an
            unknown ``gemm``, ``gemm="triton"`` on strides TMA cannot describe, or a ``gemm``
            that cannot take the weight's dtype (``"cublas"`` with FP8).
        NotImplementedError: for a rank above 256.
        RuntimeError: when Triton cannot run on ``x``'s device, or for an FP8 weight on a GPU
            without FP8 tensor cores.
    """
    if not _utils.triton_usable(x):
        raise RuntimeError(f"fused_lora_linear needs Triton on CUDA, got x on {x.device}")
    fp8 = isinstance(weight, Fp8Weight)
    if fp8:
        check_fp8_device(x.device)
    _check_inputs(x, weight, bias, lora_a, lora_b, layout)
    if len(scalings) != layout.num_adapters or len(dropouts) != layout.num_adapters:
        raise ValueError(
            f"scalings has {len(scalings)} and dropouts {len(dropouts)} entries, "
            f"expected A={layout.num_adapters}"
        )
    if gemm not in _GEMMS:
        raise ValueError(f"gemm must be one of {_GEMMS}, got {gemm!r}")
    if any(not 0.0 <= p < 1.0 for p in dropouts):
        raise ValueError(f"dropouts must lie in [0, 1), got {list(dropouts)}")
    device = str(x.device)
    scales = _utils.device_params(tuple(float(v) for v in scalings), device)
    counts = layout.token_counts()
    use_mask = training and any(p > 0 and n > 0 for p, n in zip(dropouts, counts, strict=True))
    drop = _utils.device_params(tuple(float(p) for p in dropouts), device) if use_mask else None
    seed = _utils.mixed_seed(layout.dropout_seed, layer_seed)
    return LoRALinearFunction.apply(
        x,
        weight.data if fp8 else weight,
        bias,
        lora_a,
        lora_b,
        scales,
        drop,
        layout,
        seed,
        resolve_gemm(gemm, x, weight),
        rebuild,
        weight.scale if fp8 else None,
        weight.data_t if fp8 else None,
    )
