"""`cast_table` and `packed_factors` (a layer's factors out of / gradients into the adapters'
tables) against the torch path.

CPU: the Triton interpreter. The cast is exact in fp32 and a rounding in fp16; the backward's
add is one fp32 addition per element, so it is compared exactly.
"""

import pytest
import torch

from megatron_lorafusion.ops import cast_table, cast_table_ref, packed_factors
from megatron_lorafusion.ops.packed_factor import packed_factors_bwd


def _table(adapters: int, width: int, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(adapters, width, generator=gen).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("adapters", "width"), [(1, 64), (5, 5000), (3, 1)])
def test_cast_table_matches_reference(adapters, width, dtype, device):
    table = _table(adapters, width, device)
    got = cast_table(table, dtype)
    torch.testing.assert_close(got, cast_table_ref(table, dtype), atol=0, rtol=0)
    assert got.is_contiguous()
    assert got.dtype == dtype
    assert got.data_ptr() != table.data_ptr(), "the cast must be a copy, also in fp32"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("adapters", "shape_a", "shape_b"),
    [(1, (16, 64), (48, 16)), (5, (3, 1000), (7, 3)), (3, (1, 1), (2, 1))],
)
def test_packed_factors_bwd_adds_both_gradients_into_their_columns_only(
    adapters, shape_a, shape_b, dtype, device
):
    column = 11  # slot neither first nor last in its row
    width_a, width_b = shape_a[0] * shape_a[1], shape_b[0] * shape_b[1]
    grads = torch.full((adapters, column + width_a + width_b + 5), 0.5, device=device)
    gen = torch.Generator().manual_seed(1)
    grad_a = torch.randn(adapters, *shape_a, generator=gen).to(device, dtype)
    grad_b = torch.randn(adapters, *shape_b, generator=gen).to(device, dtype)
    packed_factors_bwd(grads, column, grad_a, grad_b)
    want = torch.full_like(grads, 0.5)
    want[:, column : column + width_a] += grad_a.float().reshape(adapters, -1)
    want[:, column + width_a : column + width_a + width_b] += grad_b.float().reshape(adapters, -1)
    torch.testing.assert_close(grads, want, atol=0, rtol=0, msg="gradients added into the table")


def test_packed_factors_bwd_adds_only_the_rows_it_is_given(device, make_layout):
    layout = make_layout([5, 0, 3, 0], device)  # adapters 0 and 2 have tokens
    rows = layout.present(device)
    assert rows.tolist() == [0, 2]
    shape_a, shape_b = (2, 700), (900, 2)  # several column blocks per row
    width = 1 + 2 * 700 + 900 * 2
    grads = torch.full((4, width), 0.5, device=device)
    gen = torch.Generator().manual_seed(2)
    grad_a = torch.randn(4, *shape_a, generator=gen).to(device)  # rows 1 and 3 not zero:
    grad_b = torch.randn(4, *shape_b, generator=gen).to(device)  # they must not be read
    packed_factors_bwd(grads, 1, grad_a, grad_b, rows)
    want = torch.full_like(grads, 0.5)
    for a in (0, 2):
        want[a, 1 : 1 + 1400] += grad_a[a].reshape(-1)
        want[a, 1 + 1400 :] += grad_b[a].reshape(-1)
    torch.testing.assert_close(grads, want, atol=0, rtol=0, msg="only the given rows added")
    packed_factors_bwd(grads, 1, grad_a, grad_b, rows[:0])  # no adapter: nothing to add
    torch.testing.assert_close(grads, want, atol=0, rtol=0, msg="an empty row set adds nothing")


def test_packed_factors_bwd_torch_path_takes_an_empty_row_set(monkeypatch):
    import megatron_lorafusion.ops.packed_factor as packed_factor

    monkeypatch.setattr(packed_factor, "triton_usable", lambda t: False)  # the CPU torch path
    grads = torch.full((3, 20), 0.5)
    grad_a, grad_b = torch.ones(3, 2, 4), torch.ones(3, 3, 2)
    packed_factors_bwd(grads, 2, grad_a, grad_b, torch.tensor([], dtype=torch.int64))
    assert torch.equal(grads, torch.full((3, 20), 0.5)), "no row given: nothing added"
    packed_factors_bwd(grads, 2, grad_a, grad_b, torch.tensor([1]))
    assert grads[1, 2:16].eq(1.5).all(), "row 1's slot gets its gradient"
    assert grads[[0, 2]].eq(0.5).all(), "rows not given are untouched"


def test_packed_factors_are_views_and_accumulate_into_the_grad_table_only(device):
    weights = _table(4, 40, device).requires_grad_()
    grads = torch.zeros(weights.shape, device=device)
    compute = cast_table(weights.detach(), torch.float32)
    column, shape_a, shape_b = 3, (2, 8), (5, 2)
    upstream_a = torch.randn(4, *shape_a, device=device)
    upstream_b = torch.randn(4, *shape_b, device=device)
    for _ in range(2):
        lora_a, lora_b = packed_factors(weights, compute, grads, column, shape_a, shape_b)
        ((lora_a * upstream_a).sum() + (lora_b * upstream_b).sum()).backward()
    torch.testing.assert_close(lora_a, weights.detach()[:, 3:19].view(4, 2, 8), atol=0, rtol=0)
    torch.testing.assert_close(lora_b, weights.detach()[:, 19:29].view(4, 5, 2), atol=0, rtol=0)
    assert lora_a.data_ptr() == compute.data_ptr() + 3 * compute.element_size(), "not a view"
    want = torch.zeros_like(grads)
    want[:, 3:19] = 2 * upstream_a.reshape(4, -1)
    want[:, 19:29] = 2 * upstream_b.reshape(4, -1)
    torch.testing.assert_close(grads, want, atol=0, rtol=0, msg="two backwards must accumulate")
    assert weights.grad is None, "no gradient may flow to the weight table itself"


def test_packed_factor_ops_name_bad_input(device):
    table = _table(2, 32, device)
    with pytest.raises(ValueError, match=r"table must be a contiguous \(A, S\) fp32 table"):
        cast_table(table.t(), torch.float16)
    with pytest.raises(ValueError, match="lie outside the table's 32"):
        packed_factors_bwd(table, 20, torch.zeros(2, 2, 4), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="must have A = 2 rows"):
        packed_factors_bwd(table, 0, torch.zeros(3, 2, 4), torch.zeros(2, 3, 2))
