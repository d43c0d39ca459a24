"""Squared L2 norms of some rows of an (A, S) fp32 table, reading those rows only.

Gradient clipping needs each stepping adapter's gradient norm, row ``a`` of the gradient
table. `row_squared_norms` reads the ``k`` rows of one step group (optionally only the
columns of a per-column mask: a TP rank counts the factors it shares with its peers once),
not the whole table, whose size grows with every adapter of the run. Each program sums the
squares of one block of one row; the blocks' partial sums are added by torch in a fixed
order, so the result does not vary from run to run (no atomics).
"""

from __future__ import annotations

import torch

from megatron_lorafusion.ops._utils import tl, triton, triton_usable

if triton is not None:

    @triton.jit
    def _row_squared_norms_kernel(
        table_ptr,
        rows_ptr,
        columns_ptr,
        partial_ptr,
        width,
        n_blocks,
        HAS_COLUMNS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(1)
        block = tl.program_id(0)
        adapter = tl.load(rows_ptr + j)
        cols = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(table_ptr + adapter * width + cols, mask=mask, other=0.0)
        if HAS_COLUMNS:
            x = tl.where(tl.load(columns_ptr + cols, mask=mask, other=0) != 0, x, 0.0)
        tl.store(partial_ptr + j * n_blocks + block, tl.sum(x * x, axis=0))


_BLOCK = 4096  # elements per program


def _check(table: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor | None) -> None:
    if table.dim() != 2 or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(
            f"table must be a contiguous (A, S) fp32 tensor, got shape {tuple(table.shape)} "
            f"{table.dtype}"
        )
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != table.device:
        raise ValueError(
            f"rows must be (k,) int64 on {table.device}, got {tuple(rows.shape)} {rows.dtype} "
            f"on {rows.device}"
        )
    if columns is not None and (
        tuple(columns.shape) != (table.shape[1],)
        or columns.dtype != torch.bool
        or columns.device != table.device
    ):
        raise ValueError(
            f"columns must be bool of shape ({table.shape[1]},) on {table.device}, got "
            f"{tuple(columns.shape)} {columns.dtype} on {columns.device}"
        )


def row_squared_norms(
    table: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """(A,) fp32 squared norms of the rows ``rows`` of ``table``, 0 for the others (not read).

    Row ``a``'s value is ``sum(table[a, c]²)`` over the columns ``c`` that ``columns`` marks.

    Args:
        table: (A, S) contiguous fp32.
        rows: (k,) int64 row ids, each once, each in ``[0, A)``.
        columns: (S,) bool, the columns counted, or None: every column.

    Raises:
        ValueError: naming the tensor of the wrong shape, dtype or device.
    """
    _check(table, rows, columns)
    if not triton_usable(table):
        return row_squared_norms_ref(table, rows, columns)
    adapters, width = table.shape
    n_blocks = triton.cdiv(width, _BLOCK)
    partial = torch.empty(rows.numel(), n_blocks, dtype=torch.float32, device=table.device)
    if rows.numel() and width:
        _row_squared_norms_kernel[(n_blocks, rows.numel())](
            table,
            rows.contiguous(),
            table if columns is None else columns.view(torch.uint8),  # unread when None
            partial,
            width,
            n_blocks,
            HAS_COLUMNS=columns is not None,
            BLOCK=_BLOCK,
        )
    out = torch.zeros(adapters, dtype=torch.float32, device=table.device)
    return out.index_copy_(0, rows, partial.sum(dim=1))


def row_squared_norms_ref(
    table: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of `row_squared_norms` (same arguments and result)."""
    picked = table.index_select(0, rows)
    if columns is not None:
        picked = picked * columns
    out = torch.zeros(table.shape[0], dtype=torch.float32, device=table.device)
    return out.index_copy_(0, rows, picked.square().sum(dim=1))
