"""The pipeline runner over gloo (2-4 processes) against a one-process run of the same plan.

After ``STEPS`` optimizer steps of 3 adapters with global batch sizes 2, 3 and 5, every
adapter factor must equal the one-process run's, whatever the TP × PP × DP split, with
or without sequence parallelism (which pads microbatches to a multiple of TP with a loss-free
sample; the one-process run packs none). LoRA dropout is on for one adapter where DP does
not move samples between packed rows. The ``_clip`` cases clip two adapters' gradient norms,
which must span every stage and TP shard as in one process. After training, every case
evaluates the plan forward only through its grid (`pipeline.forward_loss_sums`): the eval
loss per adapter must equal one process's.
"""

import pytest
import torch
import torch.multiprocessing as mp
from pipeline_testing import (
    ADAPTERS,
    SEED,
    adapters_for,
    make_batch_fn,
    make_job,
    parallel_worker,
    reference_run,
)

# dtype -> tolerances; TP, PP and DP only reorder fp32 sums (partials over H, vocab, samples).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
# name -> (tp, pp, dp, sequence parallel)
CASES = {
    "pp2": (1, 2, 1, False),
    "dp2": (1, 1, 2, False),
    "tp2": (2, 1, 1, False),
    "tp2sp": (2, 1, 1, True),
    "pp4": (1, 4, 1, False),
    "pp2xdp2": (1, 2, 2, False),
    "tp2xpp2": (2, 2, 1, False),
    "tp2xpp2sp": (2, 2, 1, True),
    "tp2xdp2sp": (2, 1, 2, True),
    "pp4_defer_wgrad": (1, 4, 1, False),
    "tp2xpp2_defer_wgrad": (2, 2, 1, False),
    "pp2_clip": (1, 2, 1, False),
    "pp2xdp2_clip": (1, 2, 2, False),
    "tp2_clip": (2, 1, 1, False),
    "tp2xpp2_clip": (2, 2, 1, False),
}
# Cases that defer LoRA A's weight gradients (zero-bubble); with TP the row wrappers' deferred
# dA draws its mask columns at the shard's offset.
DEFER_WGRAD = {"pp4_defer_wgrad", "tp2xpp2_defer_wgrad"}
CLIP = {name for name in CASES if name.endswith("_clip")}


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """Every case, one spawn per world size (the cases of a world share its processes)."""
    workdir = tmp_path_factory.mktemp("parallel")
    by_world: dict[int, list] = {}
    for name, (tp, pp, dp, sp) in CASES.items():
        by_world.setdefault(tp * pp * dp, []).append(
            (name, tp, pp, sp, name in DEFER_WGRAD, name in CLIP)
        )
    for world, cases in by_world.items():
        mp.spawn(parallel_worker, args=(world, str(workdir), cases), nprocs=world, join=True)
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_run_matches_one_process(megatron_single_process, parallel_runs, case):
    tp, pp, dp, sp = CASES[case]
    casedir = parallel_runs / case
    errors = sorted(casedir.glob("error_*.txt"))
    assert not errors, "a worker failed:\n" + "\n".join(p.read_text() for p in errors)
    adapters = adapters_for(dp, case in CLIP)
    expected = reference_run(make_job(pp), adapters)
    result = torch.load(casedir / "result.pt")
    for a, adapter in enumerate(adapters):
        assert result["losses"][a] == pytest.approx(expected["losses"][a], rel=1e-5), (
            f"adapter {adapter.name}: step losses differ at tp={tp} pp={pp} dp={dp} sp={sp}"
        )
        if case in CLIP and adapter.max_grad_norm > 0:  # norms over every stage and TP shard
            assert result["norms"][a] == pytest.approx(expected["norms"][a], rel=1e-5), (
                f"adapter {adapter.name}: gradient norms differ at {case}"
            )
        assert result["states"][a].keys() == expected["states"][a].keys()
        (sums, counts), (ref_sums, ref_counts) = result["eval"], expected["eval"]
        assert counts[a].item() == ref_counts[a].item(), f"adapter {adapter.name}: eval tokens"
        loss, ref_loss = (sums[a] / counts[a]).item(), (ref_sums[a] / ref_counts[a]).item()
        assert loss == pytest.approx(ref_loss, rel=1e-5), (
            f"adapter {adapter.name}: forward-only eval loss differs at {case}"
        )
        for name, value in expected["states"][a].items():
            torch.testing.assert_close(
                result["states"][a][name],
                value,
                **TOL[torch.float32],
                msg=f"adapter {adapter.name} {name} after training at {case}",
            )


def test_clip_cases_clip(megatron_single_process):
    """The clipped job trains other weights than the unclipped one (clipping acts)."""
    job = make_job(2)
    clipped, plain = (reference_run(job, adapters_for(2, clip)) for clip in (True, False))
    for a in (0, 2):
        moved = max(
            (clipped["states"][a][n] - v).abs().max().item() for n, v in plain["states"][a].items()
        )
        assert moved > 10 * TOL[torch.float32]["atol"], f"adapter {a}: clipping moved {moved}"
    for name, value in plain["states"][1].items():
        torch.testing.assert_close(
            clipped["states"][1][name],
            value,
            atol=0,
            rtol=0,
            msg=f"adapter a1 (max_grad_norm 0) {name} changed",
        )


def test_sequence_parallel_cases_pad_odd_microbatches():
    """Some SP case's plan has microbatches of odd T, so the padding runs end to end."""
    odd = [
        name
        for name, (tp, pp, _, sp) in CASES.items()
        if sp and any(sum(s.tokens for s in mb.samples) % tp for mb in make_job(pp).microbatches)
    ]
    assert odd, "no sequence-parallel case pads a microbatch"


def test_sequence_parallel_padding_is_a_loss_free_sample():
    job = make_job(2)
    microbatch = next(mb for mb in job.microbatches if sum(s.tokens for s in mb.samples) % 2)
    plain = make_batch_fn(job, len(ADAPTERS))(microbatch, 0)
    padded = make_batch_fn(job, len(ADAPTERS), pad_to_multiple=2)(microbatch, 0)
    tokens = plain.layout.num_tokens
    assert padded.layout.num_tokens == tokens + 1
    assert padded.loss_mask[0, tokens:].tolist() == [0.0], "the pad token must not be trained"
    torch.testing.assert_close(padded.input_ids[:, :tokens], plain.input_ids)
    torch.testing.assert_close(padded.loss_mask[:, :tokens], plain.loss_mask)
    # Its own sequence (no token attends across), in the last adapter's segment.
    assert padded.layout.cu_seqlens.tolist() == [*plain.layout.cu_seqlens.tolist(), tokens + 1]
    last = microbatch.samples[-1].adapter
    counts = plain.layout.token_counts()
    counts[last] += 1
    assert padded.layout.token_counts() == counts
    assert padded.position_ids[0, tokens].item() == 0
    assert padded.layout.dropout_seed == plain.layout.dropout_seed == SEED * 1_000_003
