"""The GEMM of design (a) alone on one GPU: the TMA kernel against cuBLAS and the plain kernel.

Run as ``python -m scripts.bench_lora_gemm``: the TMA kernel's tile sweep (``--no-sweep``:
`lora_gemm`'s Hopper tiles), then cuBLAS vs the TMA kernel vs the plain kernel at every
(T, H, N) (GEMM alone, forward with the LoRA epilogue, backward with the dropout epilogue),
after a bf16 correctness check; where the TMA forward reaches ``--fused-threshold`` of cuBLAS
it also times the whole fused op (``--no-fused`` skips it). Shared helpers come from
`scripts.bench_kernels`; docs/kernels.md (a2) quotes the tables.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from megatron_lorafusion.ops import fused_dropout_keep_mask
from megatron_lorafusion.ops._utils import mixed_seed
from megatron_lorafusion.ops.lora_gemm import _TMA_TILE_CONFIGS as TMA_CONFIGS
from megatron_lorafusion.ops.lora_gemm import _launch_tma, lora_gemm, lora_gemm_ref
from megatron_lorafusion.ops.lora_shrink import lora_shrink
from scripts.bench_kernels import (
    ADAPTERS,
    DROPOUTS,
    GEMM_MODULE,
    QUANTILES,
    RANK,
    SHAPES,
    TOKENS,
    bench,
    check_correctness,
    frozen_fn,
    fused_fn,
    fwd_bwd,
    make_problem,
    rel_err,
)

PLAIN_FWD = (128, 256, 64, 8, 3)  # the plain kernel's best tiles (final run of docs/kernels.md)
PLAIN_DROPOUT = (128, 128, 64, 8, 3)
SWEEP_SHAPES = ((16384, 4096, 14336), (16384, 14336, 4096))  # (T, H, N) of the TMA tile sweep
VARIANTS = ("fwd", "dX p=0", "dX p=0.1")  # (direction, dropout) of each swept launch
_VARIANT_ARGS = {"fwd": ("fwd", False), "dX p=0": ("dx", False), "dX p=0.1": ("dx", True)}


def gemm_problem(tokens, hidden, out, adapters=4, p=0.1):
    """`lora_gemm` operands: ``fwd`` (X, Wᵀ, S', Bᵀ) and ``dx`` (dY, W, dS', A)."""
    prob = make_problem(tokens, hidden, out, adapters, p)
    layout = prob["layout"]
    scales = torch.full((adapters,), 2.0, device="cuda")
    drop = torch.full((adapters,), p, device="cuda")
    b_t = prob["lora_b"].transpose(1, 2)  # (A, R, N)
    s = lora_shrink(prob["x"], prob["lora_a"], scales, drop, layout, 1)
    ds = lora_shrink(prob["grad_y"], b_t, scales, None, layout, 1)
    return {
        "fwd": (prob["x"], prob["weight"].t(), s, b_t),
        "dx": (prob["grad_y"], prob["weight"], ds, prob["lora_a"]),
        # dX with a K-major copy of W (Wᵀ contiguous, as the forward reads W): what caching a
        # transposed copy of the frozen weight would buy
        "dx_t": (prob["grad_y"], prob["weight"].t().contiguous().t(), ds, prob["lora_a"]),
        "layout": layout, "drop": drop, "dropouts": prob["dropouts"],
        "flops": 2 * tokens * hidden * out,
    }


def gemm_call(g, direction, cfg, kernel, dropout=False, lora=True):
    """A no-argument launch of one GEMM variant; returns Triton's compiled kernel if any."""
    z, w, s, m = g[direction]
    layout = g["layout"]
    drop = g["drop"] if dropout else None
    seed = mixed_seed(layout.dropout_seed, 1)
    if kernel == "tma":
        # The launcher, so the compiled kernel (registers, spills) comes back; lora=False
        # leaves the LoRA term out of the epilogue (the GEMM alone).
        out = torch.empty(z.shape[0], w.shape[1], dtype=z.dtype, device="cuda")
        return lambda: _launch_tma(z, w, s, m, None, drop, layout, seed, out, cfg, lora=lora)
    return lambda: lora_gemm(z, w, s, m, None, drop, layout, seed, cfg, kernel=kernel)


def time_ms(fn):
    """(median ms, compiled kernel or None); NaN when the variant fails to build or run."""
    try:
        compiled = fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, quantiles=QUANTILES)[0], compiled
    except Exception as exc:  # noqa: BLE001 - e.g. a config out of shared memory
        print(f"<!-- failed: {type(exc).__name__}: {str(exc)[:300]} -->", flush=True)
        return float("nan"), None


def _regs(compiled):
    """``regs/spills`` per thread, plus ``WS`` when the TTGIR holds warp-specialised partitions."""
    if compiled is None:
        return "-"
    ws = " WS" if "ttg.warp_specialize" in compiled.asm.get("ttgir", "") else ""
    return f"{getattr(compiled, 'n_regs', '?')}/{getattr(compiled, 'n_spills', '?')}{ws}"


def gemm_check(g, direction, cfg, kernel, dropout):
    """Relative error of one variant against the fp32 reference with the fused mask."""
    z, w, s, m = g[direction]
    layout, drop = g["layout"], (g["drop"] if dropout else None)
    keep = None
    if dropout:
        keep = fused_dropout_keep_mask(layout, g["dropouts"], w.shape[1], 1, "cuda")
    got = lora_gemm(z, w, s, m, None, drop, layout, mixed_seed(layout.dropout_seed, 1), cfg,
                    kernel=kernel)
    want = lora_gemm_ref(z.float(), w.float(), s.float(), m.float(), None, keep, drop, layout)
    err = rel_err(got, want)
    del want, keep
    return err


def tma_sweep(configs):
    """Time each TMA tile config in each variant at `SWEEP_SHAPES`; {variant: best config}."""
    print(f"\n## TMA tile sweep (A=4, r={RANK}; TFLOP/s, regs/spills per thread, WS = "
          "warp-specialised partitions in the TTGIR)\n")
    print("| T | H | N | config | " + " | ".join(f"{v} regs | {v} TFLOP/s" for v in VARIANTS)
          + " |")
    print("|---|---|---|---|" + "---|---|" * len(VARIANTS))
    total = {(cfg, v): 0.0 for cfg in configs for v in VARIANTS}
    for shape in SWEEP_SHAPES:
        g = gemm_problem(*shape)
        for cfg in configs:
            cells = []
            for v in VARIANTS:
                direction, dropout = _VARIANT_ARGS[v]
                ms, compiled = time_ms(gemm_call(g, direction, cfg, "tma", dropout=dropout))
                total[(cfg, v)] += ms
                cells.append(f"{_regs(compiled)} | {g['flops'] / ms / 1e9:.0f}")
            print(f"| {' | '.join(map(str, shape))} | {cfg.label()} | " + " | ".join(cells)
                  + " |", flush=True)
        del g
        torch.cuda.empty_cache()
    best = {}
    for v in VARIANTS:
        finite = [cfg for cfg in configs if total[(cfg, v)] == total[(cfg, v)]]
        best[v] = min(finite, key=lambda c, v=v: total[(c, v)]) if finite else configs[0]
    return best


def gemm_table(tokens_list, shapes, best):
    """cuBLAS vs TMA vs plain at each shape (TFLOP/s of the frozen product); returns ratios."""
    print(f"\n## GEMM components, TFLOP/s of 2·T·H·N (A=4, r={RANK}; TMA fwd "
          f"{best['fwd'].label()}, dX p=0 {best['dX p=0'].label()}, dX p=0.1 "
          f"{best['dX p=0.1'].label()}; plain fwd {PLAIN_FWD}, plain dX {PLAIN_DROPOUT}; "
          "rel err vs fp32 ref)\n")
    print("| T | H | N | cuBLAS X·Wᵀ | cuBLAS dY·W | TMA GEMM alone | TMA fwd +LoRA "
          "| plain fwd +LoRA | TMA dX +LoRA p=0 | TMA dX p=0.1 | plain dX p=0.1 "
          "| TMA fwd / cuBLAS | TMA dX p=0 / cuBLAS | TMA dX p=0.1 / cuBLAS "
          "| rel err fwd / dX | TMA dX p=0, Wᵀ copy | TMA dX p=0.1, Wᵀ copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for tokens in tokens_list:
        for hidden, out in shapes:
            g = gemm_problem(tokens, hidden, out)
            x, w_t, _, _ = g["fwd"]
            dy, weight, _, _ = g["dx"]
            cells = [
                time_ms(lambda x=x, w=weight: F.linear(x, w))[0],
                time_ms(lambda dy=dy, w=weight: dy @ w)[0],
                time_ms(gemm_call(g, "fwd", best["fwd"], "tma", lora=False))[0],
                time_ms(gemm_call(g, "fwd", best["fwd"], "tma"))[0],
                time_ms(gemm_call(g, "fwd", PLAIN_FWD, "plain"))[0],
                time_ms(gemm_call(g, "dx", best["dX p=0"], "tma"))[0],
                time_ms(gemm_call(g, "dx", best["dX p=0.1"], "tma", dropout=True))[0],
                time_ms(gemm_call(g, "dx", PLAIN_DROPOUT, "plain", dropout=True))[0],
            ]
            errs = (gemm_check(g, "fwd", best["fwd"], "tma", False),
                    gemm_check(g, "dx", best["dX p=0.1"], "tma", True))
            copy = [time_ms(gemm_call(g, "dx_t", best["fwd"], "tma", dropout=d))[0]
                    for d in (False, True)]
            tf = [g["flops"] / ms / 1e9 for ms in cells]
            r = (cells[0] / cells[3], cells[1] / cells[5], cells[1] / cells[6])
            ratios[(tokens, hidden, out)] = r
            print(f"| {tokens} | {hidden} | {out} | " + " | ".join(f"{v:.0f}" for v in tf)
                  + " | " + " | ".join(f"{v:.3f}" for v in r)
                  + f" | {errs[0]:.1e} / {errs[1]:.1e} | "
                  + " | ".join(f"{g['flops'] / ms / 1e9:.0f}" for ms in copy) + " |",
                  flush=True)
            del g
            torch.cuda.empty_cache()
    return ratios


def fused_tma_timings(cells):
    """Whole fused op, forward + backward, with design="triton" on the TMA kernel."""
    print("\n## Fused op with design=\"triton\" on the TMA kernel, forward + backward, median ms\n")
    print("| T | H | N | A | p | frozen | fused cublas | fused triton (TMA) | cublas/frozen "
          "| triton/frozen |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens, hidden, out in cells:
        for adapters in ADAPTERS:
            for p in DROPOUTS:
                prob = make_problem(tokens, hidden, out, adapters, p)
                frozen = bench(*fwd_bwd(prob, frozen_fn(prob), with_lora=False))[0]
                cub = bench(*fwd_bwd(prob, fused_fn(prob, "cublas")))[0]
                tri = bench(*fwd_bwd(prob, fused_fn(prob, "triton")))[0]
                print(f"| {tokens} | {hidden} | {out} | {adapters} | {p} | {frozen:.3f} "
                      f"| {cub:.3f} | {tri:.3f} | {cub / frozen:.3f} | {tri / frozen:.3f} |",
                      flush=True)
                del prob
                torch.cuda.empty_cache()


def gemm_only(tokens_list, shapes, threshold, skip_ws, sweep=True, fused=True):
    """The ``--gemm-only`` run: sweep, components table, then the fused op where TMA is fast."""
    configs = [c for c in TMA_CONFIGS[1:] if not (skip_ws and c.warp_specialize)]
    if sweep:
        best = tma_sweep(configs)
        print("\nbest over the sweep shapes: "
              + ", ".join(f"{v} {cfg.label()}" for v, cfg in best.items()))
    else:  # the module's Hopper tiles
        hopper = GEMM_MODULE._TMA_HOPPER
        best = {"fwd": hopper[(True, False)], "dX p=0": hopper[(False, False)],
                "dX p=0.1": hopper[(False, True)]}
    ratios = gemm_table(tokens_list, shapes, best)
    fast = [cell for cell, r in ratios.items() if r[0] >= threshold]
    print(f"\nTMA forward >= {threshold:.2f} of cuBLAS at: {fast or 'no shape'}")
    if not fast or not fused:
        return True
    GEMM_MODULE._AUTO_KERNEL = "tma"
    GEMM_MODULE._TMA_HOPPER = {
        (True, False): best["fwd"], (True, True): best["fwd"],
        (False, False): best["dX p=0"], (False, True): best["dX p=0.1"],
    }
    ok = check_correctness(8192, sorted({(h, n) for _, h, n in fast}))
    fused_tma_timings(fast)
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one token count, one shape")
    parser.add_argument("--fused-threshold", type=float, default=0.95,
                        help="time the fused op where TMA fwd / cuBLAS >= this")
    parser.add_argument("--skip-ws", action="store_true",
                        help="leave the warp-specialised TMA configs out of the sweep")
    parser.add_argument("--no-sweep", action="store_true",
                        help="use lora_gemm's Hopper tiles instead of sweeping")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused-op timings")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_lora_gemm needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {triton.__version__}")
    shapes = SHAPES[:1] if args.quick else SHAPES
    tokens_list = TOKENS[:1] if args.quick else TOKENS
    if not gemm_only(tokens_list[::-1], shapes, args.fused_threshold, args.skip_ws,
                     sweep=not args.no_sweep, fused=not args.no_fused):
        sys.exit("correctness check failed")


if __name__ == "__main__":
    main()
