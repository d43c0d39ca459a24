import argparse

from megatron_lorafusion.planner import CostModel, check_plan, plan_microbatches
from megatron_lorafusion.planner.io import load_plan
from megatron_lorafusion.planner.round_robin import default_samples_per_microbatch
from megatron_lorafusion.sim import compare_strategies
from megatron_lorafusion.sim.commands import (
    _timelines,
    add_plan_arguments,
    add_simulate_arguments,
    job_argument_problems,
    problem_from_args,
    request_from_args,
    run_plan,
    run_simulate,
)

SMALL = [
    "--lengths",
    "heterogeneous",
    "--samples",
    "32",
    "--global-batch-size",
    "8",
    "--capacity",
    "4096",
    "--solver",
    "greedy",
]


def _parse(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_run_plan_writes_a_valid_plan_and_summary(tmp_path):
    args = _parse(add_plan_arguments, [*SMALL, "--output", str(tmp_path / "plan.json")])
    out = []
    assert run_plan(args, out.append) == 0
    problem, _ = problem_from_args(args)
    check_plan(load_plan(tmp_path / "plan.json"), problem)
    assert "microbatches:" in "".join(out)


def test_run_simulate_writes_table_and_png(tmp_path):
    plan_args = _parse(add_plan_arguments, [*SMALL, "--output", str(tmp_path / "plan.json")])
    run_plan(plan_args, lambda _: None)
    args = _parse(
        add_simulate_arguments,
        [
            *SMALL,
            "--plan",
            str(tmp_path / "plan.json"),
            "--png",
            str(tmp_path / "t.png"),
            "--optimizer-ms",
            "0",
        ],
    )
    out = []
    assert run_simulate(args, out.append) == 0
    text = "".join(out)
    assert "| (c) ours" in text
    assert "Megatron-style" in text
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_problem_from_args_without_flags_takes_the_documented_defaults():
    request = request_from_args(_parse(add_plan_arguments, []))
    problem = request.problem
    assert problem.num_adapters == 4
    assert [len(x) for x in problem.lengths] == [256] * 4
    assert problem.global_batch_sizes == (32,) * 4
    assert (problem.capacity, problem.num_stages, problem.tile_height) == (6144, 4, 64)
    assert (request.solver, request.source) == ("greedy", "mix lengths")


def test_job_argument_problems_names_each_flag_the_job_sets():
    args = _parse(add_plan_arguments, ["--job", "j.yaml", "--solver", "milp", "--seed", "3"])
    assert job_argument_problems(args) == [
        "--seed does not apply with --job (the job sets it: train.seed)",
        "--solver does not apply with --job (the job sets it: planner.solver)",
    ]
    assert job_argument_problems(_parse(add_plan_arguments, ["--job", "j.yaml", "a.b=1"])) == []
    assert job_argument_problems(_parse(add_simulate_arguments, ["a.b=1"])) == [
        "dotted overrides ['a.b=1'] need --job FILE"
    ]


def test_simulate_timelines_mark_every_idle_microbatch_without_moving_the_schedule():
    """Idle microbatches cost nothing, so the simulator has no event for them; the drawn
    panels give each one a forward on every stage and keep the makespan."""
    args = _parse(
        add_simulate_arguments,
        [
            "--lengths",
            "heterogeneous",
            "--adapters",
            "2",
            "--samples",
            "24",
            "--global-batch-size",
            "8",
            "--capacity",
            "4096",
            "--solver",
            "greedy",
        ],
    )
    problem = request_from_args(args).problem
    plan = plan_microbatches(problem, "greedy")
    cost = CostModel()
    k = default_samples_per_microbatch(problem)
    results = compare_strategies(problem, plan, cost, k)
    panels = dict(_timelines(results, problem, plan, cost, k))
    idle = [i for i, mb in enumerate(plan.microbatches) if mb.is_idle]
    assert idle, "the case must have idle microbatches"
    marked = {(e.job, e.stage) for e in panels["ours"].events if e.label < 0 and e.kind == "F"}
    assert marked == {(i, s) for i in idle for s in range(problem.num_stages)}
    for r in results:
        drawn = panels[r.name]
        assert abs(drawn.makespan_ms - r.sim.makespan_ms) < 1e-3, r.name
        real = [(e.stage, e.job, e.kind) for e in r.sim.events]
        assert [
            (e.stage, e.job, e.kind) for e in drawn.events if e.label >= 0 or e.kind == "O"
        ] == real, f"{r.name}: the same operations in the same order"


def _trace_means(*argv: str) -> dict[str, float]:
    """``simulate --trace``'s mean job completion time per policy."""
    args = _parse(
        add_simulate_arguments,
        ["--trace", "--jobs", "12", "--size-scale", "0.1", "--max-seq-length", "1024", *argv],
    )
    out = []
    assert run_simulate(args, out.append) == 0
    rows = [line.split("|") for line in "".join(out).splitlines() if line.startswith("| ")]
    return {cells[1].strip(): float(cells[3]) for cells in rows[1:]}


def test_simulate_trace_prints_each_policy_and_a_slower_server_finishes_jobs_later():
    means = _trace_means("--tokens-per-s", "60000")
    assert list(means) == ["online", "shortest", "fifo", "batch"], means
    slower = _trace_means("--tokens-per-s", "60000", "--served-tokens-per-s", "50000")
    for policy in ("online", "shortest"):  # jobs share the slower server
        assert slower[policy] > means[policy], (policy, means, slower)
    assert slower["fifo"] == means["fifo"], "one job alone runs at --alone-tokens-per-s (R)"


def test_simulate_trace_states_the_floor_no_policy_beats():
    args = _parse(
        add_simulate_arguments,
        ["--trace", "--jobs", "12", "--size-scale", "0.1", "--max-seq-length", "1024"],
    )
    out = []
    assert run_simulate(args, out.append) == 0
    text = "".join(out)
    floor = float(text.split("no schedule beats a mean JCT of ")[1].split(" s")[0])
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ")][1:]
    means = [float(cells[3]) for cells in rows]
    assert 0 < floor <= min(means), (floor, means)
