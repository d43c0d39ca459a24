"""The pipeline runner on an FP8 base (2 gloo processes): PP = 2 and DP = 2 against one
process over the same plan, the same adapter weights and losses.

An FP8 linear quantizes its own input per token, wherever its stage runs and whichever replica
holds the sample, so splitting the model or the samples only reorders fp32 sums: the
tolerances are `test_runner`'s.
"""

import dataclasses

import pipeline_testing
import pytest
import torch
import torch.multiprocessing as mp

TOL = dict(atol=1e-5, rtol=1e-5)
FP8_MODEL = dataclasses.replace(pipeline_testing.MODEL, base_precision="fp8")
CASES = {"pp2": (1, 2, 1, False), "dp2": (1, 1, 2, False)}  # name -> (tp, pp, dp, sp)


def _fp8_worker(rank: int, world: int, workdir: str, cases: list) -> None:
    pipeline_testing.MODEL = FP8_MODEL  # this process's `build_stage` builds the FP8 base
    pipeline_testing.parallel_worker(rank, world, workdir, cases)


@pytest.mark.slow
def test_fp8_base_pipeline_and_data_parallel_match_one_process(
    megatron_single_process, tmp_path, monkeypatch
):
    from megatron_lorafusion.mcore import Fp8ColumnParallelLinear

    monkeypatch.setattr(pipeline_testing, "MODEL", FP8_MODEL)
    stage = pipeline_testing.build_stage(pipeline_testing.make_job(1))
    linear = stage.model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(getattr(linear, "base", linear), Fp8ColumnParallelLinear), "not FP8"
    cases = [(name, tp, pp, sp, False, False) for name, (tp, pp, _, sp) in CASES.items()]
    mp.spawn(_fp8_worker, args=(2, str(tmp_path), cases), nprocs=2, join=True)
    for name, (_, pp, dp, _) in CASES.items():
        errors = sorted((tmp_path / name).glob("error_*.txt"))
        assert not errors, "a worker failed:\n" + "\n".join(p.read_text() for p in errors)
        adapters = pipeline_testing.adapters_for(dp)
        expected = pipeline_testing.reference_run(pipeline_testing.make_job(pp), adapters)
        result = torch.load(tmp_path / name / "result.pt")
        for a, adapter in enumerate(adapters):
            assert result["losses"][a] == pytest.approx(expected["losses"][a], rel=1e-5), name
            for key, value in expected["states"][a].items():
                torch.testing.assert_close(
                    result["states"][a][key], value, **TOL, msg=f"{name}: {adapter.name} {key}"
                )
