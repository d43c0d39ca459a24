from megatron_lorafusion.planner import CostModel, PlanProblem, plan_microbatches
from megatron_lorafusion.planner.policy import apply_length_policy
from megatron_lorafusion.planner.round_robin import (
    default_samples_per_microbatch,
    padded_tokens_of,
)
from megatron_lorafusion.sim import adapter_lengths, compare_strategies
from megatron_lorafusion.sim.baselines import megatron_jobs, mlora_jobs, mlora_microbatches


def _problem(adapters=4, stages=4):
    lengths = apply_length_policy(adapter_lengths("mix", adapters, 64, 0), 4096, 64).lengths
    return PlanProblem(lengths, (16,) * adapters, 4096, stages, 64)


def test_megatron_flushes_once_per_global_batch():
    problem = _problem()
    groups = megatron_jobs(problem, CostModel())
    assert len(groups) == 4 * 4
    assert all(g[-1].steps and not any(j.steps for j in g[:-1]) for g in groups)


def test_mlora_adds_idles_only_when_adapters_are_too_few():
    jobs4, _ = mlora_jobs(_problem(4, 4), CostModel(), 4)
    assert not any(j.label == -1 for j in jobs4)
    jobs2, _ = mlora_jobs(_problem(2, 4), CostModel(), 4)
    assert any(j.label == -1 for j in jobs2)


def test_ours_has_the_smallest_bubble():
    problem = _problem()
    results = compare_strategies(problem, plan_microbatches(problem, "greedy"), CostModel())
    bubbles = {r.name: r.sim.bubble_ratio for r in results}
    assert bubbles["ours"] < bubbles["mlora"]
    assert bubbles["ours"] < bubbles["megatron"]
    assert all(r.useful_tokens == sum(map(sum, problem.lengths)) for r in results)


def test_mlora_microbatches_fit_the_capacity_once_padded():
    lengths = apply_length_policy(adapter_lengths("wikisum", 4, 128, 0), 6144, 64).lengths
    problem = PlanProblem(lengths, (32,) * 4, 6144, 4, 64)
    k = default_samples_per_microbatch(problem)
    stream = mlora_microbatches(problem, k)
    real = [mb for mb in stream if not mb.is_idle]
    assert all(padded_tokens_of(mb.samples, 64) <= 6144 for mb in real)
    assert max(len(mb.samples) for mb in real) <= k
    placed = sorted((s.adapter, s.index) for mb in real for s in mb.samples)
    assert placed == [(a, i) for a in range(4) for i in range(128)]
    result = {
        r.name: r for r in compare_strategies(problem, plan_microbatches(problem), CostModel())
    }["mlora"]
    assert result.fill <= 1.0
