"""The FP8 base at TP = 2 (2 gloo processes), with and without sequence parallelism, against
TP = 1: the same e4m3 weights and scales (row-parallel scales span the whole row), the same
loss and adapter gradients.

Activations of row-parallel linears are quantized per token over each rank's H / tp columns,
so a shard's scale may be a smaller power of two than the whole row's; a power-of-two scale
moves no rounding of a value in e4m3's normal range, so only values below 2^-6 of the scale
could differ. Measured: loss 5e-8; gradients 7e-7 relative (summation order), except where
such values occur: the attention adapters of layer 0 of the third adapter (drawn from its
name) differ by up to 1.2e-3 (an e4m3 subnormal step, which a shard's larger scale rounds
as a normal value; the same code met 1e-5 with the factors drawn before init was keyed by
name). A wrong shard, scale or layout differs by O(1).
"""

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp
from dist_testing import gloo_world
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

TP = 2
FP8 = dataclasses.replace(TINY, base_precision="fp8", vocab_size=256)  # an FP8 output layer too
LOSS_REL_ERR = 1e-5  # per-token losses, TP = 2 against TP = 1 (measured 5e-8)
GRAD_REL_ERR = 5e-3  # adapter gradients (each factor's shard), TP = 2 against TP = 1


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _shard(name, full, rank, dim, stride=1):
    chunks = full.chunk(TP * stride, dim=dim)
    return torch.cat(chunks[rank::TP], dim=dim)


def _batch():
    ids = torch.randint(0, FP8.vocab_size, (1, 32), generator=torch.Generator().manual_seed(8))
    batch = make_packed_batch([0, 0, 2], [12, 9, 11], 3, input_ids=ids, dropout_seed=3)
    return batch, torch.roll(batch.input_ids, -1, dims=1)


def _run(model, context, batch, labels):
    loss = run_model(model, context, batch, labels=labels)
    loss.sum().backward()
    return loss.detach()


def _worker(rank: int, workdir: str) -> None:
    """Without, then with, sequence parallelism, in one two-process world (one start-up of
    the two interpreters)."""
    with gloo_world(rank, TP, workdir, TP):
        ref = torch.load(os.path.join(workdir, "tp1.pt"))
        for sequence_parallel in (False, True):
            _check_tp2(rank, ref, sequence_parallel)


def _check_tp2(rank: int, ref: dict, sequence_parallel: bool) -> None:
    from sp_testing import sequence_parallel_on_cpu

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model, fp8_weight

    on_cpu = sequence_parallel_on_cpu("cpu") if sequence_parallel else contextlib.nullcontext()
    at = f"rank {rank}, sequence_parallel={sequence_parallel}"
    with on_cpu:
        model = build_gpt_model(FP8, sequence_parallel=sequence_parallel).train()
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            got, want = fp8_weight(module), ref["weights"][name]
            dim = module.weight.partition_dim
            stride = module.weight.partition_stride
            data = _shard(name, want[0].view(torch.uint8), rank, dim, stride)
            assert torch.equal(got.data.view(torch.uint8), data), f"{at} {name}: e4m3 bytes"
            scale = want[1] if dim == 1 else _shard(name, want[1], rank, 0, stride)
            assert torch.equal(got.scale, scale), f"{at} {name}: channel scales"
        context = apply_lora(model, ADAPTERS, seed=4)
        for a in range(context.num_adapters):
            context.load_adapter_state_dict(a, _local(context, ref["trained"][a], rank))
        batch, labels = _batch()
        loss = _run(model, context, batch, labels)
        assert _rel(loss, ref["loss"]) < LOSS_REL_ERR, f"{at}: loss {_rel(loss, ref['loss'])}"
        for a in (0, 2):
            want = _local(context, ref["grads"][a], rank)
            for name, grad in context.adapter_grads(a).items():
                err = _rel(grad, want[name])
                assert err < GRAD_REL_ERR, f"{at}: adapter {a} {name}: {err:.3f}"


def _local(context, tensors, rank):
    """This rank's shards of TP = 1 adapter tensors (column: B on N; row: A on H)."""
    out = {}
    for name, full in tensors.items():
        linear, factor = name.rsplit(".", 1)
        column = linear.endswith(("linear_qkv", "linear_fc1"))
        stride = getattr(context.wrappers[linear].base.weight, "partition_stride", 1)
        if column and factor == "lora_B":
            out[name] = _shard(name, full, rank, 0, stride)
        elif not column and factor == "lora_A":
            out[name] = full.chunk(TP, dim=1)[rank]
        else:
            out[name] = full
    return out


@pytest.mark.slow
def test_fp8_tp2_matches_tp1(megatron_single_process, tmp_path):
    """One TP = 1 reference, then both TP = 2 layouts (without and with sequence
    parallelism) in one pair of worker processes."""
    from megatron_lorafusion.mcore import apply_lora, build_gpt_model, fp8_weight

    model = build_gpt_model(FP8).train()
    weights = {
        name: (fp8_weight(m).data, fp8_weight(m).scale)
        for name, m in model.named_modules()
        if hasattr(m, "weight_scale")
    }
    context = apply_lora(model, ADAPTERS, seed=4)
    randomize_lora_b(context, seed=5)
    trained = [context.adapter_state_dict(a) for a in range(context.num_adapters)]
    batch, labels = _batch()
    loss = _run(model, context, batch, labels)
    grads = [
        {n: g.clone() for n, g in context.adapter_grads(a).items()}
        for a in range(context.num_adapters)
    ]
    torch.save(dict(weights=weights, trained=trained, loss=loss, grads=grads), tmp_path / "tp1.pt")
    # Errors inside a worker are raised here, with the worker's traceback.
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=TP, join=True)
