"""The reference multi-LoRA op against one plain LoRA per adapter, in float64.

Tolerances: float64 everywhere, so differences are only summation order.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import (
    AdapterLayout,
    dropout_keep_mask,
    lora_linear,
    lora_linear_ref,
)

TOL = {torch.float64: (1e-10, 1e-10)}

# (tokens per adapter, ranks, dropouts): round and ragged cases, a zero-token adapter, A = 1.
CASES = [
    ([64], [8], [0.0]),
    ([37, 0, 21, 5], [4, 16, 3, 1], [0.1, 0.0, 0.3, 0.0]),
    ([16, 16, 16], [2, 2, 2], [0.2, 0.2, 0.2]),
]


def _single_lora(x, weight, bias, a, b, scale, keep, p):
    """One ordinary LoRA linear: x W^T + bias + scale * (drop(x) A^T) B^T."""
    dropped = x * keep / (1 - p) if p > 0 else x
    return F.linear(x, weight, bias) + scale * F.linear(F.linear(dropped, a), b)


@pytest.mark.parametrize(("counts", "ranks", "dropouts"), CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_lora_linear_ref_matches_per_adapter_lora(counts, ranks, dropouts, with_bias):
    dtype, (atol, rtol) = torch.float64, TOL[torch.float64]
    hidden, out, num = 24, 20, len(counts)
    rmax = max(ranks)
    sample_adapters = [a for a, n in enumerate(counts) if n]
    layout = AdapterLayout.from_samples(
        sample_adapters, [n for n in counts if n], num, dropout_seed=7
    )
    x = torch.randn(sum(counts), hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(out, hidden, dtype=dtype)
    bias = torch.randn(out, dtype=dtype) if with_bias else None
    a_list = [torch.randn(r, hidden, dtype=dtype, requires_grad=True) for r in ranks]
    b_list = [torch.randn(out, r, dtype=dtype, requires_grad=True) for r in ranks]
    lora_a = torch.stack([F.pad(a, (0, 0, 0, rmax - a.shape[0])) for a in a_list])
    lora_b = torch.stack([F.pad(b, (0, rmax - b.shape[1])) for b in b_list])
    scalings = [0.5 + a for a in range(num)]
    keep = dropout_keep_mask(layout, dropouts, hidden, layer_seed=3, device="cpu")
    if keep is None:
        keep = torch.ones(sum(counts), hidden, dtype=torch.bool)

    y = lora_linear_ref(x, weight, bias, lora_a, lora_b, scalings, dropouts, layout, keep)
    grad_y = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *a_list, *b_list], grad_y, allow_unused=True)

    expected_parts = []
    for a, start, end in layout.segments():
        expected_parts.append(
            _single_lora(
                x[start:end],
                weight,
                bias,
                a_list[a],
                b_list[a],
                scalings[a],
                keep[start:end],
                dropouts[a],
            )
        )
    y_ref = torch.cat(expected_parts)
    want = torch.autograd.grad(y_ref, [x, *a_list, *b_list], grad_y, allow_unused=True)

    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol, msg="output differs")
    names = ["x"] + [f"A[{i}]" for i in range(num)] + [f"B[{i}]" for i in range(num)]
    for name, g, w in zip(names, got, want, strict=True):
        if w is None:  # adapter with no tokens: no gradient at all
            assert g is None or torch.count_nonzero(g) == 0, f"grad of {name} should be zero"
            continue
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=f"grad of {name} differs")


def test_dropout_mask_is_deterministic_and_per_layer():
    layout = AdapterLayout.from_samples([0, 1], [30, 30], 2, dropout_seed=11)
    first = dropout_keep_mask(layout, [0.5, 0.5], 16, layer_seed=1, device="cpu")
    again = dropout_keep_mask(layout, [0.5, 0.5], 16, layer_seed=1, device="cpu")
    other = dropout_keep_mask(layout, [0.5, 0.5], 16, layer_seed=2, device="cpu")
    assert torch.equal(first, again), "same seeds must give the same mask"
    assert not torch.equal(first, other), "another layer must draw another mask"
    assert dropout_keep_mask(layout, [0.0, 0.0], 16, 1, "cpu") is None, "p = 0 needs no mask"


def test_dropout_mask_keeps_rows_of_adapters_without_dropout():
    layout = AdapterLayout.from_samples([0, 1], [40, 40], 2, dropout_seed=3)
    keep = dropout_keep_mask(layout, [0.0, 0.5], 64, layer_seed=0, device="cpu")
    assert keep[:40].all(), "adapter 0 has p = 0 and must keep every element"
    kept = keep[40:].float().mean().item()
    assert 0.4 < kept < 0.6, f"adapter 1 keeps {kept:.2f} of elements, expected about 0.5"


def test_lora_linear_rejects_mismatched_shapes():
    layout = AdapterLayout.from_samples([0], [4], 1)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"lora_b has shape"):
        lora_linear(x, w, None, torch.zeros(1, 2, 8), torch.zeros(1, 6, 3), [1.0], [0.0], layout)
    with pytest.raises(ValueError, match=r"layout covers 4 tokens, x has T=5"):
        lora_linear(
            torch.randn(5, 8),
            w,
            None,
            torch.zeros(1, 2, 8),
            torch.zeros(1, 6, 2),
            [1.0],
            [0.0],
            layout,
        )


def test_layout_rejects_unordered_samples():
    with pytest.raises(ValueError, match="adapter-major"):
        AdapterLayout.from_samples([1, 0], [3, 3], 2)


@pytest.mark.parametrize(("start", "end"), [(0, 25), (25, 50), (10, 42), (50, 75), (0, 75)])
def test_layout_shard_clips_segments_and_keeps_mask_rows(start, end):
    layout = AdapterLayout.from_samples([0, 0, 2], [20, 14, 41], 3, dropout_seed=5)
    shard = layout.shard(start, end)
    full_rows = layout.row_adapter("cpu")[start:end]
    assert shard.num_tokens == end - start
    assert torch.equal(shard.row_adapter("cpu"), full_rows), "rows must keep their adapter"
    assert torch.equal(shard.keys(), layout.keys()[start:end]), "rows keep their dropout keys"
    assert int(shard.cu_seqlens[0]) == 0
    assert int(shard.cu_seqlens[-1]) == end - start
    keep = dropout_keep_mask(layout, [0.3, 0.0, 0.5], 24, layer_seed=4, device="cpu")
    keep_shard = dropout_keep_mask(shard, [0.3, 0.0, 0.5], 24, layer_seed=4, device="cpu")
    assert torch.equal(keep_shard, keep[start:end]), "a shard must draw its rows' mask"
    nested = layout.shard(start, end).shard(0, (end - start) // 2)
    assert torch.equal(nested.keys(), layout.keys()[start : start + (end - start) // 2]), (
        "shards of shards keep their rows' keys"
    )


def test_dropout_mask_of_a_sample_does_not_depend_on_its_microbatch():
    """A sample's mask rows depend on its key and positions only (DESIGN.md isolation)."""
    alone = AdapterLayout.from_samples([0], [9], 1, dropout_seed=3, sample_keys=[77])
    packed = AdapterLayout.from_samples(
        [0, 0, 1], [5, 9, 4], 2, dropout_seed=3, sample_keys=[12, 77, 5]
    )
    keep_alone = dropout_keep_mask(alone, [0.5], 40, layer_seed=2, device="cpu")
    keep_packed = dropout_keep_mask(packed, [0.5, 0.5], 40, layer_seed=2, device="cpu")
    assert torch.equal(keep_packed[5:14], keep_alone), "the sample's rows must draw one mask"
    assert not torch.equal(keep_packed[0:5], keep_alone[0:5]), "another key draws another mask"


def test_layout_shard_rejects_rows_outside_the_microbatch():
    layout = AdapterLayout.from_samples([0], [8], 1)
    with pytest.raises(ValueError, match=r"shard rows \[4, 9\) must lie in \[0, 8\]"):
        layout.shard(4, 9)


def test_layout_cached_counts_follow_its_own_segments():
    """Counts are cached per layout; a layout derived by `dataclasses.replace` starts afresh."""
    layout = AdapterLayout.from_samples([0, 1, 1], [3, 4, 2], 2)
    assert (layout.token_counts(), layout.num_tokens) == ([3, 6], 9)
    layout.token_counts().append(7)  # callers get a copy
    assert layout.token_counts() == [3, 6]
    other = dataclasses.replace(layout, seg_offsets=torch.tensor([0, 5, 9]))
    assert (other.token_counts(), other.num_tokens) == ([5, 4], 9)
    assert not torch.equal(layout.tiles(4, "cpu"), other.tiles(4, "cpu"))


def test_layout_present_ids_skip_adapters_without_tokens():
    layout = AdapterLayout.from_samples([1, 3, 3], [2, 4, 1], 5)
    assert layout.present_ids() == (1, 3)
    assert layout.present("cpu").tolist() == [1, 3]
    assert layout.present("cpu").dtype == torch.int64
    empty = AdapterLayout.from_samples([], [], 2)
    assert empty.present_ids() == ()
    assert empty.present("cpu").shape == (0,)
