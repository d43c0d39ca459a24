"""Fused output layer + cross-entropy: per-token ``CE(X·Wᵀ, label)`` without the full logits.

The output layer of a 128k-vocabulary model writes ``(T, V)`` logits (8192 × 128256 bf16 is
2 GiB, 4 GiB more once upcast to fp32 for the loss) and the loss's backward another ``(T, V)``
gradient. Here the tokens are processed in chunks of rows: per chunk one cuBLAS GEMM writes
the chunk's logits, one Triton kernel reads each row once for its log-sum-exp and loss and
overwrites the logits in place with ``softmax − onehot`` (the loss's gradient w.r.t. the
logits for a unit upstream gradient), and a second GEMM turns that into the chunk's rows of
``dX = (softmax − onehot)·W``. Only one chunk of logits exists at a time; the backward scales
the saved ``dX`` by each token's upstream gradient (``(T, H)``, no GEMM). Computing ``dX`` in
the forward (as Liger-Kernel's fused linear cross-entropy does) costs ``(T, H)`` of memory
and saves the backward a second logits GEMM. The weight is frozen: there is no ``dW``.

With an FP8 weight (`Fp8Weight`, ``model.base_precision: fp8``) both GEMMs are the FP8 linear's
(`fp8_linear`): the hidden states are quantized per token once, each chunk's logits are
``(X_q·W_qᵀ)·s_x·s_w``, and its ``dX`` is ``Q(G·diag(s_w))·W_q`` with ``G`` the chunk's
``softmax − onehot``, which the loss kernel quantizes per token itself instead of writing it
(one pass more over the logits, none of the quantizer's). `linear_cross_entropy_ref`
fake-quantizes alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.fp8 import FP8_DTYPE, Fp8Weight
from megatron_lorafusion.ops.fp8_linear import (
    FAST_ACCUM_FORWARD,
    fp8_linear_ref,
    fp8_matmul,
    quantized_rows,
)
from megatron_lorafusion.ops.fp8_quant import empty_quantized, unit_scales

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops.fp8_quant import pow2_row_scales, store_quantized_rows

    @triton.jit
    def _row_grad(row_ptr, cols, V, lse, label, keep, col_ptr):
        """(1, BLOCK_V) fp32 ``softmax − onehot`` of ``cols`` times the column scales.

        The gradient is rounded to the logits' dtype first: what `quantize_rows` would read of
        the gradient written out.
        """
        x = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * keep
        grad = grad.to(row_ptr.dtype.element_ty).to(tl.float32)
        return grad * tl.load(col_ptr + cols, mask=cols < V, other=0.0)

    @triton.jit
    def _cross_entropy_fwd_kernel(
        logits_ptr,
        labels_ptr,
        loss_ptr,
        col_ptr,
        q_ptr,
        scale_ptr,
        stride_t,
        stride_q,
        V,
        ignore_index,
        WRITE_GRAD: tl.constexpr,
        QUANTIZE: tl.constexpr,
        HW_CAST: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """One row: loss ``lse − x[label]``; with WRITE_GRAD the row becomes ``softmax − onehot``.

        With QUANTIZE the gradient is not written back: its row times the column scales is
        quantized per row into ``q`` / ``scale`` instead (`quantize_rows` of the written row,
        bit for bit: a pass for the row's largest magnitude, one to store). Ignored rows
        (``label == ignore_index``) get loss 0 and a zero gradient row.
        """
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_t
        label = tl.load(labels_ptr + row).to(tl.int64)
        ignored = label == ignore_index
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, V, BLOCK_V):  # online log-sum-exp, one read of the row
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
                tl.exp(x - new_max), axis=0
            )
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        in_range = (label >= 0) & (label < V) & (~ignored)
        safe_label = tl.where(in_range, label, 0)
        x_label = tl.load(row_ptr + safe_label).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - x_label))
        keep = tl.where(ignored, 0.0, 1.0)
        if QUANTIZE:
            amax = tl.zeros((1,), dtype=tl.float32)
            for start in range(0, V, BLOCK_V):  # second read: the gradient's largest magnitude
                cols = start + tl.arange(0, BLOCK_V)[None, :]
                v = _row_grad(row_ptr, cols, V, lse, label, keep, col_ptr)
                amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
            scale, inv = pow2_row_scales(amax)
            tl.store(scale_ptr + row + tl.arange(0, 1), scale)
            for start in range(0, V, BLOCK_V):  # third read: the gradient in e4m3
                cols = start + tl.arange(0, BLOCK_V)
                v = _row_grad(row_ptr, cols[None, :], V, lse, label, keep, col_ptr)
                store_quantized_rows(
                    q_ptr + row * stride_q, cols, (cols < V)[None, :], v, inv, HW_CAST
                )
        elif WRITE_GRAD:
            for start in range(0, V, BLOCK_V):  # second read: overwrite with the gradient
                cols = start + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
                grad = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
                tl.store(
                    row_ptr + cols, (grad * keep).to(logits_ptr.dtype.element_ty), mask=cols < V
                )


# Memory-bound row kernel: 4096 columns per step (8 KiB of bf16), 8 warps; rows are independent.
_BLOCK_V = {"cuda": 4096, "cpu": 64}
_NUM_WARPS = 8
# One chunk's logits: 2**27 elements (256 MiB of bf16): 1024 rows at V = 128256, where the
# logits GEMM (1024 × 128256 × 4096) is still large enough for cuBLAS to run near peak.
_CHUNK_ELEMENTS = 2**27
_MAX_CHUNK_ROWS = 8192


def _default_chunk_rows(vocab: int) -> int:
    """Rows per chunk: a power of two with ``rows · V`` ≤ `_CHUNK_ELEMENTS`, in [16, 8192]."""
    rows = max(16, _CHUNK_ELEMENTS // max(vocab, 1))
    return min(_MAX_CHUNK_ROWS, 1 << (rows.bit_length() - 1))


def cross_entropy_fwd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    ignore_index: int,
    write_grad: bool,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Launch the row kernel on a chunk (no checks: `linear_cross_entropy` made them).

    Args:
        logits: (C, V) contiguous logits of the chunk; with ``write_grad`` overwritten in place
            by ``softmax − onehot`` (zero rows where the label is ignored).
        labels: (C,) int64 labels.
        loss: (C,) fp32 output, every row written.
        ignore_index: label of tokens without loss.
        write_grad: also write the gradient into ``logits``.
        quantized: ``(col_scale (V,) fp32, q (C, V) e4m3, scale (C,) fp32)``: instead of
            writing the gradient, store ``quantize_rows(gradient, col_scale)`` in ``q`` and
            ``scale`` (``logits`` is left as it is).
    """
    rows, vocab = logits.shape
    if rows == 0:
        return
    col_scale, q, scale = quantized if quantized is not None else (loss, loss, loss)
    _cross_entropy_fwd_kernel[(rows,)](
        logits,
        labels,
        loss,
        col_scale,
        q,
        scale,
        logits.stride(0),
        q.stride(0),
        vocab,
        ignore_index,
        WRITE_GRAD=write_grad,
        QUANTIZE=quantized is not None,
        HW_CAST=logits.is_cuda,
        BLOCK_V=_BLOCK_V["cuda" if logits.is_cuda else "cpu"],
        num_warps=_NUM_WARPS,
    )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd of `linear_cross_entropy`: ``dX`` is computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_rows):
        """(T,) fp32 loss; saves the unit-upstream ``dX`` (T, H) when ``hidden`` needs a grad.

        ``weight`` is a (V, H) tensor or an `Fp8Weight` (both GEMMs then in FP8).
        """
        tokens, vocab = hidden.shape[0], weight.shape[0]
        needs_grad = ctx.needs_input_grad[0]
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        fp8 = isinstance(weight, Fp8Weight)
        if fp8:
            x_q, x_scale = quantized_rows(hidden)  # (T, H) e4m3, (T,): once for every chunk
            w_t = weight.transposed() if needs_grad else None  # (H, V): dX's K-major operand
            ones = unit_scales(hidden.shape[1], str(hidden.device))
        for start in range(0, tokens, chunk_rows):
            end = min(start + chunk_rows, tokens)
            if fp8:
                logits = fp8_matmul(
                    x_q[start:end],
                    weight.data,
                    x_scale[start:end],
                    weight.scale,
                    hidden.dtype,
                    fast_accum=FAST_ACCUM_FORWARD,
                )
            else:
                logits = hidden[start:end] @ weight.t()  # (C, V) in the weights' dtype
            quantized = None
            if needs_grad and fp8:  # softmax − onehot quantized by the loss kernel itself
                quantized = (weight.scale, *empty_quantized(end - start, vocab, hidden.device))
            cross_entropy_fwd(
                logits, labels[start:end], loss[start:end], ignore_index, needs_grad, quantized
            )
            if quantized is not None:
                _, grad_q, grad_scale = quantized
                grad_hidden[start:end] = fp8_matmul(grad_q, w_t, grad_scale, ones, hidden.dtype)
                del quantized, grad_q
            elif needs_grad:
                torch.mm(logits, weight, out=grad_hidden[start:end])  # (C, V) · (V, H)
            del logits
        ctx.save_for_backward(grad_hidden)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """``dX = g_t · dX_unit``, the product in fp32 (as Megatron's CE backward) then cast."""
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is None:
            return None, None, None, None, None
        scaled = (grad_hidden * grad_loss.float()[:, None]).to(grad_hidden.dtype)  # (T, H)
        return scaled, None, None, None, None


def _check_weight(weight: torch.Tensor | Fp8Weight, hidden: torch.Tensor) -> None:
    """A (V, H) frozen weight in ``hidden``'s dtype, or an `Fp8Weight` whose GEMMs can run."""
    width = hidden.shape[1]
    if not isinstance(weight, Fp8Weight):
        _utils.check_tensor("weight", weight, (None, width), (hidden.dtype,), hidden.device)
        if weight.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("linear_cross_entropy has no weight gradient: freeze weight")
        return
    _utils.check_tensor("weight.data", weight.data, (None, width), (FP8_DTYPE,), hidden.device)
    vocab = weight.data.shape[0]
    _utils.check_tensor("weight.scale", weight.scale, (vocab,), (torch.float32,), hidden.device)
    if vocab % 16 or width % 16:
        raise ValueError(
            f"an FP8 weight needs V and H multiples of 16 (FP8 GEMMs), got (V, H)=({vocab}, "
            f"{width})"
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden · weightᵀ``, chunked over tokens (Triton + cuBLAS).

    Args:
        hidden: (T, H) contiguous final hidden states (fp16, bf16 or fp32).
        weight: (V, H) contiguous frozen output weight, same dtype and device; or an
            `Fp8Weight` (V and H multiples of 16): FP8 GEMMs, logits in ``hidden``'s dtype.
        labels: (T,) int64 target ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: label of tokens that get loss 0 and no gradient.
        chunk_rows: tokens per chunk (memory knob: a chunk holds ``chunk_rows × V`` logits);
            None picks `_default_chunk_rows` (256 MiB of logits).

    Returns:
        (T,) fp32 loss per token; its backward accepts any (T,) upstream gradient.

    Raises:
        ValueError: on shape, dtype, device or contiguity mismatch (names the tensor).
        NotImplementedError: when ``weight`` requires a gradient (the output layer is frozen).
    """
    _utils.check_tensor("hidden", hidden, (None, None), _utils.KERNEL_DTYPES, hidden.device)
    tokens = hidden.shape[0]
    _check_weight(weight, hidden)
    _utils.check_tensor("labels", labels, (tokens,), (torch.int64,), hidden.device)
    rows = chunk_rows if chunk_rows is not None else _default_chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {rows}")
    return LinearCrossEntropyFunction.apply(hidden, weight, labels, ignore_index, rows)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Torch reference of `linear_cross_entropy`: full logits, upcast, ``F.cross_entropy``.

    An `Fp8Weight`'s logits are `fp8_linear_ref`'s (fake-quantized forward and ``dX``).
    ``chunk_rows`` is accepted for the same signature and ignored.
    """
    del chunk_rows
    if isinstance(weight, Fp8Weight):
        logits = fp8_linear_ref(hidden, weight)  # (T, V) in hidden's dtype
    else:
        logits = hidden @ weight.t()  # (T, V) in the weights' dtype, as Megatron's output layer
    return F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=ignore_index)
