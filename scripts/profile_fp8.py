"""Where one microbatch's GPU time goes, by kernel: bf16 against FP8 base, floor and adapters.

    python -m scripts.profile_fp8                          # the 8B preset, ~2 min on an H200
    python -m scripts.profile_fp8 --model-shape llama3.2-1b
    python -m scripts.profile_fp8 --precisions fp8 --recompute none

`torch.profiler` (CUDA activity only) over 2 microbatches of 8192 tokens after 2 warm-up ones,
for the bf16 and the FP8 base, each as the frozen floor (no adapters) and with 4 adapters
r 16 p 0.1 (``--recompute``, selective by default; an optimizer step per microbatch):
`scripts.bench_fp8`'s models and steps. Prints the top kernels of each case, ms per microbatch by
`KERNEL_CATEGORIES`, and GPU busy time against the wall clock of the same microbatches run
without the profiler (docs/fp8.md has the H200's tables).
"""

import argparse
import time

import torch
from torch.autograd import DeviceType

from megatron_lorafusion.config import MODEL_PRESETS
from megatron_lorafusion.mcore.recompute import RECOMPUTE_MODES
from scripts.bench_fp8 import (
    ADAPTERS,
    DROPOUT,
    RANK,
    adapter_step,
    build_model,
    floor_step,
    free_memory,
    random_microbatches,
)

# (category, lower-case substrings of the kernel name); the first match wins, so our own kernels
# come before the generic words their names hold (`_lora_gemm_tma_kernel` has "gemm"; torch's
# FlashAttention kernels have "cutlass" in their template arguments).
KERNEL_CATEGORIES = [
    ("fp8 quantize", ("quantize_rows",)),  # ops/fp8_quant.py
    ("gemm (ours, Triton)", ("lora_gemm",)),  # ops/lora_gemm.py: frozen GEMM + the LoRA term
    ("lora", ("_lora_", "keep_mask", "packed_factors", "cast_table", "dora_scale")),
    ("cross-entropy", ("cross_entropy", "nll_loss", "log_softmax")),
    ("adamw", ("adapter_adamw", "row_squared_norms")),  # + the clip's per-adapter grad norms
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "flex")),
    (
        "gemm (cuBLAS/CUTLASS)",
        ("gemm", "cutlass", "xmma", "nvjet", "cublas", "scaled_mm", "splitk", "gemv"),
    ),
    ("norm", ("rms", "norm")),
    ("copy/memset", ("memcpy", "memset")),
]
OTHER_CATEGORY = "elementwise/other"
PROFILE_WARMUP, PROFILE_MICROBATCHES, PROFILE_TOP = 2, 2, 20


def _categorise(name: str) -> str:
    """The `KERNEL_CATEGORIES` entry of a kernel name (case-insensitive), else "other"."""
    lower = name.lower()
    for category, words in KERNEL_CATEGORIES:
        if any(word in lower for word in words):
            return category
    return OTHER_CATEGORY


def _device_us(event) -> float:
    """An event's own device time in us: ``self_device_time_total`` (``self_cuda_time_total``
    before torch 2.4), or its span where that reads 0 (torch gives 0 for an event it marked
    async or when the profiler has no device)."""
    us = getattr(event, "self_device_time_total", None)
    if us is None:
        us = event.self_cuda_time_total
    return us or event.time_range.elapsed_us()


def _kernel_table(events, microbatches: int = 1) -> list[tuple[str, float, float]]:
    """(kernel name, ms, calls) per microbatch, by ms descending.

    Args:
        events: `torch.profiler.profile.events()`: FunctionEvents with ``name``,
            ``device_type`` and ``self_device_time_total``. Host-side events (CUDA runtime
            calls) are skipped; memcpy and memset count, as they occupy the GPU.
        microbatches: how many microbatches ``events`` span.
    """
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.device_type == DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += _device_us(event)
            entry[1] += 1
    rows = [(n, us / 1e3 / microbatches, k / microbatches) for n, (us, k) in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def _category_ms(table: list[tuple[str, float, float]]) -> dict[str, float]:
    """ms per category (every category, in `KERNEL_CATEGORIES` order, then other)."""
    out = {category: 0.0 for category, _ in KERNEL_CATEGORIES} | {OTHER_CATEGORY: 0.0}
    for name, ms, _ in table:
        out[_categorise(name)] += ms
    return out


def _gpu_busy_ms(events) -> tuple[float, float]:
    """(busy, span) ms of the device events: the union of their intervals (kernels overlapping
    on two streams count once), and the first start to the last end."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    )
    if not spans:
        return 0.0, 0.0
    busy, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            busy, lo = busy + hi - lo, start
        hi = max(hi, end)
    busy += hi - lo
    return busy / 1e3, (max(end for _, end in spans) - spans[0][0]) / 1e3


def _short(name: str, width: int = 70) -> str:
    name = name.removeprefix("void ").replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def _profile_step(step, batches: list) -> dict:
    """Warm ``step`` up on the first `PROFILE_WARMUP` batches, time the rest (synchronised, no
    profiler), then profile the same batches (CUDA activity only: no host-side overhead)."""
    from torch.profiler import ProfilerActivity, profile

    for batch in batches[:PROFILE_WARMUP]:
        step(batch)
    timed = batches[PROFILE_WARMUP:]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / len(timed)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in timed:
            step(batch)
        torch.cuda.synchronize()  # every kernel ends inside the trace
    events = prof.events()
    busy, span = _gpu_busy_ms(events)
    return {
        "table": _kernel_table(events, len(timed)),
        "busy_ms": busy / len(timed),
        "span_ms": span / len(timed),
        "wall_ms": wall_ms,
    }


def _print_kernels(case: str, result: dict) -> None:
    table = result["table"]
    total = sum(ms for _, ms, _ in table)
    print(f"\n### {case}: top {PROFILE_TOP} of {len(table)} kernels, {total:.1f} ms\n")
    print("| kernel | category | ms | calls | share % |")
    print("|---|---|---|---|---|")
    for name, ms, calls in table[:PROFILE_TOP]:
        print(
            f"| `{_short(name)}` | {_categorise(name)} | {ms:.2f} | {calls:g} | "
            f"{100 * ms / max(total, 1e-9):.1f} |"
        )


def _profile_model(shape: str, precision: str, recompute: str, batches: list, cases: dict) -> None:
    """Build ``shape`` in ``precision``, profile its floor, then 4 adapters, into ``cases``."""
    model, build_s = build_model(shape, precision)
    gib = torch.cuda.memory_allocated() / 2**30
    print(f"\n{precision}: built in {build_s:.1f} s, {gib:.1f} GiB on the GPU")
    model.train()
    floor, hook = floor_step(model)
    cases[(precision, "floor")] = _profile_step(floor, batches)
    hook.remove()
    _print_kernels(f"{precision} floor", cases[(precision, "floor")])
    mode = f"{ADAPTERS} adapters"
    cases[(precision, mode)] = _profile_step(adapter_step(model, recompute), batches)
    _print_kernels(f"{precision} {mode}", cases[(precision, mode)])


def _print_profile_summary(cases: dict) -> None:
    names = [category for category, _ in KERNEL_CATEGORIES] + [OTHER_CATEGORY]
    print("\n### ms per microbatch by category\n")
    print("| base | mode | " + " | ".join(names) + " | total |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for (precision, mode), result in cases.items():
        ms = _category_ms(result["table"])
        cells = " | ".join(f"{ms[n]:.1f}" for n in names)
        print(f"| {precision} | {mode} | {cells} | {sum(ms.values()):.1f} |")
    print("\n### GPU busy against wall clock, ms per microbatch\n")
    print("| base | mode | kernels sum | GPU busy | profiled span | wall (no profiler) | busy % |")
    print("|---|---|---|---|---|---|---|")
    for (precision, mode), r in cases.items():
        kernels = sum(ms for _, ms, _ in r["table"])
        print(
            f"| {precision} | {mode} | {kernels:.1f} | {r['busy_ms']:.1f} | {r['span_ms']:.1f} | "
            f"{r['wall_ms']:.1f} | {100 * r['busy_ms'] / r['wall_ms']:.0f} |"
        )


def section_profile(shape: str, precisions: list[str], recompute: str) -> None:
    from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel

    tokens = 8192
    bases = " against ".join(precisions)
    print(
        f"\n## profile: {shape}, CUDA kernel time per {tokens}-token microbatch (mean of "
        f"{PROFILE_MICROBATCHES} after {PROFILE_WARMUP} warm-up), {bases} base, floor "
        f"and {ADAPTERS} adapters r {RANK} p {DROPOUT}, recompute {recompute}\n"
    )
    init_model_parallel(1, 1, torch.device("cuda"), seed=0)
    cases: dict = {}
    try:
        count = PROFILE_WARMUP + PROFILE_MICROBATCHES
        batches = random_microbatches(tokens, count, MODEL_PRESETS[shape]["vocab_size"])
        for precision in precisions:
            try:
                _profile_model(shape, precision, recompute, batches, cases)
            except torch.cuda.OutOfMemoryError as err:
                print(f"\n{precision}: OOM: {str(err)[:80]}")
            free_memory()  # the model goes before the next one is built
    finally:
        destroy_model_parallel()
    _print_profile_summary(cases)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-shape", default="llama3.1-8b", choices=["llama3.2-1b", "llama3.1-8b"]
    )
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--recompute", default="selective", choices=RECOMPUTE_MODES)
    args = parser.parse_args(argv)
    section_profile(args.model_shape, args.precisions, args.recompute)


if __name__ == "__main__":
    main()
