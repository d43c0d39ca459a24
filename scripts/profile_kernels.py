"""Where the fused op's GPU time goes: device time of every kernel of one forward + backward.

Run as ``python -m scripts.profile_kernels`` on a GPU. For each cell (T, H, N, A, p) it runs
the frozen linear and the fused op (``design="auto"``) under `torch.profiler` and prints each
kernel's device time per forward + backward (µs, the mean over the profiled steps), the sum
over kernels, and the sum's ratio to the frozen one. Kernel sums leave out launch gaps and
host time: they are the GPU-only cost, to set against `bench_kernels`' end-to-end ratios.
The two are profiled in alternating rounds, so both see the same clock and power states.
"""

import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.bench_kernels import SHAPES, TOKENS, frozen_fn, fused_fn, fwd_bwd, make_problem

ROUNDS = 5
STEPS_PER_ROUND = 2
NAME_CHARS = 70


def _run(step, leaves, steps: int) -> None:
    for _ in range(steps):
        step()
        for leaf in leaves:
            leaf.grad = None


def kernel_times(*variants) -> list[dict[str, float]]:
    """Device µs per step of each kernel, by kernel name, for each ``(step, leaves)`` variant.

    The variants are profiled in ``ROUNDS`` alternating rounds of ``STEPS_PER_ROUND`` steps.
    """
    for step, leaves in variants:
        _run(step, leaves, 3)  # compile and pick configs outside the profile
    torch.cuda.synchronize()
    times: list[dict[str, float]] = [defaultdict(float) for _ in variants]
    steps = ROUNDS * STEPS_PER_ROUND
    for _ in range(ROUNDS):
        for (step, leaves), acc in zip(variants, times, strict=True):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _run(step, leaves, STEPS_PER_ROUND)
                torch.cuda.synchronize()
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
                    acc[event.name[:NAME_CHARS]] += event.device_time / steps
    return [dict(acc) for acc in times]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_kernels needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    summary = []
    for tokens in args.tokens:
        for hidden, out in SHAPES:
            for p in (0.1, 0.0):
                prob = make_problem(tokens, hidden, out, args.adapters, p)
                frozen, fused = kernel_times(fwd_bwd(prob, frozen_fn(prob), with_lora=False),
                                             fwd_bwd(prob, fused_fn(prob, "auto")))
                print(f"\n### T={tokens} H={hidden} N={out} A={args.adapters} p={p}\n")
                print("| kernel | frozen µs | fused µs |")
                print("|---|---|---|")
                for name in sorted(set(frozen) | set(fused),
                                   key=lambda k: -max(frozen.get(k, 0), fused.get(k, 0))):
                    print(f"| `{name}` | {frozen.get(name, 0):.1f} | {fused.get(name, 0):.1f} |")
                total_frozen, total_fused = sum(frozen.values()), sum(fused.values())
                print(f"| **sum** | {total_frozen:.1f} | {total_fused:.1f} |")
                summary.append((tokens, hidden, out, p, total_frozen, total_fused))
                del prob
                torch.cuda.empty_cache()
    print(f"\n## Kernel-time sums per forward + backward (A={args.adapters}), µs\n")
    print("| T | H | N | p | frozen | fused | fused/frozen | extra µs |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens, hidden, out, p, total_frozen, total_fused in summary:
        print(f"| {tokens} | {hidden} | {out} | {p} | {total_frozen:.0f} | {total_fused:.0f} "
              f"| {total_fused / total_frozen:.3f} | {total_fused - total_frozen:.0f} |")


if __name__ == "__main__":
    main()
