"""The dropout keep-mask of the fused kernels, in torch: Philox4x32-7 on 64-bit integer tensors.

The Triton kernels draw element ``(t, d)`` of a ``(T, D)`` input from one Philox call per
eight columns, keyed by the row's dropout key (`_utils.keep_mask_tile`); this is the same
function on any device, so the torch reference and the fused path drop exactly the same
elements. uint32 arithmetic is done in
int64: products of a 32-bit constant and a 32-bit word are split at 16 bits so they never
leave int64's range.
"""

from __future__ import annotations

import torch

__all__ = ["philox_keep_mask"]

_M32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0xCD9E8D57, 0xD2511F53  # Philox4x32 multipliers
_WEYL_A, _WEYL_B = 0x9E3779B9, 0xBB67AE85  # key increments per round
_ROUNDS = 7  # Philox4x32-7 passes BigCrush (Salmon et al., SC'11)


def _mul_hi_lo(constant: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``constant · word`` (both < 2³²), in int64 tensors."""
    high_part = constant * (word >> 16)  # < 2⁴⁸
    low_part = constant * (word & 0xFFFF)  # < 2⁴⁸
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _M32
    return hi, lo


def _philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, seed: int):
    """Philox4x32-7 of counters ``(c0, c1, c2, 0)`` (uint32 words in int64) under a 64-bit seed."""
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_ROUNDS):
        hi_a, lo_a = _mul_hi_lo(_MUL_A, c2)
        hi_b, lo_b = _mul_hi_lo(_MUL_B, c0)
        c0, c1, c2, c3 = hi_a ^ c1 ^ k0, lo_a, hi_b ^ c3 ^ k1, lo_b
        k0, k1 = (k0 + _WEYL_A) & _M32, (k1 + _WEYL_B) & _M32
    return c0, c1, c2, c3


def philox_keep_mask(
    seed: int,
    keys: torch.Tensor,
    width: int,
    thresholds: torch.Tensor,
    col_offset: int = 0,
    cols: int | None = None,
) -> torch.Tensor:
    """Keep-mask of the rows with dropout ``keys`` × columns ``col_offset:col_offset + cols``.

    Element ``(t, d)`` keeps iff the 16-bit draw ``d % 8`` of Philox counter
    ``(d // 8, key_t)`` is ``>=`` its row's threshold (``round(p·65536)``).

    Args:
        seed: the layer's Philox seed (`_utils.mixed_seed`), in ``[0, 2⁶³)``.
        keys: (T,) int64 dropout keys of the rows (`AdapterLayout.row_keys`), non-negative.
        width: ``D``, the full width of the mask (the unsharded in-features).
        thresholds: (T,) int64 drop threshold of each row, in ``[0, 65536]``.
        col_offset: first column.
        cols: columns wanted (default ``width - col_offset``).

    Returns:
        (T, cols) bool, True keeps.
    """
    cols = width - col_offset if cols is None else cols
    col = torch.arange(col_offset, col_offset + cols, device=keys.device)
    shape = (keys.shape[0], cols)
    c0 = (col // 8)[None, :].expand(shape)
    c1 = (keys & _M32)[:, None].expand(shape)
    c2 = (keys >> 32)[:, None].expand(shape)
    c0, c1, c2, c3 = _philox4x32(c0, c1, c2, seed)
    # Columns 8g..8g+7 read the words in the order (c0, c2, c1, c3), low half first.
    words = torch.stack([c0, c2, c1, c3])  # (4, T, cols)
    slot = (col % 8) // 2
    word = words.gather(0, slot.expand_as(c0)[None]).squeeze(0)  # (T, cols)
    draws = (word >> (16 * (col % 2))[None, :]) & 0xFFFF
    return draws >= thresholds[:, None]
