"""Where a microbatch's time goes in the real `lorafusion train` loop: host phases and GPU.

    python -m scripts.profile_train --preset llama3.2-1b --adapters 1 --global-batch 8
    python -m scripts.profile_train --device cpu --preset tiny --samples 64 --max-seq-length 1024
    python -m scripts.profile_train --preset llama3.1-8b --adapters 4 --samples 512 \
        --set model.base_precision=fp8 train.recompute=none   # issue 34's speed job

Runs `train.main` in this process on the issue 33 workload (`bench_train_cli`'s job) and
times, per microbatch after a warm-up: the host's time in packing (`Session._make_batch`),
in the forward and backward calls of the runner, in the optimizer step and in confirming a
step (metrics, progress, saves: `Session._on_step`), the wall time per microbatch, and the
GPU time of its forward, backward and step (CUDA events on the compute stream, the runner's
``record_events``). If the host's sum is near the wall time and the GPU's well below, the
loop is host-bound there. Prints one markdown table (medians over the timed microbatches);
with ``--cuda-graphs on`` a second one splits every microbatch by what the graphs did with it
(ran it eagerly, captured its shape, replayed it).

``--job FILE`` profiles that job file instead (its own adapters and data: e.g. issue 34's
speed job, ``--job configs/llama8b_fp8.yaml --set train.steps=16``); ``--trace FILE`` writes
every microbatch as a JSON line (wall and tokens, the host's and the GPU's start and end of its
forward, backward and step on one time axis each) and prints where the GPU stood idle.

``--cprofile FILE`` also profiles the host's Python over the timed microbatches (cProfile,
saved to FILE, top functions printed); ``--first-cprofile FILE`` profiles the first
microbatch alone (warm-up: Triton's kernel loads, first calls) and prints the wall time of
each of the first ten; ``--sync-sites`` lists, for the timed microbatches,
every call site that made the host wait for the GPU (torch's sync debug mode, CUDA only).
"""

import argparse
import cProfile
import json
import math
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from megatron_lorafusion.config import load_config
from megatron_lorafusion.pipeline import runner as runner_module
from megatron_lorafusion.pipeline.graphs import MicrobatchGraphs
from megatron_lorafusion.train import session as session_module
from megatron_lorafusion.train.main import main as train_main
from scripts.bench_train_cli import _job


def _timed(owner, name: str, into: list[float]):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--adapters", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=20, help="microbatches not timed")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dir", default="runs/profile_train")
    parser.add_argument("--job", type=Path, help="profile this job file (not the generated job)")
    parser.add_argument("--trace", type=Path, help="write every microbatch here (JSON lines)")
    parser.add_argument("--cprofile", help="save a cProfile of the timed microbatches here")
    parser.add_argument("--first-cprofile", help="save a cProfile of the first microbatch here")
    parser.add_argument("--sync-sites", action="store_true", help="list host-GPU syncs")
    parser.add_argument(
        "--slowest", type=int, default=0, help="list this many slowest timed microbatches"
    )
    parser.add_argument(
        "--cuda-graphs", choices=("auto", "on", "off"), default="auto", help="train.cuda_graphs"
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="job file overrides"
    )
    args = parser.parse_args(argv)
    bench = argparse.Namespace(
        samples=args.samples,
        min_steps=0,
        rank=16,
        capacity=8192,
        max_seq_length=args.max_seq_length,
        keep_last=1,
        save_buffer_gib=None,
        device=args.device,
        from_checkpoint=None,
    )
    folder = Path(args.dir)
    job = args.job or _job(
        bench, folder, args.preset, args.adapters, args.global_batch, 0, args.cuda_graphs
    )
    phases = {k: [] for k in ("pack", "forward", "backward", "step", "confirm")}
    _timed(session_module.Session, "_make_batch", phases["pack"])
    tokens: list[int] = []  # real (not padding) tokens of each microbatch packed
    real_make_batch = session_module.Session._make_batch

    def counted_make_batch(self, microbatch, index):
        tokens.append(microbatch.tokens)
        return real_make_batch(self, microbatch, index)

    session_module.Session._make_batch = counted_make_batch
    _timed(session_module.Session, "_on_step", phases["confirm"])
    _timed(runner_module._Runner, "_forward", phases["forward"])
    _timed(runner_module._Runner, "_backward", phases["backward"])
    _timed(runner_module._Runner, "_finish_step", phases["step"])
    walls, events = [], []
    kinds: list[str] = []  # per microbatch with graphs on: eager, capture or replay
    real_graph_train = MicrobatchGraphs.train

    def graph_train(self, batch, denominators):
        before = (self.replays, self.captures)
        losses = real_graph_train(self, batch, denominators)
        replayed, captured = self.replays > before[0], self.captures > before[1]
        kinds.append("replay" if replayed else "capture" if captured else "eager")
        return losses

    MicrobatchGraphs.train = graph_train
    real_run = runner_module._Runner.run

    profiler = cProfile.Profile() if args.cprofile else None
    first = cProfile.Profile() if args.first_cprofile else None
    sync_sites: Counter = Counter()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames = [
                f"{Path(f.filename).name}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()[:-1]
                if "megatron_lorafusion" in f.filename
            ]
            sync_sites[" <- ".join(reversed(frames[-4:]))] += 1

    def watch(on: bool) -> None:  # the timed window: cProfile and the sync sites
        if profiler is not None:
            profiler.enable() if on else profiler.disable()
        if args.sync_sites and args.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn" if on else "default")
            warnings.simplefilter("always" if on else "default")
            warnings.showwarning = on_warning if on else real_showwarning

    real_showwarning = warnings.showwarning

    def run(self, actions):  # time every microbatch (wall) and keep the GPU events
        self.record_events = args.device == "cuda"
        last = [time.perf_counter()]
        if first is not None and not walls:
            first.enable()

        def marked():
            for action in actions:
                yield action
                if action.kind == "B":  # host time between backward calls (no sync)
                    now = time.perf_counter()
                    walls.append(now - last[0])
                    last[0] = now
                    if first is not None and len(walls) == 1:
                        first.disable()
                    if len(walls) == args.warmup:
                        watch(True)

        try:
            real_run(self, marked())
        finally:
            watch(False)
        events.extend(self.state.events)

    runner_module._Runner.run = run
    gpu_axis: list[tuple] = []  # (microbatch, kind, GPU start s, GPU end s, host start s)
    origin: list = []  # the job's first timing mark: one GPU time axis for every run call
    real_resolve = runner_module._Runner._resolve_gpu_events

    def resolve(self):
        if self.state.gpu_events:
            torch.cuda.synchronize(self.device)
            origin[:] = origin or [self.state.gpu_events[0][3]]
            for k, kind, host_start, first, last, *_ in self.state.gpu_events:
                begin, end = origin[0].elapsed_time(first), origin[0].elapsed_time(last)
                gpu_axis.append((k, kind, begin / 1e3, end / 1e3, host_start))
        real_resolve(self)

    runner_module._Runner._resolve_gpu_events = resolve
    train_main(load_config(job, ["train.output_dir=" + str(folder / "run"), *args.set]))
    w = args.warmup

    def med(values: list[float]) -> float:
        values = values[w:] if len(values) > w else values
        return 1e3 * statistics.median(values) if values else float("nan")

    gpu = {kind: [e.compute_s for e in events if e.kind == kind][w:] for kind in ("F", "B", "O")}
    result = {f"host_{k}_ms": med(v) for k, v in phases.items()}
    result["wall_ms"] = med(walls)
    timed = walls[w:] if len(walls) > w else walls
    result["tokens_per_s"] = sum(tokens[len(walls) - len(timed) : len(walls)]) / max(
        sum(timed), 1e-9
    )
    for kind, values in gpu.items():
        result[f"gpu_{kind}_ms"] = 1e3 * statistics.median(values) if values else float("nan")
    print(
        f"{args.preset}, {args.adapters} adapter(s), global batch {args.global_batch}, "
        f"{len(walls)} microbatches ({w} warm-up), medians in ms; wall: host time from one "
        "backward call to the next (the host runs ahead of the GPU unless it waits); "
        "tokens_per_s: the timed microbatches' real tokens over their summed wall time"
    )
    print("| " + " | ".join(result) + " |")
    print("|" + "---|" * len(result))
    print("| " + " | ".join(f"{v:.2f}" if v < 1e4 else f"{v:,.0f}" for v in result.values()) + " |")
    if kinds:
        _print_kinds(kinds, walls, gpu["F"], w)
    if first is not None and walls:  # a run with no microbatch has no profile
        _print_first(walls, kinds)
        first.dump_stats(args.first_cprofile)
        for order in ("tottime", "cumulative"):
            pstats.Stats(first).sort_stats(order).print_stats(30)
    if profiler is not None:
        profiler.dump_stats(args.cprofile)
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler).sort_stats(order).print_stats(40)
    if args.trace is not None:
        _write_trace(args.trace, walls, tokens, events, gpu_axis, w)
    if args.slowest:
        _print_slowest(walls, tokens, w, args.slowest)
    if args.sync_sites:
        print(f"host-GPU syncs in the timed microbatches ({len(walls) - w}):")
        for site, count in sync_sites.most_common():
            print(f"{count:6d}  {site}")
    return result


def _write_trace(
    path: Path, walls: list[float], tokens: list[int], events: list, gpu_axis: list, warmup: int
) -> None:
    """Every microbatch and step as a JSON line; prints the GPU's idle time.

    A microbatch's line: ``microbatch``, ``wall_ms`` (host, backward call to backward call),
    ``tokens``, and ``host_F``, ``host_B``, ``gpu_F``, ``gpu_B`` as [start, end] in seconds (the
    host's on its clock, the GPU's from the job's first timing mark). A step group's line:
    ``step`` (its first adapter), ``host_O`` and ``gpu_O``.
    """
    rows: dict[tuple, dict] = {}
    for i, wall in enumerate(walls):
        rows[("F", i)] = {"microbatch": i, "wall_ms": 1e3 * wall, "tokens": tokens[i]}
    for e in events:
        key = ("O", e.start_s) if e.kind == "O" else ("F", e.microbatch)
        row = rows.setdefault(key, {"step" if e.kind == "O" else "microbatch": e.microbatch})
        row[f"host_{e.kind}"] = [e.start_s, e.end_s]
    for k, kind, begin, end, host_start in gpu_axis:
        key = ("O", host_start) if kind == "O" else ("F", k)
        rows.setdefault(key, {"step" if kind == "O" else "microbatch": k})[f"gpu_{kind}"] = [
            begin,
            end,
        ]
    with path.open("w") as out:
        for row in sorted(rows.values(), key=lambda r: r.get("gpu_F", r.get("gpu_O", [0]))[0]):
            out.write(json.dumps(row) + "\n")
    spans = sorted((begin, end) for _, _, begin, end, _ in gpu_axis)
    first = [begin for k, kind, begin, _, _ in gpu_axis if kind == "F" and k == warmup]
    timed = [(b, e) for b, e in spans if first and b >= first[0]]
    if not timed:
        return
    busy = sum(e - b for b, e in timed)
    span = timed[-1][1] - timed[0][0]
    gaps = sorted((timed[i + 1][0] - timed[i][1] for i in range(len(timed) - 1)), reverse=True)
    print(
        f"GPU from microbatch {warmup} on: {span:.3f} s, inside the timed operations "
        f"{busy:.3f} s ({100 * busy / max(span, 1e-9):.1f} %); largest gaps between them "
        "(ms): " + ", ".join(f"{1e3 * g:.1f}" for g in gaps[:8])
    )


def _print_slowest(walls: list[float], tokens: list[int], warmup: int, count: int) -> None:
    """The ``count`` slowest timed microbatches: index, wall ms, x the median, tokens."""
    timed = list(enumerate(walls))[warmup:]
    steady = statistics.median(w for _, w in timed) if timed else math.nan
    print(f"slowest timed microbatches (of {len(timed)}; median {1e3 * steady:.1f} ms):")
    print("| microbatch | wall ms | x median | tokens |")
    print("|---|---|---|---|")
    for index, wall in sorted(timed, key=lambda iw: -iw[1])[:count]:
        print(f"| {index} | {1e3 * wall:.1f} | {wall / steady:.2f} | {tokens[index]} |")


def _print_first(walls: list[float], kinds: list[str]) -> None:
    """The wall time of each of the first ten microbatches against the run's median."""
    steady = statistics.median(walls) if walls else math.nan
    print(f"first microbatches (wall ms; x the median {1e3 * steady:.1f} ms):")
    print("| microbatch | kind | wall ms | x median |")
    print("|---|---|---|---|")
    for i, wall in enumerate(walls[:10]):
        kind = kinds[i] if i < len(kinds) else "eager"
        print(f"| {i + 1} | {kind} | {1e3 * wall:.1f} | {wall / steady:.1f} |")


def _print_kinds(kinds: list[str], walls: list[float], gpu_forward: list[float], warmup: int):
    """Per kind of microbatch (eager, capture, replay): count, median wall and GPU, total wall.

    Every microbatch, the warm-up's included (captures happen early). With graphs on, the GPU
    time of the forward event holds the whole microbatch (forward, loss and backward).
    """
    gpu = [math.nan] * warmup + gpu_forward  # `gpu_forward` skips the warm-up
    print("| microbatch | count | median wall ms | median GPU ms | total wall s |")
    print("|---|---|---|---|---|")
    for kind in ("eager", "capture", "replay"):
        picked = [i for i, k in enumerate(kinds[: len(walls)]) if k == kind]
        if not picked:
            continue
        wall = [walls[i] for i in picked]
        busy = [gpu[i] for i in picked if i < len(gpu) and not math.isnan(gpu[i])]
        print(
            f"| {kind} | {len(picked)} | {1e3 * statistics.median(wall):.1f} | "
            f"{1e3 * statistics.median(busy) if busy else math.nan:.1f} | {sum(wall):.2f} |"
        )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
