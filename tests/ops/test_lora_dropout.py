"""`fused_dropout_keep_mask`: deterministic in its seeds, right density, no mask at p = 0,
and the mask the fused kernels apply (checked through `lora_shrink`)."""

import pytest
import torch

from megatron_lorafusion.ops import fused_dropout_keep_mask, lora_shrink, lora_shrink_ref
from megatron_lorafusion.ops._utils import mixed_seed


def test_fused_dropout_keep_mask_is_a_function_of_the_seeds(device, make_layout):
    layout = make_layout([50, 0, 30], device, seed=9)
    dropouts = [0.3, 0.5, 0.0]
    first = fused_dropout_keep_mask(layout, dropouts, 64, layer_seed=4, device=device)
    again = fused_dropout_keep_mask(layout, dropouts, 64, layer_seed=4, device=device)
    other_layer = fused_dropout_keep_mask(layout, dropouts, 64, layer_seed=5, device=device)
    assert torch.equal(first, again), "same seeds must give the same mask"
    assert not torch.equal(first[:50], other_layer[:50]), "another layer must draw another mask"
    assert bool(first[50:].all()), "an adapter with p = 0 keeps everything"


def test_fused_dropout_keep_mask_density(device, make_layout):
    layout = make_layout([256], device, seed=1)
    keep = fused_dropout_keep_mask(layout, [0.25], 256, layer_seed=0, device=device)
    frac = keep.float().mean().item()
    sigma = (0.25 * 0.75 / keep.numel()) ** 0.5
    assert abs(frac - 0.75) < 5 * sigma, f"kept fraction {frac:.4f}, expected 0.75"
    col_means = keep.float().mean(0)  # no column (draw slot within a Philox word) is biased
    assert float((col_means - 0.75).abs().max()) < 0.15, "a column is far from p"


def test_fused_dropout_keep_mask_none_without_dropout(device, make_layout):
    layout = make_layout([5, 0], device)
    assert fused_dropout_keep_mask(layout, [0.0, 0.9], 8, 0, device) is None


@pytest.mark.parametrize("width", [64, 37])  # a multiple of 8, and a ragged width
def test_kernels_apply_the_materialised_mask(width, device, make_layout, make_lora):
    layout = make_layout([40, 25], device, seed=2)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(layout.num_tokens, width, generator=gen).to(device)
    m, _ = make_lora(8, width, [4, 4], torch.float32, device, gen)
    scales = torch.ones(2, device=device)
    dropouts = [0.5, 0.25]
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(layout, dropouts, width, 3, device)
    got = lora_shrink(z, m, scales, drop, layout, mixed_seed(layout.dropout_seed, 3))
    want = lora_shrink_ref(z, m, scales, keep, drop, layout)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg="mask applied")
