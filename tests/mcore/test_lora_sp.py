"""LoRA wrappers under TP = 2 with sequence parallelism (2 gloo processes) against plain math.

Each rank builds Megatron's own sequence-parallel `ColumnParallelLinear` / `RowParallelLinear`
around a shard of one full weight, wraps it, and checks its output and every gradient
(input, A, B) against the TP = 1 formula computed on the whole microbatch: the column
wrapper takes this rank's token rows and returns all rows of its output columns, the row
wrapper takes all rows of its input columns and returns its token rows. Segments are ragged
(the TP rank boundary cuts adapter 2's segment), adapter 1 has no tokens, and two adapters
use dropout.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mcore_testing import ADAPTERS

# dtype -> tolerances; TP splits fp32 sums over H (row) and over token rows (dA, dB).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
TP = 2
H, N = 16, 12  # in- and out-features of both linears
SAMPLES = ([0, 0, 2, 2], [5, 3, 4, 6])  # T = 18; rank 0 holds rows 0-8, cutting adapter 2
SP_ADAPTERS = [
    dataclasses.replace(ADAPTERS[0], dropout=0.2),
    ADAPTERS[1],
    dataclasses.replace(ADAPTERS[2], dropout=0.1),
]
LAYER_SEED = 5


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(x, weight, factors, layout, training: bool) -> torch.Tensor:
    """TP = 1 multi-LoRA linear: ``X·Wᵀ + s_a·drop_a(X)·A_aᵀ·B_aᵀ`` on each segment."""
    from megatron_lorafusion.config import adapter_scaling
    from megatron_lorafusion.ops import dropout_keep_mask

    dropouts = [a.dropout for a in SP_ADAPTERS]
    keep = dropout_keep_mask(layout, dropouts, x.shape[1], LAYER_SEED, "cpu") if training else None
    rows = []
    for a, start, end in layout.segments():
        xs = x[start:end]
        if keep is not None and dropouts[a] > 0:
            xs = xs * keep[start:end] / (1.0 - dropouts[a])
        lora_a, lora_b = factors[a]
        rows.append(adapter_scaling(SP_ADAPTERS[a]) * (xs @ lora_a.t()) @ lora_b.t())
    return x @ weight.t() + torch.cat(rows)


def _check_wrapper(kind: str, rank: int) -> None:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_lorafusion.mcore import (
        LoRAColumnParallelLinear,
        LoRAContext,
        LoRARowParallelLinear,
    )
    from megatron_lorafusion.ops import AdapterLayout

    config = ModelParallelConfig(
        tensor_model_parallel_size=TP,
        sequence_parallel=True,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    column = kind == "column"
    layout = AdapterLayout.from_samples(*SAMPLES, 3, dropout_seed=9)
    tokens = layout.num_tokens
    rows = slice(rank * tokens // TP, (rank + 1) * tokens // TP)
    out_cols = slice(rank * N // TP, (rank + 1) * N // TP)
    in_cols = slice(rank * H // TP, (rank + 1) * H // TP)
    weight = _full(1, N, H)
    if column:
        base = ColumnParallelLinear(
            H, N, config=config, init_method=lambda w: None, bias=False, gather_output=False
        )
        local_weight = weight[out_cols]
    else:
        base = RowParallelLinear(
            H,
            N,
            config=config,
            init_method=lambda w: None,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        local_weight = weight[:, in_cols]
    with torch.no_grad():
        base.weight.copy_(local_weight)
    base.weight.requires_grad_(False)
    context = LoRAContext(SP_ADAPTERS, {})
    wrapper_cls = LoRAColumnParallelLinear if column else LoRARowParallelLinear
    wrapper = wrapper_cls(
        base, SP_ADAPTERS, [0, 1, 2], context, seed=3, layer_seed=LAYER_SEED
    ).train()
    context.wrappers[kind] = wrapper
    context.pack()
    assert wrapper.sequence_parallel, f"{kind}: the wrapper did not see the base's SP"
    # Full factors: A as drawn at TP = 1 (gathered), B random (zero at init).
    factors = {}
    for a in range(3):
        rank_a = SP_ADAPTERS[a].rank
        full_a = wrapper.lora_A[a, :rank_a].clone()
        if not column:
            parts = [torch.empty_like(full_a) for _ in range(TP)]
            dist.all_gather(parts, full_a.contiguous())
            full_a = torch.cat(parts, dim=1)
        full_b = _full(10 + a, N, SP_ADAPTERS[a].rank) * 0.1
        with torch.no_grad():
            wrapper.lora_B[a, :, :rank_a].copy_(full_b[out_cols] if column else full_b)
        factors[a] = (full_a.clone().requires_grad_(), full_b.requires_grad_())
    x = _full(2, tokens, H).requires_grad_()
    grad_out = _full(3, tokens, N)
    expected = _reference(x, weight, factors, layout, training=True)
    expected.backward(grad_out)

    context.layout = layout
    local_x = (x[rows] if column else x[:, in_cols]).detach().clone()[:, None, :]
    local_x.requires_grad_()
    out, bias = wrapper(local_x)
    assert bias is None
    want = expected[:, out_cols] if column else expected[rows]
    torch.testing.assert_close(
        out[:, 0],
        want.detach(),
        **TOL[torch.float32],
        msg=f"rank {rank}: {kind} output under SP != TP = 1",
    )
    out.backward((grad_out[:, out_cols] if column else grad_out[rows])[:, None, :])
    want_dx = x.grad[rows] if column else x.grad[:, in_cols]
    torch.testing.assert_close(
        local_x.grad[:, 0],
        want_dx,
        **TOL[torch.float32],
        msg=f"rank {rank}: {kind} input gradient under SP",
    )
    for a in range(3):
        rank_a = SP_ADAPTERS[a].rank
        grad_a, grad_b = wrapper.lora_A_grad[a, :rank_a], wrapper.lora_B_grad[a, :, :rank_a]
        if a == 1:  # no tokens in this microbatch
            assert not grad_a.any(), f"{kind}: A of absent adapter 1 has a gradient"
            assert not grad_b.any(), f"{kind}: B of absent adapter 1 has a gradient"
            continue
        full_da, full_db = factors[a][0].grad, factors[a][1].grad
        torch.testing.assert_close(
            grad_a,
            full_da if column else full_da[:, in_cols],
            **TOL[torch.float32],
            msg=f"rank {rank}: {kind} dA of adapter {a} is partial",
        )
        torch.testing.assert_close(
            grad_b,
            full_db[out_cols] if column else full_db,
            **TOL[torch.float32],
            msg=f"rank {rank}: {kind} dB of adapter {a} is partial",
        )
    # A microbatch that TP ranks cannot split evenly, and unpacked inputs, are refused.
    context.layout = AdapterLayout.from_samples([0], [tokens - 1], 3)
    if not column:
        with pytest.raises(ValueError, match="multiple of tp = 2 tokens"):
            wrapper(torch.zeros(tokens - 1, 1, H // TP))
    context.layout = AdapterLayout.from_samples([0, 0], [tokens // 2, tokens // 2], 3)
    shape = (tokens // (2 * TP), 2, H) if column else (tokens // 2, 2, H // TP)
    with pytest.raises(ValueError, match=r"b = 1"):
        wrapper(torch.zeros(shape))


def _sp_worker(rank: int, workdir: str) -> None:
    from dist_testing import gloo_world
    from sp_testing import sequence_parallel_on_cpu

    with gloo_world(rank, TP, workdir, TP), sequence_parallel_on_cpu("cpu"):
        for kind in ("column", "row"):
            _check_wrapper(kind, rank)


def test_sp_wrappers_match_tp1_math(tmp_path):
    # Errors inside a worker are raised here, with the worker's traceback.
    mp.spawn(_sp_worker, args=(str(tmp_path),), nprocs=TP, join=True)
