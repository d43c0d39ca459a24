"""Cost of dropout-mask variants inside a shrink-like pass over X, and host cost per launch.

Run as ``python -m scripts.bench_dropout_mask`` on a GPU. docs/kernels.md quotes its table
(the choice of the fused path's mask RNG and of regenerating vs saving mask bits).
"""
import argparse
import functools
import time

import torch
import triton
import triton.language as tl
import triton.testing

from megatron_lorafusion.ops import AdapterLayout
from megatron_lorafusion.ops._utils import (
    _PHILOX_ROUNDS,
    _philox_words,
    keep_bits_from_words,
    keep_mask_and_bits_tile,
    keep_mask_tile,
    philox4x32,
    unpack_keep_bits,
)
from megatron_lorafusion.ops.lora_shrink import lora_shrink
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _keep_mask_bytes(seed, rows, col_start, D, p, BLOCK_D: tl.constexpr):
    """Keep-mask from 8-bit draws: one Philox call per 16 columns (byte m of word q keys
    column 16g + 4q + m), threshold p rounded to 1/256."""
    BLOCK_T: tl.constexpr = rows.shape[0]
    group = col_start // 16 + tl.arange(0, BLOCK_D // 16)
    counters = rows.to(tl.int64)[:, None] * ((D + 15) // 16) + group[None, :]
    r0, r1, r2, r3 = philox4x32(counters.to(tl.uint32), (counters >> 32).to(tl.uint32), seed,
                                _PHILOX_ROUNDS)
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3)).reshape(BLOCK_T, BLOCK_D // 16, 4)
    draws = tl.join(tl.join(words & 0xFF, (words >> 16) & 0xFF),
                    tl.join((words >> 8) & 0xFF, words >> 24))
    return draws.reshape(BLOCK_T, BLOCK_D) >= (p * 256.0 + 0.5).to(tl.uint32)


@triton.jit
def _keep_mask_via_bits(seed, rows, col_start, D, p, BLOCK_D: tl.constexpr):
    """The shipped mask, built as packed bits from the Philox words and then unpacked."""
    r0, r1, r2, r3 = _philox_words(seed, rows, col_start, D, BLOCK_D)
    bits = keep_bits_from_words(r0, r1, r2, r3, p)
    return unpack_keep_bits(bits, BLOCK_D), bits


@triton.jit(do_not_specialize=["seed"])
def _study(x_ptr, a_ptr, out_ptr, bits_ptr, seed, D, R, p, MODE: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        z = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :])
        if MODE == 1:
            keep = keep_mask_tile(seed, rows, d0, D, p, BLOCK_D)
            z = tl.where(keep, z, 0.0)
        elif MODE == 7:
            keep = _keep_mask_bytes(seed, rows, d0, D, p, BLOCK_D)
            z = tl.where(keep, z, 0.0)
        elif MODE == 6:
            if p > 0:
                keep = keep_mask_tile(seed, rows, d0, D, p, BLOCK_D)
                z = tl.where(keep, z, 0.0)
        elif MODE == 2:
            offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
            s = seed.to(tl.uint64)
            x = offs.to(tl.uint32) ^ (s & 0xFFFFFFFF).to(tl.uint32)
            x = _lowbias32(x)
            x = x ^ (offs >> 32).to(tl.uint32) ^ ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
            x = _lowbias32(x)
            z = tl.where(x >= (p * 4294967296.0).to(tl.uint32), z, 0.0)
        elif MODE == 3:
            offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
            r = tl.randint(seed, offs, 7)
            z = tl.where(r >= (p * 4294967296.0).to(tl.uint32), z, 0.0)
        elif MODE == 4:
            g = d0 // 8 + tl.arange(0, BLOCK_D // 8)
            b = tl.load(bits_ptr + rows.to(tl.int64)[:, None] * (D // 8) + g[None, :])
            b = b.to(tl.int32)
            bits = (b[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
            keep = bits.reshape(BLOCK_T, BLOCK_D) != 0
            z = tl.where(keep, z, 0.0)
        elif MODE == 5 or MODE == 9:
            if MODE == 5:
                keep, packed = keep_mask_and_bits_tile(seed, rows, d0, D, p, BLOCK_D)
            else:
                keep, packed = _keep_mask_via_bits(seed, rows, d0, D, p, BLOCK_D)
            z = tl.where(keep, z, 0.0)
            g = d0 // 8 + tl.arange(0, BLOCK_D // 8)
            tl.store(bits_ptr + rows.to(tl.int64)[:, None] * (D // 8) + g[None, :], packed)
        elif MODE == 8:
            keep, _ = _keep_mask_via_bits(seed, rows, d0, D, p, BLOCK_D)
            z = tl.where(keep, z, 0.0)
        m = tl.load(a_ptr + ranks[None, :] * D + cols[:, None], mask=(ranks < R)[None, :],
                    other=0.0)
        acc = tl.dot(z, m, acc)
    tl.store(out_ptr + rows[:, None] * BLOCK_R + ranks[None, :], acc)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", type=int, nargs="+", default=[0, 1, 8, 7, 6, 2, 3, 4, 5, 9],
                        help="mask variants to time (the MODE numbers of `_study`)")
    args = parser.parse_args(argv)
    print("# rng study", torch.cuda.get_device_name(), triton.__version__)
    names = {0: "no mask", 1: "philox8 (shipped)", 6: "philox8 + run-time if p>0",
             2: "2x lowbias32 hash", 3: "tl.randint 7 rounds per elem", 4: "read packed bits",
             5: "philox8 + write bits (shipped)", 7: "philox16, 8-bit draws",
             8: "philox8 via packed bits", 9: "philox8 via packed bits + write bits"}
    for T, H in ((16384, 4096), (16384, 14336)):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, 16, device="cuda", dtype=torch.float32)
        bits = torch.randint(0, 255, (T, H // 8), device="cuda", dtype=torch.uint8)
        for cfg in ((64, 128, 4, 3), (32, 128, 4, 4)):
            bt, bd, w, s = cfg
            for mode in args.modes:
                fn = functools.partial(
                    _study[(T // bt,)], x, a, out, bits, 12345678901, H, 16, 0.1, MODE=mode,
                    BLOCK_T=bt, BLOCK_D=bd, BLOCK_R=16, num_warps=w, num_stages=s,
                )
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
                    print(f"| T={T} H={H} | {cfg} | {names[mode]} | {ms:.4f} ms "
                          f"| {T * H * 2 / ms / 1e9:.2f} TB/s of X |", flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"| {cfg} | {names[mode]} | failed {type(exc).__name__} {str(exc)[:200]}")
    # host overhead per launcher call (tiny problem: launch-bound)
    layout = AdapterLayout.from_samples([0, 1], [64, 64], 2, "cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    la = torch.randn(2, 16, 256, device="cuda", dtype=torch.bfloat16)
    sc = torch.ones(2, device="cuda")
    dp = torch.full((2,), 0.1, device="cuda")
    s16 = lora_shrink(x, la, sc, None, layout, 1)
    grad = torch.empty(2, 256, 16, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("lora_shrink", lambda: lora_shrink(x, la, sc, dp, layout, 1)),
                     ("lora_wgrad", lambda: lora_wgrad(x, s16, grad, dp, layout, 1)),
                     ("raw _study launch", lambda: _study[(4,)](
                         x, la, out, bits, 1, 256, 16, 0.1, MODE=0, BLOCK_T=32, BLOCK_D=256,
                         BLOCK_R=16)),
                     ("torch.empty", lambda: torch.empty(128, 16, device="cuda"))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        print(f"host {name}: {(time.perf_counter() - t0) / 500 * 1e6:.1f} us/call")


if __name__ == "__main__":
    main()
