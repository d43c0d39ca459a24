"""The pure 1F1B tables: order, step points, idle slots, the bubble lemma, DP shares."""

import random

import pytest

from megatron_lorafusion.pipeline import (
    LemmaError,
    data_parallel_share,
    lemma_checked,
    schedule,
    stage_actions,
)
from megatron_lorafusion.planner import Microbatch, PlanProblem, Sample, plan_microbatches


def _mb(*adapters, finishes=(), start=0):
    return Microbatch(
        tuple(Sample(a, start + i, 5) for i, a in enumerate(adapters)), tuple(finishes)
    )


def _ops(actions, stage):
    return [f"{a.kind}{a.microbatch}" for a in actions if a.stage == stage]


def test_stage_actions_follow_1f1b_order():
    stream = [_mb(0, start=i) for i in range(5)]
    table = [a for s in range(3) for a in stage_actions(s, 3, stream)]
    assert _ops(table, 0) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4".split()
    assert _ops(table, 1) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4".split()
    assert _ops(table, 2) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4".split()


def test_stage_actions_are_lazy_over_an_endless_stream():
    def endless():
        k = 0
        while True:
            yield _mb(k % 3, start=k)
            k += 1

    actions = stage_actions(0, 4, endless())
    first = [next(actions) for _ in range(6)]
    assert [f"{a.kind}{a.microbatch}" for a in first] == "F0 F1 F2 F3 B0 F4".split()


def test_schedule_steps_right_after_the_finishing_backward():
    stream = [_mb(0, 1), _mb(2, finishes=(0,)), _mb(1, finishes=(1,)), _mb(2, finishes=(2,))]
    table = schedule(2, stream)
    for stage in range(2):
        ops = [a for a in table if a.stage == stage]
        steps = [(i, a) for i, a in enumerate(ops) if a.kind == "O"]
        assert [a.finishes for _, a in steps] == [(0,), (1,), (2,)], f"stage {stage}"
        for i, step in steps:
            before = ops[i - 1]
            assert (before.kind, before.microbatch) == ("B", step.microbatch), (
                f"stage {stage}: step of microbatch {step.microbatch} must follow its backward"
            )


def test_idle_microbatch_keeps_its_slot_and_computes_nothing():
    stream = [_mb(0, finishes=(0,)), Microbatch(()), _mb(0, finishes=(0,), start=1)]
    table = schedule(2, stream)
    assert _ops(table, 0) == "F0 F1 B0 O0 F2 B1 B2 O2".split()
    idle = [a for a in table if a.microbatch == 1]
    assert all(a.adapters == () for a in idle), "an idle microbatch reads no adapter"


def test_lemma_violation_is_refused_with_a_clear_error():
    stream = [_mb(0, finishes=(0,)), _mb(0, finishes=(0,), start=1)]  # batch 1 right after 0
    with pytest.raises(LemmaError, match=r"adapter 0's microbatch 1 .* stage 0 .*S - 1"):
        schedule(2, stream)
    with pytest.raises(LemmaError, match="num_stages=2"):
        list(lemma_checked(stream, 2))
    assert len(schedule(1, stream)) == 6, "one stage has no bubble: back-to-back is fine"


def _random_stream(rng: random.Random, length: int, num_adapters: int):
    index = [0] * num_adapters
    stream = []
    for _ in range(length):
        present = sorted(rng.sample(range(num_adapters), rng.randint(0, num_adapters)))
        samples = []
        for a in present:
            samples.append(Sample(a, index[a], 3))
            index[a] += 1
        finishes = tuple(a for a in present if rng.random() < 0.4)
        stream.append(Microbatch(tuple(samples), finishes))
    return stream


def _table_keeps_lemma(table) -> bool:
    """The lemma read off the tables: on each stage, once the forward of the microbatch that
    finishes adapter ``a``'s global batch has run, no other forward reads ``a`` before that
    stage's ``"O"`` action for it."""
    unstepped = {}  # (stage, adapter) -> finishing microbatch
    for action in table:
        s, k = action.stage, action.microbatch
        if action.kind == "O":
            for a in action.finishes:
                unstepped.pop((s, a), None)
        elif action.kind == "F":
            if any(unstepped.get((s, a), k) != k for a in action.adapters):
                return False
            unstepped.update(((s, a), k) for a in action.finishes)
    return True


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stream_check_agrees_with_every_stage_table(num_stages):
    rng = random.Random(num_stages)
    outcomes = set()
    for _ in range(200):
        stream = _random_stream(rng, 8, 3)
        table = [a for s in range(num_stages) for a in stage_actions(s, num_stages, stream)]
        table_ok = _table_keeps_lemma(table)
        try:
            list(lemma_checked(stream, num_stages))
            stream_ok = True
        except LemmaError:
            stream_ok = False
        assert table_ok == stream_ok, f"stream check and table check disagree on {stream}"
        outcomes.add(table_ok)
    assert num_stages == 1 or outcomes == {True, False}, "draw both valid and invalid streams"


@pytest.mark.parametrize("num_stages", [2, 4])
def test_planner_plans_pass_and_every_stage_runs_each_microbatch_once(num_stages):
    rng = random.Random(0)
    lengths = [[rng.randint(3, 40) for _ in range(n)] for n in (12, 9, 20)]
    plan = plan_microbatches(
        PlanProblem(lengths, [4, 3, 5], 64, num_stages=num_stages), solver="greedy"
    )
    table = schedule(num_stages, plan)
    m = len(plan.microbatches)
    for stage in range(num_stages):
        ops = [a for a in table if a.stage == stage]
        for kind in "FB":
            assert sorted(a.microbatch for a in ops if a.kind == kind) == list(range(m))
        assert sum(len(a.finishes) for a in ops if a.kind == "O") == 3 + 3 + 4


def test_data_parallel_shares_partition_the_microbatch_in_plan_order():
    mb = Microbatch(
        tuple(
            Sample(a, i, t) for a, i, t in [(0, 0, 9), (0, 1, 2), (1, 0, 7), (1, 1, 7), (2, 0, 1)]
        ),
        (1,),
    )
    shares = [data_parallel_share(mb, r, 2) for r in range(2)]
    key = lambda s: (s.adapter, s.index)  # noqa: E731
    assert sorted((s for sh in shares for s in sh.samples), key=key) == list(mb.samples)
    for sh in shares:
        assert list(sh.samples) == [s for s in mb.samples if s in sh.samples], "plan order"
        assert sh.finishes == (1,)
    loads = [sh.tokens for sh in shares]
    assert max(loads) - min(loads) <= max(s.tokens for s in mb.samples)
    assert data_parallel_share(mb, 0, 1) is mb
    one = Microbatch((Sample(0, 0, 4),), (0,))
    assert data_parallel_share(one, 1, 2).is_idle, "a replica may get nothing"
    with pytest.raises(ValueError, match="dp_rank"):
        data_parallel_share(mb, 2, 2)
