"""FlexAttention for packed microbatches: a document-causal (optionally sliding-window) mask.

The ``BlockMask`` is built by block arithmetic on ``cu_seqlens``, never a ``T x T`` mask, and
shared by every layer of a microbatch (`document_causal_block_mask`); `VarlenCoreAttention`
(``mcore.attention``) calls `varlen_causal_attention_flex` where FlashAttention's varlen op is
missing or when it is forced (``flex``). torch >= 2.5; the compiled kernels run on CUDA.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["document_causal_block_mask", "varlen_causal_attention_flex"]

_FLEX_BLOCK = 128  # FlexAttention's default sparse block: (T/128)² blocks per microbatch
# cu_seqlens tensor -> (tokens, {window: BlockMask}), an entry living as long as its tensor:
# every layer of a microbatch attends with the masks built for the first.
_BLOCK_MASKS = WeakIdKeyDictionary()


def _ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 1, n) counts and (1, 1, n, n) int32 indices, listed first, of a (n, n) block map."""
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None], indices.to(torch.int32)[None, None]


def document_causal_block_mask(
    cu_seqlens: torch.Tensor, tokens: int, window: int | None = None
) -> BlockMask:
    """FlexAttention's ``BlockMask``: q attends to kv iff same sample and 0 <= q - kv < window.

    Without a window, kv <= q is the whole rule. Built by block arithmetic on ``cu_seqlens``
    (no ``T x T`` mask, no host sync) and cached for the ``cu_seqlens`` tensor and window, so
    the layers of one microbatch share it.

    Args:
        cu_seqlens: (S + 1,) int32 token offset of each sample (equal offsets: empty samples).
        tokens: ``T`` = ``cu_seqlens[-1]``, known on the host.
        window: sliding window ``W`` in tokens, or None (causal).

    Returns:
        The ``(T, T)`` block mask.
    """
    cached = _BLOCK_MASKS.get(cu_seqlens)
    if cached is not None and cached[0] == tokens and window in cached[1]:
        return cached[1][window]
    from torch.nn.attention.flex_attention import BlockMask

    blocks = -(-tokens // _FLEX_BLOCK)
    index = torch.arange(blocks * _FLEX_BLOCK, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # sample id of every token; the padding past T is one more sample, so tail blocks are
    # never full and mask_mod never indexes out of range
    doc = torch.searchsorted(cu_seqlens[1:], index, right=True, out_int32=True)
    first, last = doc[::_FLEX_BLOCK], doc[_FLEX_BLOCK - 1 :: _FLEX_BLOCK]  # (n,) per block
    block = torch.arange(blocks, device=doc.device)
    below = block[None, :] < block[:, None]  # [q block, kv block]: kv block entirely earlier
    # samples are contiguous and in order: an earlier kv block meets the q block's first
    # sample iff that is its last one, and is all one sample with the q block iff its first
    # sample is the q block's last
    full = below & (first[None, :] == last[:, None])
    touched = below & (last[None, :] == first[:, None])
    if window is not None:  # q - kv over a block pair spans [(d-1)·B + 1, (d+1)·B - 1]
        apart = (block[:, None] - block[None, :]) * _FLEX_BLOCK
        full &= apart + _FLEX_BLOCK - 1 < window
        touched &= apart - _FLEX_BLOCK + 1 < window
    touched |= torch.eye(blocks, dtype=torch.bool, device=doc.device)

    def mask_mod(b, h, q_idx, kv_idx):
        causal = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return causal if window is None else causal & (q_idx - kv_idx < window)

    mask = BlockMask.from_kv_blocks(
        *_ordered_blocks(touched & ~full),
        *_ordered_blocks(full),
        BLOCK_SIZE=_FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(tokens, tokens),
    )
    if cached is None or cached[0] != tokens:
        cached = (tokens, {})
        _BLOCK_MASKS[cu_seqlens] = cached
    cached[1][window] = mask
    return mask


@functools.cache
def _compiled_flex_attention():
    """``torch.compile``'d flex_attention: uncompiled, it materialises the scores.

    A second sequence length recompiles it with dynamic shapes (torch.compile's default).
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def varlen_causal_attention_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention inside each packed sample, one FlexAttention call (CUDA).

    Same arguments as `varlen_causal_attention_ref` without dropout; the block mask comes
    from `document_causal_block_mask`. Query head ``j`` reads KV group ``j // (np / ng)``.

    Returns:
        (T, np, d) attention output.
    """
    block_mask = document_causal_block_mask(cu_seqlens, query.shape[0], window)
    # (T, heads, d) -> (1, heads, T, d): views, no copies
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    out = _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # (T, np, d)
