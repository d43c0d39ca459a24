"""TP = 2 LoRA (2 gloo processes) against TP = 1: same loss, same adapter init and gradients.

Column wrappers shard B on N (with the base's partition stride) and replicate A; row
wrappers shard A on H and replicate B; dropout masks are the TP = 1 masks, sliced. An adapter
with per-projection targets (k/v, gate, down) masks the same entries of its stacked B on
each rank's query groups and [gate | up] halves as at TP = 1.
"""

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp
from dist_testing import gloo_world
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

# dtype -> tolerances; TP splits sums over H (row) and vocab (loss) into per-rank partials.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
TP = 2
SAMPLES = ([0, 0, 2, 3], [6, 9, 5, 7])  # adapter 1 absent
ADAPTERS_WITH_DROPOUT = [
    dataclasses.replace(ADAPTERS[0], dropout=0.2),
    ADAPTERS[1],
    dataclasses.replace(ADAPTERS[2], dropout=0.1),
    dataclasses.replace(
        ADAPTERS[0],
        name="a3",
        rank=3,
        dropout=0.1,
        target_modules=["k_proj", "v_proj", "gate_proj", "down_proj"],
    ),
]
NUM = len(ADAPTERS_WITH_DROPOUT)


def _shard(name: str, full: torch.Tensor, rank: int, strides: dict[str, int]) -> torch.Tensor:
    """This TP rank's part of a TP = 1 adapter tensor."""
    linear, factor = name.rsplit(".", 1)
    column = linear.endswith(("linear_qkv", "linear_fc1"))
    if column and factor == "lora_B":  # rows of the base weight, with its partition stride
        chunks = full.chunk(TP * strides[linear], dim=0)
        return torch.cat(chunks[rank::TP], dim=0)
    if not column and factor == "lora_A":
        return full.chunk(TP, dim=1)[rank]
    return full


def _batch():
    batch = make_packed_batch(*SAMPLES, NUM, seed=8, dropout_seed=3)
    return batch, torch.roll(batch.input_ids, -1, dims=1)


def _tp2_worker(rank: int, workdir: str) -> None:
    from megatron_lorafusion.mcore import apply_lora, build_gpt_model

    with gloo_world(rank, TP, workdir, TP):
        ref = torch.load(os.path.join(workdir, "tp1.pt"))
        model = build_gpt_model(TINY).train()
        context = apply_lora(model, ADAPTERS_WITH_DROPOUT, seed=4)
        strides = {
            name: getattr(w.base.weight, "partition_stride", 1)
            for name, w in context.wrappers.items()
        }
        for a in range(context.num_adapters):
            for name, value in context.adapter_state_dict(a).items():
                torch.testing.assert_close(
                    value,
                    _shard(name, ref["init"][a][name], rank, strides),
                    atol=0,
                    rtol=0,
                    msg=f"rank {rank}: init of adapter {a} {name} is not the TP = 1 shard",
                )
            context.load_adapter_state_dict(
                a, {n: _shard(n, v, rank, strides) for n, v in ref["trained"][a].items()}
            )
        batch, labels = _batch()
        loss = run_model(model, context, batch, labels=labels)
        loss.sum().backward()
        torch.testing.assert_close(
            loss.detach(),
            ref["loss"],
            **TOL[torch.float32],
            msg=f"rank {rank}: TP = 2 per-token loss != TP = 1",
        )
        for a in range(context.num_adapters):
            for name, grad in context.adapter_grads(a).items():
                expected = ref["grads"][a][name]
                if not expected.any():
                    assert not grad.any(), f"rank {rank}: {name} of absent adapter {a}"
                    continue
                torch.testing.assert_close(
                    grad,
                    _shard(name, expected, rank, strides),
                    **TOL[torch.float32],
                    msg=f"rank {rank}: gradient of adapter {a} {name} != TP = 1 shard",
                )


@pytest.mark.slow
def test_tp2_lora_matches_tp1(megatron_single_process, tmp_path):
    from megatron_lorafusion.mcore import apply_lora, build_gpt_model

    model = build_gpt_model(TINY).train()  # training mode: LoRA dropout on
    context = apply_lora(model, ADAPTERS_WITH_DROPOUT, seed=4)
    init = [context.adapter_state_dict(a) for a in range(NUM)]
    randomize_lora_b(context, seed=5)  # non-zero B: every factor matters and gets gradients
    trained = [context.adapter_state_dict(a) for a in range(NUM)]
    batch, labels = _batch()
    loss = run_model(model, context, batch, labels=labels)
    loss.sum().backward()
    grads = [{n: g.clone() for n, g in context.adapter_grads(a).items()} for a in range(NUM)]
    torch.save(
        dict(init=init, trained=trained, loss=loss.detach(), grads=grads), tmp_path / "tp1.pt"
    )
    # Errors inside a worker are raised here, with the worker's traceback.
    mp.spawn(_tp2_worker, args=(str(tmp_path),), nprocs=TP, join=True)
