"""`JobStream`: every sample of a running job exactly once, whole global batches marked where
they finish, jobs joining and leaving at chunk boundaries (re-planned, mid-batch too), a cut
at each plan switch of a pipelined run, and no sample of a job gone at a cut after it."""

import pytest

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.data import TokenizedSample
from megatron_lorafusion.planner import iter_plan_chunks
from megatron_lorafusion.train.job import AdapterJob
from megatron_lorafusion.train.stream import CUT, JobStream


def _job(name: str, samples: int, gbs: int, seed: int = 0) -> AdapterJob:
    rows = [
        TokenizedSample((1,) * n, (1,) * n, (1,) * n)
        for n in ((7 * i + 3 * seed) % 29 + 4 for i in range(samples))
    ]
    return AdapterJob.create(
        AdapterConfig(name=name, global_batch_size=gbs), rows, [], list(range(samples)), 0
    )


def _stream(num_stages: int = 1, in_process: bool = False) -> JobStream:
    return JobStream(
        capacity=64,
        num_stages=num_stages,
        tile_height=1,
        seed=3,
        start_planner=lambda problem: iter_plan_chunks(problem, rounds_per_chunk=1),
        plans_in_process=lambda samples: in_process,
    )


def _check_batches(job: AdapterJob, yielded: list[tuple[list[int], bool]], upto: int | None):
    """``yielded``: per microbatch holding the job, its positions and whether it finishes.

    Every batch the job finished is whole and marked where its last sample is; samples after
    the last finished batch (a job that left) all belong to the next one. ``upto``: samples
    expected in all (None: the job left mid-way).
    """
    gbs = job.global_batch_size
    positions = [p for ps, _ in yielded for p in ps]
    assert len(set(positions)) == len(positions), f"{job.name}: a sample appears twice"
    if upto is not None:
        assert sorted(positions) == list(range(upto)), f"{job.name}: {positions}"
    seen, batch = set(), 0
    for ps, finishes in yielded:
        assert all(p // gbs == batch for p in ps), f"{job.name}: batches mixed at {ps}"
        seen.update(ps)
        complete = seen >= set(range(batch * gbs, min((batch + 1) * gbs, len(job.order))))
        assert finishes == complete, f"{job.name}: batch {batch} marked {finishes}, {complete}"
        if finishes:
            batch, seen = batch + 1, set()


def _run(stream: JobStream, events: dict[int, callable] | None = None):
    """Iterate, calling ``events[k]`` before microbatch k is asked for; per job name its
    (positions, finishes) in order, the cuts' positions and the microbatches."""
    per_job, cuts, count = {}, [], 0
    items = iter(stream)
    while True:
        if events and count in events:
            events.pop(count)()
        item = next(items, "end")
        if item == "end":
            break
        if item is CUT:
            cuts.append(count)
            continue
        names = {slot: stream.jobs[slot].name for slot in stream.jobs}
        by_slot = {}
        for s in item.samples:
            by_slot.setdefault(s.adapter, []).append(s.index)
        for slot in set(by_slot) | set(item.finishes):
            per_job.setdefault(names[slot], []).append(
                (by_slot.get(slot, []), slot in item.finishes)
            )
        count += 1
    return per_job, cuts, count


def test_stream_yields_every_sample_once_in_whole_batches():
    jobs = [_job("a", 20, 4), _job("b", 13, 3, seed=1), _job("c", 9, 9, seed=2)]
    stream = _stream()
    stream.jobs.update(enumerate(jobs))
    per_job, cuts, _ = _run(stream)
    for job in jobs:
        _check_batches(job, per_job[job.name], upto=len(job.order))
    assert stream.replans == 1, "a job set that never changes is planned once"
    assert cuts == []


def test_stream_drops_a_leaving_job_and_replans_the_others():
    jobs = [_job("a", 24, 4), _job("b", 24, 4, seed=1)]
    stream = _stream()
    stream.jobs.update(enumerate(jobs))
    per_job, _, _ = _run(stream, {3: lambda: stream.jobs.pop(1)})
    _check_batches(jobs[0], per_job["a"], upto=24)
    left = sum(len(ps) for ps, _ in per_job["b"])
    assert left < 24, "b left: its later samples must not be trained"
    _check_batches(jobs[1], per_job["b"], upto=None)
    assert stream.replans == 2


@pytest.mark.parametrize("at", [0, 2, 5])
def test_stream_admits_a_joining_job_mid_run(at):
    jobs = [_job("a", 30, 5), _job("late", 12, 4, seed=3)]
    stream = _stream()
    stream.jobs[0] = jobs[0]
    per_job, _, _ = _run(stream, {at: lambda: stream.jobs.__setitem__(1, jobs[1])})
    _check_batches(jobs[0], per_job["a"], upto=30)  # its partial batch continues across
    _check_batches(jobs[1], per_job["late"], upto=12)


def test_a_job_joins_one_chunk_sooner_when_its_plan_is_made_in_process():
    """A worker's plan is hidden behind the old plan's next chunk; a plan made in this
    process is waited for, so the joining job's samples start right after the current chunk.
    """
    firsts = {}
    for in_process in (False, True):
        jobs = [_job("a", 40, 4), _job("late", 12, 4, seed=3)]
        stream = _stream(in_process=in_process)
        stream.jobs[0] = jobs[0]
        order = []
        for count, item in enumerate(stream):
            if count == 1:
                stream.jobs[1] = jobs[1]
            order.append([s.adapter for s in item.samples])
        firsts[in_process] = next(i for i, slots in enumerate(order) if 1 in slots)
        for slot, job in enumerate(jobs):
            trained = sum(slots.count(slot) for slots in order)
            assert trained == len(job.order), (in_process, job.name, trained)
    assert firsts[True] < firsts[False], firsts


def test_stream_of_a_pipelined_run_cuts_at_plan_switches():
    jobs = [_job("a", 16, 4), _job("b", 16, 4, seed=1)]
    stream = _stream(num_stages=2)
    stream.jobs[0] = jobs[0]
    per_job, cuts, _ = _run(stream, {2: lambda: stream.jobs.__setitem__(1, jobs[1])})
    _check_batches(jobs[0], per_job["a"], upto=16)
    _check_batches(jobs[1], per_job["b"], upto=16)
    assert len(cuts) == 1, f"one switch, one cut: {cuts}"


def test_stream_of_a_pipelined_run_holds_no_sample_of_a_job_gone_at_its_cut():
    """Jobs retired at a plan switch's cut (a server frees their rows there) have no sample
    in any later microbatch: the microbatch after a cut is made after it."""
    jobs = [_job("a", 16, 4), _job("b", 16, 4, seed=1), _job("c", 16, 4, seed=2)]
    stream = _stream(num_stages=2)
    stream.jobs.update({0: jobs[0], 1: jobs[1]})
    seen, cuts, after_cut = 0, 0, []
    for item in stream:
        if item is CUT:
            cuts += 1
            stream.jobs.pop(1, None)  # b and c leave at the first cut: a trains on alone
            stream.jobs.pop(2, None)
            continue
        seen += 1
        if cuts:
            after_cut.append(item)
        if seen == 2:
            stream.jobs[2] = jobs[2]  # joins: the next chunk switches plans, with a cut
    assert cuts, "the join must have caused a cut"
    assert after_cut, "a must train on after the cut"
    assert all(s.adapter == 0 for mb in after_cut for s in mb.samples), after_cut[:2]
    assert all(mb.finishes in ((), (0,)) for mb in after_cut), after_cut[:2]


def _shortest_stream(tokens: int) -> JobStream:
    stream = _stream(in_process=True)
    stream.shortest_first = tokens
    return stream


def _first_and_last(order: list[int]) -> dict[int, tuple[int, int]]:
    """Per slot, the first and last microbatch holding it."""
    spans = {}
    for k, slot in enumerate(order):
        first, _ = spans.get(slot, (k, k))
        spans[slot] = (first, k)
    return spans


def test_shortest_first_trains_the_jobs_with_fewest_tokens_left_first():
    """Two global batches fill the 40 tokens asked: the two shortest jobs train, the longest
    waits until one of them ends; every sample still once, in whole batches."""
    jobs = [_job("long", 24, 4), _job("short", 8, 4, seed=1), _job("middle", 16, 4, seed=2)]
    stream = _shortest_stream(40)
    stream.jobs.update(enumerate(jobs))
    assert [stream.tokens_left(job) for job in jobs] == [
        sum(job.sample_tokens(p) for p in range(len(job.order))) for job in jobs
    ]
    assert list(stream.training()) == [1, 2], "the two shortest, shortest first"
    per_job, _, _ = _run(stream)
    for job in jobs:
        _check_batches(job, per_job[job.name], upto=len(job.order))
    stream = _shortest_stream(40)  # again, for the order of the jobs
    stream.jobs.update(enumerate(jobs))
    order = []
    for item in stream:
        order.append({s.adapter for s in item.samples})
    short_ends = max(k for k, slots in enumerate(order) if 1 in slots)
    long_starts = min(k for k, slots in enumerate(order) if 0 in slots)
    assert short_ends < long_starts, order
    assert stream.training() == {}, "nothing left"


def test_shortest_first_trains_as_many_jobs_as_fill_the_tokens_asked():
    jobs = [_job("long", 24, 4), _job("short", 8, 4, seed=1), _job("middle", 16, 4, seed=2)]
    stream = _shortest_stream(10**9)  # every job: the round-robin of `train`
    stream.jobs.update(enumerate(jobs))
    assert sorted(stream.training()) == [0, 1, 2]
    stream.shortest_first = 1
    assert list(stream.training()) == [1, 2], "at least two, whatever the tokens"
    del stream.jobs[2]
    assert list(stream.training()) == [1, 0]


def test_a_shorter_job_that_joins_trains_before_a_longer_one_resumes():
    """long and middle train (long mid-batch) when short joins: short and middle train until
    one of them ends, then long takes up its batch where it left it."""
    jobs = [_job("long", 30, 5), _job("middle", 24, 4, seed=1), _job("short", 8, 4, seed=3)]
    stream = _shortest_stream(40)
    stream.jobs.update({0: jobs[0], 1: jobs[1]})
    order, per_job, joined = [], {}, None
    for count, item in enumerate(stream):
        if count == 3:
            stream.jobs[2] = jobs[2]
            joined = count
        order.append({s.adapter for s in item.samples})
        for s in item.samples:
            per_job.setdefault(s.adapter, []).append(s.index)
    short = [k for k, slots in enumerate(order) if 2 in slots]
    assert short[0] > joined, order
    paused = [k for k in range(short[0], short[-1] + 1) if 0 in order[k]]
    assert not paused, f"long waits while short trains: {order}"
    assert any(0 in slots for slots in order[short[-1] + 1 :]), "long resumes"
    for slot, job in enumerate(jobs):
        assert sorted(per_job[slot]) == list(range(len(job.order))), job.name
