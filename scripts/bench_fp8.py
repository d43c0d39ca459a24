"""FP8 frozen base on one GPU (issue 34): correctness first, then GEMMs, the fused op, the 8B
model against its bf16 twin, and the 70B preset on one GPU.

    python -m scripts.bench_fp8                          # check gemm op model, ~2.5 min (H200)
    python -m scripts.bench_fp8 --sections check gemm op # kernels only, ~1.5 min (compiles)
    python -m scripts.bench_fp8 --sections model         # 8B bf16 vs FP8, ~1 min
    python -m scripts.bench_fp8 --sections 70b           # 70B build + microbatches, ~1.5 min
    python -m scripts.bench_fp8 --write-jobs runs/fp8    # datasets of the train jobs (CPU)
    python -m scripts.bench_fp8 --compare-runs runs/fp8/acc_bf16 runs/fp8/acc_fp8

Sections (each prints a markdown table; a failed check marks its variant and skips its timing):
- ``check``: the Triton quantizer against `quantize_rows_ref` (bytes equal), the frozen FP8
  linear and the fused op (both FP8 GEMMs) against the fake-quant reference in fp32, 8B
  projections, 2048 tokens (relative errors; bf16 rounding and fast accumulation leave <1e-2).
- ``gemm``: each 8B projection's frozen GEMMs at T = 8192: bf16 cuBLAS and FP8 with row-wise
  (ours), per-tensor and 1x128 / 128x128 block scales (the last where torch has them), each
  with its error against fp32 on activations with outlier tokens and channels; the quantizer
  and the weight transpose. Decides the scale granularity and ``FAST_ACCUM_FORWARD``.
- ``op``: `fused_lora_linear` forward + backward (4 adapters r 16 p 0.1): bf16 ``auto``
  against FP8 ``scaled_mm`` and ``triton`` (with and without the kept transposed weight), and
  each frozen floor. Decides ``_resolve_fp8_gemm``'s ``"auto"``.
- ``model``: the 8B preset (random, same seed) built in bf16 and in FP8: build time, memory,
  the frozen floor's and 4 adapters r 16 p 0.1's tokens/s (8192-token microbatches, samples of
  256-2048 tokens, selective recompute, an optimizer step after each), and the FP8 logits'
  relative error against bf16's.
- ``70b``: the llama3.1-70b preset in FP8 built on the GPU, then 4 adapters r 16 with full
  recompute at 4096-token microbatches: build time, memory, tokens/s, peak.

Timing: ``triton.testing.do_bench`` medians (p20-p80) for kernels, CUDA-synchronised wall
clock over microbatches after a warm-up for models. ``--write-jobs`` writes the random-letter
datasets of configs/llama8b_fp8.yaml and configs/llama70b_fp8.yaml and the demo tasks of
configs/llama1b_fp8_accuracy.yaml, then prints the ``lorafusion train`` commands; ``--compare-runs``
prints two runs' final eval losses, eval curves and peak memory (docs/fp8.md's tables); the
runs' steady tokens/s come from their logs (``scripts.bench_models.steady_tokens_per_s``).
"""

import argparse
import gc
import importlib.metadata
import json
import random
import sys
import time
from pathlib import Path

import torch

from megatron_lorafusion.config import MODEL_PRESETS, AdapterConfig, DatasetConfig, ModelConfig
from megatron_lorafusion.ops import (
    AdapterLayout,
    Fp8Weight,
    fp8_linear,
    fp8_linear_ref,
    fused_dropout_keep_mask,
    fused_lora_linear,
    lora_linear_ref,
    quantize_rows,
    quantize_rows_ref,
    quantize_weight,
)
from megatron_lorafusion.ops.fp8_linear import fp8_matmul

# (name, H, N) of the 8B decoder's linears: qkv, proj, fc1 (gate | up), fc2
PROJECTIONS = [
    ("qkv", 4096, 6144),
    ("proj", 4096, 4096),
    ("fc1", 4096, 28672),
    ("fc2", 14336, 4096),
]
ADAPTERS, RANK, DROPOUT = 4, 16, 0.1
CHECK_REL_ERR = 1e-2


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _bench(fn) -> tuple[float, float, float]:
    """(median, p20, p80) ms of ``fn()`` after warm-up (`triton.testing.do_bench`)."""
    import triton

    out = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
    return tuple(float(v) for v in out)


def _ms(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.3f} ({t[1]:.3f}-{t[2]:.3f})"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _layout(tokens: int, seed: int = 0) -> AdapterLayout:
    """Samples of 256-2048 tokens, round-robin over the adapters, adapter-major."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < tokens:
        lengths.append(min(tokens - sum(lengths), rng.randint(256, 2048)))
    samples = sorted((i % ADAPTERS, n) for i, n in enumerate(lengths))
    return AdapterLayout.from_samples(
        [a for a, _ in samples], [n for _, n in samples], ADAPTERS, "cuda", dropout_seed=seed
    )


def _activations(tokens: int, width: int, seed: int) -> torch.Tensor:
    """bf16 activations with what LLMs have: tokens of spread magnitude, outlier channels."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, width, device="cuda", generator=gen)
    x *= torch.exp(torch.randn(tokens, 1, device="cuda", generator=gen))  # per token
    x[:, torch.randperm(width, device="cuda", generator=gen)[:8]] *= 50.0  # outlier channels
    return x.bfloat16()


def _weight(out: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out, hidden, device="cuda", generator=gen) / hidden**0.5
    return (w * torch.exp(0.5 * torch.randn(out, 1, device="cuda", generator=gen))).bfloat16()


def _lora(hidden: int, out: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(ADAPTERS, RANK, hidden, device="cuda", generator=gen) / hidden**0.5
    b = torch.randn(ADAPTERS, out, RANK, device="cuda", generator=gen) * 0.01
    return a.bfloat16(), b.bfloat16()


# ---- check -----------------------------------------------------------------------------------


def _grads(fn, leaves, grad_y):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    y.backward(grad_y)
    return [y.detach()] + [t.grad for t in leaves]


def _check_projection(hidden: int, out: int, tokens: int, failed: set) -> None:
    x = _activations(tokens, hidden, 1)
    w = quantize_weight(_weight(out, hidden, 2).float(), transposed=True)
    for col in (None, w.scale):
        src = x if col is None else _activations(tokens, out, 3)
        q, s = quantize_rows(src, col)
        q_ref, s_ref = quantize_rows_ref(src, col)
        same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        what = "quantize_rows" + ("" if col is None else " (dY, col scale)")
        if not same:
            failed.add("quantize")
        verdict = "ok" if same else "FAIL"
        print(
            f"| {what} | {hidden} | {out} | bytes {'equal' if same else 'DIFFER'} | "
            f"| | | | {verdict} |"
        )
    grad_y = _activations(tokens, out, 4)
    got = _grads(lambda t: fp8_linear(t, w), [x], grad_y)
    want = _grads(lambda t: fp8_linear_ref(t, w), [x.float()], grad_y.float())
    errs = [_rel(g, r) for g, r in zip(got, want, strict=True)]
    ok = max(errs) < CHECK_REL_ERR
    if not ok:
        failed.add("fp8_linear")
    print(
        f"| fp8_linear | {hidden} | {out} | {errs[0]:.1e} | {errs[1]:.1e} | | | | "
        f"{'ok' if ok else 'FAIL'} |"
    )
    layout = _layout(tokens, seed=5)
    a, b = _lora(hidden, out, 6)
    scalings, dropouts = [2.0] * ADAPTERS, [DROPOUT] * ADAPTERS
    keep = fused_dropout_keep_mask(layout, dropouts, hidden, 7, "cuda")

    def ref(x_, a_, b_):
        return lora_linear_ref(x_, w, None, a_, b_, scalings, dropouts, layout, keep)

    want = _grads(ref, [x.float(), a.float(), b.float()], grad_y.float())
    for gemm in ("scaled_mm", "triton"):

        def fused(x_, a_, b_, gemm=gemm):
            return fused_lora_linear(
                x_, w, None, a_, b_, scalings, dropouts, layout, layer_seed=7, gemm=gemm
            )

        try:
            got, again = _grads(fused, [x, a, b], grad_y), _grads(fused, [x, a, b], grad_y)
            errs = [_rel(g, r) for g, r in zip(got, want, strict=True)]
            same = all(torch.equal(p, q) for p, q in zip(got, again, strict=True))
            ok = max(errs) < CHECK_REL_ERR and same
            cells = " | ".join(f"{e:.1e}" for e in errs)
        except Exception as err:  # noqa: BLE001 - a failing variant is reported, not fatal
            ok, same, cells = False, False, f"{type(err).__name__}: {str(err)[:80]} | | |"
        if not ok:
            failed.add(f"op {gemm}")
        print(f"| fused {gemm} | {hidden} | {out} | {cells} | {same} | {'ok' if ok else 'FAIL'} |")


def section_check(failed: set) -> None:
    tokens = 2048
    print(f"\n## check: kernels against the fake-quant reference (fp32), T = {tokens}\n")
    print("| what | H | N | y | dX | dA | dB | repeatable | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _, hidden, out in PROJECTIONS:
        _check_projection(hidden, out, tokens, failed)
        free_memory()


# ---- gemm ------------------------------------------------------------------------------------


def _tensorwise(x: torch.Tensor, w: torch.Tensor):
    """Per-tensor scales (amax / 448), the coarsest granularity."""
    sx = x.float().abs().amax().clamp(min=1e-12) / 448.0
    sw = w.float().abs().amax().clamp(min=1e-12) / 448.0
    xq = (x.float() / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq = (w.float() / sw).clamp(-448, 448).to(torch.float8_e4m3fn)
    return lambda: torch._scaled_mm(
        xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True
    )


def _blockwise(x: torch.Tensor, w: torch.Tensor):
    """DeepSeek-V3 style: X in 1x128 blocks, W in 128x128 blocks (cuBLASLt >= 12.9, sm90)."""
    tokens, hidden = x.shape
    out = w.shape[0]
    xb = x.float().view(tokens, hidden // 128, 128)
    sx = xb.abs().amax(-1).clamp(min=1e-12) / 448.0  # (T, H/128)
    xq = (xb / sx[..., None]).clamp(-448, 448).view(tokens, hidden).to(torch.float8_e4m3fn)
    wb = w.float().view(out // 128, 128, hidden // 128, 128)
    sw = wb.abs().amax((1, 3)).clamp(min=1e-12) / 448.0  # (N/128, H/128)
    wq = (wb / sw[:, None, :, None]).clamp(-448, 448).view(out, hidden).to(torch.float8_e4m3fn)
    scale_a = sx.t().contiguous().t()  # (T, H/128), outer-dim-major (strides (1, T))
    scale_b = sw.t()  # (H/128, N/128) for B = Wqᵀ (K, N), strides (1, H/128)
    return lambda: torch._scaled_mm(
        xq, wq.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
    )


def _gemm_projection(name: str, hidden: int, out: int, tokens: int) -> None:
    x, w = _activations(tokens, hidden, 11), _weight(out, hidden, 12)
    dy = _activations(tokens, out, 13)
    exact, exact_dx = x.float() @ w.float().t(), dy.float() @ w.float()
    flops = 2 * tokens * hidden * out
    fp8 = quantize_weight(w, transposed=True)
    xq, xs = quantize_rows(x)
    dyq, dys = quantize_rows(dy, fp8.scale)
    ones = torch.ones(hidden, device="cuda")
    rows = [
        ("bf16 X·Wᵀ", lambda: x @ w.t(), exact),
        ("bf16 dY·W", lambda: dy @ w, exact_dx),
        (
            "fp8 row-wise X·Wᵀ, fast accum",
            lambda: fp8_matmul(xq, fp8.data, xs, fp8.scale, torch.bfloat16, fast_accum=True),
            exact,
        ),
        (
            "fp8 row-wise X·Wᵀ",
            lambda: fp8_matmul(xq, fp8.data, xs, fp8.scale, torch.bfloat16),
            exact,
        ),
        (
            "fp8 row-wise dY·W (Wᵀ kept)",
            lambda: fp8_matmul(dyq, fp8.data_t, dys, ones, torch.bfloat16),
            exact_dx,
        ),
    ]
    for what, build in (
        ("fp8 per-tensor X·Wᵀ", _tensorwise),
        ("fp8 1x128·128x128 X·Wᵀ", _blockwise),
    ):
        try:
            rows.append((what, build(x, w), exact))
        except Exception as err:  # noqa: BLE001 - reported as a row
            print(f"| {name} | {hidden} | {out} | {what} | {type(err).__name__} | | |")
    for what, fn, ref in rows:
        try:
            err = _rel(fn(), ref)
            t = _bench(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. block scales absent in this torch
            print(
                f"| {name} | {hidden} | {out} | {what} | {type(exc).__name__}: "
                f"{str(exc)[:80]} | | |"
            )
            continue
        print(
            f"| {name} | {hidden} | {out} | {what} | {_ms(t)} | "
            f"{flops / t[0] / 1e9:.0f} | {err:.2e} |"
        )
    for what, fn in (
        ("quantize X (T, H)", lambda: quantize_rows(x)),
        ("quantize dY·diag(s_w) (T, N)", lambda: quantize_rows(dy, fp8.scale)),
        ("transpose W_q (N, H) -> (H, N)", lambda: fp8.data.t().contiguous()),
    ):
        print(f"| {name} | {hidden} | {out} | {what} | {_ms(_bench(fn))} | | |")


def section_gemm() -> None:
    tokens = 8192
    print(
        f"\n## gemm: frozen GEMMs of the 8B projections, T = {tokens}; activations with "
        f"log-normal token scales and 8 outlier channels (x50)\n"
    )
    print("| proj | H | N | what | ms (p20-p80) | TFLOP/s | rel err vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name, hidden, out in PROJECTIONS:
        _gemm_projection(name, hidden, out, tokens)
        free_memory()


# ---- op --------------------------------------------------------------------------------------


def _op_projection(name: str, hidden: int, out: int, tokens: int, failed: set) -> None:
    layout = _layout(tokens, seed=21)
    x = _activations(tokens, hidden, 22).requires_grad_()
    grad_y = _activations(tokens, out, 23)
    w = _weight(out, hidden, 24)
    a, b = _lora(hidden, out, 25)
    scalings, dropouts = [2.0] * ADAPTERS, [DROPOUT] * ADAPTERS
    kept = quantize_weight(w, transposed=True)
    fresh = Fp8Weight(kept.data, kept.scale)  # no Wᵀ: transposed in each backward

    def op(weight, gemm):
        return lambda t: fused_lora_linear(
            t, weight, None, a, b, scalings, dropouts, layout, layer_seed=3, gemm=gemm
        )

    variants = [
        ("bf16 frozen (X·Wᵀ, dY·W)", "", lambda t: t @ w.t()),
        ("bf16 op auto", "", op(w, "auto")),
        ("fp8 frozen (quantize, X·Wᵀ, dY·W)", "fp8_linear", lambda t: fp8_linear(t, kept)),
        ("fp8 op scaled_mm", "op scaled_mm", op(kept, "scaled_mm")),
        ("fp8 op triton", "op triton", op(kept, "triton")),
        ("fp8 op scaled_mm, Wᵀ per backward", "op scaled_mm", op(fresh, "scaled_mm")),
    ]
    times = {}
    for what, check, fn in variants:
        if check in failed:
            print(f"| {name} | {what} | skipped: failed its check | | |")
            continue

        def step(fn=fn):
            x.grad = None
            fn(x).backward(grad_y)

        try:
            times[what] = _bench(step)
        except Exception as err:  # noqa: BLE001 - reported as a row
            print(f"| {name} | {what} | {type(err).__name__}: {str(err)[:80]} | | |")
            continue
        cells = []
        for base in (variants[0][0], variants[1][0]):
            cells.append(f"{times[what][0] / times[base][0]:.3f}" if base in times else "")
        print(f"| {name} | {what} | {_ms(times[what])} | {cells[0]} | {cells[1]} |")


def section_op(failed: set) -> None:
    tokens = 8192
    print(
        f"\n## op: fused_lora_linear forward + backward, T = {tokens}, {ADAPTERS} adapters "
        f"r {RANK} p {DROPOUT}\n"
    )
    print("| proj | what | ms (p20-p80) | x bf16 frozen | x bf16 op |")
    print("|---|---|---|---|---|")
    for name, hidden, out in PROJECTIONS:
        _op_projection(name, hidden, out, tokens, failed)
        free_memory()


# ---- model -----------------------------------------------------------------------------------


def random_microbatches(tokens: int, count: int, vocab: int):
    from megatron_lorafusion.mcore.parallel import packed_seq_params

    out = []
    for k in range(count):
        layout = _layout(tokens, seed=100 + k)
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(k))
        lengths = (layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).tolist()
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        out.append((ids.cuda(), pos.cuda(), layout, packed_seq_params(layout)))
    return out


def _time_microbatches(train, batches, warmup: int) -> float:
    """Tokens/s of ``train`` over ``batches`` after ``warmup`` of them, synchronised."""
    for batch in batches[:warmup]:
        train(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        train(batch)
    torch.cuda.synchronize()
    return sum(b[0].shape[1] for b in batches) / (time.perf_counter() - start)


def _adapter_configs(count: int) -> list[AdapterConfig]:
    return [
        AdapterConfig(
            name=f"a{i}",
            rank=RANK,
            alpha=2 * RANK,
            dropout=DROPOUT,
            dataset=DatasetConfig(path="unused"),
        )
        for i in range(count)
    ]


def build_model(shape: str, precision: str):
    """``shape`` (random, same seed) on the GPU with its base in ``precision``; (model, build s)."""
    from megatron_lorafusion.mcore import build_gpt_model

    free_memory()
    cfg = ModelConfig(**{**MODEL_PRESETS[shape], "base_precision": precision})
    start = time.perf_counter()
    model = build_gpt_model(cfg, params_dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    return model, time.perf_counter() - start


def floor_step(model):
    """The frozen floor's step (forward + backward, no adapters) and its hook, to remove before
    adding adapters: the embedding's output requires grad, so backward runs through the base."""
    hook = model.embedding.register_forward_hook(lambda m, i, o: o.requires_grad_())

    def floor(batch):
        ids, pos, _, params = batch
        model(ids, pos, None, labels=ids, packed_seq_params=params).float().mean().backward()

    return floor, hook


def adapter_step(model, recompute: str):
    """Add 4 adapters r 16 p 0.1 (B drawn, not zero) with ``recompute``; returns their step:
    forward, backward and an optimizer step."""
    from megatron_lorafusion.mcore import apply_lora
    from megatron_lorafusion.mcore.recompute import apply_recompute
    from megatron_lorafusion.train.optim import AdapterAdamW

    adapters = _adapter_configs(ADAPTERS)
    lora = apply_lora(model, adapters, seed=0)
    apply_recompute(model, lora, recompute)
    optimizer = AdapterAdamW(lora, adapters, total_steps=[1000] * ADAPTERS)
    with torch.no_grad():
        for i in range(ADAPTERS):
            for name, factor in lora.adapter_tensors(i).items():
                if name.endswith("lora_B"):
                    factor.normal_(0, 0.01)

    def train(batch):
        ids, pos, layout, params = batch
        lora.layout = layout
        model(ids, pos, None, labels=ids, packed_seq_params=params).float().mean().backward()
        optimizer.step(layout.present_ids())

    return train


def _model_rows(shape: str, precision: str, tokens: int, batches: list, recompute: str):
    """Build ``shape`` in ``precision`` and time its floor and 4 adapters; returns (row, logits)."""
    model, build_s = build_model(shape, precision)
    row = {"build_s": build_s, "weights_gib": torch.cuda.memory_allocated() / 2**30}
    logits = None
    if shape != "llama3.1-70b":  # one 2048-token sample of the first microbatch
        from megatron_lorafusion.mcore.parallel import packed_seq_params

        one = AdapterLayout.from_samples([0], [2048], ADAPTERS, "cuda")
        ids = batches[0][0][:, :2048]
        pos = torch.arange(2048, device="cuda")[None]
        with torch.no_grad():
            logits = model.eval()(ids, pos, None, packed_seq_params=packed_seq_params(one))
        logits = logits.float().cpu()
    model.train()

    floor, hook = floor_step(model)
    if shape != "llama3.1-70b":
        row["floor_tok_s"] = _time_microbatches(floor, batches, warmup=2)
    hook.remove()
    train = adapter_step(model, recompute)
    torch.cuda.reset_peak_memory_stats()
    row["ours_tok_s"] = _time_microbatches(train, batches, warmup=2)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row, logits


def section_model(shape: str) -> None:
    from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel

    tokens = 8192
    print(
        f"\n## model: {shape}, bf16 against FP8 base, {tokens}-token microbatches, "
        f"{ADAPTERS} adapters r {RANK} p {DROPOUT}, selective recompute\n"
    )
    init_model_parallel(1, 1, torch.device("cuda"), seed=0)
    rows, logits = {}, {}
    try:
        batches = random_microbatches(tokens, 6, MODEL_PRESETS[shape]["vocab_size"])
        for precision in ("bf16", "fp8"):
            try:
                rows[precision], logits[precision] = _model_rows(
                    shape, precision, tokens, batches, "selective"
                )
            except torch.cuda.OutOfMemoryError as err:
                rows[precision] = {"note": f"OOM: {str(err)[:80]}"}
            free_memory()
    finally:
        destroy_model_parallel()
    print("| base | build s | weights GiB | floor tok/s | 4 adapters tok/s | peak GiB | note |")
    print("|---|---|---|---|---|---|---|")
    for precision, r in rows.items():
        print(
            f"| {precision} | {r.get('build_s', 0):.1f} | {r.get('weights_gib', 0):.1f} | "
            f"{r.get('floor_tok_s', 0):,.0f} | {r.get('ours_tok_s', 0):,.0f} | "
            f"{r.get('peak_gib', 0):.1f} | {r.get('note', '')} |"
        )
    if all("floor_tok_s" in r for r in rows.values()):
        floor = rows["fp8"]["floor_tok_s"] / rows["bf16"]["floor_tok_s"]
        ours = rows["fp8"]["ours_tok_s"] / rows["bf16"]["ours_tok_s"]
        print(f"\nFP8 / bf16: floor {floor:.3f}x (target >= 1.45), 4 adapters {ours:.3f}x")
    if len(logits) == 2:
        err = _rel(logits["fp8"], logits["bf16"])
        print(f"FP8 logits against bf16 (2048 tokens, random base): relative error {err:.4f}")


def section_70b() -> None:
    from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel

    tokens = 4096
    print(
        f"\n## 70b: llama3.1-70b FP8 base on one GPU, {tokens}-token microbatches, "
        f"{ADAPTERS} adapters r {RANK} p {DROPOUT}, full recompute\n"
    )
    init_model_parallel(1, 1, torch.device("cuda"), seed=0)
    try:
        batches = random_microbatches(tokens, 3, MODEL_PRESETS["llama3.1-70b"]["vocab_size"])
        try:
            row, _ = _model_rows("llama3.1-70b", "fp8", tokens, batches, "full")
        except torch.cuda.OutOfMemoryError as err:
            row = {
                "note": f"OOM at {torch.cuda.memory_allocated() / 2**30:.1f} GiB: {str(err)[:80]}"
            }
    finally:
        destroy_model_parallel()
    print("| build s | weights GiB | 4 adapters tok/s | peak GiB | note |")
    print("|---|---|---|---|---|")
    print(
        f"| {row.get('build_s', 0):.1f} | {row.get('weights_gib', 0):.1f} | "
        f"{row.get('ours_tok_s', 0):,.0f} | {row.get('peak_gib', 0):.1f} | "
        f"{row.get('note', '')} |"
    )


# ---- jobs and runs ---------------------------------------------------------------------------


def write_jobs(root: Path) -> None:
    """Datasets of the shipped FP8 jobs under ``root`` (``runs/fp8`` in their YAMLs)."""
    from megatron_lorafusion.data import write_task

    letters = "abcdefghijklmnopqrstuvwxyz"
    for i in range(ADAPTERS):
        rng = random.Random(f"speed{i}")
        path = root / "data" / f"speed{i}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for _ in range(400):  # samples of 256-2048 byte tokens, 32-token responses
                length = rng.randint(256, 2048) - 34  # bos and eos
                prompt = "".join(rng.choice(letters) for _ in range(length - 32))
                response = "".join(rng.choice(letters) for _ in range(32))
                f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    for task in ("reverse", "sort", "add", "upper"):
        write_task(task, root / "data" / f"{task}.jsonl", 2000, seed=0)
    print(f"wrote {root / 'data'}; the runs (docs/fp8.md):")
    if root.resolve() != Path("runs/fp8").resolve():
        print("  (the shipped YAMLs read runs/fp8/data: override adapters.<i>.dataset.path)")
    for line in TRAIN_COMMANDS:
        print("  " + line)


TRAIN_COMMANDS = [
    "lorafusion train configs/llama8b_fp8.yaml model.base_precision=bf16 "
    "train.output_dir=runs/fp8/speed_bf16",
    "lorafusion train configs/llama8b_fp8.yaml train.output_dir=runs/fp8/speed_fp8",
    "lorafusion train configs/llama70b_fp8.yaml",
    "lorafusion train configs/llama1b_fp8_accuracy.yaml model.base_precision=bf16 "
    "train.output_dir=runs/fp8/acc_bf16",
    "lorafusion train configs/llama1b_fp8_accuracy.yaml train.output_dir=runs/fp8/acc_fp8",
    "python -m scripts.bench_fp8 --compare-runs runs/fp8/speed_bf16 runs/fp8/speed_fp8",
    "python -m scripts.bench_fp8 --compare-runs runs/fp8/acc_bf16 runs/fp8/acc_fp8",
]


def compare_runs(first: Path, second: Path) -> None:
    """Final eval loss per adapter, eval curves and peak memory of two runs."""
    from megatron_lorafusion.train.metrics import read_metrics

    runs = {str(p): read_metrics(p) for p in (first, second)}
    names = sorted({r["adapter"] for recs in runs.values() for r in recs if r.get("adapter")})
    print(f"\n## {first} against {second}\n")
    print(f"| adapter | final eval {first.name} | final eval {second.name} | rel. diff |")
    print("|---|---|---|---|")
    curves = {}
    for name in names:
        finals = []
        for run, recs in runs.items():
            evals = sorted(
                (r["step"], r["eval_loss"])
                for r in recs
                if r.get("adapter") == name and "eval_loss" in r
            )
            curves[(name, run)] = dict(evals)
            finals.append(evals[-1][1] if evals else None)
        diff = f"{(finals[1] - finals[0]) / finals[0]:+.2%}" if None not in finals else ""
        cells = " | ".join("-" if f is None else f"{f:.4f}" for f in finals)
        print(f"| {name} | {cells} | {diff} |")
    # Tokens/s: the runs' logs (`scripts.bench_models.steady_tokens_per_s`); the metrics
    # count the tokens that carry a loss, not those trained through.
    print("\n| run | peak GiB |")
    print("|---|---|")
    for run, recs in runs.items():
        mem = max((r.get("gpu_mem_gib") or 0 for r in recs), default=0)
        print(f"| {Path(run).name} | {mem:.1f} |")
    for name in names:
        steps = sorted({s for (n, _), c in curves.items() if n == name for s in c})
        if not steps:
            continue
        print(f"\neval loss of {name}:\n\n| step | {first.name} | {second.name} |\n|---|---|---|")
        for step in steps:
            vals = [curves[(name, run)].get(step) for run in runs]
            print(
                f"| {step} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals) + " |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["check", "gemm", "op", "model"],
        choices=["check", "gemm", "op", "model", "70b"],
    )
    parser.add_argument(
        "--model-shape", default="llama3.1-8b", choices=["llama3.2-1b", "llama3.1-8b"]
    )
    parser.add_argument("--write-jobs", type=Path, help="write the train jobs' datasets here")
    parser.add_argument("--compare-runs", nargs=2, type=Path, help="two run folders")
    args = parser.parse_args(argv)
    if args.write_jobs:
        write_jobs(args.write_jobs)
        return 0
    if args.compare_runs:
        compare_runs(*args.compare_runs)
        return 0
    if not torch.cuda.is_available():
        print("bench_fp8 needs a CUDA GPU (--write-jobs and --compare-runs do not)")
        return 1
    name = torch.cuda.get_device_name()
    print(
        f"# {name} | torch {torch.__version__} | triton {_version('triton')} | "
        f"CUDA {torch.version.cuda} | bf16 activations, e4m3 base"
    )
    failed: set[str] = set()
    started = time.perf_counter()
    if "check" in args.sections:
        section_check(failed)
    if "gemm" in args.sections:
        section_gemm()
    if "op" in args.sections:
        section_op(failed)
    if "model" in args.sections:
        section_model(args.model_shape)
    if "70b" in args.sections:
        section_70b()
    print(
        f"\n# done in {time.perf_counter() - started:.0f} s; failed checks: "
        f"{sorted(failed) or 'none'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
