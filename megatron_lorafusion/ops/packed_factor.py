"""A layer's packed LoRA factors out of the adapters' weight table, their gradients back in.

Every adapter factor of a rank is row ``a`` of one (A, S) fp32 table; a layer's ``lora_A``
(A, R, H) and ``lora_B`` (A, N, R) are adjacent column ranges of it. The forward needs them in
the compute dtype: `cast_table` copies the whole table once per version of the weights (one
launch for every layer and adapter), and `packed_factors` hands each layer views of that copy
(no launch). Backward adds the layer's two gradients into its columns of the fp32 gradient
table in one launch (`packed_factors_bwd`), for the microbatch's adapters only: the others'
gradients are zero, and reading and adding them would cost traffic in proportion to every
adapter of the run. The kernels use 64-bit offsets: torch's copy and
add index a strided view in 32 bits and split into several launches once ``A·S`` passes 2³¹
bytes (16 adapters of rank 64 on a 1B model, 64 of rank 8 on an 8B one).
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops._utils import tl, triton, triton_usable

if triton is not None:

    @triton.jit
    def _cast_table_kernel(table_ptr, out_ptr, width, BLOCK: tl.constexpr):
        adapter = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        value = tl.load(table_ptr + adapter * width + cols, mask=mask)
        tl.store(out_ptr + adapter * width + cols, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _packed_factors_bwd_kernel(
        table_ptr,
        grad_a_ptr,
        grad_b_ptr,
        rows_ptr,
        row_stride,
        width_a,
        width_b,
        BLOCK: tl.constexpr,
    ):
        adapter = tl.load(rows_ptr + tl.program_id(1))
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_a = cols < width_a
        in_b = (cols >= width_a) & (cols < width_a + width_b)
        grad_a = tl.load(grad_a_ptr + adapter * width_a + cols, mask=in_a, other=0.0)
        grad_b = tl.load(grad_b_ptr + adapter * width_b + (cols - width_a), mask=in_b, other=0.0)
        offs = table_ptr + adapter * row_stride + cols
        mask = in_a | in_b
        total = tl.load(offs, mask=mask) + grad_a.to(tl.float32) + grad_b.to(tl.float32)
        tl.store(offs, total, mask=mask)


_BLOCK = 4096  # elements per program


def _check_table(name: str, table: torch.Tensor) -> None:
    if table.dim() != 2 or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous (A, S) fp32 table, got shape {tuple(table.shape)} "
            f"{table.dtype}, strides {table.stride()}"
        )


def cast_table(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(A, S) contiguous copy of the fp32 ``table`` in ``dtype`` (one launch on CUDA)."""
    _check_table("table", table)
    if not triton_usable(table):
        return cast_table_ref(table, dtype)
    out = torch.empty(table.shape, dtype=dtype, device=table.device)
    if table.numel():
        grid = (triton.cdiv(table.shape[1], _BLOCK), table.shape[0])
        _cast_table_kernel[grid](table, out, table.shape[1], BLOCK=_BLOCK)
    return out


def cast_table_ref(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of `cast_table` (always a copy, also in fp32)."""
    return table.detach().to(dtype, copy=True)


def _slot(table: torch.Tensor, column: int, shape: tuple[int, int]) -> torch.Tensor:
    """(A, rows, cols) view of ``table``'s columns ``column ..`` (one factor's slot)."""
    rows, cols = shape
    return table[:, column : column + rows * cols].view(table.shape[0], rows, cols)


def packed_factors_bwd(
    grads: torch.Tensor,
    column: int,
    grad_a: torch.Tensor,
    grad_b: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Add ``[grad_a | grad_b]`` into ``grads``' columns ``column ..`` in place (one launch).

    Args:
        grads: (A, S) fp32 gradient table.
        column: first column of the layer's ``lora_A`` slot; ``lora_B``'s follows it.
        grad_a: (A, R, H) gradient of ``lora_A``, any float dtype.
        grad_b: (A, N, R) gradient of ``lora_B``.
        rows: (k,) int64 the adapters whose gradients are added (the others' are not read),
            or None: every adapter. An adapter without tokens in the microbatch has zero
            gradients, so the microbatch's adapters (`AdapterLayout.present`) suffice.
    """
    _check_table("grads", grads)
    width_a, width_b = grad_a[0].numel(), grad_b[0].numel()
    if grad_a.shape[0] != grads.shape[0] or grad_b.shape[0] != grads.shape[0]:
        raise ValueError(
            f"grad_a {tuple(grad_a.shape)} and grad_b {tuple(grad_b.shape)} must have "
            f"A = {grads.shape[0]} rows"
        )
    if column < 0 or column + width_a + width_b > grads.shape[1]:
        raise ValueError(
            f"columns {column}..{column + width_a + width_b} lie outside the table's "
            f"{grads.shape[1]}"
        )
    if rows is not None and (
        rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != grads.device
    ):
        raise ValueError(
            f"rows must be (k,) int64 on {grads.device}, got {tuple(rows.shape)} {rows.dtype} "
            f"on {rows.device}"
        )
    if rows is None:
        rows = torch.arange(grads.shape[0], device=grads.device)
    if rows.numel() == 0:
        return
    if not triton_usable(grads):
        a_cols = slice(column, column + width_a)
        b_cols = slice(column + width_a, column + width_a + width_b)
        grads[rows, a_cols] += grad_a[rows].reshape(rows.numel(), -1)
        grads[rows, b_cols] += grad_b[rows].reshape(rows.numel(), -1)
        return
    grid = (triton.cdiv(width_a + width_b, _BLOCK), rows.numel())
    _packed_factors_bwd_kernel[grid](
        grads[:, column:],
        grad_a.contiguous(),
        grad_b.contiguous(),
        rows.contiguous(),
        grads.stride(0),
        width_a,
        width_b,
        BLOCK=_BLOCK,
    )


class PackedFactorsFunction(torch.autograd.Function):
    """A layer's (A, R, H) and (A, N, R) factors as views of the compute-dtype table.

    ``weights`` (the fp32 table, which requires grad) is an input only so autograd reaches
    this node; no gradient flows to it: backward adds into ``grads`` in place.
    """

    @staticmethod
    def forward(ctx, weights, compute, grads, column, shape_a, shape_b, rows):
        """Views of ``compute``: ``lora_A`` at ``column``, ``lora_B`` right after it."""
        ctx.grads, ctx.column, ctx.rows = grads, column, rows
        ctx.shape_a, ctx.shape_b = shape_a, shape_b
        width_a = shape_a[0] * shape_a[1]
        return _slot(compute, column, shape_a), _slot(compute, column + width_a, shape_b)

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        """Both gradients into the fp32 table; nothing flows to the inputs."""
        adapters = ctx.grads.shape[0]
        if grad_a is None:
            grad_a = ctx.grads.new_zeros(adapters, *ctx.shape_a)
        if grad_b is None:
            grad_b = ctx.grads.new_zeros(adapters, *ctx.shape_b)
        packed_factors_bwd(ctx.grads, ctx.column, grad_a, grad_b, ctx.rows)
        return None, None, None, None, None, None, None


def packed_factors(
    weights: torch.Tensor,
    compute: torch.Tensor,
    grads: torch.Tensor,
    column: int,
    shape_a: tuple[int, int],
    shape_b: tuple[int, int],
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``lora_A`` and ``lora_B`` in the compute dtype, their gradients into ``grads``.

    Args:
        weights: (A, S) fp32 weight table requiring grad (connects the graph, gets no grad).
        compute: `cast_table` of ``weights`` (A, S) in the compute dtype.
        grads: (A, S) fp32 gradient table; backward adds into it in place.
        column: first column of the layer's ``lora_A`` slot; ``lora_B``'s follows it.
        shape_a: ``(R, H)`` of ``lora_A[a]``.
        shape_b: ``(N, R)`` of ``lora_B[a]``.
        rows: (k,) int64 the adapters whose gradients backward adds (`packed_factors_bwd`),
            or None: every adapter.

    Returns:
        (A, R, H) and (A, N, R) views of ``compute`` (adapter stride S).
    """
    return PackedFactorsFunction.apply(weights, compute, grads, column, shape_a, shape_b, rows)


class PackedSlotFunction(torch.autograd.Function):
    """A contiguous copy of one slot of the weight table; backward adds into its grad view.

    For the small per-linear vectors a variant keeps beside the factors (DoRA's magnitudes,
    (A, 1, N)), read in fp32: a copy, so an optimizer step between a forward and its backward
    changes nothing autograd saved.
    """

    @staticmethod
    def forward(ctx, weights, slot, grad_view, dtype):
        """(A, R, C) contiguous copy of ``slot`` in ``dtype``."""
        ctx.grad_view = grad_view
        return slot.detach().to(dtype, memory_format=torch.contiguous_format, copy=True)

    @staticmethod
    def backward(ctx, grad_out):
        """Add ``grad_out`` into the gradient view; nothing flows to the inputs."""
        ctx.grad_view.add_(grad_out)
        return None, None, None, None


def packed_slot(
    weights: torch.Tensor, slot: torch.Tensor, grad_view: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """One (A, R, C) slot of the table, copied contiguous in ``dtype``.

    Its gradient is added to ``grad_view``, the same view of the gradient table.

    Args:
        weights: (A, S) fp32 weight table requiring grad (connects the graph, gets no grad).
        slot: (A, R, C) fp32 view of ``weights``.
        grad_view: the same view of the gradient table; backward adds into it in place.
        dtype: the dtype of the copy.
    """
    return PackedSlotFunction.apply(weights, slot, grad_view, dtype)
