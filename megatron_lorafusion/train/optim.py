"""One AdamW for all adapters, each stepping on its own schedule, in one fused launch.

Adapter ``a``'s weights, gradients and moments are row ``a`` of (A, S) fp32 tables
(`mcore.LoRAContext.weights`), so the adapters whose global batch ends at a microbatch step
together in one `ops.adapter_adamw_` launch, each with its own learning rate (its schedule at
its own step count), betas, epsilon and weight decay. Each adapter's state stays its own:
step count and moments are saved and restored per adapter (`adapter_state`).

An adapter with ``loraplus_lr_ratio`` k != 1 (LoRA+) steps its B factors and DoRA magnitudes
at k × its learning rate (PEFT's ``create_loraplus_optimizer`` groups: B and every 1-D
parameter at ``lr × k``, A at ``lr``; weight decay the same for both): one per-column mask of
the table (`LoRAContext.loraplus_columns`) in the same launch.

Before the launch each stepping adapter's gradient row is clipped to its ``max_grad_norm``
(``torch.nn.utils.clip_grad_norm_``'s rule, coefficient ``max / (norm + 1e-6)`` capped at 1):
one norm over the table's rows and one row scaling, both on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.ops import copy_to_device
from megatron_lorafusion.ops.adapter_adamw import GRAD_SCALE, HYPER_COLUMNS, adapter_adamw_

if TYPE_CHECKING:  # mcore imports Megatron (~2 s): not before the job summary is printed
    from megatron_lorafusion.mcore.context import LoRAContext

_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, as PEFT recipes use them
_EPS = 1e-8
_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s

SquaredNormReduce = Callable[[torch.Tensor], torch.Tensor]
"""``(grads (A, S) fp32) -> (A,) fp32``: every adapter's squared gradient norm over all ranks
holding its factors (each factor counted once); the default, one process, sums the row."""


def _local_squared_norms(grads: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grads, dim=1).square()  # one read of the table, no copy


class DivergenceError(RuntimeError):
    """An adapter's loss or gradient became NaN or infinite; its weights were not stepped."""


def lr_multiplier(step: int, total_steps: int, adapter: AdapterConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based) as a fraction of ``adapter.lr``.

    Linear warm-up over ``warmup_steps``, then constant, or cosine/linear decay reaching
    ``min_lr_ratio`` at the last step.
    """
    if step < adapter.warmup_steps:
        return (step + 1) / adapter.warmup_steps
    if adapter.lr_schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - 1 - adapter.warmup_steps, 1)
    progress = min((step - adapter.warmup_steps) / decay_steps, 1.0)
    if adapter.lr_schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return adapter.min_lr_ratio + (1.0 - adapter.min_lr_ratio) * shape


class AdapterAdamW:
    """AdamW over the packed factors of every adapter of a `LoRAContext`.

    Args:
        lora: the context whose ``weights`` and ``grads`` tables it steps.
        adapters: the run's adapters (lr, schedule, weight decay), by id.
        total_steps: per adapter, its optimizer steps in the run (the schedule's length).
        squared_norms: computes the adapters' squared gradient norms (see
            `SquaredNormReduce`); model-parallel runs pass one that sums over their ranks.
        track_grad_norms: compute every step's norms for `grad_norm` even without clipping
            (one more read of the gradient table per step, about an eighth of the step's
            memory traffic); every rank of a model-parallel group must pass the same value.

    Attributes:
        stopped: adapters that no longer step (early stopping): `step` zeroes their
            gradients and leaves their weights, moments and step counts as they are.
        last_lr: per adapter, the learning rate of its last step (0.0 before any); with
            LoRA+ that of its A factors (B's is ``last_lr × loraplus_lr_ratio``).

    Raises:
        ValueError: when ``adapters`` or ``total_steps`` do not match the context's adapters.
    """

    def __init__(
        self,
        lora: LoRAContext,
        adapters: Sequence[AdapterConfig],
        total_steps: Sequence[int],
        *,
        squared_norms: SquaredNormReduce = _local_squared_norms,
        track_grad_norms: bool = False,
    ):
        if len(adapters) != lora.num_adapters or len(total_steps) != lora.num_adapters:
            raise ValueError(
                f"AdapterAdamW needs one adapter config and one step count per adapter of "
                f"the context ({lora.num_adapters}), got {len(adapters)} and {len(total_steps)}"
            )
        self.lora = lora
        self.adapters = tuple(adapters)
        self.total_steps = tuple(total_steps)
        self.exp_avg = torch.zeros_like(lora.weights)
        self.exp_avg_sq = torch.zeros_like(lora.weights)
        self.steps = [0] * lora.num_adapters
        self.stopped: set[int] = set()
        self.last_lr = [0.0] * lora.num_adapters
        self._squared_norms = squared_norms
        self._track_grad_norms = track_grad_norms
        self._max_norms = torch.tensor([a.max_grad_norm for a in adapters], dtype=torch.float32)
        plus = any(a.loraplus_lr_ratio != 1.0 for a in adapters)
        self._lr_groups = lora.loraplus_columns() if plus else None  # (S,) bool, B's columns
        self._norms: torch.Tensor | None = None  # (A,) device, of the last step's gradients
        self._norms_host: list[float] | None = None

    def check_losses(self, losses: Mapping[int, float]) -> None:
        """Raise `DivergenceError` naming the first adapter whose loss is not finite.

        Args:
            losses: adapter id -> the loss of the global batch it is about to step on.
        """
        for a, value in sorted(losses.items()):
            if not math.isfinite(value):
                raise DivergenceError(
                    f"adapter {self.adapters[a].name!r}: loss {value} at step "
                    f"{self.steps[a] + 1}; training stopped before that step (the last "
                    "checkpoint holds the weights before it); lower its lr or set its "
                    "max_grad_norm"
                )

    def lr(self, adapter_id: int) -> float:
        """Learning rate of adapter ``adapter_id``'s next step."""
        adapter = self.adapters[adapter_id]
        return adapter.lr * lr_multiplier(
            self.steps[adapter_id], self.total_steps[adapter_id], adapter
        )

    def needs_norms(self, adapter_ids: Iterable[int]) -> bool:
        """A `step` of these adapters reads gradient norms (clipping or tracking).

        Depends on the configs only (not on ``stopped``), so every rank of a model-parallel
        run answers the same and issues the same collectives.
        """
        return self._track_grad_norms or any(
            self.adapters[a].max_grad_norm > 0 for a in adapter_ids
        )

    def squared_norms(self) -> torch.Tensor:
        """(A,) fp32 squared gradient norms of every row, over this rank's model-parallel peers.

        The ``squared_norms`` hook (a TP all-reduce under TP): a pipeline stage sums the
        result over its stages and passes it to `step`.
        """
        return self._squared_norms(self.lora.grads)

    def step(
        self, adapter_ids: Iterable[int], *, squared_norms: torch.Tensor | None = None
    ) -> None:
        """Clip and step the given adapters (one launch) and zero their gradients.

        The other adapters' weights, moments and accumulated gradients are left untouched;
        stopped adapters' gradients are zeroed without a step.

        Args:
            adapter_ids: the adapters whose global batch is done.
            squared_norms: (A,) their squared gradient norms when already computed (summed
                over pipeline stages by the runner); None: the ``squared_norms`` hook's.
        """
        stepping = set(adapter_ids)
        for a in stepping & self.stopped:
            self.lora.grads[a].zero_()
        stepping -= self.stopped
        if not stepping:
            return
        grad_scale = self._clip(stepping, squared_norms)
        rows = []
        for a in range(self.lora.num_adapters):
            if a not in stepping:
                rows.append([0.0] * HYPER_COLUMNS)
                continue
            step = self.steps[a] + 1
            beta1, beta2 = _BETAS
            self.last_lr[a] = self.lr(a)
            rows.append(
                [
                    self.last_lr[a],
                    beta1,
                    beta2,
                    _EPS,
                    self.adapters[a].weight_decay,
                    1.0 - beta1**step,
                    1.0 - beta2**step,
                    1.0,
                    self.last_lr[a] * self.adapters[a].loraplus_lr_ratio,
                    1.0,
                ]
            )
        hyper = copy_to_device(torch.tensor(rows, dtype=torch.float32), self.lora.weights.device)
        if grad_scale is not None:
            hyper[:, GRAD_SCALE] = grad_scale
        adapter_adamw_(
            self.lora.weights,
            self.lora.grads,
            self.exp_avg,
            self.exp_avg_sq,
            hyper,
            self._lr_groups,
        )
        for a in stepping:
            self.steps[a] += 1

    def _clip(self, stepping: set[int], squared: torch.Tensor | None) -> torch.Tensor | None:
        """Norms of every row, and the (A,) factors the step's kernel scales gradients by.

        A clipping adapter about to step gets ``max_norm / norm`` (at most 1), the others 1.0;
        None when no stepping adapter clips.
        """
        grads = self.lora.grads
        clipping = any(self.adapters[a].max_grad_norm > 0 for a in stepping)
        if not (clipping or self._track_grad_norms):
            self._norms, self._norms_host = None, None
            return None
        norms = (self.squared_norms() if squared is None else squared).sqrt()  # (A,)
        self._norms, self._norms_host = norms, norms.tolist()
        for a in sorted(stepping):  # never step on a NaN/inf gradient
            if not math.isfinite(self._norms_host[a]):
                raise DivergenceError(
                    f"adapter {self.adapters[a].name!r}: gradient norm {self._norms_host[a]} "
                    f"at step {self.steps[a] + 1}; training stopped before that step"
                )
        if not clipping:
            return None
        device = grads.device
        mask = torch.zeros(self.lora.num_adapters, dtype=torch.bool)
        mask[sorted(a for a in stepping if self.adapters[a].max_grad_norm > 0)] = True
        max_norms = copy_to_device(self._max_norms, device)
        coef = (max_norms / (norms + _CLIP_EPS)).clamp(max=1.0)
        return torch.where(copy_to_device(mask, device), coef, torch.ones_like(coef))

    def grad_norm(self, adapter_id: int) -> float:
        """Gradient norm (before clipping) of the adapter at the last `step` (a host read)."""
        if self._norms is None:
            return float("nan")
        if self._norms_host is None:
            self._norms_host = self._norms.tolist()
        return self._norms_host[adapter_id]

    def adapter_state(self, adapter_id: int) -> dict:
        """One adapter's optimizer state: step count and moments by factor name (CPU copies)."""
        return {
            "step": self.steps[adapter_id],
            "exp_avg": {
                n: v.detach().cpu().clone()
                for n, v in self.lora.adapter_views(self.exp_avg, adapter_id).items()
            },
            "exp_avg_sq": {
                n: v.detach().cpu().clone()
                for n, v in self.lora.adapter_views(self.exp_avg_sq, adapter_id).items()
            },
        }

    def load_adapter_state(self, adapter_id: int, state: Mapping) -> None:
        """Restore what `adapter_state` returned (strict: same factor names and shapes).

        Raises:
            ValueError: naming every missing, unexpected or mis-shaped moment.
        """
        from megatron_lorafusion.mcore.context import load_views

        name = self.adapters[adapter_id].name
        for key in ("exp_avg", "exp_avg_sq"):
            views = self.lora.adapter_views(getattr(self, key), adapter_id)
            load_views(views, state[key], f"the {key} of adapter {adapter_id} ({name!r})")
        self.steps[adapter_id] = int(state["step"])


def tensor_parallel_squared_norms(lora: LoRAContext, tp_rank: int, tp_group) -> SquaredNormReduce:
    """`SquaredNormReduce` of a TP group: split factors summed, replicated ones counted once.

    Column-parallel linears split lora_B and replicate lora_A, row-parallel ones the reverse
    (`LoRAContext.sharding`); replicated factors' gradients agree across TP ranks, so only TP
    rank 0 counts them. One all-reduce of (A,) over ``tp_group`` per step (TP ranks run in
    lockstep, so a blocking collective is safe here).

    Args:
        lora: this rank's adapters.
        tp_rank: this rank's position in its TP group.
        tp_group: the TP process group.
    """
    import torch.distributed as dist

    weight = torch.ones_like(lora.grads)  # (A, S) 1 where this rank counts the column
    if tp_rank != 0:
        replicated = [n for n, split in lora.sharding().items() if split is None]
        for a in range(lora.num_adapters):
            views = lora.adapter_views(weight, a)
            for name in replicated:
                if name in views:
                    views[name].zero_()

    def reduce(grads: torch.Tensor) -> torch.Tensor:
        squared = (grads.square() * weight).sum(dim=1)  # (A,)
        dist.all_reduce(squared, group=tp_group)
        return squared

    return reduce
