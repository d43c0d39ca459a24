"""Benchmark of the fused multi-LoRA linear on one GPU: correctness first, then timings.

Run as ``python -m scripts.bench_kernels`` (``--quick`` for one shape, ``--csv PATH`` to append
rows, ``--variants-only`` for the adapter-variant table alone). Forward + backward, W frozen,
bf16, r = 16. Prints markdown tables headed by the GPU name and the torch / triton versions;
docs/kernels.md quotes them. The TMA GEMM alone was benchmarked by the bench_lora_gemm study
(in git history, see docs/kernels.md). The adapter-variant table (issue 19) times, on the
Llama-3.1-8B linear_qkv, the per-forward work of the LoRA wrapper for plain LoRA, DoRA (row
norms of W + sBA, then `dora_scale` on the fused output) and per-projection q/v targets
(rank 2r stacked, B's off-block entries masked each forward). Without CUDA every table is
skipped with the reason.
"""

import argparse
import csv
import sys
from unittest import mock

import torch
import torch.nn.functional as F
import triton
import triton.testing

from megatron_lorafusion.ops import (
    AdapterLayout,
    dora_scale,
    dora_scale_ref,
    dora_weight_norm,
    fused_dropout_keep_mask,
    fused_lora_linear,
    lora_linear_ref,
    weight_sq_norm,
)
from megatron_lorafusion.ops.lora_expand import lora_expand
from megatron_lorafusion.ops.lora_gemm import lora_gemm
from megatron_lorafusion.ops.lora_shrink import lora_shrink
from megatron_lorafusion.ops.lora_up_bwd import lora_up_bwd
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad

FUSED_MODULE = sys.modules["megatron_lorafusion.ops.fused_lora_linear"]
SHRINK_MODULE = sys.modules["megatron_lorafusion.ops.lora_shrink"]
WGRAD_MODULE = sys.modules["megatron_lorafusion.ops.lora_wgrad"]
UP_BWD_MODULE = sys.modules["megatron_lorafusion.ops.lora_up_bwd"]
TOKENS = (8192, 16384)
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (H, N): Llama-3.1-8B projections
ADAPTERS = (1, 4)
DROPOUTS = (0.1, 0.0)
RANK = 16
REL_ERR_MAX = 1e-2
QUANTILES = [0.5, 0.2, 0.8]
REP_MS = 300  # per timing; run-to-run spread on the H200 was ~3-5% at the default 100 ms


def make_problem(tokens, hidden, out, adapters, p, dtype=torch.bfloat16, seed=0, rank=RANK):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = [tokens // adapters] * adapters
    counts[-1] += tokens - sum(counts)
    layout = AdapterLayout.from_samples(
        list(range(adapters)), counts, adapters, "cuda", dropout_seed=seed + 1
    )
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(out, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
    lora_a = (torch.randn(adapters, rank, hidden, device="cuda", generator=gen) / hidden**0.5).to(
        dtype
    )
    lora_b = (torch.randn(adapters, out, rank, device="cuda", generator=gen) / rank**0.5).to(dtype)
    grad_y = torch.randn(tokens, out, device="cuda", generator=gen).to(dtype)
    return {
        "layout": layout,
        "x": x,
        "weight": weight,
        "lora_a": lora_a,
        "lora_b": lora_b,
        "grad_y": grad_y,
        "scalings": [2.0] * adapters,
        "dropouts": [p] * adapters,
    }


def fused_fn(prob, gemm):
    def fn(x, lora_a, lora_b):
        return fused_lora_linear(
            x,
            prob["weight"],
            None,
            lora_a,
            lora_b,
            prob["scalings"],
            prob["dropouts"],
            prob["layout"],
            layer_seed=3,
            gemm=gemm,
        )

    return fn


def _eager_keep_mask(prob, hidden, device):
    """A fresh ``torch.rand`` mask per call, as PEFT's nn.Dropout draws (None without dropout)."""
    if not any(p > 0 for p in prob["dropouts"]):
        return None
    p_rows = torch.tensor(prob["dropouts"], device=device)[prob["layout"].row_adapter(device)]
    return torch.rand(p_rows.numel(), hidden, device=device) >= p_rows[:, None]


def ref_fn(prob, keep=None, draw_mask=True):
    """Eager reference; ``draw_mask`` draws its own torch mask inside (as PEFT's nn.Dropout)."""
    hidden = prob["x"].shape[1]

    def fn(x, lora_a, lora_b):
        mask = _eager_keep_mask(prob, hidden, x.device) if draw_mask else keep
        return lora_linear_ref(
            x,
            prob["weight"],
            None,
            lora_a,
            lora_b,
            prob["scalings"],
            prob["dropouts"],
            prob["layout"],
            mask,
        )

    return fn


class _AugmentedK(torch.autograd.Function):
    """Design (b): ``Y = [X | S_bd]·[W | B_all]ᵀ``, ``[dX | ·] = [dY | dS_bd]·[W ; A_all]``.

    Only for dropout 0 (the masked dX term cannot ride in the GEMM). ``copy`` = build the
    augmented buffers here (what a producer without spare columns costs); without it the
    buffers are assumed written by the producer and only the S / dS columns are filled.
    """

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, weight, layout, scales, bufs):
        tokens, hidden = x.shape
        adapters, rank, _ = lora_a.shape
        s = lora_shrink(x, lora_a, scales, None, layout, 0)
        xa, wa = bufs["xa"], bufs["wa"]
        if bufs["copy"]:
            xa[:, :hidden].copy_(x)
            wa[:, :hidden].copy_(weight)
        wa[:, hidden:].copy_(lora_b.permute(1, 0, 2).reshape(-1, adapters * rank))
        xa[:, hidden:].zero_()
        for a, start, end in layout.segments():
            xa[start:end, hidden + a * rank : hidden + (a + 1) * rank] = s[start:end]
        y = xa @ wa.t()
        ctx.save_for_backward(x, lora_a, lora_b, weight, s, scales)
        ctx.layout, ctx.bufs = layout, bufs
        return y

    @staticmethod
    def backward(ctx, dy):
        x, lora_a, lora_b, weight, s, scales = ctx.saved_tensors
        layout, bufs = ctx.layout, ctx.bufs
        adapters, rank, _ = lora_a.shape
        out = dy.shape[1]
        ds = lora_shrink(dy, lora_b.transpose(1, 2), scales, None, layout, 0)
        grad_b = lora_wgrad(dy, s, torch.empty_like(lora_b), None, layout, 0)
        grad_a = torch.empty_like(lora_a)
        lora_wgrad(x, ds, grad_a.transpose(1, 2), None, layout, 0)
        dya, wt = bufs["dya"], bufs["wt"]
        if bufs["copy"]:
            dya[:, :out].copy_(dy)
            wt[:out].copy_(weight)
        wt[out:].copy_(lora_a.reshape(adapters * rank, -1))
        dya[:, out:].zero_()
        for a, start, end in layout.segments():
            dya[start:end, out + a * rank : out + (a + 1) * rank] = ds[start:end]
        grad_x = dya @ wt
        return grad_x, grad_a, grad_b, None, None, None, None


def augk_fn(prob, copy):
    x, weight, lora_a = prob["x"], prob["weight"], prob["lora_a"]
    tokens, hidden = x.shape
    out, extra = weight.shape[0], lora_a.shape[0] * lora_a.shape[1]
    bufs = {
        "copy": copy,
        "xa": torch.empty(tokens, hidden + extra, device="cuda", dtype=x.dtype),
        "wa": torch.empty(out, hidden + extra, device="cuda", dtype=x.dtype),
        "dya": torch.empty(tokens, out + extra, device="cuda", dtype=x.dtype),
        "wt": torch.empty(out + extra, hidden, device="cuda", dtype=x.dtype),
    }
    bufs["xa"][:, :hidden].copy_(x)
    bufs["wa"][:, :hidden].copy_(weight)
    bufs["dya"][:, :out].copy_(prob["grad_y"])
    bufs["wt"][:out].copy_(weight)
    scales = torch.tensor(prob["scalings"], device="cuda", dtype=torch.float32)

    def fn(x_, lora_a_, lora_b_):
        return _AugmentedK.apply(x_, lora_a_, lora_b_, weight, prob["layout"], scales, bufs)

    return fn


def frozen_fn(prob):
    def fn(x, lora_a, lora_b):
        return F.linear(x, prob["weight"])

    return fn


def fwd_bwd(prob, fn, with_lora=True):
    leaves = [prob["x"].detach().requires_grad_()]
    if with_lora:
        leaves += [prob[k].detach().requires_grad_() for k in ("lora_a", "lora_b")]
    x = leaves[0]
    lora_a, lora_b = (leaves[1], leaves[2]) if with_lora else (prob["lora_a"], prob["lora_b"])
    grad_y = prob["grad_y"]

    def step():
        fn(x, lora_a, lora_b).backward(grad_y)

    return step, leaves


def bench(step, leaves):
    """Median, p20, p80 in ms; NaNs (and the error printed) when the variant fails."""
    try:
        step()  # warm-up: compilation and config choice stay out of the numbers
        torch.cuda.synchronize()
        return triton.testing.do_bench(step, rep=REP_MS, grad_to_none=leaves, quantiles=QUANTILES)
    except Exception as exc:  # noqa: BLE001 - keep the other variants' numbers
        print(f"<!-- failed: {type(exc).__name__}: {str(exc)[:300]} -->", flush=True)
        return [float("nan")] * 3


def bench_graph(step, leaves):
    """GPU-only median ms: forward + backward captured once in a CUDA graph, then replayed.

    Takes host (Python, launch) overhead out of the number; grads accumulate across replays,
    which does not change the work. NaN when the variant cannot be captured.
    """
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()  # warm-up on the side stream, as torch.cuda.graph requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, rep=REP_MS, quantiles=QUANTILES)[0]
    except Exception as exc:  # noqa: BLE001 - e.g. a torch.Generator inside the captured region
        print(f"<!-- graph capture failed: {type(exc).__name__}: {str(exc)[:200]} -->", flush=True)
        ms = float("nan")
    for leaf in leaves:
        leaf.grad = None
    return ms


def saved_bytes_per_token(prob, fn, with_lora=True):
    """Bytes of activations saved for backward (weights excluded), per token."""
    params = {
        t.untyped_storage().data_ptr() for t in (prob["weight"], prob["lora_a"], prob["lora_b"])
    }
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    step, _ = fwd_bwd(prob, fn, with_lora)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    # x itself is kept by the caller anyway only if something else saves it; count it here.
    return sum(seen.values()) / prob["x"].shape[0]


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def grads(prob, fn, cast=None):
    leaves = [prob[k].detach().clone() for k in ("x", "lora_a", "lora_b")]
    if cast is not None:
        leaves = [t.to(cast) for t in leaves]
    leaves = [t.requires_grad_() for t in leaves]
    y = fn(*leaves)
    y.backward(prob["grad_y"].to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def check_correctness(tokens, shapes):
    print(
        f"\n## Correctness (bf16 vs fp32 reference with the fused mask, T={tokens}, A=4, "
        f"r={RANK}, p=0.1; relative error = ||out - ref|| / ||ref||)\n"
    )
    print("| H | N | gemm | Y | dX | dA | dB | torch-bf16 ref (Y/dX/dA/dB) | deterministic |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for hidden, out in shapes:
        prob = make_problem(tokens, hidden, out, 4, 0.1)
        keep = fused_dropout_keep_mask(prob["layout"], prob["dropouts"], hidden, 3, "cuda")
        w32 = dict(prob, weight=prob["weight"].float())
        want = grads(w32, ref_fn(w32, keep, draw_mask=False), cast=torch.float32)
        torch16 = grads(prob, ref_fn(prob, keep, draw_mask=False))
        t16 = "/".join(f"{rel_err(g, w):.1e}" for g, w in zip(torch16, want, strict=True))
        for gemm in ("cublas", "triton"):
            try:
                got = grads(prob, fused_fn(prob, gemm))
                again = grads(prob, fused_fn(prob, gemm))
            except Exception as exc:  # noqa: BLE001 - report and go on to the timings
                print(
                    f"| {hidden} | {out} | {gemm} | failed: {type(exc).__name__}: "
                    f"{str(exc)[:300]} |"
                )
                ok = False
                continue
            errs = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
            same = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
            ok &= all(e < REL_ERR_MAX for e in errs)
            cells = " | ".join(f"{e:.1e}" for e in errs)
            print(f"| {hidden} | {out} | {gemm} | {cells} | {t16} | {same} |")
        del prob, want, torch16
        torch.cuda.empty_cache()
    print(f"\ncorrectness: {'PASS' if ok else 'FAIL'} (threshold {REL_ERR_MAX})")
    return ok


def _tile(cfg) -> str:
    return f"{cfg.block_t}x{cfg.block_d} w{cfg.num_warps} s{cfg.num_stages}"


def components(tokens, hidden, out, adapters=4, p=0.1):
    """GPU time of each kernel of the default path alone, and of the tile choices, ms.

    Timed from a CUDA graph (`triton.testing.do_bench_cudagraph`): these calls take 50-140 µs
    of host time, as long as the smaller kernels themselves, so eager timings of one call
    measure the host.
    """
    prob = make_problem(tokens, hidden, out, adapters, p)
    layout, x, weight = prob["layout"], prob["x"], prob["weight"]
    lora_a, lora_b, dy = prob["lora_a"], prob["lora_b"], prob["grad_y"]
    scales = torch.full((adapters,), 2.0, device="cuda")
    drop = torch.full((adapters,), p, device="cuda")
    s = lora_shrink(x, lora_a, scales, drop, layout, 1)
    b_t = lora_b.transpose(1, 2)
    grad_a_t = torch.empty_like(lora_a).transpose(1, 2)
    grad_x = torch.zeros_like(x)
    flops = 2 * tokens * hidden * out

    def patched(module, attr, value, fn):
        """``fn`` run with ``module.attr`` set to ``value``."""

        def run():
            with mock.patch.object(module, attr, value):
                fn()

        return run

    def at_tile(module, cfg, fn):
        """``fn`` with ``module``'s Hopper tile forced to ``cfg``."""
        return patched(module, "_hopper_config", lambda key: cfg, fn)

    def per_sm_run(module, per_sm, fn):
        """``fn`` with ``module``'s chunks sized for ``per_sm`` programs per SM."""
        return patched(module, "_PROGRAMS_PER_SM", per_sm, fn)

    def wgrad(dropouts):
        return lambda: lora_wgrad(
            x, s, grad_a_t, dropouts, layout, 1, expand_m=lora_a, expand_out=torch.empty_like(x)
        )

    rows = [
        ("F.linear X·Wᵀ", lambda: F.linear(x, weight), flops),
        ("dY·W (torch.mm)", lambda: dy @ weight, flops),
        ("dX += dY·W (addmm_, reads C)", lambda: grad_x.addmm_(dy, weight), flops),
        (
            "TMA lora_gemm X·Wᵀ + S'·Bᵀ",
            lambda: lora_gemm(x, weight, s, b_t, None, layout),
            flops,
        ),
        ("shrink X p=0", lambda: lora_shrink(x, lora_a, scales, None, layout, 1), 0),
        (f"shrink X p={p}", lambda: lora_shrink(x, lora_a, scales, drop, layout, 1), 0),
        *[
            (
                f"shrink X p={q}, tile {_tile(cfg)}",
                at_tile(
                    SHRINK_MODULE,
                    cfg,
                    lambda q=q: lora_shrink(x, lora_a, scales, drop if q else None, layout, 1),
                ),
                0,
            )
            for q in (0, p)
            for cfg in SHRINK_MODULE._TILE_CONFIGS[1:]
        ],
        ("expand Y (write T×N)", lambda: lora_expand(s, b_t, None, None, layout, 1), 0),
        (
            "lora_up_bwd: dS' and dB, one pass over dY",
            lambda: lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=False),
            0,
        ),
        *[
            (
                f"lora_up_bwd, tile {_tile(cfg)}",
                at_tile(
                    UP_BWD_MODULE,
                    cfg,
                    lambda: lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=False),
                ),
                0,
            )
            for cfg in UP_BWD_MODULE._TILE_CONFIGS[1:]
        ],
        *[
            (
                f"lora_up_bwd, {per_sm} programs per SM",
                per_sm_run(
                    UP_BWD_MODULE,
                    per_sm,
                    lambda: lora_up_bwd(dy, s, lora_b, scales, layout, scale_db=False),
                ),
                0,
            )
            for per_sm in (1, 2, 4)
        ],
        ("wgrad dA + expand dX, p=0", wgrad(None), 0),
        (f"wgrad dA + expand dX, p={p}, mask drawn", wgrad(drop), 0),
        *[
            (f"wgrad dA + expand dX, {how}, tile {_tile(cfg)}", at_tile(WGRAD_MODULE, cfg, fn), 0)
            for how, fn in (("p=0", wgrad(None)), (f"p={p} drawn", wgrad(drop)))
            for cfg in WGRAD_MODULE._TILE_CONFIGS[1:]
        ],
        *[
            (
                f"wgrad dA + expand dX, {how}, {per_sm} programs per SM",
                per_sm_run(WGRAD_MODULE, per_sm, fn),
                0,
            )
            for how, fn in (("p=0", wgrad(None)), (f"p={p} drawn", wgrad(drop)))
            for per_sm in (1, 2, 8)
        ],
    ]
    print(f"\n## Components (T={tokens}, H={hidden}, N={out}, A={adapters}, r={RANK})\n")
    print("| kernel | median ms (graphed) | TFLOP/s |")
    print("|---|---|---|")
    for name, fn, flops in rows:
        try:
            fn()
            ms = triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - report a config that fails, keep going
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | |")
            continue
        tflops = f"{flops / ms / 1e9:.0f}" if flops else ""
        print(f"| {name} | {ms:.4f} | {tflops} |")
    del prob
    torch.cuda.empty_cache()


def timings(tokens_list, shapes, csv_path):
    auto = FUSED_MODULE.resolve_gemm(
        "auto",
        torch.empty(16, 16, device="cuda", dtype=torch.bfloat16),
        torch.empty(16, 16, device="cuda", dtype=torch.bfloat16),
    )
    print(
        f"\n## Forward + backward, median ms (p20–p80 for auto), bf16, r={RANK}; "
        f"auto = {auto} here\n"
    )
    print(
        "| T | H | N | A | p | frozen | ref (eager) | cublas | auto "
        "| augK copy | augK no-copy | cublas/frozen | auto/frozen "
        "| ref/auto | graphed frozen | graphed auto | graphed auto/frozen |"
    )
    print("|" + "---|" * 17)
    rows = []
    for tokens in tokens_list:
        for hidden, out in shapes:
            for adapters in ADAPTERS:
                for p in DROPOUTS:
                    prob = make_problem(tokens, hidden, out, adapters, p)
                    frozen = bench(*fwd_bwd(prob, frozen_fn(prob), with_lora=False))[0]
                    ref = bench(*fwd_bwd(prob, ref_fn(prob)))[0]
                    cub = bench(*fwd_bwd(prob, fused_fn(prob, "cublas")))[0]
                    fused = bench(*fwd_bwd(prob, fused_fn(prob, "auto")))
                    g_frozen = bench_graph(*fwd_bwd(prob, frozen_fn(prob), with_lora=False))
                    g_fused = bench_graph(*fwd_bwd(prob, fused_fn(prob, "auto")))
                    if p == 0:
                        aug_c = bench(*fwd_bwd(prob, augk_fn(prob, copy=True)))[0]
                        aug_n = bench(*fwd_bwd(prob, augk_fn(prob, copy=False)))[0]
                        aug = f"{aug_c:.3f} | {aug_n:.3f}"
                    else:
                        aug = "- | -"
                    row = [tokens, hidden, out, adapters, p, frozen, ref, cub, fused[0]]
                    rows.append(row)
                    print(
                        f"| {tokens} | {hidden} | {out} | {adapters} | {p} | {frozen:.3f} "
                        f"| {ref:.3f} | {cub:.3f} "
                        f"| {fused[0]:.3f} ({fused[1]:.3f}–{fused[2]:.3f}) | {aug} "
                        f"| {cub / frozen:.3f} | {fused[0] / frozen:.3f} "
                        f"| {ref / fused[0]:.2f} "
                        f"| {g_frozen:.3f} | {g_fused:.3f} | {g_fused / g_frozen:.3f} |",
                        flush=True,
                    )
                    del prob
                    torch.cuda.empty_cache()
    if csv_path:
        with open(csv_path, "a", newline="") as f:
            writer = csv.writer(f)
            for row in rows:
                writer.writerow([torch.cuda.get_device_name(), *row])


def memory(tokens=8192, hidden=4096, out=4096):
    print(f"\n## Activations saved for backward (T={tokens}, H={hidden}, A=4, r={RANK}, p=0.1)\n")
    print("| path | bytes / token |")
    print("|---|---|")
    prob = make_problem(tokens, hidden, out, 4, 0.1)
    for name, fn, lora in (
        ("frozen linear", frozen_fn(prob), False),
        ("reference (eager)", ref_fn(prob), True),
        ("fused, mask regenerated (default)", fused_fn(prob, "auto"), True),
    ):
        print(f"| {name} | {saved_bytes_per_token(prob, fn, lora):.0f} |")


QKV = (4096, 8, 4, 128)  # Llama-3.1-8B linear_qkv: H, query groups, q heads per group, head dim


def _qv_off_mask(adapters: int, rank: int, device: torch.device) -> torch.Tensor:
    """(A, N, 2r) bool: True off the q / v blocks of a per-projection q/v adapter's B.

    Rows follow Megatron's QKV order, per group ``[q heads | k | v]``; q rows own rank
    columns ``0..r``, v rows ``r..2r``, k rows none (as `mcore.lora._off_block_mask`).
    """
    _, groups, per_group, head = QKV
    group = torch.tensor([0] * per_group * head + [-1] * head + [1] * head)
    block_of_row = group.repeat(groups)  # (N,)
    block_of_col = torch.arange(2 * rank) // rank  # (2r,)
    off = block_of_row[:, None] != block_of_col[None, :]
    return off.expand(adapters, -1, -1).contiguous().to(device)


def variant_fns(prob):
    """``{name: fn(x, lora_a, lora_b)}``: the wrapper's work per forward for each variant.

    ``prob`` holds rank-2r factors; plain LoRA and DoRA read their first r ranks as strided
    views, q/v all 2r with B masked (one fill of B per forward), as the wrapper reads them
    from the packed table (`ops.packed_factors`).
    """
    weight, layout = prob["weight"], prob["layout"]
    adapters, rank = prob["lora_a"].shape[0], prob["lora_a"].shape[1] // 2
    off = _qv_off_mask(adapters, rank, weight.device)
    w_sq = weight_sq_norm(weight)
    magnitude = w_sq.sqrt().expand(adapters, -1).clone().requires_grad_()

    def lora(x, lora_a, lora_b):
        return fused_lora_linear(
            x,
            weight,
            None,
            lora_a[:, :rank],
            lora_b[:, :, :rank],
            prob["scalings"],
            prob["dropouts"],
            layout,
            layer_seed=3,
        )

    def dora(x, lora_a, lora_b):
        out = lora(x, lora_a, lora_b)
        scalings = torch.full((adapters,), 2.0, device=weight.device)
        norms = dora_weight_norm(  # every adapter in one call, as the wrapper does
            weight, w_sq, lora_a[:, :rank].float(), lora_b[:, :, :rank].float(), scalings
        )
        return dora_scale(out, magnitude / norms, layout)

    def qv(x, lora_a, lora_b):
        return fused_lora_linear(
            x,
            weight,
            None,
            lora_a,
            lora_b.masked_fill(off, 0.0),
            prob["scalings"],
            prob["dropouts"],
            layout,
            layer_seed=3,
        )

    return {"lora": lora, "dora": dora, "qv": qv}, magnitude


def check_dora(prob) -> bool:
    """DoRA's fused scale against its torch reference on the same fused output (bf16)."""
    fns, magnitude = variant_fns(prob)
    out = fns["lora"](prob["x"], prob["lora_a"], prob["lora_b"]).detach()
    scale = magnitude.detach() * 1.1
    err = rel_err(
        dora_scale(out, scale, prob["layout"]), dora_scale_ref(out, scale, prob["layout"])
    )
    print(f"DoRA scale vs reference: relative error {err:.1e}")
    return err < REL_ERR_MAX


def variants(tokens=8192, p=0.1):
    """Forward + backward ms of plain LoRA, DoRA and per-projection q/v on linear_qkv."""
    hidden, groups, per_group, head = QKV
    out = groups * (per_group + 2) * head
    print(
        f"\n## Adapter variants on linear_qkv (T={tokens}, H={hidden}, N={out}, r={RANK}, "
        f"p={p}; q/v: rank {2 * RANK} stacked, B masked), median ms (p20–p80)\n"
    )
    print(
        "| A | frozen | LoRA | DoRA | q/v per-projection | DoRA/LoRA | q/v/LoRA | graphed LoRA "
        "| graphed DoRA | graphed q/v |"
    )
    print("|" + "---|" * 10)
    ok = True
    for adapters in ADAPTERS:
        prob = make_problem(tokens, hidden, out, adapters, p, rank=2 * RANK)
        ok &= check_dora(prob)
        frozen = bench(*fwd_bwd(prob, frozen_fn(prob), with_lora=False))[0]
        fns, magnitude = variant_fns(prob)
        times, graphed = {}, {}
        for name, fn in fns.items():
            step, leaves = fwd_bwd(prob, fn)
            leaves = leaves + [magnitude] if name == "dora" else leaves
            times[name] = bench(step, leaves)
            graphed[name] = bench_graph(step, leaves)
        cells = " | ".join(f"{t[0]:.3f} ({t[1]:.3f}–{t[2]:.3f})" for t in times.values())
        lora = times["lora"][0]
        print(
            f"| {adapters} | {frozen:.3f} | {cells} | {times['dora'][0] / lora:.3f} "
            f"| {times['qv'][0] / lora:.3f} | "
            + " | ".join(f"{graphed[n]:.3f}" for n in fns)
            + " |",
            flush=True,
        )
        del prob
        torch.cuda.empty_cache()
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one token count, one shape")
    parser.add_argument("--csv", default=None, help="append timing rows to this CSV file")
    parser.add_argument("--skip-components", action="store_true")
    parser.add_argument(
        "--components-only",
        action="store_true",
        help="only the per-kernel times, at T=16384 and every (H, N)",
    )
    parser.add_argument(
        "--variants-only",
        action="store_true",
        help="only the adapter-variant table (LoRA, DoRA, per-projection q/v on linear_qkv)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        for table in ("correctness", "components", "memory", "timings", "adapter variants"):
            print(f"skipped {table}: needs a CUDA device (Triton kernels, CUDA-timed)")
        return
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"triton {triton.__version__}"
    )
    shapes = SHAPES[:1] if args.quick else SHAPES
    tokens_list = TOKENS[:1] if args.quick else TOKENS
    if args.components_only:
        for hidden, out in shapes:
            components(tokens_list[-1], hidden, out)
        return
    if args.variants_only:
        if not variants(tokens_list[0]):
            sys.exit("correctness check failed")
        return
    ok = all([check_correctness(tokens, shapes) for tokens in tokens_list])
    if not args.skip_components:
        for hidden, out in shapes:
            components(tokens_list[-1], hidden, out)
    memory()
    timings(tokens_list, shapes, args.csv)
    ok &= variants(tokens_list[0])
    if not ok:
        sys.exit("correctness check failed")


if __name__ == "__main__":
    main()
