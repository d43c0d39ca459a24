"""Host time of one forward + backward of the fused multi-LoRA linear, on one GPU.

Run as ``python -m scripts.profile_host_overhead``. A long sleep kernel is queued first, so the
host never waits for the GPU: the wall time of ``--calls`` calls divided by their number is the
host's cost of one call (Python, autograd, argument binding, launches). Each measurement checks
that the GPU was still asleep when it ended. Then ``cProfile`` lists where the fused path's
host time goes. Prints markdown; docs/kernels.md (section "Host overhead") quotes it.
"""

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch
import torch.nn.functional as F
import triton

from megatron_lorafusion.ops import AdapterLayout, fused_lora_linear
from megatron_lorafusion.ops.lora_expand import lora_expand
from megatron_lorafusion.ops.lora_shrink import lora_shrink
from megatron_lorafusion.ops.lora_up_bwd import lora_up_bwd
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad

SLEEP_CYCLES = 2_000_000_000  # ~1 s at the H200's clock, longer than any measured batch


@triton.jit
def _empty_kernel(x_ptr):
    pass


def host_us(fn, calls: int, make_arg=None) -> float:
    """Host µs per call of ``fn`` while the GPU sleeps; NaN when the GPU woke up too early.

    ``make_arg``, when given, builds each call's argument beforehand, untimed (a forward's
    output, to time its backward alone).
    """
    args = [make_arg() if make_arg else None for _ in range(calls + 1)]
    run = fn if make_arg else (lambda _: fn())
    run(args[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    awake = torch.cuda.Event()
    awake.record()
    start = time.perf_counter()
    for arg in args[1:]:
        run(arg)
    elapsed = time.perf_counter() - start
    asleep = not awake.query()
    torch.cuda.synchronize()
    return elapsed / calls * 1e6 if asleep else float("nan")


def problem(tokens, hidden, out, adapters, p, rank=16):
    counts = [tokens // adapters] * adapters
    counts[-1] += tokens - sum(counts)
    layout = AdapterLayout.from_samples(list(range(adapters)), counts, adapters, "cuda",
                                        dropout_seed=1)
    dev = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(tokens, hidden, **dev).requires_grad_()
    weight = torch.randn(out, hidden, **dev) / hidden**0.5
    lora_a = (torch.randn(adapters, rank, hidden, **dev) / hidden**0.5).requires_grad_()
    lora_b = (torch.randn(adapters, out, rank, **dev) / rank**0.5).requires_grad_()
    grad_y = torch.randn(tokens, out, **dev)
    return layout, x, weight, lora_a, lora_b, grad_y, [2.0] * adapters, [p] * adapters


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", type=int, default=4096)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_host_overhead needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {triton.__version__}")
    layout, x, weight, lora_a, lora_b, grad_y, scalings, dropouts = problem(
        args.tokens, args.hidden, args.out, args.adapters, args.dropout)
    s = torch.randn(args.tokens, lora_a.shape[1], device="cuda", dtype=torch.bfloat16)
    scales = torch.full((args.adapters,), 2.0, device="cuda")
    drops = torch.full((args.adapters,), args.dropout, device="cuda")
    grad_a_t = torch.empty_like(lora_a).transpose(1, 2)  # (A, H, R), as the backward passes it

    def fused(design):
        def step():
            y = fused_lora_linear(x, weight, None, lora_a, lora_b, scalings, dropouts, layout,
                                  layer_seed=3, design=design)
            y.backward(grad_y)
        return step

    def frozen():
        F.linear(x, weight).backward(grad_y)

    def fused_forward():
        return fused_lora_linear(x, weight, None, lora_a, lora_b, scalings, dropouts, layout,
                                 layer_seed=3)

    def fused_forward_no_grad():
        with torch.no_grad():
            fused_forward()

    variants = [
        ("empty Triton kernel, 1 argument", lambda: _empty_kernel[(1,)](x)),
        ("torch.empty (T, N)", lambda: torch.empty_like(grad_y)),
        ("F.linear forward + backward (frozen)", frozen),
        ("lora_shrink", lambda: lora_shrink(x.detach(), lora_a.detach(), scales, drops, layout, 3)),
        ("lora_expand", lambda: lora_expand(s, lora_b.detach().transpose(1, 2), None, None,
                                            layout, 3)),
        ("lora_up_bwd", lambda: lora_up_bwd(grad_y, s, lora_b.detach(), scales, layout,
                                            scale_db=False)),
        ("lora_wgrad", lambda: lora_wgrad(x.detach(), s, grad_a_t, drops, layout, 3)),
        ("fused forward, no grad (auto)", fused_forward_no_grad),
        ("fused forward + backward, cublas", fused("cublas")),
        ("fused forward + backward, triton_fwd", fused("triton_fwd")),
        ("fused forward + backward, triton", fused("triton")),
    ]
    print(f"\n## Host µs per call (T={args.tokens}, H={args.hidden}, N={args.out}, "
          f"A={args.adapters}, p={args.dropout}; the GPU asleep meanwhile)\n")
    print("| call | host µs |")
    print("|---|---|")
    variants += [  # (name, fn, make_arg): forward and backward apart
        ("F.linear forward, grad on (frozen)", lambda: F.linear(x, weight)),
        ("F.linear backward alone (frozen)", lambda y: y.backward(grad_y),
         lambda: F.linear(x, weight)),
        ("fused forward, grad on (auto)", fused_forward),
        ("fused backward alone (auto)", lambda y: y.backward(grad_y), fused_forward),
    ]
    for name, fn, *make_arg in variants:
        try:
            print(f"| {name} | {host_us(fn, args.calls, *make_arg):.1f} |", flush=True)
        except Exception as exc:  # noqa: BLE001 - report the variant, keep the others
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} |", flush=True)
        x.grad = lora_a.grad = lora_b.grad = None
    for design in ("cublas", "triton"):
        step = fused(design)
        step()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(f"\n## cProfile of {args.calls} fused forward + backward, design={design} "
              "(by own time)\n\n```")
        print(text.getvalue().strip())
        print("```")


if __name__ == "__main__":
    main()
