import argparse

from megatron_lorafusion.planner import check_plan
from megatron_lorafusion.planner.commands import (
    add_plan_arguments,
    add_simulate_arguments,
    problem_from_args,
    run_plan,
    run_simulate,
)
from megatron_lorafusion.planner.io import load_plan

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
