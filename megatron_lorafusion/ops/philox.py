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


def _mul_hi_lo(constant: torch.Tensor, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``constant · word`` (both < 2³²), in int64 tensors."""
    high_part = constant * (word >> 16)  # < 2⁴⁸
    low_part = constant * (word & 0xFFFF)  # < 2⁴⁸
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _M32
    return hi, lo


def _philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, seed: int):
    """Philox4x32-7 of counters ``(c0, c1, c2, 0)`` (uint32 words in int64) under a 64-bit seed.

    The two words each round multiplies, ``(c2, c0)``, and the two it xors in, ``(c1, c3)``,
    are stacked, so a round is one pass over both halves.
    """
    multiplied = torch.stack([c2, c0])  # (2, ...)
    xored = torch.stack([c1, torch.zeros_like(c0)])
    shape = (2,) + (1,) * c0.dim()
    multipliers = torch.tensor([_MUL_A, _MUL_B], device=c0.device).view(shape)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    round_keys = [  # (k1, k0) of each round, flipped as the stacked halves are
        [(k1 + r * _WEYL_B) & _M32, (k0 + r * _WEYL_A) & _M32] for r in range(_ROUNDS)
    ]
    round_keys = torch.tensor(round_keys, device=c0.device).view((_ROUNDS, *shape))
    for r in range(_ROUNDS):
        hi, lo = _mul_hi_lo(multipliers, multiplied)
        # c0' = hi_a ^ c1 ^ k0, c2' = hi_b ^ c3 ^ k1; c1' = lo_a, c3' = lo_b
        multiplied, xored = (hi ^ xored).flip(0) ^ round_keys[r], lo
    return multiplied[1], xored[0], multiplied[0], xored[1]


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
    first, last = col_offset // 8, (col_offset + cols - 1) // 8  # Philox calls: 8 columns each
    group = torch.arange(first, last + 1, device=keys.device)
    shape = (keys.shape[0], group.numel())
    c0 = group[None, :].expand(shape)
    c1 = (keys & _M32)[:, None].expand(shape)
    c2 = (keys >> 32)[:, None].expand(shape)
    c0, c1, c2, c3 = _philox4x32(c0, c1, c2, seed)
    # Columns 8g..8g+7 read the words in the order (c0, c2, c1, c3), low half first.
    words = torch.stack([c0, c2, c1, c3], dim=-1)  # (T, G, 4)
    draws = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=-1).flatten(1)  # (T, 8G)
    start = col_offset - 8 * first
    return draws[:, start : start + cols] >= thresholds[:, None]
