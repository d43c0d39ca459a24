"""Job traces for a LoRA server: jobs that arrive over time, and what-ifs at cluster scale.

`make_trace` draws the jobs of the tLoRA setting (arXiv 2602.07263): Poisson arrivals, ranks
8-64, global batches 8-32, sizes log-uniform in 200-2000 samples and XSum / CNN-DM /
WikiSum-like lengths, the arrival rate set so the offered load is a given fraction of the
server's throughput. ``scripts/bench_serve_trace.py`` runs a trace through a real server;
`simulate_trace` runs it through a model of one, for hundreds of jobs and many servers:

- a server trains ``R`` tokens/s whatever the number of jobs it holds (many adapters cost
  what one costs: docs/throughput.md), shared among its running jobs in proportion to the
  tokens of their global batches (the planner takes one global batch of every running job
  per round); a job alone runs at ``R_alone`` (one adapter fills its microbatches less);
- the policies of `config.ServerConfig.policy`: ``online`` (a job starts as soon as a row
  is free), ``shortest`` (as online, but only the jobs with the fewest tokens left train,
  at least two and enough to fill `config.SHORTEST_FIRST_MICROBATCHES` microbatches a
  round: `planner.shortest.choose_shortest`),
  ``fifo`` (one job at a time, what users do without a server), ``batch`` (jobs wait until
  the server is empty, then start together: static batches).

`best_mean_jct` is the floor under every policy: the mean job completion time of preemptive
shortest-remaining-first at the server's full rate, which no schedule of one server beats.

Pure Python (no torch): the CLI's ``lorafusion simulate --trace``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_lorafusion.config import SHORTEST_FIRST_MICROBATCHES
from megatron_lorafusion.planner.shortest import Candidate, choose_shortest
from megatron_lorafusion.sim.distributions import sample_lengths

__all__ = [
    "POLICIES",
    "TraceJob",
    "TraceResult",
    "best_mean_jct",
    "make_trace",
    "simulate_trace",
    "summarize",
]

POLICIES = ("online", "shortest", "fifo", "batch")
_DATASETS = ("xsum", "cnn_dm", "wikisum")


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace.

    Attributes:
        name: unique job name.
        arrival_s: when it is submitted, in seconds from the trace's start.
        rank: LoRA rank.
        global_batch_size: samples per optimizer step.
        dataset: length distribution (`distributions.DISTRIBUTIONS`).
        lengths: its samples' token lengths (one epoch).
        seed: its data's seed.
    """

    name: str
    arrival_s: float
    rank: int
    global_batch_size: int
    dataset: str
    lengths: tuple[int, ...]
    seed: int

    @property
    def tokens(self) -> int:
        """Tokens it trains (one epoch)."""
        return sum(self.lengths)

    @property
    def batch_tokens(self) -> float:
        """Mean tokens of one of its global batches (its share of a round)."""
        return self.tokens * self.global_batch_size / len(self.lengths)


def make_trace(
    num_jobs: int,
    *,
    seed: int,
    load: float,
    tokens_per_s: float,
    size_scale: float = 1.0,
    max_length: int = 2048,
) -> list[TraceJob]:
    """A trace of ``num_jobs`` jobs whose offered load is ``load`` × ``tokens_per_s``.

    Args:
        num_jobs: jobs in the trace.
        seed: everything is drawn from it.
        load: offered tokens per second over the arrival window, as a fraction of the
            server's throughput (0.8: the server is busy 80 % of the time on average).
        tokens_per_s: the server's throughput ``R``.
        size_scale: multiplies every job's sample count (a shorter trace of the same shape).
        max_length: samples are truncated to this many tokens (``data.max_seq_length``).

    Raises:
        ValueError: for a non-positive count, load, throughput or scale.
    """
    if num_jobs < 1 or not load > 0 or not tokens_per_s > 0 or not size_scale > 0:
        raise ValueError(
            f"num_jobs, load, tokens_per_s and size_scale must be positive, got {num_jobs}, "
            f"{load}, {tokens_per_s}, {size_scale}"
        )
    rng = random.Random(seed)
    drawn = []
    for i in range(num_jobs):
        gbs = rng.choice((8, 16, 32))
        samples = math.exp(rng.uniform(math.log(200), math.log(2000))) * size_scale
        samples = max(gbs, round(samples))
        dataset = rng.choice(_DATASETS)
        data_seed = seed * 1_000 + i
        lengths = tuple(min(n, max_length) for n in sample_lengths(dataset, samples, data_seed))
        drawn.append((f"job{i:03d}", rng.choice((8, 16, 32, 64)), gbs, dataset, lengths, data_seed))
    window = sum(sum(d[4]) for d in drawn) / (load * tokens_per_s)
    arrival, jobs = 0.0, []
    for name, rank, gbs, dataset, lengths, data_seed in drawn:
        jobs.append(TraceJob(name, arrival, rank, gbs, dataset, lengths, data_seed))
        arrival += rng.expovariate(num_jobs / window)
    return jobs


@dataclass(frozen=True)
class TraceResult:
    """Per job ``(start_s, finish_s)`` of one policy's run, and the run's busy time."""

    policy: str
    jobs: tuple[TraceJob, ...]
    start_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    busy_s: float


@dataclass
class _Running:
    job: TraceJob
    index: int
    left: float = field(default=0.0)  # tokens


def simulate_trace(
    jobs: Sequence[TraceJob],
    policy: str,
    tokens_per_s: float,
    max_adapters: int,
    *,
    alone_tokens_per_s: float | None = None,
    microbatch_tokens: int = 8192,
) -> TraceResult:
    """Run ``jobs`` through a model of one server (see the module docstring).

    Args:
        jobs: the trace, by arrival.
        policy: one of `POLICIES`.
        tokens_per_s: the server's throughput with several jobs, ``R``.
        max_adapters: jobs it trains at once.
        alone_tokens_per_s: throughput of a job alone (default ``R``).
        microbatch_tokens: tokens per microbatch (``shortest``: how many jobs train).

    Raises:
        ValueError: for an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    alone = tokens_per_s if alone_tokens_per_s is None else alone_tokens_per_s
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival_s)
    start, finish = [math.nan] * len(jobs), [math.nan] * len(jobs)
    queue: list[int] = []
    running: list[_Running] = []
    now, busy, arrived = 0.0, 0.0, 0
    trained: set[int] = set()  # ``shortest``: the jobs that trained in the last interval
    while arrived < len(order) or queue or running:
        while arrived < len(order) and jobs[order[arrived]].arrival_s <= now:
            queue.append(order[arrived])
            arrived += 1
        free = max_adapters - len(running)
        room = {
            "online": free,
            "shortest": free,
            "fifo": 0 if running else 1,
            "batch": 0 if running else free,
        }
        for _ in range(min(room[policy], len(queue))):
            i = queue.pop(0)
            start[i] = now
            running.append(_Running(jobs[i], i, float(jobs[i].tokens)))
        next_arrival = jobs[order[arrived]].arrival_s if arrived < len(order) else math.inf
        if not running:
            now = next_arrival
            continue
        training = running
        if policy == "shortest":
            candidates = [
                Candidate(r.index, r.left, r.job.batch_tokens, r.index in trained) for r in running
            ]
            keys = set(choose_shortest(candidates, SHORTEST_FIRST_MICROBATCHES * microbatch_tokens))
            training = [r for r in running if r.index in keys]
            trained = keys
        rate = alone if len(training) == 1 else tokens_per_s
        weights = sum(r.job.batch_tokens for r in training)
        shares = [rate * r.job.batch_tokens / weights for r in training]
        step = min(
            min(r.left / s for r, s in zip(training, shares, strict=True)), next_arrival - now
        )
        for r, s in zip(training, shares, strict=True):
            r.left -= s * step
        now += step
        busy += step
        for r in [r for r in running if r.left <= 1e-6 * r.job.tokens]:
            finish[r.index] = now
            running.remove(r)
    return TraceResult(policy, tuple(jobs), tuple(start), tuple(finish), busy)


def best_mean_jct(jobs: Sequence[TraceJob], tokens_per_s: float) -> float:
    """The smallest mean job completion time (s) any schedule of one server can give ``jobs``.

    The server trains ``tokens_per_s`` whatever it holds, all on the job with the fewest
    tokens left (preempted when a shorter one arrives): shortest-remaining-processing-time,
    which minimizes the mean completion time of a single server (Schrage, 1968). A real
    server's policy can only come close to it; a target below it is out of reach.
    """
    order = sorted(jobs, key=lambda j: j.arrival_s)
    left: dict[int, float] = {}  # position in ``order`` -> tokens left
    now, arrived, total = 0.0, 0, 0.0
    while arrived < len(order) or left:
        if not left:
            now = max(now, order[arrived].arrival_s)
        while arrived < len(order) and order[arrived].arrival_s <= now:
            left[arrived] = float(order[arrived].tokens)
            arrived += 1
        i = min(left, key=lambda k: (left[k], k))
        next_arrival = order[arrived].arrival_s if arrived < len(order) else math.inf
        done_at = now + left[i] / tokens_per_s
        if done_at <= next_arrival:
            now = done_at
            total += now - order[i].arrival_s
            del left[i]
        else:
            left[i] -= (next_arrival - now) * tokens_per_s
            now = next_arrival
    return total / len(order)


def summarize(result: TraceResult) -> dict[str, float]:
    """The run in numbers: makespan, job completion times, queue delay, busy share.

    Job completion time is finish − arrival (mean, p50, p95), queue delay start − arrival;
    busy is the share of the makespan the server was training.
    """
    jcts = sorted(f - j.arrival_s for j, f in zip(result.jobs, result.finish_s, strict=True))
    delays = [s - j.arrival_s for j, s in zip(result.jobs, result.start_s, strict=True)]
    first = min(j.arrival_s for j in result.jobs)
    makespan = max(result.finish_s) - first

    def pct(q: float) -> float:
        return jcts[min(len(jcts) - 1, round(q * (len(jcts) - 1)))]

    return {
        "makespan_s": makespan,
        "mean_jct_s": sum(jcts) / len(jcts),
        "p50_jct_s": pct(0.5),
        "p95_jct_s": pct(0.95),
        "mean_queue_s": sum(delays) / len(delays),
        "busy": result.busy_s / makespan if makespan > 0 else 0.0,
    }
