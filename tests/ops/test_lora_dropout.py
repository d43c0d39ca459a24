"""`fused_dropout_keep_mask`: deterministic in its seeds, right density, no mask at p = 0,
the mask the fused kernels apply (checked through `lora_shrink`), and the same mask as the
torch reference's `dropout_keep_mask` (`ops.philox`)."""

import numpy as np
import pytest
import torch

from megatron_lorafusion.ops import (
    AdapterLayout,
    dropout_keep_mask,
    fused_dropout_keep_mask,
    lora_shrink,
    lora_shrink_ref,
)
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


def _philox_keep_mask(seed, keys, cols, p):
    """NumPy Philox4x32-7 of `_utils.keep_mask_tile`: keep-mask of the rows with dropout
    ``keys`` × ``cols``, an oracle independent of Triton (counter ``(col // 8, key)``)."""
    m32 = np.uint64(0xFFFFFFFF)
    keys, cols = keys.astype(np.uint64), cols.astype(np.uint64)
    shape = (len(keys), len(cols))
    c0 = np.broadcast_to((cols // np.uint64(8))[None, :], shape)
    c1 = np.broadcast_to((keys & m32)[:, None], shape)
    c2 = np.broadcast_to((keys >> np.uint64(32))[:, None], shape)
    c3 = np.zeros(shape, dtype=np.uint64)
    k0, k1 = np.uint64(seed) & m32, np.uint64(seed) >> np.uint64(32)
    for _ in range(7):
        prev0, prev2 = c0, c2
        c0 = ((np.uint64(0xCD9E8D57) * prev2) >> np.uint64(32)) ^ c1 ^ k0
        c2 = ((np.uint64(0xD2511F53) * prev0) >> np.uint64(32)) ^ c3 ^ k1
        c1 = (prev2 * np.uint64(0xCD9E8D57)) & m32
        c3 = (prev0 * np.uint64(0xD2511F53)) & m32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    slot = (cols % np.uint64(8)).astype(np.int64)  # tl.join interleaves: words r0 r2 r1 r3
    words = np.stack([c0, c2, c1, c3])[
        slot[None, :] // 2, np.arange(len(keys))[:, None], np.arange(len(cols))[None, :]
    ]
    draws = (words >> (np.uint64(16) * (cols % np.uint64(2)))[None, :]) & np.uint64(0xFFFF)
    threshold = np.uint64(np.float32(p) * np.float32(65536.0) + np.float32(0.5))
    return torch.from_numpy(draws >= threshold)


def test_fused_dropout_keep_mask_matches_numpy_philox(device, make_layout):
    """The default mask is Philox of (row, column): pinned by an independent oracle."""
    layout = make_layout([30, 21], device, seed=6)
    keep = fused_dropout_keep_mask(layout, [0.3, 0.3], 44, layer_seed=2, device=device)
    want = _philox_keep_mask(mixed_seed(6, 2), np.arange(51), np.arange(44), 0.3)
    assert torch.equal(keep.cpu(), want), "fused mask differs from the Philox oracle"


def test_fused_dropout_keep_mask_keys_rows_by_sample_and_position(device):
    """A job keys each row by its sample's key plus its position (keys above 32 bits here):
    the fused mask is the oracle's of those keys, so a sample draws the same mask wherever
    it is packed."""
    keys = [2**40 + 3, 17]
    layout = AdapterLayout.from_samples(
        [0, 1], [6, 9], 2, device=device, dropout_seed=4, sample_keys=keys
    )
    keep = fused_dropout_keep_mask(layout, [0.4, 0.4], 24, layer_seed=1, device=device)
    row_keys = np.array([keys[0] + i for i in range(6)] + [keys[1] + i for i in range(9)])
    want = _philox_keep_mask(mixed_seed(4, 1), row_keys, np.arange(24), 0.4)
    assert torch.equal(keep.cpu(), want), "rows must be keyed by sample key + position"
    alone = AdapterLayout.from_samples([0], [9], 1, device=device, dropout_seed=4, sample_keys=[17])
    keep_alone = fused_dropout_keep_mask(alone, [0.4], 24, layer_seed=1, device=device)
    assert torch.equal(keep[6:], keep_alone), "a sample's mask must not depend on its microbatch"


@pytest.mark.parametrize(("start", "end"), [(0, 25), (25, 80), (13, 61), (78, 80)])
def test_fused_dropout_keep_mask_shard_gets_rows_of_whole(start, end, device, make_layout):
    layout = make_layout([50, 0, 30], device, seed=9)
    dropouts = [0.3, 0.5, 0.2]
    whole = fused_dropout_keep_mask(layout, dropouts, 40, layer_seed=4, device=device)
    shard = layout.shard(start, end)
    got = fused_dropout_keep_mask(shard, dropouts, 40, layer_seed=4, device=device)
    assert torch.equal(got, whole[start:end]), "a shard must draw its rows of the whole mask"
    nested = shard.shard(1, end - start)
    got = fused_dropout_keep_mask(nested, dropouts, 40, layer_seed=4, device=device)
    assert torch.equal(got, whole[start + 1 : end]), "a shard of a shard keeps its rows' keys"


@pytest.mark.parametrize(
    ("counts", "width", "dropouts", "seed"),
    [
        ([30, 21], 44, [0.3, 0.3], 6),
        ([50, 0, 30], 40, [0.3, 0.5, 0.2], 9),
        ([17, 5, 64], 264, [0.1, 0.0, 0.9], 2**40 + 7),  # seed above 32 bits, p = 0 and 0.9
    ],
)
def test_reference_mask_is_the_fused_mask(counts, width, dropouts, seed, device, make_layout):
    # The torch Philox of the reference path and the kernels' Triton Philox, bit for bit
    # (the fused one is pinned to a NumPy oracle above), whole and on a row shard.
    layout = make_layout(counts, device, seed=seed)
    fused = fused_dropout_keep_mask(layout, dropouts, width, layer_seed=5, device=device)
    ref = dropout_keep_mask(layout, dropouts, width, layer_seed=5, device=device)
    assert torch.equal(ref, fused.bool()), "the reference and fused masks differ"
    shard = layout.shard(3, layout.num_tokens - 2)
    assert torch.equal(dropout_keep_mask(shard, dropouts, width, 5, device), ref[3:-2]), (
        "a shard of the reference mask must be its rows of the whole"
    )
