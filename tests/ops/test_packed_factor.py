"""`packed_factor` (Triton copy out of / add into the adapters' table) against the torch path.

CPU: the Triton interpreter. The copy is exact in fp32 and a rounding in fp16; the backward's
add is one fp32 addition per element, so it is compared exactly.
"""

import pytest
import torch

from megatron_lorafusion.ops import packed_factor, packed_factor_ref
from megatron_lorafusion.ops.packed_factor import packed_factor_bwd, packed_factor_fwd

TOL = {torch.float32: (0.0, 0.0), torch.float16: (0.0, 0.0)}  # a cast: exact per element


def _table(adapters, rows, cols, extra, device, seed=0):
    """An (A, S) table with the factor's (R, C) slot at column ``extra`` of each row."""
    gen = torch.Generator().manual_seed(seed)
    width = extra + rows * cols + 5  # slot neither first nor last in its row
    table = torch.randn(adapters, width, generator=gen).to(device)
    view = table[:, extra : extra + rows * cols].view(adapters, rows, cols)
    return table, view


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("adapters", "rows", "cols"), [(1, 16, 64), (5, 3, 1000), (3, 7, 1)])
def test_packed_factor_matches_reference(adapters, rows, cols, dtype, device):
    table, view = _table(adapters, rows, cols, extra=11, device=device)
    grads = torch.zeros_like(table)
    grad_view = grads[:, 11 : 11 + rows * cols].view(adapters, rows, cols)
    got = packed_factor_fwd(view, dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        got, packed_factor_ref(view, dtype), atol=atol, rtol=rtol, msg="copy of the strided factor"
    )
    assert got.is_contiguous()
    upstream = torch.randn(adapters, rows, cols, generator=torch.Generator().manual_seed(1))
    upstream = upstream.to(device, dtype)
    grad_view.fill_(0.5)
    packed_factor_bwd(grad_view, upstream)
    torch.testing.assert_close(
        grad_view, 0.5 + upstream.float(), atol=0, rtol=0, msg="gradient added into the table"
    )
    outside = torch.ones_like(grads, dtype=torch.bool)
    outside[:, 11 : 11 + rows * cols] = False
    assert not grads[outside].any(), "the add wrote outside the factor's slot"


def test_packed_factor_autograd_adds_into_grad_view_only(device):
    table, view = _table(4, 2, 8, extra=3, device=device)
    table.requires_grad_()
    grads = torch.zeros(table.shape, device=device)
    grad_view = grads[:, 3:19].view(4, 2, 8)
    with torch.no_grad():
        factor_view = table.detach()[:, 3:19].view(4, 2, 8)
    out = packed_factor(table, factor_view, grad_view, torch.float32)
    weights = torch.randn(4, 2, 8, device=device)
    (out * weights).sum().backward()
    (packed_factor(table, factor_view, grad_view, torch.float32) * weights).sum().backward()
    torch.testing.assert_close(
        grad_view,
        2 * weights,
        atol=0,
        rtol=0,
        msg="two backwards must accumulate into the grad view",
    )
    assert table.grad is None, "no gradient may flow to the table itself"


def test_packed_factor_names_bad_view(device):
    table, view = _table(2, 4, 8, extra=0, device=device)
    with pytest.raises(ValueError, match=r"factor must have contiguous \(R, C\) blocks"):
        packed_factor_fwd(view.transpose(1, 2), torch.float32)
    with pytest.raises(ValueError, match="grad has shape"):
        packed_factor_bwd(view, torch.zeros(2, 4, 7, device=device))
