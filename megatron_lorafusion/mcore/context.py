"""Apply multi-adapter LoRA to a built `GPTModel` and manage the adapters' parameters.

`apply_lora` swaps each targeted linear of every decoder layer for a LoRA wrapper (after the
base weights exist, before any DDP wrapping) and returns the `LoRAContext` through which the
caller sets each microbatch's `AdapterLayout` and reads or loads one adapter's weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from megatron.core.transformer import TransformerConfig
from torch import nn

from megatron_lorafusion.config import (
    FUSED_LINEARS,
    MAX_FUSED_RANK,
    PROJECTIONS,
    AdapterConfig,
    fused_ranks,
    lora_blocks,
)
from megatron_lorafusion.mcore.lora import (
    LoRAColumnParallelLinear,
    LoRARowParallelLinear,
    RowBlocks,
)
from megatron_lorafusion.mcore.recompute import RecomputedLayer
from megatron_lorafusion.mcore.wgrad import WgradQueue
from megatron_lorafusion.ops import AdapterLayout, cast_table

# target -> (parent attribute in the layer, wrapper class); the order numbers the layer seeds.
_SLOT_ALIGN = 16  # elements: each wrapper's factors start 64-byte aligned (32 in bf16)
_TARGETS: dict[str, tuple[str, type[nn.Module]]] = {
    "linear_qkv": ("self_attention", LoRAColumnParallelLinear),
    "linear_proj": ("self_attention", LoRARowParallelLinear),
    "linear_fc1": ("mlp", LoRAColumnParallelLinear),
    "linear_fc2": ("mlp", LoRARowParallelLinear),
}
assert tuple(_TARGETS) == FUSED_LINEARS  # internal invariant: one wrapper per fused linear

LoRAWrapper = LoRAColumnParallelLinear | LoRARowParallelLinear


@dataclass(frozen=True)
class SlotView:
    """Where one factor of one adapter lives in a row of the (A, S) tables.

    Attributes:
        name: ``<linear>.lora_A``, ``<linear>.lora_B`` or ``<linear>.<row vector>``.
        start: first column of the factor's slot in the row.
        rows: the slot's rows (``R``, ``N_local`` or 1).
        cols: the slot's columns (``H_local``, ``R`` or ``N_local``).
        kind: ``"lora_A"``, ``"lora_B"`` or ``"vector"``.
        rank: the adapter's rank on this linear (its blocks × r).
        live: (N_local, rank) bool CPU mask of ``B``'s entries that may be non-zero, for a
            per-projection adapter (its off-block entries are always zero); None otherwise.
    """

    name: str
    start: int
    rows: int
    cols: int
    kind: str
    rank: int
    live: torch.Tensor | None = None

    def view(self, row: torch.Tensor) -> torch.Tensor:
        """The factor in ``row`` (S,): A (rank, H_local), B (N_local, rank) or (N_local,)."""
        slot = row[self.start : self.start + self.rows * self.cols].view(self.rows, self.cols)
        if self.kind == "lora_A":
            return slot[: self.rank]
        if self.kind == "lora_B":
            return slot[:, : self.rank]
        return slot[0]


class LoRAContext:
    """The adapters of one model: the current microbatch layout and per-adapter weights.

    Every adapter factor of this rank lives in one row per adapter of two fp32 tables,
    ``weights`` and ``grads`` (A, S): row ``a`` holds, wrapper after wrapper, the packed
    slots ``lora_A[a]`` (R × H_local) and ``lora_B[a]`` (N_local × R), and on a linear with
    a DoRA adapter ``lora_magnitude[a]`` (1 × N_local; `adapter_types`). Each wrapper's
    ``lora_A`` / ``lora_B`` is a strided view of its columns of ``weights``, and its
    ``lora_A_grad`` / ``lora_B_grad`` the same view of ``grads``: backward adds into the
    table in place, and one kernel steps any subset of adapters (`ops.adapter_adamw_`). A
    forward reads the factors from one compute-dtype copy of the table (`compute_weights`).
    ``weights`` requires grad (it connects the wrappers' factors to autograd) but never
    receives a ``.grad``; write it only under ``torch.no_grad()``.

    Attributes:
        layout: the `AdapterLayout` of the next forward; set it before every forward (the
            LoRA op saves the layout it ran with, so backward needs no further setting).
        adapters: the run's adapters; adapter id = position.
        wrappers: LoRA wrapper of each adapted linear, keyed by its global name
            (``decoder.layers.{global layer index}.self_attention.linear_qkv``, ...).
        wgrad_queue: when set, training backwards defer each down-projection's weight
            gradient into this queue (zero-bubble; `mcore.wgrad`); None computes it at once.
        rebuild_inputs: selective recompute (on by default, exact): a wrapper fed by a
            fused-base norm or SwiGLU rebuilds that input in backward instead of keeping it
            (`mcore.lora`); `mcore.recompute.apply_recompute` sets it for a job.
        weights: (A, S) fp32, every factor of adapter ``a`` on this rank in row ``a``.
        grads: (A, S) fp32, their accumulated gradients (zero until a backward adds to them).
    """

    def __init__(self, adapters: Sequence[AdapterConfig], wrappers: dict[str, LoRAWrapper]):
        self.layout: AdapterLayout | None = None
        self.wgrad_queue: WgradQueue | None = None
        self.rebuild_inputs = True
        self.adapters = list(adapters)
        self.wrappers = wrappers
        self.weights = torch.zeros(len(adapters), 0)  # (A, S) once `pack` ran
        self.grads = torch.zeros(len(adapters), 0)
        # (name, 'lora_A' | 'lora_B' | row vector, wrapper, first column, rows, columns) per slot
        self._slots: list[tuple[str, str, LoRAWrapper, int, int, int]] = []
        self._compute: tuple[tuple, torch.Tensor] | None = None  # `compute_weights`' cache

    def pack(self) -> None:
        """Move every wrapper's factors into ``weights`` and point them (and grads) there.

        Called once by `apply_lora` after the wrappers exist.
        """
        slots, width = [], 0
        for name, wrapper in self.wrappers.items():
            wrapper.lora_column = width  # its lora_A slot; lora_B's follows (`ops.packed_factors`)
            vector = () if wrapper.row_vector is None else (wrapper.row_vector,)
            for factor in ("lora_A", "lora_B", *vector):
                _, rows, cols = getattr(wrapper, factor).shape
                slots.append((f"{name}.{factor}", factor, wrapper, width, rows, cols))
                width += rows * cols
            width += -width % _SLOT_ALIGN  # the next wrapper's factors start aligned
        device = next(iter(self.wrappers.values())).lora_A.device
        weights = torch.zeros(self.num_adapters, width, device=device)
        self.grads = torch.zeros_like(weights)
        for _, factor, wrapper, col, rows, cols in slots:
            view = weights[:, col : col + rows * cols].view(-1, rows, cols)  # (A, rows, cols)
            view.copy_(getattr(wrapper, factor))
            setattr(wrapper, factor, view)
            setattr(
                wrapper,
                f"{factor}_grad",
                self.grads[:, col : col + rows * cols].view(-1, rows, cols),
            )
        # The autograd leaf of every `ops.packed_factors`: the same storage under another tensor, so
        # the views above (read by the wrappers, written by the optimizer) stay plain tensors.
        self.weights = weights.detach().requires_grad_()
        self._slots = slots
        self._compute = None

    def compute_weights(self, dtype: torch.dtype) -> torch.Tensor:
        """(A, S) copy of ``weights`` in the compute ``dtype``, one per version of the weights.

        Every layer of a forward takes its factors as views of this copy (`ops.packed_factors`):
        one cast per microbatch instead of one per factor and layer. A new copy is made when
        ``weights`` changed in place since the last one (its version counter: torch's in-place
        ops and `ops.adapter_adamw_` advance it); copies that a pending backward still uses
        stay alive through its saved views.
        """
        key = (dtype, self.weights._version)
        if self._compute is None or self._compute[0] != key:
            self._compute = (key, cast_table(self.weights.detach(), dtype))
        return self._compute[1]

    def drop_compute_weights(self) -> None:
        """Forget the compute-dtype copy: the next forward casts the table again.

        A CUDA graph must record that cast (its replays then cast the current weights), and
        eager forwards must not read the copy a graph owns (`pipeline.MicrobatchGraphs`).
        """
        self._compute = None

    @property
    def num_adapters(self) -> int:
        """``A``, adapters in the run."""
        return len(self.adapters)

    def _check_id(self, adapter_id: int) -> None:
        if not 0 <= adapter_id < self.num_adapters:
            raise ValueError(f"adapter_id must lie in [0, {self.num_adapters}), got {adapter_id}")

    def adapter_views(self, table: torch.Tensor, adapter_id: int) -> dict[str, torch.Tensor]:
        """Named views of one adapter's factors in a (A, S) ``table`` laid out as ``weights``.

        Names are ``<linear>.lora_A`` (r, H_local) and ``<linear>.lora_B`` (N_local, r), for
        the linears this adapter targets, with ``r`` its rank there: its own rank, times its
        blocks with per-projection targets (A stacked, B block-diagonal; docs/adapters.md);
        a DoRA adapter also has ``<linear>.lora_magnitude`` (N_local,) (its variant's row
        vector, `adapter_types.AdapterType.row_vector`).
        ``table`` is ``weights``, ``grads`` or anything shaped like them (the optimizer's
        moments).
        """
        self._check_id(adapter_id)
        if table.shape != self.weights.shape:
            raise ValueError(
                f"table must have shape {tuple(self.weights.shape)}, got {tuple(table.shape)}"
            )
        row = table.detach()[adapter_id]
        return {slot.name: slot.view(row) for slot in self.adapter_slots(adapter_id)}

    def bind(self, adapter_id: int, adapter: AdapterConfig, seed: int) -> None:
        """Give row ``adapter_id`` of the tables to ``adapter`` (a server's job joining).

        Its rank, scale, dropout and blocks go to every wrapper, and its factors start as
        `apply_lora` draws them: A kaiming-uniform from ``(seed, adapter name, layer)``, B
        zero; the row's gradients are zeroed. The wrappers must have room (their rank, the
        server's ``max_rank``, and a DoRA magnitude only where built with one).

        Raises:
            NotImplementedError: for a rank above a wrapper's, DoRA on wrappers without
                magnitudes, or a target the model's wrappers do not cover.
        """
        from megatron_lorafusion.mcore.lora import bind_adapter

        self._check_id(adapter_id)
        blocks = _adapter_blocks([adapter])[0]
        targets = {name.rsplit(".", 1)[1] for name in self.wrappers}
        missing = sorted(set(blocks) - targets)
        if missing:
            raise NotImplementedError(
                f"adapter {adapter.name!r} targets {missing}, which this model's adapter tables "
                f"do not cover (they cover {sorted(targets)})"
            )
        with torch.no_grad():
            self.weights[adapter_id].zero_()
            self.grads[adapter_id].zero_()
            for name, wrapper in self.wrappers.items():
                target = name.rsplit(".", 1)[1]
                row_blocks = {}
                if target in blocks and wrapper.is_column:
                    row_blocks = _row_blocks(target, wrapper.base, {adapter_id: blocks[target]})
                bind_adapter(
                    wrapper, adapter_id, adapter if target in blocks else None, seed, row_blocks
                )
        self.adapters[adapter_id] = adapter
        self._compute = None

    def adapter_slots(self, adapter_id: int) -> list[SlotView]:
        """Where each factor of one adapter lives in a row of the tables (`SlotView`).

        The factors of the linears it targets, in table order; a checkpoint of the adapter is
        these views of its rows (`train.checkpoint`), its per-projection ``B`` without the
        off-block zeros.
        """
        self._check_id(adapter_id)
        slots = []
        for name, factor, wrapper, col, rows, cols in self._slots:
            rank = wrapper.ranks[adapter_id]
            if rank == 0:
                continue
            live = None
            if factor == "lora_A":
                kind = "lora_A"
            elif factor == "lora_B":
                kind = "lora_B"
                if wrapper.lora_B_off is not None:
                    off = wrapper.lora_B_off[adapter_id, :, :rank]
                    live = None if not bool(off.any()) else (~off).cpu()
            elif wrapper.types[adapter_id].row_vector == factor:
                kind = "vector"
            else:
                continue
            slots.append(SlotView(name, col, rows, cols, kind, rank, live))
        return slots

    def loraplus_columns(self) -> torch.Tensor:
        """(S,) bool on the tables' device: the columns LoRA+ steps at ``lr × ratio``.

        Every ``lora_B`` slot and every row-vector slot (DoRA's magnitude): PEFT's
        ``create_loraplus_optimizer`` puts B and every 1-D parameter in B's group.
        """
        return self._slot_columns(lambda name, factor: factor != "lora_A")

    def replicated_columns(self) -> torch.Tensor:
        """(S,) bool on the tables' device: the columns of factors TP does not split.

        Their gradients agree across the TP ranks (`sharding`: None), so a norm over the TP
        group counts them on one rank only.
        """
        replicated = {name for name, split in self.sharding().items() if split is None}
        return self._slot_columns(lambda name, factor: name in replicated)

    def _slot_columns(self, marked: Callable[[str, str], bool]) -> torch.Tensor:
        """(S,) bool on the tables' device: True on the columns of the ``marked`` slots.

        ``marked(name, factor)`` decides for each slot (its parameter name and factor).
        """
        columns = torch.zeros(self.weights.shape[1], dtype=torch.bool)
        for name, factor, _, col, rows, cols in self._slots:
            columns[col : col + rows * cols] = marked(name, factor)
        return columns.to(self.weights.device)

    def adapter_tensors(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """Views of one adapter's factors on this rank (TP shards, fp32), writable in place.

        A: (r, H_local), B: (N_local, r); see `adapter_views`.
        """
        return self.adapter_views(self.weights, adapter_id)

    def adapter_grads(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """Views of one adapter's accumulated gradients, keyed as `adapter_tensors`."""
        return self.adapter_views(self.grads, adapter_id)

    def sharding(self) -> dict[str, tuple[int, int] | None]:
        """Per factor name, ``(dim, partition stride)`` of its TP split, None if replicated.

        Column-parallel linears shard B (N_local, r) on dim 0 with the base weight's stride,
        row-parallel linears A (r, H_local) on dim 1 (DESIGN.md "LoRA wrapper").
        """
        out = {}
        for name, factor, wrapper, *_ in self._slots:
            if factor != "lora_A" and wrapper.is_column:  # B (N_local, r), a vector (N_local,)
                out[name] = (0, int(getattr(wrapper.base.weight, "partition_stride", 1)))
            elif factor == "lora_A" and not wrapper.is_column:
                out[name] = (1, 1)
            else:
                out[name] = None
        return out

    def adapter_state_dict(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """Detached copies of one adapter's TP-local factors, keyed as `adapter_tensors`."""
        return {name: t.detach().clone() for name, t in self.adapter_tensors(adapter_id).items()}

    def load_adapter_state_dict(self, adapter_id: int, state_dict: Mapping[str, torch.Tensor]):
        """Copy ``state_dict`` into one adapter's factors (strict: same keys, same shapes).

        Raises:
            ValueError: naming every missing or unexpected key and every shape mismatch;
                nothing is copied when any problem is found.
        """
        load_views(
            self.adapter_tensors(adapter_id),
            state_dict,
            f"adapter {adapter_id} ({self.adapters[adapter_id].name!r})",
        )

    def merged_weights(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """``W + s·B·A`` of each adapted linear (``<linear>.weight``), TP-local shards."""
        self._check_id(adapter_id)
        return {f"{n}.weight": w.merged_weight(adapter_id) for n, w in self.wrappers.items()}


def load_views(
    views: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], what: str
) -> None:
    """Copy ``state_dict`` into same-named ``views`` (strict: same keys, same shapes).

    Raises:
        ValueError: ``cannot load <what>`` naming every missing or unexpected key and every
            shape mismatch; nothing is copied when any problem is found.
    """
    problems = [f"missing key {k!r}" for k in views if k not in state_dict]
    problems += [f"unexpected key {k!r}" for k in state_dict if k not in views]
    problems += [
        f"{k} has shape {tuple(state_dict[k].shape)}, expected {tuple(v.shape)}"
        for k, v in views.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if problems:
        raise ValueError(f"cannot load {what}:\n  - " + "\n  - ".join(problems))
    with torch.no_grad():
        for k, v in views.items():
            v.copy_(state_dict[k])


def _adapter_blocks(adapters: Sequence[AdapterConfig]) -> list[dict[str, tuple]]:
    """`config.lora_blocks` of each adapter, checked.

    Raises:
        ValueError: for no adapters, a rank <= 0, an unknown or repeated target.
        NotImplementedError: for a rank × blocks on one linear above the kernels' limit.
    """
    if not adapters:
        raise ValueError("apply_lora needs at least one adapter")
    blocks = []
    for i, adapter in enumerate(adapters):
        try:
            blocks.append(lora_blocks(adapter.target_modules))
        except ValueError as err:
            raise ValueError(f"adapters[{i}].target_modules {err}") from None
        if adapter.rank <= 0:
            raise ValueError(f"adapters[{i}].rank must be > 0, got {adapter.rank}")
        for linear, rank in fused_ranks(adapter).items():
            if rank > MAX_FUSED_RANK:
                raise NotImplementedError(
                    f"adapters[{i}] has rank {adapter.rank} × {rank // adapter.rank} projections "
                    f"= {rank} on {linear}, above the kernels' {MAX_FUSED_RANK}"
                )
    return blocks


def _projection_rows(target: str, config: TransformerConfig, out_local: int) -> torch.Tensor:
    """(N_local,) int64: which of ``PROJECTIONS[target]`` each local output row belongs to.

    ``linear_qkv`` rows are grouped per query group, ``[q heads of the group | k | v]``
    (0, 1, 2), and a TP rank holds whole groups; ``linear_fc1`` rows are this rank's
    ``[gate | up]`` halves (0, 1). Other linears are one projection (all 0).

    Args:
        target: a name of `FUSED_LINEARS`.
        config: the base linear's Megatron ``TransformerConfig``.
        out_local: the base weight's rows on this rank.

    Raises:
        ValueError: when ``out_local`` does not fit that layout.
    """
    if target == "linear_qkv":
        head_dim = config.kv_channels
        groups = config.num_query_groups or config.num_attention_heads
        per_group = config.num_attention_heads // groups
        group = torch.tensor([0] * per_group * head_dim + [1] * head_dim + [2] * head_dim)
        if out_local % len(group):
            raise ValueError(
                f"linear_qkv has {out_local} output rows on this rank, not whole "
                f"query groups of {len(group)}"
            )
        return group.repeat(out_local // len(group))
    if target == "linear_fc1":
        if not config.gated_linear_unit or out_local % 2:
            raise ValueError(
                f"linear_fc1 must be gated ([gate | up] rows) for gate_proj / "
                f"up_proj targets, got {out_local} rows, gated_linear_unit="
                f"{config.gated_linear_unit}"
            )
        return torch.arange(2).repeat_interleave(out_local // 2)
    return torch.zeros(out_local, dtype=torch.int64)


def _row_blocks(target: str, base: nn.Module, blocks: dict[int, tuple]) -> RowBlocks:
    """`RowBlocks` of the adapters ``blocks`` holds whose blocks on ``target`` are not one.

    ``blocks``: adapter id -> its blocks on ``target`` (`config.lora_blocks`).
    """
    split = {a: b for a, b in blocks.items() if b != (PROJECTIONS[target],)}
    if not split:
        return {}
    rows = _projection_rows(target, base.config, base.weight.shape[0])  # (N_local,)
    out = {}
    for a, adapter_blocks in split.items():
        lut = torch.full((len(PROJECTIONS[target]),), -1, dtype=torch.int64)
        for j, block in enumerate(adapter_blocks):
            for projection in block:
                lut[PROJECTIONS[target].index(projection)] = j
        out[a] = (len(adapter_blocks), lut[rows])
    return out


def apply_lora(
    model: nn.Module,
    adapters: Sequence[AdapterConfig],
    *,
    seed: int,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> LoRAContext:
    """Wrap the targeted linears of every decoder layer with multi-adapter LoRA, in place.

    Call after base weights are built or loaded and before any DDP wrapping. For every layer
    ``i`` (global index, so pipeline stages agree) and target ``t`` adapted by at least one
    adapter, ``decoder.layers.i.<parent>.t`` becomes a `LoRAColumnParallelLinear`
    (linear_qkv, linear_fc1) or `LoRARowParallelLinear` (linear_proj, linear_fc2); an adapter
    naming Hugging Face projections gets one LoRA block per projection there (its blocks'
    A rows stacked, B block-diagonal: `config.lora_blocks`, docs/adapters.md). Factors
    are drawn from ``(seed, adapter name, 4·i + target index)`` (A kaiming-uniform, B zero),
    the same number also keys the layer's dropout masks.

    Args:
        model: a `GPTModel` (or one pipeline stage of it), not DDP-wrapped.
        adapters: the run's adapters; adapter id = position.
        seed: run seed of the adapter initialisation.
        tp_group: tensor-parallel group; defaults to each base linear's own ``tp_group``.

    Returns:
        The `LoRAContext`; set its ``layout`` before every forward.

    Raises:
        TypeError: when ``model`` has no ``decoder.layers`` (e.g. it is already DDP-wrapped).
        ValueError: on an empty adapter list, unknown or repeated target modules.
        NotImplementedError: when an adapter's rank × projections on one fused linear
            passes `config.MAX_FUSED_RANK`.
        RuntimeError: when the model already carries LoRA wrappers, or its layers are
            `RecomputedLayer`s (apply LoRA before `apply_recompute`).
    """
    blocks = _adapter_blocks(adapters)
    decoder = getattr(model, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"apply_lora needs a GPTModel with decoder.layers, got {type(model).__name__}; "
            "apply LoRA before wrapping the model in DDP"
        )
    context = LoRAContext(adapters, {})
    # One pool draws every linear's A factors, ended with the call (no thread outlives it,
    # so a process forked later inherits none): a pool per linear started cpu_count threads
    # for each of them (128 wrapped linears in the 8B preset).
    workers = min(len(adapters), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="lorafusion-draw") as pool:
        _wrap_layers(decoder, adapters, blocks, context, seed, tp_group, pool)
    if not context.wrappers:
        raise ValueError("apply_lora found no targeted linear in the model's decoder layers")
    context.pack()
    return context


def _wrap_layers(
    decoder: nn.Module,
    adapters: Sequence[AdapterConfig],
    blocks: list,
    context: LoRAContext,
    seed: int,
    tp_group: torch.distributed.ProcessGroup | None,
    pool: Executor,
) -> None:
    """`apply_lora`'s loop: each targeted linear of each layer wrapped, into ``context``."""
    for layer in decoder.layers:
        index = layer.layer_number - 1  # global, 0-based
        if isinstance(layer, RecomputedLayer):
            raise RuntimeError(
                f"decoder.layers.{index} is a RecomputedLayer: apply LoRA before apply_recompute"
            )
        for target_index, (target, (parent_name, wrapper_cls)) in enumerate(_TARGETS.items()):
            targeted = [a for a in range(len(adapters)) if target in blocks[a]]
            if not targeted:
                continue
            parent = getattr(layer, parent_name)
            base = getattr(parent, target)
            if isinstance(base, LoRAColumnParallelLinear | LoRARowParallelLinear):
                raise RuntimeError(f"decoder.layers.{index}: LoRA is already applied")
            extra = {}
            if wrapper_cls is LoRAColumnParallelLinear:
                extra["row_blocks"] = _row_blocks(
                    target, base, {a: blocks[a][target] for a in targeted}
                )
            wrapper = wrapper_cls(
                base,
                adapters,
                targeted,
                context,
                seed=seed,
                layer_seed=4 * index + target_index,
                tp_group=tp_group,
                draw_pool=pool,
                **extra,
            )
            setattr(parent, target, wrapper)
            context.wrappers[f"decoder.layers.{index}.{parent_name}.{target}"] = wrapper
