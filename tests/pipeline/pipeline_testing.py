"""Helpers of the pipeline tests: a tiny job (model, 3 adapters, data, plan) and its runs.

`reference_run` trains the plan in one process with the runner at PP = DP = 1;
`parallel_worker` trains the same plan on one rank of a TP × PP × DP gloo world with the
pipeline runner and writes the gathered adapter weights. Tests compare the two.
"""

import contextlib
import dataclasses
import os
import random
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from dist_testing import gloo_world
from model_testing import PIPELINE_MODEL as MODEL

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.data import TokenizedSample, pack_microbatch
from megatron_lorafusion.pipeline.gather import unshard_tp
from megatron_lorafusion.planner import PlanProblem, plan_microbatches

# Different global batch sizes, ranks and targets; adapter 1 skips linear_proj and linear_fc1.
# Learning rates of 1e-3..2e-3: Adam turns the fp32 reordering of TP's partial sums into
# weight differences proportional to lr; at 10x these rates TP = 2 against one process measured
# 0.3-2.8x the 1e-5 tolerance over seeds 7-11 (0.04-0.17x here), while a wrong gradient still
# moves the weights by ~lr per step. Clipping off here; `adapters_for(dp, clip=True)` turns it on.
ADAPTERS = [
    AdapterConfig(name="a0", rank=4, alpha=8.0, lr=2e-3, global_batch_size=2, max_grad_norm=0.0),
    AdapterConfig(
        name="a1",
        rank=2,
        alpha=4.0,
        lr=2e-3,
        global_batch_size=3,
        target_modules=["linear_qkv", "linear_fc2"],
        lr_schedule="constant",
        max_grad_norm=0.0,
    ),
    AdapterConfig(
        name="a2",
        rank=8,
        alpha=16.0,
        lr=1e-3,
        global_batch_size=5,
        weight_decay=0.01,
        use_rslora=True,
        max_grad_norm=0.0,
    ),
]
STEPS = 3  # optimizer steps of every adapter


# Gradient norms of the 3 steps: a0 0.37-0.42 (with or without dropout), a2 1.11-1.21; both
# are clipped at every step (AdamW is nearly invariant to a constant gradient scale, so the
# weights move by what the coefficients' variation makes of it). Tests also compare the norms.
CLIP_NORMS = (0.2, 0.0, 0.5)


def _recording_norms(optimizer, num_adapters: int):
    """``(norms, on_step)``: per adapter, the gradient norm of each step (NaN: not computed)."""
    norms = [[] for _ in range(num_adapters)]

    def on_step(a, run):
        norms[a].append(optimizer.grad_norm(a))

    return norms, on_step


def adapters_for(dp: int, clip: bool = False) -> list:
    """`ADAPTERS`, with LoRA dropout on adapter 0 unless DP moves samples between rows.

    Dropout masks are keyed by (microbatch, packed row); a DP share packs other rows.
    ``clip`` sets each adapter's ``max_grad_norm`` from `CLIP_NORMS`.
    """
    adapters = ADAPTERS
    if clip:
        adapters = [
            dataclasses.replace(a, max_grad_norm=m)
            for a, m in zip(adapters, CLIP_NORMS, strict=True)
        ]
    if dp > 1:
        return adapters
    return [dataclasses.replace(adapters[0], dropout=0.1), *adapters[1:]]


CAPACITY = 40  # tokens per microbatch
SEED = 7


@dataclass(frozen=True)
class Job:
    """Everything both runs share: data, training orders, plan, loss denominators."""

    datasets: list
    orders: list
    microbatches: tuple
    batch_tokens: list
    num_stages: int


def make_job(num_stages: int, adapters=ADAPTERS) -> Job:
    """Random samples (3-14 tokens) for ``STEPS`` global batches per adapter, greedily planned."""
    rng = random.Random(SEED)
    datasets = []
    for a in adapters:
        rows = []
        for _ in range(STEPS * a.global_batch_size):
            n = rng.randint(3, 14)
            ids = tuple(rng.randrange(MODEL.vocab_size) for _ in range(n))
            labels = tuple(rng.randrange(MODEL.vocab_size) for _ in range(n))
            mask = tuple(int(i == n - 1 or rng.random() < 0.7) for i in range(n))
            rows.append(TokenizedSample(ids, labels, mask))
        datasets.append(rows)
    orders = [list(range(len(d))) for d in datasets]
    problem = PlanProblem(
        [[len(r) for r in d] for d in datasets],
        [a.global_batch_size for a in adapters],
        CAPACITY,
        num_stages=num_stages,
        seed=SEED,
    )
    plan = plan_microbatches(problem, solver="greedy")
    batch_tokens = [
        [
            sum(
                sum(d[i].loss_mask)
                for i in range(j * a.global_batch_size, (j + 1) * a.global_batch_size)
            )
            for j in range(STEPS)
        ]
        for d, a in zip(datasets, adapters, strict=True)
    ]
    return Job(datasets, orders, plan.microbatches, batch_tokens, num_stages)


def make_batch_fn(job: Job, num_adapters: int, pad_to_multiple: int = 1):
    def make_batch(microbatch, index):
        return pack_microbatch(
            microbatch,
            job.datasets,
            job.orders,
            num_adapters,
            "cpu",
            dropout_seed=SEED * 1_000_003 + index,
            pad_to_multiple=pad_to_multiple,
        )

    return make_batch


def build_stage(
    job: Job,
    adapters=ADAPTERS,
    timeout_s: float = 60.0,
    sequence_parallel: bool = False,
    defer_wgrad: bool = False,
):
    """This rank's `train.recipe.Run` of the job, as `train.main` builds it (`build_run`).

    ``sequence_parallel`` turns on Megatron's sequence parallelism under TP (microbatches are
    then padded to a multiple of TP); ``defer_wgrad`` defers LoRA A's weight gradients.
    """
    from megatron.core import parallel_state

    from megatron_lorafusion.train.recipe import build_run

    tp = parallel_state.get_tensor_model_parallel_world_size()
    run = build_run(
        MODEL,
        adapters,
        job.batch_tokens,
        seed=SEED,
        sequence_shards=tp if sequence_parallel else 1,
        defer_wgrad=defer_wgrad,
        comm_timeout_s=timeout_s,
    )
    run.model.train()
    return run


def run_stage(job: Job, run, make_batch=None, on_step=None):
    """Train the job's plan on this rank's stage (`Run.train`)."""
    make_batch = make_batch or make_batch_fn(job, len(run.runs), run.sequence_shards)
    return run.train(job.microbatches, make_batch, on_step=on_step)


def eval_stage(job: Job, run, tp_rank: int):
    """The trained stage's eval loss sums over the plan's microbatches (forward only)."""
    from megatron_lorafusion.pipeline import forward_loss_sums

    run.model.eval()
    make_batch = make_batch_fn(job, len(run.runs), run.sequence_shards)
    return forward_loss_sums(
        job.microbatches,
        run.forward,
        lambda mb: make_batch(mb, 0),
        run.groups,
        num_adapters=len(run.runs),
        hidden_size=MODEL.hidden_size,
        activation_dtype=torch.float32,
        device="cpu",
        counts_once=tp_rank == 0,
        sequence_shards=run.sequence_shards,
    )


def reference_run(job: Job, adapters=ADAPTERS) -> dict:
    """One process (needs a one-rank world): the runner at PP = DP = 1 over the same plan."""
    from megatron_lorafusion.train.evaluate import one_stage_loss_sums

    run = build_stage(job, adapters)
    norms, on_step = _recording_norms(run.optimizer, len(adapters))
    run_stage(job, run, on_step=on_step)
    run.model.eval()
    make_batch = make_batch_fn(job, len(adapters))
    sums = one_stage_loss_sums(
        lambda batch: run.forward(batch, None), lambda mb: make_batch(mb, 0), len(adapters)
    )
    return {
        "states": [run.lora.adapter_state_dict(a) for a in range(len(adapters))],
        "losses": [r.losses for r in run.runs],
        "norms": norms,
        "eval": sums(job.microbatches),
    }


def parallel_worker(rank: int, world: int, workdir: str, cases: list) -> None:
    """Train the job once per ``(name, tp, pp, sp, defer_wgrad, clip)`` case on one rank.

    ``sp`` turns on sequence parallelism (microbatches padded to a multiple of ``tp``);
    ``defer_wgrad`` defers LoRA A's weight gradients into idle time (zero-bubble); ``clip``
    clips gradient norms (`CLIP_NORMS`). After training, the plan's microbatches are
    evaluated forward only through the same grid (`eval_stage`).

    Cases share the processes (imports cost ~10 s each on 2 cores) but not the groups: each
    gets a fresh gloo world in ``workdir/name``, where rank 0 saves the gathered weights and
    losses (``result.pt``) and a failing rank its traceback (``error_<rank>.txt``).
    """
    for name, tp, pp, sp, defer_wgrad, clip in cases:
        casedir = os.path.join(workdir, name)
        os.makedirs(casedir, exist_ok=True)
        try:
            with gloo_world(rank, world, casedir, tp, pp):
                _train_case(rank, world, casedir, name, tp, pp, sp, defer_wgrad, clip)
        except Exception:
            with open(os.path.join(casedir, f"error_{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())


def _train_case(rank, world, casedir, name, tp, pp, sp, defer_wgrad, clip) -> None:
    """One `parallel_worker` case inside its world."""
    from sp_testing import sequence_parallel_on_cpu

    from megatron_lorafusion.mcore.parallel import parallel_sizes

    job = make_job(pp)
    adapters = adapters_for(world // (tp * pp), clip)
    with sequence_parallel_on_cpu("cpu") if sp else contextlib.nullcontext():
        run = build_stage(job, adapters, sequence_parallel=sp, defer_wgrad=defer_wgrad)
        modes = {w.sequence_parallel for w in run.lora.wrappers.values()}
        assert modes == {sp and tp > 1}, f"{name}: LoRA wrappers' SP modes {modes}"
        norms, on_step = _recording_norms(run.optimizer, len(adapters))
        # Every case warms up first, as `train` does on a GPU: what it trained must not
        # stay (the one-process reference does not warm up).
        run.warm_up(job.microbatches[0], make_batch_fn(job, len(adapters), run.sequence_shards))
        run_stage(job, run, on_step=on_step)
        sizes = parallel_sizes()
        evaluated = eval_stage(job, run, sizes["tp_rank"])
    states = gather_adapter_states(
        run.lora, tp_rank=sizes["tp_rank"], tp_size=tp, dp_rank=sizes["dp_rank"]
    )
    if rank == 0:
        torch.save(
            {
                "states": states,
                "losses": [r.losses for r in run.runs],
                "norms": norms,
                "eval": evaluated,
            },
            os.path.join(casedir, "result.pt"),
        )


def lemma_worker(rank: int, world: int, workdir: str) -> None:
    """PP = 2 on a plan made for one stage: every rank must refuse it before computing."""
    from megatron_lorafusion.pipeline import LemmaError

    with gloo_world(rank, world, workdir, 1, world):
        adapters = ADAPTERS[:1]  # planned alone for one stage: its global batches back to back
        job = make_job(1, adapters)
        run = build_stage(job, adapters)
        try:
            run_stage(job, run)
        except LemmaError as err:
            torch.save({"error": str(err)}, os.path.join(workdir, f"refused_{rank}.pt"))


def fault_worker(rank: int, world: int, workdir: str, fault: str, timeout_s: float) -> None:
    """PP = ``world``; the last rank dies (``kill``) or raises (``raise``) at microbatch 2."""
    import signal

    with gloo_world(rank, world, workdir, 1, world, timeout_s=timeout_s):
        job = make_job(world)
        run = build_stage(job, timeout_s=timeout_s)
        make_batch = make_batch_fn(job, len(ADAPTERS))

        def faulty_make_batch(microbatch, index):
            if rank == world - 1 and index == 2:
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("injected failure")
            return make_batch(microbatch, index)

        try:
            run_stage(job, run, make_batch=faulty_make_batch)
        except BaseException:
            with open(os.path.join(workdir, f"error_{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
            raise


def config_worker(rank: int, world: int, workdir: str) -> None:
    """Rank 1 holds another config: both must raise at start-up."""
    from megatron_lorafusion.pipeline import check_same_across_ranks

    with gloo_world(rank, world, workdir, megatron=False):
        try:
            check_same_across_ranks('{"lr": %s}' % ("0.1" if rank == 0 else "0.2"), "job config")
        except RuntimeError as err:
            with open(os.path.join(workdir, f"refused_{rank}.txt"), "w") as f:
                f.write(str(err))


def stuck_worker(rank: int, world: int, workdir: str, timeout_s: float) -> None:
    """Rank 1 hangs (alive, silent); rank 0's receive must fail after the group timeout."""
    import time
    from datetime import timedelta

    from megatron_lorafusion.pipeline import make_pipeline_groups

    signals = dist.FileStore(os.path.join(workdir, "signals"), world)  # outside the world
    with gloo_world(rank, world, workdir, megatron=False):
        groups = make_pipeline_groups([0, 1], [rank], timeout_s)
        if rank == 1:  # a hung stage: alive, never sends, until rank 0 has given up
            signals.wait(["rank0_done"], timedelta(seconds=20 * timeout_s))
            return
        start = time.monotonic()
        try:
            dist.irecv(torch.empty(4), src=1, group=groups.backward_group).wait()
        except RuntimeError as err:
            with open(os.path.join(workdir, "timed_out.txt"), "w") as f:
                f.write(f"{time.monotonic() - start:.1f} {err}")
        signals.set("rank0_done", "1")


def gather_adapter_states(
    lora,
    *,
    tp_rank: int,
    tp_size: int,
    dp_rank: int,
    local: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[dict[str, torch.Tensor]] | None:
    """Every adapter's full state dict on global rank 0 (a collective over the world): one
    ``all_gather_object`` of every rank's CPU copies; rank 0 keeps data-parallel replica 0
    and undoes the TP split (`pipeline.gather.unshard_tp`).

    Args:
        lora: this rank's `LoRAContext`.
        tp_rank: this rank's tensor-parallel rank.
        tp_size: tensor-parallel size.
        dp_rank: this rank's data-parallel rank (only replica 0 is kept).
        local: per adapter, this rank's factors to gather instead of the current ones (an
            early-stopped adapter's best); None entries (or None): the current weights.

    Returns:
        On rank 0, per adapter id, ``{"decoder.layers.{i}.<parent>.<linear>.lora_A|B": fp32
        CPU tensor}`` over all layers, unsharded; None on other ranks.
    """
    rules = lora.sharding()
    local = local or [None] * lora.num_adapters
    states = [
        {k: v.cpu() for k, v in (local[a] or lora.adapter_state_dict(a)).items()}
        for a in range(lora.num_adapters)
    ]
    payload = (tp_rank, dp_rank, rules, states)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    if dist.get_rank() != 0:
        return None
    replica = [p for p in gathered if p[1] == 0]
    merged: list[dict[str, torch.Tensor]] = []
    for a in range(lora.num_adapters):
        shards: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for tp, _, _, rank_states in replica:
            for key, value in rank_states[a].items():
                shards.setdefault(key, []).append((tp, value))
        all_rules = {n: r for p in replica for n, r in p[2].items()}
        full = {}
        for key, parts in sorted(shards.items()):
            parts = [v for _, v in sorted(parts, key=lambda tv: tv[0])]
            split = all_rules[key]
            full[key] = parts[0] if split is None or tp_size == 1 else unshard_tp(parts, *split)
        merged.append(full)
    return merged
