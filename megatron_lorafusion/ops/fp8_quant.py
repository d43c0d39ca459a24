"""Row-wise FP8 (e4m3) quantization of the frozen base: weights once, activations on the fly.

``q[t, :] = round_e4m3(v[t, :] / 2^k_t)``, one power-of-two scale ``2^k_t`` per row, the
smallest with ``max_d |v[t, d]| / 2^k_t <= 448`` (e4m3's largest finite value), rounded to
nearest even. A weight (N, H) gets one scale per output channel (row), an activation (T, H)
one per token (row); an incoming gradient (T, N) is first multiplied by the weight's channel
scales (``col_scale``), which moves them out of the contraction of ``dX = dY·W``
(docs/fp8.md). Powers of two make dequantization exact and let the kernel and the torch
reference compute the same scale with integer operations, bit for bit.

A tensor's producer may quantize it as it writes it and hand the result to the FP8 linear
that reads it (`attach_quantized`, `take_quantized`: the SwiGLU and RMSNorm kernels under an
FP8 base), or hand over only its rows' largest magnitudes (`attach_row_maxima`: SwiGLU's
backward), so that the consumer quantizes in a pass it makes anyway (`lora_up_bwd_quantized`);
`pow2_row_scales`, `store_quantized_rows`, `quantize_row_blocks` and `inverse_pow2` are the
Triton helpers such kernels share with the quantizer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from megatron_lorafusion.ops import _utils
from megatron_lorafusion.ops._utils import triton
from megatron_lorafusion.ops.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight

_AMAX_FLOOR = 2.0**-100  # an all-zero (or subnormal) row gets scale 2^-108, not inf or NaN
_QUANTIZED = "_lorafusion_fp8"  # tensor attribute: the `_Handover` its producer left
_GRAD_COL_SCALE = "_lorafusion_fp8_grad_col_scale"  # tensor attribute: its gradient's col_scale


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """(R,) fp32 ``2^k``: the smallest power of two with ``amax / 2^k <= FP8_MAX``.

    With ``amax = m·2^E``, ``m`` in [1, 2): ``k = E − 8``, or ``E − 7`` when ``m > 1.75``
    (448 = 1.75·2^8). Integer operations on the fp32 bits, as the kernel does them.
    """
    bits = amax.float().clamp(min=_AMAX_FLOOR).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    k = exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return ((k + 127) << 23).view(torch.float32)


def quantize_rows_ref(
    x: torch.Tensor,
    col_scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_rows` (any device); also quantizes weights at load.

    Args:
        x: (R, D) values, any float dtype.
        col_scale: (D,) fp32 factor applied to every row first, or None.
        amax: (R,) fp32 largest magnitude of each row to scale by (a tensor-parallel shard's
            rows take the whole row's), or None: each row's own.

    Returns:
        ``q`` (R, D) e4m3 and ``scale`` (R,) fp32 powers of two, ``q·scale ≈ x``.
    """
    v = x.float()
    if col_scale is not None:
        v = v * col_scale.float()[None, :]
    if amax is None:
        amax = v.abs().amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])
    scale = _pow2_scale(amax)
    q = (v * (1.0 / scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(
    weight: torch.Tensor, amax: torch.Tensor | None = None, *, transposed: bool = False
) -> Fp8Weight:
    """`Fp8Weight` of a (N, H) frozen weight: e4m3 rows, one scale per output channel.

    Args:
        weight: (N, H) bf16/fp32 values, on the device the weight will live on.
        amax: (N,) largest magnitude of each whole row (for a row-parallel shard of H), or
            None: this tensor's rows.
        transposed: also keep the (H, N) transposed copy for the backward.
    """
    data, scale = quantize_rows_ref(weight, amax=amax)
    return Fp8Weight(data, scale, data.t().contiguous() if transposed else None)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _e4m3_grid(v):
        """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even.

        Done with integer operations so that the final cast is exact on every backend:
        Triton's interpreter (3.8) rounds values whose mantissa carries into the exponent
        wrongly (126.04 -> 64). On a GPU the kernel casts with the hardware instead, which
        rounds the same way in one instruction (``HW_CAST``).
        """
        bits = v.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mag = bits & 0x7FFFFFFF
        # Normal e4m3 (|v| >= 2^-6): keep 3 of 23 mantissa bits, round the 20 dropped ones.
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
        # Subnormal e4m3 (|v| < 2^-6): multiples of 2^-9.
        a = tl.abs(v) * 512.0  # exact, < 8
        whole = tl.floor(a)
        frac = a - whole
        odd = (whole.to(tl.int32) & 1) == 1
        up = (frac > 0.5) | ((frac == 0.5) & odd)
        sub = ((whole + up.to(tl.float32)) * (1.0 / 512.0)).to(tl.uint32, bitcast=True)
        out = tl.where(mag < 0x3C800000, sub, normal) | sign  # 0x3C800000 = 2^-6
        return out.to(tl.float32, bitcast=True)

    @triton.jit
    def _load_rows(x_rows, col_ptr, cols, ok, D, HAS_COL_SCALE: tl.constexpr):
        """(BLOCK_R, BLOCK_D) fp32 values of ``cols`` of the rows, times the column scales."""
        v = tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            v = v * tl.load(col_ptr + cols, mask=cols < D, other=0.0)[None, :]
        return v

    @triton.jit
    def store_quantized_rows(q_rows, cols, ok, v, inv, HW_CAST: tl.constexpr):
        """Store ``v / scale`` of the rows in e4m3 (or its grid values in fp32)."""
        v = tl.minimum(tl.maximum(v * inv[:, None], -448.0), 448.0)
        if HW_CAST:  # cvt.rn.satfinite: to nearest even, as `_e4m3_grid`
            q = v.to(tl.float8e4nv)
        else:
            q = _e4m3_grid(v).to(q_rows.dtype.element_ty)
        tl.store(q_rows + cols[None, :], q, mask=ok)

    @triton.jit
    def quantize_row_blocks(
        x_rows,
        col_ptr,
        q_rows,
        row_ok,
        D,
        inv,
        HAS_COL_SCALE: tl.constexpr,
        HW_CAST: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Store the rows' ``D`` values (times the column scales) times ``inv`` in e4m3.

        ``BLOCK_D`` columns a step: the pass that follows the rows' largest magnitudes.
        """
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (cols < D)[None, :]
            v = _load_rows(x_rows, col_ptr, cols, ok, D, HAS_COL_SCALE)
            store_quantized_rows(q_rows, cols, ok, v, inv, HW_CAST)

    @triton.jit
    def pow2_row_scales(amax):
        """``2^k`` and ``2^-k`` from the bits of each row's largest magnitude (`_pow2_scale`)."""
        bits = tl.maximum(amax, 7.888609052210118e-31).to(tl.int32, bitcast=True)  # 2^-100
        k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
        return scale, inv

    @triton.jit
    def inverse_pow2(scale):
        """``1 / scale`` of `pow2_row_scales`' normal powers of two, exactly (from the bits)."""
        return ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)

    @triton.jit(do_not_specialize=["R"])  # the token count: one compiled kernel for all
    def _quantize_rows_kernel(
        x_ptr,
        col_ptr,
        parts_ptr,
        q_ptr,
        scale_ptr,
        R,
        D,
        NUM_PARTS,
        stride_xr,
        stride_qr,
        HAS_COL_SCALE: tl.constexpr,
        HAS_PARTS: tl.constexpr,
        HW_CAST: tl.constexpr,
        ONE_PASS: tl.constexpr,
        SCALES_ONLY: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qr
        if ONE_PASS:  # BLOCK_D >= D: the rows held in registers, read once
            cols = tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (cols < D)[None, :]
            v = _load_rows(x_rows, col_ptr, cols, ok, D, HAS_COL_SCALE)
            scale, inv = pow2_row_scales(tl.max(tl.abs(v), axis=1))
            tl.store(scale_ptr + rows, scale, mask=row_ok)
            store_quantized_rows(q_rows, cols, ok, v, inv, HW_CAST)
        else:
            if HAS_PARTS:  # the producer's maxima of column blocks: no pass of our own
                parts = tl.arange(0, BLOCK_P)
                part_ok = row_ok[:, None] & (parts < NUM_PARTS)[None, :]
                part_rows = parts_ptr + rows.to(tl.int64)[:, None] * NUM_PARTS
                amax = tl.max(tl.load(part_rows + parts[None, :], mask=part_ok, other=0.0), axis=1)
            else:
                amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
                for d0 in range(0, D, BLOCK_D):  # pass 1: each row's largest magnitude
                    cols = d0 + tl.arange(0, BLOCK_D)
                    ok = row_ok[:, None] & (cols < D)[None, :]
                    v = _load_rows(x_rows, col_ptr, cols, ok, D, HAS_COL_SCALE)
                    amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
            scale, inv = pow2_row_scales(amax)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
            if not SCALES_ONLY:  # pass 2: the rows again (from L2), quantized
                quantize_row_blocks(
                    x_rows, col_ptr, q_rows, row_ok, D, inv, HAS_COL_SCALE, HW_CAST, BLOCK_D
                )


# Memory-bound. A row of up to 8192 values is read once (held in registers); a longer one
# twice (its maximum, then its values, mostly from L2). Blocks from device run 2 of the
# twenty-first session (8192 rows of the 8B microbatch's widths, against 4 x 1024 in two
# passes): 4096 columns 1.32-1.63x faster in one pass, 6144 1.18x, 14336 1.44x with one row
# of 4096 columns a step; 28672 kept 4 x 1024 (its rows pass L2 otherwise).
_INTERPRETER_BLOCKS = (2, 16)


def _gpu_blocks(width: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of a program for rows of ``width`` values."""
    if width <= 8192:
        return 2, 1 << (width - 1).bit_length(), 8
    if width <= 16384:
        return 1, 4096, 8
    return 4, 1024, 4


def quantize_rows_fwd(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    col_scale: torch.Tensor | None,
    amax_parts: torch.Tensor | None = None,
) -> None:
    """Launch the row quantization into ``q`` (R, D) and ``scale`` (R,), inputs checked.

    ``q`` is e4m3, or fp32 in tests: the kernel rounds to the e4m3 grid itself, so an fp32
    ``q`` holds the exact values the e4m3 one would. An e4m3 ``q`` on a GPU is cast by the
    hardware (the same values in one instruction instead of ~25 integer operations: 37 ms
    of an 8B microbatch's quantization became 23 ms, docs/fp8.md). ``amax_parts`` (R, P)
    fp32, the largest ``|x·col_scale|`` of P column blocks of each row as ``x``'s producer
    found them, saves the pass that finds each row's largest magnitude (rows held in
    registers find it without a pass of their own and ignore them).
    """
    rows, width = x.shape
    if rows == 0:
        return
    if x.is_cuda:
        block_r, block_d, warps = _gpu_blocks(width)
    else:
        (block_r, block_d), warps = _INTERPRETER_BLOCKS, 4
    num_parts = 0 if amax_parts is None else amax_parts.shape[1]
    _quantize_rows_kernel[(_utils.cdiv(rows, block_r),)](
        x,
        col_scale if col_scale is not None else scale,
        amax_parts if amax_parts is not None else scale,
        q,
        scale,
        rows,
        width,
        num_parts,
        x.stride(0),
        q.stride(0),
        HAS_COL_SCALE=col_scale is not None,
        HAS_PARTS=amax_parts is not None,
        HW_CAST=x.is_cuda and q.dtype == FP8_DTYPE,
        ONE_PASS=block_d >= width,
        SCALES_ONLY=False,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BLOCK_P=max(1 << (num_parts - 1).bit_length(), 2),
        num_warps=warps,
    )


def row_scales_from_maxima(amax_parts: torch.Tensor, scale: torch.Tensor) -> None:
    """Write into ``scale`` (R,) the row scales `quantize_rows` gives those rows.

    ``amax_parts`` (R, P) fp32 holds the largest magnitudes (times the column scales) of P
    column blocks of each row, as the rows' producer found them.
    """
    rows, parts = amax_parts.shape
    if rows == 0:
        return
    block_r = 64 if amax_parts.is_cuda else _INTERPRETER_BLOCKS[0]
    _quantize_rows_kernel[(_utils.cdiv(rows, block_r),)](
        amax_parts,  # x, col_scale and q are not read: the maxima are all it needs
        scale,
        amax_parts,
        scale,
        scale,
        rows,
        0,
        parts,
        0,
        0,
        HAS_COL_SCALE=False,
        HAS_PARTS=True,
        HW_CAST=False,
        ONE_PASS=False,
        SCALES_ONLY=True,
        BLOCK_R=block_r,
        BLOCK_D=16,
        BLOCK_P=max(1 << (parts - 1).bit_length(), 2),
    )


def empty_quantized(
    rows: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised ``q`` (rows, width) e4m3 and ``scale`` (rows,) fp32 for a row quantization."""
    q = torch.empty(rows, width, dtype=FP8_DTYPE, device=device)
    return q, torch.empty(rows, dtype=torch.float32, device=device)


def quantize_rows(
    x: torch.Tensor, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to e4m3 with its own power-of-two scale (Triton).

    The same function as `quantize_rows_ref`, bit for bit.

    Args:
        x: (R, D) fp16/bf16/fp32, unit-stride rows.
        col_scale: (D,) fp32 factor applied to every row before quantizing, or None.

    Returns:
        ``q`` (R, D) contiguous e4m3 and ``scale`` (R,) fp32.

    Raises:
        ValueError: on a bad shape, dtype or device (the message names the tensor).
        RuntimeError: when Triton cannot run on ``x``'s device.
    """
    if not _utils.triton_usable(x):
        raise RuntimeError(f"quantize_rows needs Triton on CUDA, got x on {x.device}")
    _utils.check_tensor("x", x, (None, None), _utils.KERNEL_DTYPES, x.device, contiguous=False)
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit-stride rows, got strides {x.stride()}")
    if col_scale is not None:
        _utils.check_tensor("col_scale", col_scale, (x.shape[1],), (torch.float32,), x.device)
    q, scale = empty_quantized(*x.shape, x.device)
    quantize_rows_fwd(x, q, scale, col_scale)
    return q, scale


def _root(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None else x._base


class _Handover(NamedTuple):
    """What a producer left on a tensor's storage owner for the FP8 linear that reads it."""

    q: torch.Tensor | None  # (R, D) e4m3, or None: only the maxima were found
    scale: torch.Tensor | None  # (R,) fp32 powers of two
    amax_parts: torch.Tensor | None  # (R, P) fp32 largest |x·col_scale| of column blocks
    col_scale: torch.Tensor | None  # (D,) fp32 column scales, or None
    version: int  # the storage owner's version when the producer wrote it


def attach_quantized(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, col_scale: torch.Tensor | None = None
) -> None:
    """Hand ``quantize_rows(x, col_scale)``, computed by ``x``'s producer, to its FP8 consumer.

    The producer of ``x`` (the SwiGLU and norm kernels: fc2's input, the residual stream's
    gradient) quantizes while it writes ``x`` and leaves ``(q, scale)`` on ``x``'s storage
    owner (``x`` or its base), so that `take_quantized` finds them from any contiguous view of
    all of ``x``. Nothing is attached to an inference tensor (it keeps no version to check).

    Args:
        x: (R, D) the values, as written.
        q: (R, D) e4m3, ``quantize_rows(x, col_scale)``'s.
        scale: (R,) fp32 powers of two.
        col_scale: (D,) fp32 column scales applied before quantizing, or None.
    """
    root = _root(x)
    if not root.is_inference():
        setattr(root, _QUANTIZED, _Handover(q, scale, None, col_scale, root._version))


def attach_row_maxima(x: torch.Tensor, amax_parts: torch.Tensor, col_scale: torch.Tensor) -> None:
    """Hand the largest magnitudes of ``x``'s rows, found by its producer, to its FP8 consumer.

    SwiGLU's backward finds, as it writes fc1's incoming gradient, the largest
    ``|x·col_scale|`` of each of P column blocks of a row, and quantizes nothing: fc1's LoRA
    backward quantizes in its own pass over ``x`` (`take_row_maxima`,
    `lora_up_bwd_quantized`); any other consumer gets the quantization from `take_quantized`
    in one read of ``x``. Nothing is attached to an inference tensor.

    Args:
        x: (R, D) the values, as written.
        amax_parts: (R, P) fp32 maxima of ``|x·col_scale|`` over P column blocks of each row.
        col_scale: (D,) fp32 column scales.
    """
    root = _root(x)
    if not root.is_inference():
        setattr(root, _QUANTIZED, _Handover(None, None, amax_parts, col_scale, root._version))


def _covers_root(x: torch.Tensor, root: torch.Tensor) -> bool:
    """``x`` is a contiguous view of all of ``root``'s values."""
    return (
        x.is_contiguous()
        and x.dtype == root.dtype
        and x.data_ptr() == root.data_ptr()
        and x.numel() == root.numel()
    )


def _handover(x: torch.Tensor, col_scale: torch.Tensor | None) -> _Handover | None:
    """The hand-over left on ``x`` for these very values and column scales, else None."""
    root = _root(x)
    found = getattr(root, _QUANTIZED, None)
    if (
        found is None
        or found.col_scale is not col_scale
        or root._version != found.version
        or not _covers_root(x, root)
        or x.dim() != 2
        or (found.q is not None and tuple(x.shape) != tuple(found.q.shape))
        or (found.amax_parts is not None and x.shape[0] != found.amax_parts.shape[0])
    ):
        return None
    return found


def take_quantized(
    x: torch.Tensor, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_rows(x, col_scale)`` as the producer handed it over, once; None when absent.

    Only for the very values and scales: a contiguous (R, D) ``x`` covering all of the
    attached tensor, which was not written since (through torch: a write the version counter
    does not see, e.g. by a kernel through a raw pointer, is not detected; none happens between
    the producers and the linears), with the same ``col_scale`` tensor. Where the producer
    left only its rows' maxima (`attach_row_maxima`), the rows are quantized now, in one read.
    The hand-over is dropped (its memory freed) when taken.

    Returns:
        ``(q, scale)``: (R, D) e4m3 and (R,) fp32, or None.
    """
    found = _handover(x, col_scale)
    if found is None:
        return None
    delattr(_root(x), _QUANTIZED)
    if found.q is not None:
        return found.q, found.scale
    q, scale = empty_quantized(*x.shape, x.device)
    quantize_rows_fwd(x, q, scale, col_scale, amax_parts=found.amax_parts)
    return q, scale


def take_row_maxima(x: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor | None:
    """The (R, P) row maxima `attach_row_maxima` left on ``x`` for ``col_scale``, once.

    None where there are none (nothing attached, or a quantization already done), under the
    same conditions as `take_quantized`.
    """
    found = _handover(x, col_scale)
    if found is None or found.amax_parts is None:
        return None
    delattr(_root(x), _QUANTIZED)
    return found.amax_parts


def mark_grad_col_scale(y: torch.Tensor, col_scale: torch.Tensor) -> None:
    """Record on a frozen FP8 linear's output ``y`` that its backward quantizes ``dY·diag(s_w)``.

    A producer of ``dY`` that can quantize (`ops.swiglu_fp8`) reads ``col_scale`` (N,) back
    with `grad_col_scale` and attaches the result for that backward.
    """
    setattr(_root(y), _GRAD_COL_SCALE, col_scale)


def grad_col_scale(x: torch.Tensor) -> torch.Tensor | None:
    """The (N,) column scales `mark_grad_col_scale` left on ``x``'s values, else None.

    None as well for a view of part of them, or a non-contiguous one: its gradient would reach
    the linear as a copy, which `take_quantized` cannot recognise.
    """
    root = _root(x)
    return getattr(root, _GRAD_COL_SCALE, None) if _covers_root(x, root) else None


@functools.lru_cache(maxsize=64)
def unit_scales(width: int, device: str) -> torch.Tensor:
    """(1, width) fp32 ones: the scale of an operand whose scales were folded elsewhere."""
    return torch.ones(1, width, dtype=torch.float32, device=device)
