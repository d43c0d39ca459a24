"""Multi-adapter LoRA wrappers for Megatron's tensor-parallel linears (TP- and SP-aware).

Each wrapper keeps the built base linear and adds, per adapter, ``Y += s_a·drop_a(X)·A_aᵀ·B_aᵀ``
on that adapter's token segment (LoRAFusion, arXiv 2510.00206, Eq. 1). Sharding follows the
base (DESIGN.md "LoRA wrapper"): a column-parallel base shards B on N and replicates A, and
``dS`` is all-reduced over the TP group in backward; a row-parallel base shards A on H and
all-reduces the partial ``S`` in forward, with B replicated. Under sequence parallelism the
collectives on the small ``S`` (T × R) become an all-gather (column) or a reduce-scatter
(row) over the sequence, matching the base's own (``docs/pipeline.md``).

A DoRA adapter (`adapter_types.DORA`, TP = 1) also scales its tokens' output columns by
``m / ‖W + s·B·A‖_row`` (`ops.dora_scale` on the fused output, before the bias), its
magnitudes ``m`` packed with the factors.

With the context's ``rebuild_inputs`` on (selective recompute), a wrapper whose input a
fused-base norm or SwiGLU produced (`fused_base.input_rebuild`) does not keep that input for
``dA = dSᵀ·drop(X)``: its LoRA op saves the producer's input, which the producer's backward
saves anyway, and rebuilds X from it in backward with the producer's own function.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from torch import nn

from megatron_lorafusion.adapter_types import LORA, adapter_type
from megatron_lorafusion.config import AdapterConfig, adapter_scaling
from megatron_lorafusion.mcore.fp8 import FP8_LINEARS, fp8_weight
from megatron_lorafusion.mcore.fused_base import input_rebuild
from megatron_lorafusion.mcore.wgrad import WgradQueue, down_projection
from megatron_lorafusion.ops import (
    AdapterLayout,
    copy_to_device,
    dora_scale,
    lora_down,
    lora_linear,
    lora_up,
    packed_factors,
    packed_slot,
    weight_sq_norm,
)
from megatron_lorafusion.ops.saved_input import InputRebuild


class LayoutSource(Protocol):
    """What the wrappers read at each forward (a `LoRAContext`).

    ``layout`` is the microbatch's; ``wgrad_queue`` holds deferred weight gradients (None:
    none are deferred); ``rebuild_inputs`` turns selective recompute on.
    """

    layout: AdapterLayout | None
    wgrad_queue: WgradQueue | None
    rebuild_inputs: bool


def _init_seed(seed: int, adapter_name: str, layer_seed: int) -> int:
    """Generator seed of one adapter's factors in one layer: a stable hash of the triple.

    Keyed by the adapter's name, never its position: the same adapter starts from the same
    factors alone, among others, or in another order (DESIGN.md "Every adapter on its own").
    """
    digest = hashlib.sha256(f"{seed}/{adapter_name}/{layer_seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def _kaiming_uniform(rank: int, fan_in: int, generator: torch.Generator) -> torch.Tensor:
    """(rank, fan_in) fp32 like PEFT's ``kaiming_uniform_(a=sqrt(5))``: U(±1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=generator) * 2.0 - 1.0) * bound


def _tokens_major(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> (b·s, h) with each sequence's rows contiguous (a view when b == 1)."""
    if x.dim() != 3:
        raise ValueError(f"Megatron linears take [s, b, h] inputs, got shape {tuple(x.shape)}")
    seq, batch, hidden = x.shape
    return x.reshape(seq, hidden) if batch == 1 else x.transpose(0, 1).reshape(-1, hidden)


def _sequence_major(y: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """(b·s, n) -> [s, b, n], the inverse of `_tokens_major`."""
    return y.reshape(seq, 1, -1) if batch == 1 else y.reshape(batch, seq, -1).transpose(0, 1)


RowBlocks = dict[int, tuple[int, torch.Tensor]]
"""Per-projection adapters of a column wrapper: adapter id -> ``(k, block)``, its ``k`` LoRA
blocks and ``block`` (N_local,) int64, the block of each local output row (-1: none)."""


def _off_block_mask(
    row_blocks: RowBlocks, ranks: Sequence[int], num_adapters: int, out_local: int, max_rank: int
) -> torch.Tensor | None:
    """(A, N_local, R) bool, True where a per-projection adapter's ``B`` must stay zero.

    Adapter ``a`` with ``k`` blocks of rank ``r`` owns rank columns ``j·r..(j+1)·r`` for its
    block ``j``: entry ``(n, c)`` of its ``B`` is live only when row ``n`` is in block
    ``c // r``. None when no adapter of the wrapper is per-projection.
    """
    if not row_blocks:
        return None
    off = torch.zeros(num_adapters, out_local, max_rank, dtype=torch.bool)
    for a, (blocks, block_of_row) in row_blocks.items():
        block_of_col = torch.arange(max_rank) // (ranks[a] // blocks)  # (R,), >= k past rank
        off[a] = block_of_row[:, None] != block_of_col[None, :]
    return off


def _init_factors(
    wrapper: nn.Module,
    adapters: Sequence[AdapterConfig],
    targeted: Sequence[int],
    *,
    in_features: int,
    in_shard: slice,
    out_local: int,
    seed: int,
    layer_seed: int,
    device: torch.device,
    row_blocks: RowBlocks | None = None,
    draw_pool: Executor | None = None,
) -> None:
    """Give ``wrapper`` its packed factors and the per-adapter constants of the op.

    ``wrapper.lora_A`` (A, R, H_local) and ``wrapper.lora_B`` (A, N_local, R) are fp32
    tensors (not parameters), with ``R`` the largest rank of the targeting adapters.
    Adapter ``a``'s factors are ``lora_A[a, :r_a]`` and ``lora_B[a, :, :r_a]``; everything
    else (rows beyond its rank, adapters not targeting this linear) is zero and stays zero
    in training: its gradient is exactly zero (zero factors, or scale 0), and AdamW moves a
    zero weight with a zero gradient nowhere. `LoRAContext.pack` later moves both into its
    per-adapter rows.

    An adapter of ``row_blocks`` (per-projection targets, `config.lora_blocks`) has rank
    ``r_a = k·r`` here: its ``k`` blocks' A rows stacked, and a block-diagonal B whose
    off-block entries ``wrapper.lora_B_off`` masks to zero in every forward, so their
    gradient is exactly zero too and they stay zero (docs/adapters.md).
    """
    if not targeted:
        raise ValueError(f"{type(wrapper).__name__} needs at least one targeting adapter")
    row_blocks = row_blocks or {}
    wrapper.num_adapters = len(adapters)
    wrapper.ranks = [0] * len(adapters)
    for a in targeted:
        wrapper.ranks[a] = adapters[a].rank * (row_blocks[a][0] if a in row_blocks else 1)
    wrapper.max_rank = max(wrapper.ranks)
    wrapper.in_features, wrapper.in_shard = in_features, in_shard  # `bind_adapter` draws A
    local_in = len(range(in_features)[in_shard])
    lora_a = torch.empty(len(adapters), wrapper.max_rank, local_in)

    def draw(a: int) -> None:
        rank = wrapper.ranks[a]
        if rank == 0:  # not targeting this linear
            lora_a[a].zero_()
            return
        generator = torch.Generator().manual_seed(_init_seed(seed, adapters[a].name, layer_seed))
        # Drawn at full width then sliced, so a TP shard equals the TP = 1 slice.
        lora_a[a, :rank] = _kaiming_uniform(rank, in_features, generator)[:, in_shard]
        lora_a[a, rank:].zero_()

    # Each adapter from its own generator, so in the caller's threads when it has some
    # (`apply_lora`'s pool; torch's ops release the GIL): 64 adapters on the 8B preset draw
    # 0.9 G values. The values do not depend on the threads.
    list((draw_pool.map if draw_pool is not None else map)(draw, range(len(adapters))))
    wrapper.lora_A = lora_a.to(device)
    wrapper.lora_B = torch.zeros(len(adapters), out_local, wrapper.max_rank, device=device)
    wrapper.lora_A_grad = wrapper.lora_B_grad = None  # views of the gradient table, once packed
    wrapper.lora_column = -1  # first column of its factors in the tables, once packed
    off = _off_block_mask(row_blocks, wrapper.ranks, len(adapters), out_local, wrapper.max_rank)
    wrapper.lora_B_off = None if off is None else off.to(device)
    on = set(targeted)
    wrapper.scalings = [adapter_scaling(ad) if i in on else 0.0 for i, ad in enumerate(adapters)]
    wrapper.dropouts = [ad.dropout if i in on else 0.0 for i, ad in enumerate(adapters)]
    wrapper.types = [adapter_type(ad) if i in on else LORA for i, ad in enumerate(adapters)]
    _init_row_vectors(wrapper, adapters, row_blocks, out_local, device)


def bind_adapter(
    wrapper: nn.Module,
    a: int,
    adapter: AdapterConfig | None,
    seed: int,
    row_blocks: RowBlocks,
) -> None:
    """Set wrapper row ``a`` to ``adapter`` (None: it does not adapt this linear).

    Its factors' rows must be zero already (`LoRAContext.bind` zeroes the table row); A is
    drawn as `_init_factors` draws it, B stays zero.

    Raises:
        NotImplementedError: for a rank above the wrapper's ``max_rank``, or a variant with a
            row vector (DoRA: a server's tables hold LoRA factors only).
    """
    kind = LORA if adapter is None else adapter_type(adapter)
    blocks = row_blocks[a][0] if a in row_blocks else 1
    rank = 0 if adapter is None else adapter.rank * blocks
    if rank > wrapper.max_rank:
        raise NotImplementedError(
            f"adapter {adapter.name!r} has rank {rank} on {type(wrapper).__name__}, above the "
            f"{wrapper.max_rank} its table rows were allocated with (server.max_rank)"
        )
    if kind.row_vector is not None:
        raise NotImplementedError(
            f"adapter {adapter.name!r} uses {kind.name} (use_dora): a server's adapter tables "
            "hold LoRA factors only; train it with lorafusion train"
        )
    wrapper.ranks[a] = rank
    wrapper.scalings[a] = 0.0 if adapter is None else adapter_scaling(adapter)
    wrapper.dropouts[a] = 0.0 if adapter is None else adapter.dropout
    wrapper.types[a] = kind
    if rank:
        generator = torch.Generator().manual_seed(
            _init_seed(seed, adapter.name, wrapper.layer_seed)
        )
        drawn = _kaiming_uniform(rank, wrapper.in_features, generator)[:, wrapper.in_shard]
        wrapper.lora_A[a, :rank].copy_(drawn)
    if row_blocks and wrapper.lora_B_off is None:
        shape = (wrapper.num_adapters, wrapper.lora_B.shape[1], wrapper.max_rank)
        wrapper.lora_B_off = torch.zeros(shape, dtype=torch.bool, device=wrapper.lora_B.device)
    if wrapper.lora_B_off is not None:
        off = _off_block_mask(
            row_blocks,
            wrapper.ranks,
            wrapper.num_adapters,
            wrapper.lora_B.shape[1],
            wrapper.max_rank,
        )
        wrapper.lora_B_off[a] = False if off is None else off[a].to(wrapper.lora_B_off.device)


def _init_row_vectors(
    wrapper: nn.Module,
    adapters: Sequence[AdapterConfig],
    row_blocks: RowBlocks,
    out_local: int,
    device: torch.device,
) -> None:
    """The per-output-row vectors of the variants that have one (DoRA's magnitude).

    Sets ``wrapper.row_vector`` (the vector's name, e.g. ``lora_magnitude``, or None), the
    (A, 1, N_local) fp32 tensor of that name (packed by `LoRAContext.pack` like the factors),
    ``row_vector_on`` (A, N_local) bool (True on the rows an adapter's vector scales: all
    rows, or a per-projection adapter's block rows; elsewhere the scale is 1 and the vector
    stays 0 with zero gradient) and ``weight_sq`` (N_local,) fp32 ``‖W_n‖²`` of the frozen
    base weight, computed once.

    Raises:
        NotImplementedError: for a vector adapter under TP > 1, or two kinds on one linear.
    """
    ids = [a for a, t in enumerate(wrapper.types) if t.row_vector is not None]
    wrapper.row_vector = wrapper.row_vector_on = wrapper.weight_sq = None
    if not ids:
        return
    names = {wrapper.types[a].row_vector for a in ids}
    if len(names) > 1:
        raise NotImplementedError(f"one linear takes one kind of row vector, got {sorted(names)}")
    if wrapper.tp_size > 1:
        raise NotImplementedError(
            f"adapter {adapters[ids[0]].name!r} uses {wrapper.types[ids[0]].name} "
            f"(use_dora), which supports tp = 1 only, got tp = {wrapper.tp_size}"
        )
    if isinstance(wrapper.base, FP8_LINEARS):
        raise NotImplementedError(
            f"adapter {adapters[ids[0]].name!r} uses {wrapper.types[ids[0]].name} "
            f"(use_dora), whose column norms read the full-precision base weight; an FP8 "
            f"base (model.base_precision: fp8) supports LoRA adapters only"
        )
    wrapper.row_vector = names.pop()
    wrapper.weight_sq = weight_sq_norm(wrapper.base.weight)  # (N_local,) fp32
    on = torch.zeros(len(adapters), out_local, dtype=torch.bool, device=device)
    vectors = torch.zeros(len(adapters), 1, out_local, device=device)
    for a in ids:
        rows = row_blocks[a][1].to(device) >= 0 if a in row_blocks else True
        on[a] = rows
        init = wrapper.types[a].init_row_vector(wrapper.weight_sq)
        vectors[a, 0] = torch.where(on[a], init, 0.0)
    wrapper.row_vector_on = on
    setattr(wrapper, wrapper.row_vector, vectors)
    # its gradient: a view of the context's gradient table, once packed
    setattr(wrapper, f"{wrapper.row_vector}_grad", None)


def _adapter_factors(wrapper: nn.Module, a: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapter ``a``'s fp32 ``A`` (r, H_local) and ``B`` (N_local, r) views, off-block zeroed."""
    rank = wrapper.ranks[a]
    factor_b = wrapper.lora_B[a, :, :rank]
    if wrapper.lora_B_off is not None:
        factor_b = factor_b.masked_fill(wrapper.lora_B_off[a, :, :rank], 0.0)
    return wrapper.lora_A[a, :rank], factor_b


def _column_scale(wrapper: nn.Module, layout: AdapterLayout) -> torch.Tensor | None:
    """(A, N_local) fp32 scale of each adapter's output columns (DoRA), or None for all 1.

    One batched call of the variant's hook for every adapter with a scale and tokens in this
    microbatch (1 elsewhere): no per-adapter work; None when no such adapter. The vectors'
    gradient reaches the context's table through `ops.packed_slot`.
    """
    if wrapper.row_vector is None:
        return None
    table = wrapper.context.weights
    vectors = getattr(wrapper, wrapper.row_vector)
    grads = getattr(wrapper, f"{wrapper.row_vector}_grad")
    vectors = packed_slot(table, vectors, grads, torch.float32)[:, 0]  # (A, N_local)
    counts = layout.token_counts()
    ids = [
        a
        for a, kind in enumerate(wrapper.types)
        if kind.column_scale is not None and counts[a] and wrapper.ranks[a]
    ]
    if not ids:  # no scaled adapter has tokens here: every scale is 1
        return None
    kind = wrapper.types[ids[0]]  # one kind of row vector per linear (`_init_row_vectors`)
    device = vectors.device
    index = copy_to_device(torch.tensor(ids), device)
    factor_b = wrapper.lora_B.index_select(0, index)  # (k, N_local, R), fresh copies
    if wrapper.lora_B_off is not None:
        factor_b = factor_b.masked_fill(wrapper.lora_B_off.index_select(0, index), 0.0)
    scalings = torch.tensor([wrapper.scalings[a] for a in ids], dtype=torch.float32)
    picked = kind.column_scale(  # every scaled adapter of the microbatch at once
        wrapper.base.weight.detach(),
        wrapper.weight_sq,
        wrapper.lora_A.index_select(0, index),
        factor_b,
        copy_to_device(scalings, device),
        vectors.index_select(0, index),
    )  # (k, N_local)
    scale = torch.ones_like(vectors).index_copy(0, index, picked)
    return torch.where(wrapper.row_vector_on, scale, 1.0)


def _scale_columns(
    wrapper: nn.Module, y: torch.Tensor, scale: torch.Tensor, layout, bias_included: bool
) -> torch.Tensor:
    """``scale[a(t)] ⊙ (y − b) + b`` on [s, b, N] ``y`` (``b``: the bias ``y`` holds, if any)."""
    bias = wrapper.base.bias if bias_included else None
    seq, batch = y.shape[0], y.shape[1]
    rows = _tokens_major(y if bias is None else y - bias)
    out = _sequence_major(dora_scale(rows, scale, layout), seq, batch)
    return out if bias is None else out + bias


def _compute_factors(
    wrapper: nn.Module, dtype: torch.dtype, layout: AdapterLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lora_a`` (A, R, H_local) and ``lora_b`` (A, N_local, R) in ``dtype``.

    Views of the context's compute-dtype table (`LoRAContext.compute_weights`, one cast per
    microbatch whatever the number of adapters and layers); in backward one launch adds both
    gradients of the microbatch's adapters (``layout``'s, the whole microbatch's under
    sequence parallelism) into the context's gradient table (`ops.packed_factors`).
    Off-block entries of per-projection adapters (``lora_B_off``) are zeroed here, so their
    gradient that lands in the table is exactly zero (one masked fill of B, A × N_local × R
    elements).
    """
    if wrapper.lora_A_grad is None:
        raise RuntimeError(
            f"{type(wrapper).__name__}: its factors are not packed; build "
            "wrappers through apply_lora"
        )
    context = wrapper.context
    lora_a, lora_b = packed_factors(
        context.weights,
        context.compute_weights(dtype),
        context.grads,
        wrapper.lora_column,
        tuple(wrapper.lora_A.shape[1:]),
        tuple(wrapper.lora_B.shape[1:]),
        layout.present(context.grads.device),
    )
    if wrapper.lora_B_off is not None:
        lora_b = lora_b.masked_fill(wrapper.lora_B_off, 0.0)
    return lora_a, lora_b


def _current_layout(wrapper: nn.Module, tokens: int) -> AdapterLayout:
    """The layout set for this microbatch, checked against the wrapper and the input.

    ``tokens`` is the microbatch's whole token count ``T`` (under sequence parallelism the
    caller passes ``tp`` times the rows of a column wrapper's input).
    """
    name = type(wrapper).__name__
    layout = wrapper.context.layout
    if layout is None:
        raise RuntimeError(
            f"{name}: no AdapterLayout set; assign lora_context.layout for this microbatch "
            "before calling the model"
        )
    if layout.num_adapters != wrapper.num_adapters:
        raise ValueError(
            f"{name}: the AdapterLayout has {layout.num_adapters} adapters, LoRA was applied "
            f"with {wrapper.num_adapters}"
        )
    if layout.num_tokens != tokens:
        scope = f"{tokens // wrapper.tp_size} rows × tp {wrapper.tp_size} (sequence parallel)"
        detail = scope if wrapper.sequence_parallel and wrapper.is_column else f"{tokens} (s·b)"
        raise ValueError(
            f"{name}: the AdapterLayout covers {layout.num_tokens} tokens, the input has {detail}"
        )
    return layout


def _sequence_shard(wrapper: nn.Module, layout: AdapterLayout) -> AdapterLayout:
    """This TP rank's rows of ``layout`` under sequence parallelism (cached per layout).

    Raises:
        ValueError: when the microbatch's ``T`` is not a multiple of the TP size.
    """
    cached = wrapper._sequence_shard_cache
    if cached is not None and cached[0] is layout:
        return cached[1]
    tokens, tp = layout.num_tokens, wrapper.tp_size
    if tokens % tp:
        raise ValueError(
            f"{type(wrapper).__name__}: sequence parallelism needs a microbatch of a multiple "
            f"of tp = {tp} tokens, got T = {tokens}; pad it (pack_microbatch(pad_to_multiple=tp))"
        )
    rows = tokens // tp
    rank = wrapper.tp_group.rank()
    shard = layout.shard(rank * rows, (rank + 1) * rows)
    wrapper._sequence_shard_cache = (layout, shard)
    return shard


def _rebuilt_rows(fn: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor) -> torch.Tensor:
    """(T, H) rows of ``fn(source)``, laid out as `_tokens_major` lays out the wrapper input."""
    return _tokens_major(fn(source))


def _input_rebuild(wrapper: nn.Module, input_: torch.Tensor, defer: bool) -> InputRebuild | None:
    """How the LoRA op rebuilds its (T, H_local) input in backward; None: the op keeps it.

    Set for selective recompute (the context's ``rebuild_inputs``) in a training forward whose
    input a fused-base norm or SwiGLU produced (`fused_base.input_rebuild`). Not when dA is
    deferred (``defer``): the deferred pass holds X until it runs.
    """
    if defer or not (
        wrapper.context.rebuild_inputs and wrapper.training and torch.is_grad_enabled()
    ):
        return None
    recipe = input_rebuild(input_)
    if recipe is None:
        return None
    fn, source = recipe
    return InputRebuild(functools.partial(_rebuilt_rows, fn), (source,))


def _down(
    wrapper,
    x,
    lora_a,
    layout: AdapterLayout,
    rebuild: InputRebuild | None,
    col_offset: int = 0,
    full_width: int | None = None,
) -> torch.Tensor:
    """``S = drop(X)·Aᵀ`` (T, R): `lora_down` rebuilding X in backward, else `down_projection`."""
    if rebuild is None:
        return down_projection(
            wrapper, x, lora_a, layout, col_offset=col_offset, full_width=full_width
        )
    return lora_down(
        x,
        lora_a,
        wrapper.dropouts,
        layout,
        layer_seed=wrapper.layer_seed,
        training=wrapper.training,
        col_offset=col_offset,
        full_width=full_width,
        rebuild=rebuild,
    )


def _column_delta(
    wrapper, x, lora_a, lora_b, layout: AdapterLayout, rebuild: InputRebuild | None
) -> torch.Tensor:
    """LoRA delta of a column-parallel linear: (T, N / tp) from this rank's input rows.

    Without SP, ``x`` is (T, H) on every rank: ``S`` is computed whole, and its gradient is
    all-reduced in backward (B is sharded on N, so each rank holds a partial ``dS``). With
    SP, ``x`` is this rank's (T / tp, H) rows: ``S_local = drop(X_local)·Aᵀ`` with the shard
    layout, all-gathered to (T, R) (backward: reduce-scatter of the partial ``dS``); ``A``
    is replicated but each rank's ``dA`` covers only its rows, so the packed ``A`` goes
    through copy-to-TP-region (backward: all-reduce of ``dA``, A × R × H per microbatch).
    ``layout`` is the whole microbatch's; ``rebuild`` (or None) rebuilds ``x`` in backward.
    """
    group = wrapper.tp_group
    down_layout = layout
    if wrapper.sequence_parallel:
        down_layout = _sequence_shard(wrapper, layout)
        lora_a = copy_to_tensor_model_parallel_region(lora_a, group=group)
    s = _down(wrapper, x, lora_a, down_layout, rebuild)  # (T or T / tp, R)
    if wrapper.sequence_parallel:
        s = gather_from_sequence_parallel_region(
            s, tensor_parallel_output_grad=True, group=group
        )  # (T, R)
    elif wrapper.tp_size > 1:
        s = copy_to_tensor_model_parallel_region(s, group=group)
    return lora_up(s, lora_b, wrapper.scalings, layout)  # (T, N / tp)


def _row_delta(
    wrapper, x, lora_a, lora_b, layout: AdapterLayout, rebuild: InputRebuild | None
) -> torch.Tensor:
    """LoRA delta of a row-parallel linear from (T, H / tp): (T, N), or (T / tp, N) with SP.

    The partial ``S = drop(X)·A_localᵀ`` (T, R) uses this rank's columns of the full-width
    dropout mask. Without SP it is all-reduced (backward: copy). With SP it is
    reduce-scattered over the sequence to this rank's (T / tp, R) rows (backward:
    all-gather), and ``Δ = s·S_local·Bᵀ`` uses the shard layout; ``B`` is replicated but each
    rank's ``dB`` covers only its rows, so the packed ``B`` goes through copy-to-TP-region
    (backward: all-reduce of ``dB``). ``layout`` is the whole microbatch's; ``rebuild`` (or
    None) rebuilds ``x`` in backward.
    """
    group = wrapper.tp_group
    s = _down(
        wrapper,
        x,
        lora_a,
        layout,
        rebuild,
        col_offset=wrapper.in_shard.start,
        full_width=wrapper.in_features,
    )  # (T, R), partial over H
    if not wrapper.sequence_parallel:
        if wrapper.tp_size > 1:
            s = reduce_from_tensor_model_parallel_region(s, group=group)
        return lora_up(s, lora_b, wrapper.scalings, layout)  # (T, N)
    s = reduce_scatter_to_sequence_parallel_region(s, group=group)  # (T / tp, R)
    lora_b = copy_to_tensor_model_parallel_region(lora_b, group=group)
    return lora_up(s, lora_b, wrapper.scalings, _sequence_shard(wrapper, layout))  # (T/tp, N)


def _lora_forward(wrapper: nn.Module, input_: torch.Tensor, args: tuple, kwargs: dict):
    """Base output plus the LoRA delta, shared by both wrappers.

    With TP = 1 on CUDA this is one fused `lora_linear`; otherwise the base linear (with its
    own TP / SP collectives) plus `lora_down` → collective → `lora_up` (`_column_delta`,
    `_row_delta`), each op on its Triton kernels on CUDA and the torch reference elsewhere.
    Either way the LoRA op rebuilds X in backward when `_input_rebuild` says how.
    """
    base = wrapper.base
    seq, batch = input_.shape[0], input_.shape[1]
    x = _tokens_major(input_)  # (T, H_local), or (T / tp, H) for a column wrapper under SP
    if wrapper.sequence_parallel and batch != 1:
        raise ValueError(
            f"{type(wrapper).__name__}: sequence parallelism needs packed inputs [s, 1, h] "
            f"(b = 1), got shape {tuple(input_.shape)}"
        )
    gathers_rows = wrapper.sequence_parallel and wrapper.is_column
    layout = _current_layout(wrapper, x.shape[0] * (wrapper.tp_size if gathers_rows else 1))
    if wrapper.sequence_parallel:
        _sequence_shard(wrapper, layout)  # checks T % tp before any collective
    lora_a, lora_b = _compute_factors(wrapper, input_.dtype, layout)  # (A,R,H_l), (A,N_l,R)
    queue = getattr(wrapper.context, "wgrad_queue", None)
    defer = queue is not None and wrapper.training and torch.is_grad_enabled()
    rebuild = _input_rebuild(wrapper, input_, defer)
    scale = _column_scale(wrapper, layout)  # (A, N_local), None without DoRA
    if wrapper.tp_size == 1 and input_.is_cuda and not args and not kwargs and not defer:
        # One fused multi-LoRA linear (the Triton path behind `lora_linear`), DoRA's scale
        # on its output before the bias; an FP8 base passes its `Fp8Weight`.
        bias = None if base.skip_bias_add else base.bias
        out = lora_linear(
            x,
            fp8_weight(base) if isinstance(base, FP8_LINEARS) else base.weight,
            bias if scale is None else None,
            lora_a,
            lora_b,
            wrapper.scalings,
            wrapper.dropouts,
            layout,
            layer_seed=wrapper.layer_seed,
            training=wrapper.training,
            rebuild=rebuild,
        )
        if scale is not None:
            out = dora_scale(out, scale, layout)
            out = out if bias is None else out + bias
        return _sequence_major(out, seq, batch), (base.bias if base.skip_bias_add else None)
    out, out_bias = base(input_, *args, **kwargs)
    if wrapper.is_column:
        delta = _column_delta(wrapper, x, lora_a, lora_b, layout, rebuild)  # (T, N / tp)
        if base.gather_output and wrapper.tp_size > 1:
            delta = gather_from_tensor_model_parallel_region(delta, group=wrapper.tp_group)
    else:
        delta = _row_delta(wrapper, x, lora_a, lora_b, layout, rebuild)  # (T, N), (T/tp, N) SP
    out = out + _sequence_major(delta, out.shape[0], out.shape[1])
    if scale is not None:  # tp = 1 (`_init_row_vectors`): out holds every token's full row
        has_bias = base.bias is not None and not base.skip_bias_add
        out = _scale_columns(wrapper, out, scale, layout, has_bias)
    return out, out_bias


class _LoRAWrapper(nn.Module):
    """What both wrappers share: the base, its TP / SP mode, its weight and merged weights."""

    def __init__(
        self,
        base: nn.Module,
        context: LayoutSource,
        layer_seed: int,
        tp_group: torch.distributed.ProcessGroup | None,
        *,
        is_column: bool,
    ):
        super().__init__()
        name = type(self).__name__
        if getattr(base, "is_expert", False):
            raise NotImplementedError(f"{name}: LoRA on MoE expert linears is not supported")
        self.base = base
        self.train(base.training)  # a new module defaults to training mode; follow the model
        self.context = context
        self.layer_seed = layer_seed
        self.tp_group = tp_group if tp_group is not None else base.tp_group
        self.tp_size = self.tp_group.size()
        self.is_column = is_column
        # Megatron's linears turn sequence_parallel off by themselves at TP = 1.
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and (
            self.tp_size > 1
        )
        self._sequence_shard_cache = None

    @property
    def weight(self) -> torch.Tensor:
        """The frozen base weight, this rank's shard (e4m3 for an FP8 base)."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The base bias, if any."""
        return self.base.bias

    def backward_dw(self) -> None:
        """Delegate Megatron's delayed weight-gradient hook to the base."""
        self.base.backward_dw()

    def merged_weight(self, adapter_id: int) -> torch.Tensor:
        """This rank's shard of ``W + s·B·A``, shaped like the base weight, in its dtype.

        An FP8 base gives ``dequantized W + s·B·A`` in the compute dtype.

        Raises:
            ValueError: for an ``adapter_id`` outside ``[0, A)``.
        """
        if not 0 <= adapter_id < self.num_adapters:
            raise ValueError(f"adapter_id must lie in [0, {self.num_adapters}), got {adapter_id}")
        weight = self.base.weight.detach()
        if isinstance(self.base, FP8_LINEARS):  # an FP8 base merges into its dequantized W
            weight = fp8_weight(self.base).dequantize(self.base.config.params_dtype)
        if self.ranks[adapter_id] == 0:
            return weight.clone()
        factor_a, factor_b = _adapter_factors(self, adapter_id)  # (r, H_local), (N_local, r)
        kind = self.types[adapter_id]
        vector = None
        if kind.row_vector is not None:
            vector = getattr(self, kind.row_vector)[adapter_id, 0]
        with torch.no_grad():
            merged = kind.merged_weight(
                weight, factor_a, factor_b, self.scalings[adapter_id], vector
            )  # fp32
            if kind.row_vector is not None:  # rows outside its blocks keep W
                merged = torch.where(
                    self.row_vector_on[adapter_id, :, None], merged, weight.float()
                )
        return merged.to(weight.dtype)


class LoRAColumnParallelLinear(_LoRAWrapper):
    """Multi-adapter LoRA on a `ColumnParallelLinear`; under TP, **B is sharded** on N.

    ``A`` (r, H) is replicated on every TP rank, ``B`` (N / tp, r) holds this rank's output
    rows (the same rows, and partition stride, as the base weight). ``S = drop(X)·Aᵀ`` is
    identical on all ranks; its gradient is all-reduced over the TP group in backward, so every
    rank gets the same ``dA``. Under sequence parallelism (the base's ``sequence_parallel``)
    the input is this rank's ``T / tp`` token rows: ``S`` of those rows is all-gathered over
    the TP group to (T, R) (reduce-scattered in backward) and ``dA`` is all-reduced, so every
    rank still gets the whole ``dA`` (see ``docs/pipeline.md``).

    Args:
        base: the built linear; its forward returns ``(out, bias)``.
        adapters: every adapter of the run (ids are list positions).
        targeted: ids of the adapters that adapt this linear (at least one).
        context: holds the microbatch's `AdapterLayout` (``.layout``), read at each forward.
        seed: run seed; factors are drawn from ``(seed, adapter id, layer_seed)``.
        layer_seed: a number unique to this linear in the model (also keys its dropout masks).
        tp_group: tensor-parallel group; defaults to ``base.tp_group``.
        row_blocks: adapters with per-projection targets on this fused linear (`RowBlocks`,
            on this rank's output rows); the others adapt it as one LoRA.
        draw_pool: threads that draw the adapters' A factors (`apply_lora` shares one
            over every linear); None: drawn in the calling thread.

    Raises:
        NotImplementedError: for an MoE-expert base.
    """

    def __init__(
        self,
        base: nn.Module,
        adapters: Sequence[AdapterConfig],
        targeted: Sequence[int],
        context: LayoutSource,
        *,
        seed: int,
        layer_seed: int,
        tp_group: torch.distributed.ProcessGroup | None = None,
        row_blocks: RowBlocks | None = None,
        draw_pool: Executor | None = None,
    ):
        super().__init__(base, context, layer_seed, tp_group, is_column=True)
        out_local, in_features = base.weight.shape
        _init_factors(
            self,
            adapters,
            targeted,
            in_features=in_features,
            in_shard=slice(None),
            out_local=out_local,
            seed=seed,
            layer_seed=layer_seed,
            device=base.weight.device,
            row_blocks=row_blocks,
            draw_pool=draw_pool,
        )

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        """``(out, bias)`` like the base: input ``[s, b, H]``, out ``[s, b, N / tp]``.

        Under sequence parallelism the input is this rank's ``[T / tp, 1, H]`` rows of the
        microbatch and the output ``[T, 1, N / tp]``.

        Raises:
            RuntimeError: when the context holds no layout.
            ValueError: when the layout's token count is not ``s·b`` (``s·tp`` under SP),
                or, under SP, when ``b != 1`` or ``T`` is not a multiple of ``tp``.
        """
        return _lora_forward(self, input_, args, kwargs)


class LoRARowParallelLinear(_LoRAWrapper):
    """Multi-adapter LoRA on a `RowParallelLinear`; under TP, **A is sharded** on H.

    ``A`` (r, H / tp) holds this rank's input columns, ``B`` (N, r) is replicated. The partial
    ``S`` of each rank is all-reduced in forward (its backward is a copy) and the LoRA output
    is added to the base output, which the base has already all-reduced. The base must take
    parallel input (``input_is_parallel``), as in every Megatron block. Under sequence
    parallelism the partial ``S`` is reduce-scattered over the sequence instead (all-gathered
    in backward), the delta covers this rank's ``T / tp`` rows like the base output, and
    ``dB`` is all-reduced so every rank gets the whole ``dB``.

    Args: as `LoRAColumnParallelLinear`.

    Raises:
        NotImplementedError: for an MoE-expert or non-parallel-input base.
    """

    def __init__(
        self,
        base: nn.Module,
        adapters: Sequence[AdapterConfig],
        targeted: Sequence[int],
        context: LayoutSource,
        *,
        seed: int,
        layer_seed: int,
        tp_group: torch.distributed.ProcessGroup | None = None,
        draw_pool: Executor | None = None,
    ):
        if not base.input_is_parallel:
            raise NotImplementedError(
                "LoRARowParallelLinear needs a base with input_is_parallel=True"
            )
        super().__init__(base, context, layer_seed, tp_group, is_column=False)
        out_features, in_local = base.weight.shape
        rank = self.tp_group.rank()
        _init_factors(
            self,
            adapters,
            targeted,
            in_features=in_local * self.tp_size,
            in_shard=slice(rank * in_local, (rank + 1) * in_local),
            out_local=out_features,
            seed=seed,
            layer_seed=layer_seed,
            device=base.weight.device,
            draw_pool=draw_pool,
        )

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        """``(out, bias)`` like the base: input ``[s, b, H / tp]``, out ``[s, b, N]``.

        Under sequence parallelism the input is ``[T, 1, H / tp]`` and the output this rank's
        ``[T / tp, 1, N]`` rows (reduce-scattered, like the base's).

        Raises:
            RuntimeError: when the context holds no layout.
            ValueError: when the layout's token count is not ``s·b``, or, under SP, when
                ``b != 1`` or ``T`` is not a multiple of ``tp``.
        """
        return _lora_forward(self, input_, args, kwargs)
