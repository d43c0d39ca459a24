"""`row_squared_norms` (Triton kernel) against `row_squared_norms_ref` and torch's norm.

CPU: the Triton interpreter, fp32; the block sums add in another order than torch's, so the
comparison is at fp32 tolerance.
"""

import pytest
import torch

from megatron_lorafusion.ops import row_squared_norms, row_squared_norms_ref

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("adapters", "width"), [(1, 4096), (5, 9001), (3, 7)])
def test_row_squared_norms_reads_the_given_rows_only(adapters, width, device):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(adapters, width, generator=gen).to(device)
    rows = torch.arange(adapters - 1, -1, -2, device=device)  # every other row, reversed
    got = row_squared_norms(table, rows)
    want = torch.zeros(adapters, device=device)
    want[rows] = torch.linalg.vector_norm(table[rows], dim=1).square()
    torch.testing.assert_close(got, want, **TOL, msg="against torch's norm")
    torch.testing.assert_close(got, row_squared_norms_ref(table, rows), **TOL, msg="reference")
    others = [a for a in range(adapters) if a not in rows.tolist()]
    assert not got[others].any(), "rows not given must read 0"
    again = row_squared_norms(table, rows)
    assert torch.equal(got, again), "the block sums add in a fixed order: bitwise repeatable"


def test_row_squared_norms_counts_only_the_masked_columns(device):
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(4, 5000, generator=gen).to(device)
    columns = (torch.arange(5000) % 3 == 0).to(device)
    rows = torch.tensor([0, 3], device=device)
    got = row_squared_norms(table, rows, columns)
    want = torch.zeros(4, device=device)
    want[rows] = table[rows][:, columns].square().sum(dim=1)
    torch.testing.assert_close(got, want, **TOL)
    empty = row_squared_norms(table, rows[:0])
    assert empty.shape == (4,)
    assert not empty.any(), "no rows: all zeros"


def test_row_squared_norms_names_bad_input(device):
    table = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="table must be a contiguous"):
        row_squared_norms(table.t(), torch.tensor([0], device=device))
    with pytest.raises(ValueError, match=r"rows must be \(k,\) int64"):
        row_squared_norms(table, torch.tensor([0], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"columns must be bool of shape \(8,\)"):
        row_squared_norms(table, torch.tensor([0], device=device), torch.ones(7, device=device))
