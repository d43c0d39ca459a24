"""Online LoRA jobs on one server against the baselines, through the same code (issue 32).

    python -m scripts.bench_serve_trace --preset llama3.2-1b --jobs 32 --load 0.8 \
        --size-scale 0.2 --max-seq-length 1024
    python -m scripts.bench_serve_trace --device cpu --preset tiny --jobs 4 --size-scale 0.02

1. Draws a trace (`sim.trace.make_trace`: ranks 8-64, global batches 8-32, sizes
   log-uniform 200-2000 samples × ``--size-scale``, XSum / CNN-DM / WikiSum-like lengths)
   and writes each job's data (byte tokenizer: one token per byte).
2. Trains every job of the trace as one static `lorafusion train` job: its training
   tokens/s ``R`` sets the arrival rate (offered load ``--load`` × R) and is the bar for
   the server's tokens/s while jobs join and leave (``--static-tokens-per-s R`` reuses an
   earlier run's, so that policies can run as separate commands on the same trace).
3. For each policy (``online``: a job starts when a row is free; ``shortest``: as online,
   the jobs with the fewest tokens left training first; ``fifo``: one at a time, what users
   do without a server; ``batch``: static batches) starts `lorafusion serve`,
   submits the jobs at their arrival times with `lorafusion submit`'s code, and reads each
   job's admission and finish times from its ``status.json``. A job's time alone is its
   run time under ``fifo`` (it ran alone there); its slowdown is its completion time over it.
4. Prints per job and per policy: arrival, start, finish, job completion time, queue delay,
   slowdown; makespan, mean / p50 / p95 JCT, busy share, tokens/s while training, where a
   job's time went (queued, admission to its first optimizer step, first to last step, last
   step to its end), the simulator's figures for the same trace
   (`sim.trace.simulate_trace` with the measured R and R alone) and the floor under every
   policy's mean JCT (`sim.trace.best_mean_jct` at R).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from megatron_lorafusion.config import load_submission
from megatron_lorafusion.data import write_lengths
from megatron_lorafusion.inbox import ServerRoot
from megatron_lorafusion.sim.trace import best_mean_jct, make_trace, simulate_trace, summarize
from megatron_lorafusion.train.metrics import read_metrics


def _sections(args) -> dict:
    model = {"preset": args.preset}
    if args.preset == "tiny":
        model["num_layers"] = 1
    return {
        "model": model,
        "data": {"max_seq_length": args.max_seq_length},
        "planner": {"token_capacity": args.capacity},
        "logging": {"progress_bar": False, "log_every": 10**6},
    }


def _train_keys(args, out: Path) -> dict:
    return {
        "epochs": 1,
        "precision": "bf16" if args.device == "cuda" else "fp32",
        "device": args.device,
        "output_dir": str(out),
        "save_every": args.save_every,
        "keep_last": 1,
    }


def _entry(job, data: Path) -> dict:
    return {
        "name": job.name,
        "dataset": {"path": str(data / f"{job.name}.jsonl")},
        "rank": job.rank,
        "alpha": 2 * job.rank,
        "dropout": 0.1,
        "lr": 1e-4,
        "global_batch_size": job.global_batch_size,
    }


def _static(args, jobs, folder: Path) -> float:
    """Every job of the trace as one `lorafusion train` job: its training tokens/s."""
    job = {
        **_sections(args),
        "adapters": [_entry(j, folder / "data") for j in jobs],
        "train": _train_keys(args, folder / "static"),
    }
    path = folder / "static.yaml"
    path.write_text(yaml.safe_dump(job))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatron_lorafusion", "train", str(path)], check=True)
    records = [json.loads(line) for line in (folder / "static" / "metrics.jsonl").open()]
    run = [r for r in records if r.get("adapter") is None][-1]
    print(
        f"static job: {run['train_tokens_per_s']:,.0f} training tokens/s, wall "
        f"{time.perf_counter() - start:.0f} s",
        file=sys.stderr,
    )
    shutil.rmtree(folder / "static", ignore_errors=True)
    return run["train_tokens_per_s"]


def _serve(args, jobs, folder: Path, policy: str) -> dict:
    """One policy's run: per job (arrival, start, finish) in seconds, and server stats."""
    root = folder / f"root-{policy}"
    shutil.rmtree(root, ignore_errors=True)
    server = {
        **_sections(args),
        "train": {**_train_keys(args, folder / "unused"), "epochs": 1},
        "server": {
            "root": str(root),
            "max_adapters": args.max_adapters,
            "max_rank": 64,
            "idle_timeout_s": 0,
            "poll_s": args.poll_s,
            "policy": policy,
        },
    }
    path = folder / f"server-{policy}.yaml"
    path.write_text(yaml.safe_dump(server))
    child = subprocess.Popen([sys.executable, "-m", "megatron_lorafusion", "serve", str(path)])
    files = ServerRoot(root)
    while files.server_info() is None:
        if child.poll() is not None:
            raise RuntimeError(f"the {policy} server exited with {child.returncode}")
        time.sleep(0.2)
    server_job = files.server_job()
    specs = {}
    for job in jobs:
        one = folder / "submit" / f"{job.name}.yaml"
        one.parent.mkdir(parents=True, exist_ok=True)
        one.write_text(yaml.safe_dump({"adapters": [_entry(job, folder / "data")]}))
        specs[job.name] = load_submission(one, server_job)  # validated before the clock runs
    t0, submitted = time.time(), {}
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    while True:
        now = time.time() - t0
        while pending and pending[0].arrival_s <= now:
            job = pending.pop(0)
            files.submit(specs[job.name])
            submitted[job.name] = time.time() - t0
        statuses = {n: files.status_of(n) for n in submitted}
        if not pending and all(s in ("done", "failed") for s in statuses.values()):
            break
        if child.poll() is not None:
            raise RuntimeError(f"the {policy} server exited with {child.returncode}")
        time.sleep(0.1)
    child.terminate()
    child.wait(timeout=120)
    out, steps = {}, {}
    for job in jobs:
        status = json.loads((files.job_dir(job.name) / "status.json").read_text())
        out[job.name] = (
            submitted[job.name],
            status["started_at"] - t0,
            status["finished_at"] - t0,
            status["status"],
        )
        steps[job.name] = _step_times(files.job_dir(job.name))
    return {"jobs": out, "steps": steps, "stats": (files.server_info() or {}).get("stats", {})}


def _step_times(job_dir: Path) -> tuple[float, float] | None:
    """Seconds from a job's admission to its first and to its last optimizer step.

    A served job's metrics writer starts at its admission, so its step records' ``time_s``
    count from there.
    """
    try:
        records = read_metrics(job_dir)
    except FileNotFoundError:
        return None
    times = [r["time_s"] for r in records if "time_s" in r]
    return (min(times), max(times)) if times else None


def _where_time_went(run: dict) -> dict[str, float]:
    """Mean seconds per job: queued, admission to first step, first to last step, last step
    to its end (retired), over the jobs whose steps were recorded."""
    parts = {"queued": [], "to first step": [], "first to last step": [], "after last step": []}
    for name, (arrival, start, finish, _) in run["jobs"].items():
        got = run["steps"].get(name)
        if got is None:
            continue
        first, last = got
        parts["queued"].append(start - arrival)
        parts["to first step"].append(first)
        parts["first to last step"].append(last - first)
        parts["after last step"].append(finish - start - last)
    return {k: statistics.mean(v) if v else float("nan") for k, v in parts.items()}


def _summary(jobs, run: dict, alone: dict[str, float]) -> dict:
    jcts = sorted(f - a for a, _, f, _ in run["jobs"].values())
    delays = [s - a for a, s, _, _ in run["jobs"].values()]
    finish = max(f for _, _, f, _ in run["jobs"].values())
    slow = [(f - a) / alone[name] for name, (a, _, f, _) in run["jobs"].items() if alone.get(name)]
    spans = sorted((s, f) for _, s, f, _ in run["jobs"].values())
    busy, end = 0.0, -1.0
    for s, f in spans:  # the union of the jobs' run intervals
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    return {
        "makespan_s": finish,
        "mean_jct_s": statistics.mean(jcts),
        "p50_jct_s": jcts[len(jcts) // 2],
        "p95_jct_s": jcts[min(len(jcts) - 1, round(0.95 * (len(jcts) - 1)))],
        "mean_queue_s": statistics.mean(delays),
        "mean_slowdown": statistics.mean(slow) if slow else float("nan"),
        "busy": busy / finish if finish > 0 else 0.0,
        "tokens_per_busy_s": run["stats"].get("tokens_per_busy_s", float("nan")),
        "failed": sum(st != "done" for *_, st in run["jobs"].values()),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--size-scale", type=float, default=0.2)
    parser.add_argument("--max-seq-length", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--max-adapters", type=int, default=32)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["online", "shortest", "fifo", "batch"])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--static-tokens-per-s",
        type=float,
        default=None,
        help="skip step 2: the static job's training tokens/s from an earlier run of this trace",
    )
    parser.add_argument("--dir", default="runs/bench_trace")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    draft = make_trace(
        args.jobs,
        seed=args.seed,
        load=args.load,
        tokens_per_s=1.0,
        size_scale=args.size_scale,
        max_length=args.max_seq_length,
    )
    for job in draft:
        write_lengths(folder / "data" / f"{job.name}.jsonl", list(job.lengths), seed=job.seed)
    rate = args.static_tokens_per_s or _static(args, draft, folder)
    jobs = make_trace(  # the same jobs, arriving at the offered load of the measured rate
        args.jobs,
        seed=args.seed,
        load=args.load,
        tokens_per_s=rate,
        size_scale=args.size_scale,
        max_length=args.max_seq_length,
    )
    runs = {}
    for policy in args.policies:  # each policy's figures as soon as it is done
        runs[policy] = _serve(args, jobs, folder, policy)
        s = _summary(jobs, runs[policy], {})
        print(f"{policy}: {json.dumps(s)}", file=sys.stderr, flush=True)
    alone = {}
    if "fifo" in runs:
        alone = {n: f - s for n, (_, s, f, _) in runs["fifo"]["jobs"].items()}
    tokens = sum(j.tokens for j in jobs)
    print(
        f"trace: {len(jobs)} jobs, {tokens:,} tokens, last arrival {jobs[-1].arrival_s:.0f} s, "
        f"offered load {args.load} of the static job's {rate:,.0f} tokens/s"
    )
    print(
        "| policy | makespan s | mean JCT s | p50 | p95 | mean queue s | mean slowdown | busy "
        "| tokens/s training | failed |"
    )
    print("|---" * 10 + "|")
    result = {"static_tokens_per_s": rate, "policies": {}}
    for policy, run in runs.items():
        s = _summary(jobs, run, alone)
        result["policies"][policy] = s
        print(
            f"| {policy} | {s['makespan_s']:.0f} | {s['mean_jct_s']:.1f} | {s['p50_jct_s']:.1f} | "
            f"{s['p95_jct_s']:.1f} | {s['mean_queue_s']:.1f} | {s['mean_slowdown']:.2f} | "
            f"{100 * s['busy']:.0f}% | {s['tokens_per_busy_s']:,.0f} | {s['failed']} |"
        )
    print("\nwhere a job's time went (mean s per job; steps from its metrics.jsonl):")
    print("| policy | queued | admission to first step | first to last step | after last step |")
    print("|---|---|---|---|---|")
    for policy, run in runs.items():
        w = _where_time_went(run)
        result["policies"][policy]["where_s"] = w
        print(f"| {policy} | " + " | ".join(f"{v:.2f}" for v in w.values()) + " |")
    r_alone = tokens / max(sum(alone.values()), 1e-9) if alone else None
    print("\nsimulator, same trace (R measured, R alone from fifo):")
    for policy in args.policies:
        s = summarize(
            simulate_trace(
                jobs,
                policy,
                rate,
                args.max_adapters,
                alone_tokens_per_s=r_alone,
                microbatch_tokens=args.capacity,
            )
        )
        print(
            f"| {policy} | {s['makespan_s']:.0f} | {s['mean_jct_s']:.1f} | "
            f"{s['p50_jct_s']:.1f} | {s['p95_jct_s']:.1f} | {s['mean_queue_s']:.1f} |"
        )
    floor = best_mean_jct(jobs, rate)
    result["best_mean_jct_s"] = floor
    print(
        f"\nno schedule of one server at the static job's rate beats a mean JCT of {floor:.1f} s "
        "(shortest remaining first, no overheads: sim.trace.best_mean_jct)"
    )
    print("\nper job (arrival, start, finish s; fifo time alone s):")
    for job in jobs:
        cells = [
            f"{p}: " + "/".join(f"{t:.1f}" for t in runs[p]["jobs"][job.name][:3]) for p in runs
        ]
        print(
            f"{job.name} rank {job.rank} gbs {job.global_batch_size} {job.tokens:,} tokens "
            f"| " + " | ".join(cells) + f" | alone {alone.get(job.name, float('nan')):.1f}"
        )
    (folder / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
