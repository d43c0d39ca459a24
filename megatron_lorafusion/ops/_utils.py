"""Shared helpers of the Triton ops: availability, input checks, tile-config choice, dropout RNG.

The dropout mask of the fused path is counter-based (Philox, see `keep_mask_tile`): element
``(t, h)`` is keyed by its row's key (``layout.row_keys``: what the token is, not where it sits)
and its column in the layer's full input width (``col_offset + h`` for a tensor-parallel shard
of columns), so any kernel, at any tiling, on any shard and in any microbatch, regenerates the
same mask from ``(layout.dropout_seed, layer_seed)``.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency of the CUDA path only
    triton = None
    tl = None

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (microbatch, layer) seeds apart
_MAX_RANK = 256  # largest padded rank the kernels keep in registers
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(x: torch.Tensor) -> bool:
    """True when the fused Triton path can run on ``x``'s device."""
    if triton is None:
        return False
    return x.is_cuda or interpreter_enabled()


def mixed_seed(dropout_seed: int, layer_seed: int) -> int:
    """Philox seed of one layer in one microbatch, in ``[0, 2**63)``."""
    return (dropout_seed * _SEED_MIX + layer_seed) % (2**63)


def padded_rank(rank: int) -> int:
    """``BLOCK_R``: the rank rounded up to a power of two, at least 16 (``tl.dot``'s minimum)."""
    if not 1 <= rank <= _MAX_RANK:
        raise NotImplementedError(f"LoRA rank must lie in [1, {_MAX_RANK}], got R={rank}")
    return max(16, 1 << (rank - 1).bit_length())


def mask_width(width: int, col_offset: int, full_width: int | None) -> int:
    """Width of the dropout mask whose columns ``col_offset:col_offset + width`` a shard uses.

    Args:
        width: the shard's columns (``H_l``).
        col_offset: index of the shard's column 0 in the full-width input.
        full_width: the layer's full input width, or None for ``width`` (no column shard).

    Returns:
        The full width (the mask's columns, which key its Philox counters, are numbered in it).

    Raises:
        ValueError: when the shard's columns do not lie inside ``[0, full_width)``.
        NotImplementedError: for a ``col_offset`` that is not a multiple of 8 (the kernels draw
            eight columns per Philox call, in groups that start at multiples of 8).
    """
    full = width if full_width is None else int(full_width)
    if col_offset < 0 or col_offset + width > full:
        raise ValueError(
            f"columns [{col_offset}, {col_offset + width}) of the dropout mask must lie in "
            f"[0, full_width={full})"
        )
    if col_offset % 8:
        raise NotImplementedError(
            f"the fused dropout mask needs col_offset to be a multiple of 8, got {col_offset}"
        )
    return full


def copy_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t``, a CPU tensor, on ``device``, copied without a host sync on CUDA.

    A copy from pageable host memory makes CUDA wait for every kernel queued before it (a
    stream sync), so the host stops running ahead of the GPU at each such copy; staging
    through pinned memory (torch's caching host allocator keeps a block until its copy is
    done) makes the copy asynchronous.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host, read without stalling the host.

    On CUDA the copy into pinned memory is queued on the current stream now and `tolist`
    waits for the work queued up to that copy, not after it; so a value read one step later
    costs no wait, where ``t.tolist()`` then would wait for everything queued since.
    """

    def __init__(self, t: torch.Tensor):
        self._done: torch.cuda.Event | None = None
        if t.device.type != "cuda":
            self._host = t.detach().clone()
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t.detach(), non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def tolist(self) -> list:
        """The values, as ``Tensor.tolist`` gives them (waits for the copy, once)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host.tolist()


_DEVICE_PARAMS: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # least recent first
_DEVICE_PARAMS_KEPT = 256


def device_params(values: tuple[float, ...], device: str) -> torch.Tensor:
    """(A,) fp32 copy of per-adapter scalars on ``device``, cached (one H2D copy per run).

    The 256 most recently used copies are cached; a CUDA graph keeps the ones it may read
    alive (`cached_device_params`).
    """
    key = (values, str(device))
    copy = _DEVICE_PARAMS.get(key)
    if copy is None:
        copy = copy_to_device(torch.tensor(values, dtype=torch.float32), device)
        _DEVICE_PARAMS[key] = copy
        if len(_DEVICE_PARAMS) > _DEVICE_PARAMS_KEPT:
            _DEVICE_PARAMS.popitem(last=False)
    else:
        _DEVICE_PARAMS.move_to_end(key)
    return copy


def cached_device_params() -> list[torch.Tensor]:
    """Every cached `device_params` copy (what a CUDA graph captured now may read)."""
    return list(_DEVICE_PARAMS.values())


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` costs ~3 µs a call in triton 3.8)."""
    return -(-a // b)


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    contiguous: bool = True,
) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` has the shape, dtype and device given.

    ``None`` in ``shape`` accepts any size. Tensors must also be contiguous unless
    ``contiguous`` is False (operands the kernels read through their strides).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(
        s is not None and s != d for s, d in zip(shape, t.shape, strict=True)
    ):
        want = tuple("?" if s is None else s for s in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {tuple(dtypes)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")


def check_dropouts(dropouts: torch.Tensor | None, adapters: int, device: torch.device) -> None:
    """Check a launch's optional ``dropouts``: (A,) fp32 per adapter on ``device``, or None."""
    if dropouts is not None:
        check_tensor("dropouts", dropouts, (adapters,), (torch.float32,), device)


@dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch options of one kernel launch.

    Attributes:
        block_t: rows (tokens) per tile.
        block_d: columns of the wide dimension (H or N) per step.
        num_warps: warps per program.
        num_stages: software-pipelining depth.
    """

    block_t: int
    block_d: int
    num_warps: int
    num_stages: int


def is_hopper(device: torch.device) -> bool:
    """True on compute capability 9.x (H100, H200), where the hand-picked tiles apply."""
    return device.type == "cuda" and _capability(device.index)[0] == 9


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(index: int | None) -> tuple[int, int]:
    """``(major, minor)`` compute capability of CUDA device ``index`` (cached)."""
    return _capability(index)


@functools.lru_cache(maxsize=16)
def sm_count(index: int | None) -> int:
    """Multiprocessors of CUDA device ``index`` (cached: launchers call this every step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def chunk_rows(
    tokens: int, width: int, cfg: TileConfig, device: torch.device, programs_per_sm: int
) -> int:
    """Rows per chunk of a split-T reduction (`lora_wgrad`, `lora_up_bwd`).

    A multiple of ``cfg.block_t`` giving ~``programs_per_sm`` programs per SM over the
    ``width / block_d`` column tiles; the interpreter gets several chunks per adapter.
    """
    if device.type != "cuda":
        return 2 * cfg.block_t
    sms = sm_count(device.index)
    d_tiles = cdiv(width, cfg.block_d)
    rows = cdiv(tokens * d_tiles, programs_per_sm * sms)
    return max(cfg.block_t, cdiv(rows, cfg.block_t) * cfg.block_t)


_TUNED: dict[tuple, TileConfig] = {}


def pick_config(
    name: str,
    key: tuple,
    device: torch.device,
    hopper: Callable[[tuple], TileConfig],
    candidates: Sequence[TileConfig],
    run: Callable[[TileConfig], None],
) -> TileConfig:
    """Choose the tile config of kernel ``name`` for problem ``key``.

    Hopper uses the hand-picked ``hopper(key)``; the interpreter uses the first candidate;
    any other GPU times every candidate once per ``key`` (``run`` launches the kernel,
    which must be idempotent) and keeps the fastest. Never raises for an unknown GPU.
    """
    if device.type != "cuda":
        return candidates[0]
    if is_hopper(device):
        return hopper(key)
    cache_key = (name, key, torch.cuda.get_device_name(device))
    if cache_key not in _TUNED:
        timings = []
        for cfg in candidates:
            try:
                timings.append((triton.testing.do_bench(functools.partial(run, cfg)), cfg))
            except Exception:  # noqa: BLE001 - a config that fails to compile is just skipped
                continue
        _TUNED[cache_key] = min(timings, key=lambda tc: tc[0])[1] if timings else candidates[0]
    return _TUNED[cache_key]


if triton is not None:
    _PHILOX_ROUNDS = tl.constexpr(7)  # Philox4x32-7 passes BigCrush (Salmon et al., SC'11)

    @triton.jit
    def philox4x32(c0, c1, c2, seed, N_ROUNDS: tl.constexpr):
        """Philox4x32 of counters ``(c0, c1, c2, 0)`` (uint32) under a 64-bit ``seed``.

        Written out here rather than calling ``tl.randint4x``, whose ``@jit`` wrappers are fixed
        when triton is imported (which breaks the interpreter if it is switched on later), and
        so the mask does not depend on the installed Triton version.
        """
        seed = seed.to(tl.uint64)  # a scalar kernel argument (seed is never specialised)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c3 = c0 ^ c0
        for _ in tl.static_range(N_ROUNDS):
            prev0 = c0
            prev2 = c2
            c0 = tl.math.umulhi(0xCD9E8D57, prev2) ^ c1 ^ k0
            c2 = tl.math.umulhi(0xD2511F53, prev0) ^ c3 ^ k1
            c1 = prev2 * 0xCD9E8D57
            c3 = prev0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3

    @triton.jit
    def _philox_words(seed, keys, col_start, BLOCK_D: tl.constexpr):
        """The four (BLOCK_T, BLOCK_D // 8) uint32 Philox words of ``keys`` × ``BLOCK_D`` columns.

        ``keys`` (BLOCK_T,) int64 are the rows' dropout keys; the columns are ``col_start ..
        col_start + BLOCK_D``, ``col_start`` a multiple of 8. Counter ``(d // 8, key)`` covers
        columns ``8·(d // 8) ..+8`` of a row; its words ``r0..r3`` hold their eight 16-bit
        draws, column ``8g + j`` taking half ``j % 2`` (low first) of word ``(r0, r2, r1,
        r3)[j // 2]`` (the order `_keep_from_words` joins them in). The counters' columns come
        from the scalar start, not from a column vector: reducing a vector to one counter per
        eight columns cost a layout conversion (a shared-memory round trip and two barriers)
        in every loop step.
        """
        group = col_start // 8 + tl.arange(0, BLOCK_D // 8)  # one counter per 8 columns
        keys = keys.to(tl.int64)
        c0 = tl.broadcast_to(group[None, :], (keys.shape[0], BLOCK_D // 8)).to(tl.uint32)
        c1 = tl.broadcast_to((keys & 0xFFFFFFFF)[:, None], c0.shape).to(tl.uint32)
        c2 = tl.broadcast_to((keys >> 32)[:, None], c0.shape).to(tl.uint32)
        return philox4x32(c0, c1, c2, seed, _PHILOX_ROUNDS)

    @triton.jit
    def _drop_threshold(p):
        """16-bit draws below this are dropped: ``p`` rounded to 1/65536."""
        return (p * 65536.0 + 0.5).to(tl.uint32)

    @triton.jit
    def _keep_from_words(r0, r1, r2, r3, p, BLOCK_D: tl.constexpr):
        """(BLOCK_T, BLOCK_D) keep-mask from the words of `_philox_words`."""
        BLOCK_T: tl.constexpr = r0.shape[0]
        words = tl.join(tl.join(r0, r1), tl.join(r2, r3)).reshape(BLOCK_T, BLOCK_D // 8, 4)
        halves = tl.join(words & 0xFFFF, words >> 16)  # (BLOCK_T, G, 4, 2), 16-bit draws
        return halves.reshape(BLOCK_T, BLOCK_D) >= _drop_threshold(p)

    @triton.jit
    def keep_mask_tile(seed, keys, col_start, p, BLOCK_D: tl.constexpr):
        """(BLOCK_T, BLOCK_D) dropout keep-mask (True keeps) of a tile of a ``(T, D)`` input.

        The tile is the rows whose dropout keys are ``keys`` (BLOCK_T,) int64 (`AdapterLayout.
        row_keys`) × columns ``col_start .. col_start + BLOCK_D``, ``col_start`` a multiple of 8.

        One Philox call yields 128 random bits, cut into eight 16-bit draws for eight
        consecutive columns: 8× less integer work than one ``tl.rand`` per element.
        Element ``(t, d)`` uses draw ``d % 8`` of counter ``(d // 8, key_t)``, so any tiling
        whose column blocks start at multiples of 8 regenerates the same mask, and a row's
        mask depends on its key only. The drop threshold is ``p`` rounded to 1/65536 (keep
        probability off by at most 2⁻¹⁷).
        """
        r0, r1, r2, r3 = _philox_words(seed, keys, col_start, BLOCK_D)
        return _keep_from_words(r0, r1, r2, r3, p, BLOCK_D)
