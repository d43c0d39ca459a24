"""`MicrobatchGraphs`: a shape runs eagerly, is captured, then replayed on copies of its inputs.

On the CPU a stand-in replaces the CUDA graph (its replay runs the captured call again on the
graph's own input tensors), so what the CPU checks is everything around the graph: which
microbatches run eagerly, which replay, and that a replay trains on the microbatch it was
given (tokens, sample boundaries, dropout keys, denominators copied in). On a GPU the real
graphs train a job as the eager runner does.
"""

import dataclasses
import random
import types

import pytest
import torch
from model_testing import MCORE_MODEL

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.data import TokenizedSample, pack_microbatch
from megatron_lorafusion.ops import AdapterLayout
from megatron_lorafusion.pipeline import MicrobatchGraphs, adapter_losses
from megatron_lorafusion.pipeline.graphs import CAPTURE_AT, GIVE_UP_AFTER, sample_bucket
from megatron_lorafusion.planner import PlanProblem, plan_microbatches
from megatron_lorafusion.train.recipe import build_run
from megatron_lorafusion.validation import GRAPH_PAD_TOKENS

SEED = 5
ADAPTER = AdapterConfig(name="solo", rank=4, alpha=8.0, lr=2e-3, dropout=0.1, global_batch_size=2)
STEPS = 6


class _Rerun:
    """A graph stand-in: replay runs the recorded call again on the same input tensors."""

    def __init__(self, call):
        self.replay = call


class _CpuGraphs(MicrobatchGraphs):
    def _record(self, batch, denominators):
        out = torch.zeros(denominators.numel())

        def replay():
            # A new cu_seqlens object, as a graph computes RoPE's table in every replay (the
            # eager model caches it per cu_seqlens object).
            layout = batch.layout
            fresh = AdapterLayout(
                layout.seg_offsets,
                layout.cu_seqlens.clone(),
                layout.max_seqlen,
                layout.dropout_seed,
                layout.row_keys,
            )
            fresh._cache.update(layout._cache)
            losses = self.loss(dataclasses.replace(batch, layout=fresh), denominators)
            losses.sum().backward()
            out.copy_(losses.detach())

        return _Rerun(replay), out


def _job(adapter=ADAPTER, steps=STEPS):
    """One adapter's samples (5-30 tokens), planned in microbatches of 64 tokens (at global
    batch 2 each microbatch is one global batch; at 4 batches are split over microbatches
    of different sample counts)."""
    rng = random.Random(SEED)
    rows = []
    for _ in range(steps * adapter.global_batch_size):
        n = rng.randint(5, 30)
        ids = tuple(rng.randrange(MCORE_MODEL.vocab_size) for _ in range(n))
        labels = tuple(rng.randrange(MCORE_MODEL.vocab_size) for _ in range(n))
        rows.append(TokenizedSample(ids, labels, tuple(int(rng.random() < 0.8) for _ in range(n))))
    problem = PlanProblem([[len(r) for r in rows]], [adapter.global_batch_size], 64, seed=SEED)
    microbatches = plan_microbatches(problem, solver="greedy").microbatches
    gbs = adapter.global_batch_size
    batch_tokens = [
        sum(sum(r.loss_mask) for r in rows[j * gbs : (j + 1) * gbs]) for j in range(steps)
    ]
    return rows, microbatches, batch_tokens


def _make_batch(rows, device):
    def make_batch(microbatch, index):
        return pack_microbatch(
            microbatch,
            [rows],
            [list(range(len(rows)))],
            1,
            device,
            dropout_seed=SEED,  # a job's seed: the same in every microbatch
            pad_to_multiple=GRAPH_PAD_TOKENS,
            sample_key=lambda a, position: 1_000 * position,
        )

    return make_batch


def _train(run, microbatches, make_batch):
    run.model.train()
    run.train(microbatches, make_batch)
    return run.lora.weights.detach().clone(), list(run.runs[0].losses)


def _graphed_on_cpu(adapters, batch_tokens):
    """A run whose microbatches go through `_CpuGraphs` (captured, then replayed)."""
    run = build_run(MCORE_MODEL, adapters, batch_tokens, seed=SEED)
    forward = run.forward
    run.graphs = _CpuGraphs(
        lambda batch, den: adapter_losses(forward(batch, None), batch, den),
        max_seqlen=GRAPH_PAD_TOKENS,
        before_capture=run.lora.drop_compute_weights,
    )
    return run


@pytest.mark.parametrize("global_batch", [2, 4])
def test_replays_train_what_eager_runs_train(megatron_single_process, global_batch):
    """At global batch 2 every microbatch is 2 samples padded to 256 tokens: one shape, eager
    three times (the third is captured), then replayed. At 4, batches are split over
    microbatches of 2-5 samples: still one shape, the samples past a microbatch's own empty."""
    adapter = dataclasses.replace(ADAPTER, global_batch_size=global_batch)
    rows, microbatches, batch_tokens = _job(adapter)
    if global_batch == 2:
        assert len(microbatches) == STEPS
    else:
        samples = {len(mb.samples) for mb in microbatches}
        assert len(samples) > 1, samples
    make_batch = _make_batch(rows, "cpu")
    eager = build_run(MCORE_MODEL, [adapter], [batch_tokens], seed=SEED)
    want_weights, want_losses = _train(eager, microbatches, make_batch)

    graphed = _graphed_on_cpu([adapter], [batch_tokens])
    weights, losses = _train(graphed, microbatches, make_batch)
    assert (graphed.graphs.captures, graphed.graphs.replays) == (1, len(microbatches) - CAPTURE_AT)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)
    assert losses == want_losses


def test_sample_buckets():
    assert [sample_bucket(n) for n in (1, 5, 16, 17, 33, 100)] == [16, 16, 16, 32, 64, 128]


def test_replays_of_two_adapters_train_what_eager_runs_train(megatron_single_process):
    """Two adapters (ranks 4 and 8, dropout on one) in every microbatch, one shape throughout."""
    adapters = [ADAPTER, AdapterConfig(name="duo", rank=8, alpha=8.0, lr=1e-3, global_batch_size=3)]
    lengths = (10, 7)  # per adapter: every round is one microbatch of 2 x 10 + 3 x 7 tokens
    rng = random.Random(SEED)
    datasets = [
        [
            TokenizedSample(
                tuple(rng.randrange(MCORE_MODEL.vocab_size) for _ in range(n)),
                tuple(rng.randrange(MCORE_MODEL.vocab_size) for _ in range(n)),
                tuple(int(rng.random() < 0.8) for _ in range(n)),
            )
            for _ in range(STEPS * a.global_batch_size)
        ]
        for a, n in zip(adapters, lengths, strict=True)
    ]
    problem = PlanProblem(
        [[n] * len(rows) for n, rows in zip(lengths, datasets, strict=True)],
        [a.global_batch_size for a in adapters],
        64,
        seed=SEED,
    )
    microbatches = plan_microbatches(problem, solver="greedy").microbatches
    assert len(microbatches) == STEPS
    batch_tokens = [
        [sum(sum(r.loss_mask) for r in rows[j * g : (j + 1) * g]) for j in range(STEPS)]
        for rows, g in ((d, a.global_batch_size) for d, a in zip(datasets, adapters, strict=True))
    ]

    def make_batch(microbatch, index):
        return pack_microbatch(
            microbatch,
            datasets,
            [list(range(len(rows))) for rows in datasets],
            len(adapters),
            "cpu",
            dropout_seed=SEED,
            pad_to_multiple=GRAPH_PAD_TOKENS,
            sample_key=lambda a, position: 1_000 * a + position,
        )

    eager = build_run(MCORE_MODEL, adapters, batch_tokens, seed=SEED)
    eager.model.train()
    eager.train(microbatches, make_batch)
    graphed = _graphed_on_cpu(adapters, batch_tokens)
    graphed.model.train()
    graphed.train(microbatches, make_batch)
    assert (graphed.graphs.captures, graphed.graphs.replays) == (1, STEPS - CAPTURE_AT)
    torch.testing.assert_close(graphed.lora.weights, eager.lora.weights, rtol=0, atol=0)
    for run, want in zip(graphed.runs, eager.runs, strict=True):
        assert run.losses == want.losses


def test_graphs_that_capture_nothing_step_aside():
    """Shapes that never repeat (several adapters): after GIVE_UP_AFTER the runner goes eager."""
    weight = torch.ones(2, requires_grad=True)
    graphs = _CpuGraphs(lambda batch, den: weight * den, max_seqlen=8, pad_tokens=256)
    for i in range(GIVE_UP_AFTER):
        assert graphs.active, i
        layout = AdapterLayout.from_samples([0, 1], [1 + i, 1], 2)  # a new shape each time
        batch = types.SimpleNamespace(layout=layout, input_ids=torch.zeros(1, i + 2))
        graphs.train(batch, torch.ones(2))
    assert (graphs.active, graphs.captures, graphs.replays) == (False, 0, 0)
    assert weight.grad.tolist() == [GIVE_UP_AFTER] * 2, "every microbatch trained eagerly"
    graphs.clear()
    assert graphs.active, "new adapters bring new shapes: worth another try"


def test_a_new_adapter_drops_the_graphs():
    graphs = _CpuGraphs(lambda batch, den: den, max_seqlen=8)
    graphs._graphs[("shape",)] = object()
    graphs._seen[("shape",)] = 2
    graphs.clear()
    assert not graphs._graphs
    assert not graphs._seen


@pytest.mark.gpu
@pytest.mark.parametrize("global_batch", [2, 4])
def test_graphs_train_a_job_as_the_eager_runner_does(megatron_single_process, global_batch):
    """bf16 on the GPU (flash attention): real graphs against the eager runner, same data.

    At global batch 4 the microbatches hold 2-5 samples: replays attend over empty samples.
    """
    adapter = dataclasses.replace(ADAPTER, global_batch_size=global_batch)
    rows, microbatches, batch_tokens = _job(adapter, steps=10)
    make_batch = _make_batch(rows, "cuda")
    runs = {}
    for graphs in (False, True):
        run = build_run(
            MCORE_MODEL,
            [adapter],
            [batch_tokens],
            device="cuda",
            params_dtype=torch.bfloat16,
            seed=SEED,
            graphs_max_seqlen=GRAPH_PAD_TOKENS if graphs else None,
        )
        runs[graphs] = (run, *_train(run, microbatches, make_batch))
    run, weights, losses = runs[True]
    _, want_weights, want_losses = runs[False]
    assert (run.graphs.captures, run.graphs.replays) == (1, len(microbatches) - CAPTURE_AT)
    # Flash attention's backward adds dQ with atomics: runs differ by rounding, not by steps
    # (a replay on stale inputs moves the factors by ~lr = 2e-3 a step).
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=2e-4)
    torch.testing.assert_close(losses, want_losses, rtol=1e-3, atol=0)
