"""The pipeline runner over gloo (2-4 processes) against a one-process run of the same plan.

After ``STEPS`` optimizer steps of 3 adapters with global batch sizes 2, 3 and 5, every
adapter factor must equal the single-stage loop's, whatever the TP × PP × DP split
(LoRA dropout on one adapter where DP does not move samples between packed rows).
"""

import pytest
import torch
import torch.multiprocessing as mp
from pipeline_testing import adapters_for, make_job, parallel_worker, reference_run

# dtype -> tolerances; TP, PP and DP only reorder fp32 sums (partials over H, vocab, samples).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
CASES = {"pp2": (1, 2, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 1), "pp4": (1, 4, 1),
         "pp2xdp2": (1, 2, 2), "tp2xpp2": (2, 2, 1),
         "pp4_defer_wgrad": (1, 4, 1)}  # name -> (tp, pp, dp)
DEFER_WGRAD = {"pp4_defer_wgrad"}  # cases that defer LoRA A's weight gradients (zero-bubble)


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """Every case, one spawn per world size (the cases of a world share its processes)."""
    workdir = tmp_path_factory.mktemp("parallel")
    by_world: dict[int, list] = {}
    for name, (tp, pp, dp) in CASES.items():
        by_world.setdefault(tp * pp * dp, []).append((name, tp, pp, name in DEFER_WGRAD))
    for world, cases in by_world.items():
        mp.spawn(parallel_worker, args=(world, str(workdir), cases), nprocs=world, join=True)
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_run_matches_one_process(megatron_single_process, parallel_runs, case):
    tp, pp, dp = CASES[case]
    casedir = parallel_runs / case
    errors = sorted(casedir.glob("error_*.txt"))
    assert not errors, "a worker failed:\n" + "\n".join(p.read_text() for p in errors)
    adapters = adapters_for(dp)
    expected = reference_run(make_job(pp), adapters)
    result = torch.load(casedir / "result.pt")
    for a, adapter in enumerate(adapters):
        assert result["losses"][a] == pytest.approx(expected["losses"][a], rel=1e-5), (
            f"adapter {adapter.name}: step losses differ at tp={tp} pp={pp} dp={dp}"
        )
        assert result["states"][a].keys() == expected["states"][a].keys()
        for name, value in expected["states"][a].items():
            torch.testing.assert_close(
                result["states"][a][name], value, **TOL[torch.float32],
                msg=f"adapter {adapter.name} {name} after training at tp={tp} pp={pp} dp={dp}",
            )
