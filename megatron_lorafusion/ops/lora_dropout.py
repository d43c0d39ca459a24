"""The fused path's LoRA dropout keep-mask, materialised as a (T, H) bool tensor.

The fused kernels never store this mask: they regenerate it from the Philox seed (see
`_utils.keep_mask_tile`). This op writes it out so tests can feed the very same mask to
`lora_linear_ref`, and so recompute can be checked to draw the same mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.layout import AdapterLayout

if triton is not None:
    import triton.language as tl

    from megatron_lorafusion.ops._utils import keep_mask_tile

    @triton.jit(do_not_specialize=["seed"])
    def _keep_mask_kernel(
        out_ptr,
        tiles_ptr,
        p_ptr,
        keys_ptr,
        seed,
        D,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        adapter = tl.load(tiles_ptr + pid_t * 3)
        row_start = tl.load(tiles_ptr + pid_t * 3 + 1)
        row_end = tl.load(tiles_ptr + pid_t * 3 + 2)
        rows = row_start + tl.arange(0, BLOCK_T)
        col_start = tl.program_id(1) * BLOCK_D
        cols = col_start + tl.arange(0, BLOCK_D)
        p = tl.load(p_ptr + adapter)
        # Rows keyed by their dropout keys, so a shard draws its rows' mask.
        keys = tl.load(keys_ptr + rows, mask=rows < row_end, other=0)
        keep = keep_mask_tile(seed, keys, col_start, p, BLOCK_D)  # p = 0 keeps all
        out = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(out, keep.to(tl.int8), mask=(rows < row_end)[:, None] & (cols < D)[None, :])


_BLOCK_T = 32
_BLOCK_D = 64


def fused_dropout_keep_mask(
    layout: AdapterLayout,
    dropouts: Sequence[float],
    hidden: int,
    layer_seed: int,
    device: torch.device | str,
) -> torch.Tensor | None:
    """The keep-mask the fused path draws for one layer in one microbatch.

    Like `dropout_keep_mask`, row ``t`` is keyed by ``layout.row_keys[t]``, the same as in the whole
    microbatch's mask, so a `AdapterLayout.shard` gets the rows of the unsharded mask; a
    tensor-parallel shard of columns ``c:c + H_l`` uses columns ``c:c + H_l`` of this mask
    drawn at the full width ``hidden``.

    Args:
        layout: the microbatch's adapter layout (its ``dropout_seed`` and ``row_keys`` key
            the mask).
        dropouts: (A,) dropout probability of each adapter, in [0, 1).
        hidden: ``H``, the layer's (full, unsharded) in-features.
        layer_seed: the layer's seed, as passed to `lora_linear`.
        device: a CUDA device, or any device while ``TRITON_INTERPRET=1``.

    Returns:
        (T, H) bool keep-mask (True keeps), or None when no adapter with tokens here uses
        dropout (then the fused path applies no mask at all).

    Raises:
        RuntimeError: when Triton cannot run on ``device``.
    """
    device = torch.device(device)
    counts = layout.token_counts()
    if not any(dropouts[a] > 0 and counts[a] > 0 for a in range(layout.num_adapters)):
        return None
    if not _utils.triton_usable(torch.empty(0, device=device)):
        raise RuntimeError(f"the fused dropout mask needs Triton on CUDA, got device {device}")
    out = torch.empty(layout.num_tokens, hidden, dtype=torch.int8, device=device)
    tiles = layout.tiles(_BLOCK_T, device)
    p = torch.tensor(list(dropouts), dtype=torch.float32, device=device)
    seed = _utils.mixed_seed(layout.dropout_seed, layer_seed)
    grid = (tiles.shape[0], _utils.cdiv(hidden, _BLOCK_D))
    _keep_mask_kernel[grid](
        out, tiles, p, layout.keys(), seed, hidden, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D
    )
    return out.bool()
