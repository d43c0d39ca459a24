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

Each stepping adapter's gradient row is clipped to its ``max_grad_norm`` inside the launch
(``torch.nn.utils.clip_grad_norm_``'s rule, coefficient ``max / (norm + 1e-6)`` capped at 1),
from one pass over the stepping rows (`ops.row_squared_norms`: the other adapters' rows are
not read). Nothing is read back before the launch: an adapter with
a NaN or infinite norm or loss is left unstepped on the device, and the next step (or
`check`) reads the norms and losses back and raises, by when the GPU is long past them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.ops import HostCopy, copy_to_device, row_squared_norms
from megatron_lorafusion.ops.adapter_adamw import (
    BETA1,
    BETA2,
    BIAS_CORRECTION1,
    BIAS_CORRECTION2,
    EPS,
    HYPER_COLUMNS,
    LR,
    LR_B,
    MAX_NORM,
    STEP,
    WEIGHT_DECAY,
    adapter_adamw_,
)

if TYPE_CHECKING:  # mcore imports Megatron (~2 s): not before the job summary is printed
    from megatron_lorafusion.mcore.context import LoRAContext

_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, as PEFT recipes use them
_EPS = 1e-8

SquaredNormReduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(grads (A, S) fp32, rows (k,) int64) -> (A,) fp32``: the squared gradient norm of each
adapter of ``rows`` over all ranks holding its factors (each factor counted once), 0 for the
other adapters; the default, one process, sums the row (`ops.row_squared_norms`)."""


@functools.lru_cache(maxsize=256)
def _device_rows(adapter_ids: tuple[int, ...], device: str) -> torch.Tensor:
    """(k,) int64 copy of a step group's adapter ids on ``device`` (one H2D copy per group)."""
    return copy_to_device(torch.tensor(adapter_ids, dtype=torch.int64), device)


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
        squared_norms: SquaredNormReduce = row_squared_norms,
        track_grad_norms: bool = False,
    ):
        if len(adapters) != lora.num_adapters or len(total_steps) != lora.num_adapters:
            raise ValueError(
                f"AdapterAdamW needs one adapter config and one step count per adapter of "
                f"the context ({lora.num_adapters}), got {len(adapters)} and {len(total_steps)}"
            )
        self.lora = lora
        self.adapters = list(adapters)
        self.total_steps = list(total_steps)
        self.exp_avg = torch.zeros_like(lora.weights)
        self.exp_avg_sq = torch.zeros_like(lora.weights)
        self.steps = [0] * lora.num_adapters
        self.stopped: set[int] = set()
        self.last_lr = [0.0] * lora.num_adapters
        self._squared_norms = squared_norms
        self._track_grad_norms = track_grad_norms
        plus = any(a.loraplus_lr_ratio != 1.0 for a in adapters)
        self._lr_groups = lora.loraplus_columns() if plus else None  # (S,) bool, B's columns
        self._norms: HostCopy | None = None  # (A,) squared norms of the last step's gradients
        self._norms_host: list[float] | None = None
        self._unchecked: list[int] = []  # the last step's adapters, until `check`
        self._losses: tuple[tuple[int, ...], HostCopy] | None = None  # and what they stepped on
        self._fences: dict[int, torch.cuda.Event] = {}  # rows being copied out (a save)

    def fence(self, adapter_id: int, done: torch.cuda.Event | None) -> None:
        """Make the next step of ``adapter_id`` wait for ``done`` (a copy of its rows)."""
        if done is not None:
            self._fences[adapter_id] = done

    def bind(self, adapter_id: int, adapter: AdapterConfig, total_steps: int) -> None:
        """Give row ``adapter_id`` to a new adapter: zero moments and step, its schedule.

        Its gradients must be zero (a row between global batches) and its factors set by
        `LoRAContext.bind` or loaded.
        """
        self.wait_fence(adapter_id)
        self.adapters[adapter_id] = adapter
        self.total_steps[adapter_id] = total_steps
        self.exp_avg[adapter_id].zero_()
        self.exp_avg_sq[adapter_id].zero_()
        self.steps[adapter_id] = 0
        self.last_lr[adapter_id] = 0.0
        self.stopped.discard(adapter_id)

    def wait_fence(self, adapter_id: int) -> None:
        """Make the current stream wait for a copy of ``adapter_id``'s rows on its way (a save).

        Called before anything writes the row: its next step, a new job's bind.
        """
        done = self._fences.pop(adapter_id, None)
        if done is not None:  # the copy of its rows runs on a side stream (a save)
            torch.cuda.current_stream(self.lora.weights.device).wait_event(done)

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

    def squared_norms(self, adapter_ids: Iterable[int]) -> torch.Tensor:
        """(A,) fp32 squared gradient norms of these adapters over this rank's TP peers.

        The other adapters read 0: only these rows of the gradient table are read. The
        ``squared_norms`` hook (a TP all-reduce under TP); a pipeline stage sums the result
        over its stages and passes it to `step`.
        """
        rows = _device_rows(tuple(adapter_ids), str(self.lora.grads.device))
        return self._squared_norms(self.lora.grads, rows)

    def step(
        self,
        adapter_ids: Iterable[int],
        *,
        squared_norms: torch.Tensor | None = None,
        losses: torch.Tensor | None = None,
    ) -> tuple[int, ...]:
        """Clip and step the given adapters (one launch) and zero their gradients.

        Queued with no host read: the kernel leaves the row of an adapter whose gradient norm
        (when norms are computed) or loss is NaN or infinite as it is, and `check`, which the
        next step calls first, raises for it. The other adapters' weights, moments and
        accumulated gradients are left untouched; stopped adapters' gradients are zeroed
        without a step.

        Args:
            adapter_ids: the adapters whose global batch is done.
            squared_norms: (A,) their squared gradient norms when already computed (summed
                over pipeline stages by the runner); None: the ``squared_norms`` hook's.
            losses: (k,) on the device, the loss each of ``adapter_ids`` (in that order)
                steps on, or None.

        Returns:
            The adapters queued to step (not stopped), in ``adapter_ids`` order.

        Raises:
            DivergenceError: for the previous step (`check`).
        """
        self.check()
        ids = tuple(adapter_ids)
        for a in ids:
            self.wait_fence(a)
            if a in self.stopped:
                self.lora.grads[a].zero_()
        stepping = [a for a in ids if a not in self.stopped]
        if not stepping:
            return ()
        norms = None
        if self.needs_norms(ids):  # the configs only: every rank issues the same collectives
            norms = self.squared_norms(stepping) if squared_norms is None else squared_norms
        beta1, beta2 = _BETAS
        rows = []
        for a in ids:
            if a in self.stopped:
                rows.append([0.0] * HYPER_COLUMNS)
                continue
            step = self.steps[a] + 1
            self.last_lr[a] = self.lr(a)
            row = [0.0] * HYPER_COLUMNS
            row[LR], row[BETA1], row[BETA2], row[EPS] = self.last_lr[a], beta1, beta2, _EPS
            row[WEIGHT_DECAY] = self.adapters[a].weight_decay
            row[BIAS_CORRECTION1], row[BIAS_CORRECTION2] = 1.0 - beta1**step, 1.0 - beta2**step
            row[STEP] = 1.0
            row[LR_B] = self.last_lr[a] * self.adapters[a].loraplus_lr_ratio
            row[MAX_NORM] = self.adapters[a].max_grad_norm
            rows.append(row)
        self._launch(ids, torch.tensor(rows, dtype=torch.float32), norms, losses)
        for a in stepping:
            self.steps[a] += 1
        self._unchecked = stepping
        self._norms = None if norms is None else HostCopy(norms)
        self._norms_host = None
        self._losses = None if losses is None else (ids, HostCopy(losses))
        return tuple(stepping)

    def warm_up(self, adapter_ids: Iterable[int], *, losses: torch.Tensor | None) -> None:
        """Launch what `step` launches for these adapters with every row's ``STEP`` unset.

        Their norms (when a step reads them: a TP all-reduce under TP) and one launch of the
        fused kernel that leaves every row, moment and gradient as it is; no step is counted
        and nothing is left for `check`. A run's first step then finds its kernel loaded:
        ``losses`` must be what that step will pass (its dtype picks the kernel), or None.
        """
        ids = tuple(adapter_ids)
        norms = self.squared_norms(ids) if self.needs_norms(ids) else None
        self._launch(ids, torch.zeros(len(ids), HYPER_COLUMNS), norms, losses)

    def _launch(
        self,
        ids: tuple[int, ...],
        hyper: torch.Tensor,
        norms: torch.Tensor | None,
        losses: torch.Tensor | None,
    ) -> None:
        """One `adapter_adamw_` launch over rows ``ids``, with (k, HYPER_COLUMNS) fp32 ``hyper``."""
        device = self.lora.weights.device
        adapter_adamw_(
            self.lora.weights,
            self.lora.grads,
            self.exp_avg,
            self.exp_avg_sq,
            _device_rows(ids, str(device)),
            copy_to_device(hyper, device),
            self._lr_groups,
            squared_norms=norms,
            losses=losses,
        )

    def check(self) -> None:
        """Raise `DivergenceError` when the last step refused an adapter, naming the first.

        `confirm`, for a caller that stops on any refusal (the runner confirms each step
        group itself and fails only the refused adapters).
        """
        refused = self.confirm()
        if refused:
            raise DivergenceError(refused[0][1])

    def confirm(self) -> list[tuple[int, str]]:
        """The adapters the last step refused, with why; they stop stepping (``stopped``).

        The kernel refused every stepping adapter whose loss or gradient norm was NaN or
        infinite; this reads that step's losses and norms back (a wait for the work queued up
        to the step, not after it). A refused adapter's weights, moments, gradients and step
        count stay those before the step; the other adapters of that step took it. Stopped
        adapters are not checked: they do not step.

        Returns:
            ``(adapter id, message)`` per refused adapter, in step order.
        """
        stepping, self._unchecked = self._unchecked, []
        if not stepping:
            return []
        norms = None if self._norms is None else self._host_norms()
        if self._losses is None:
            losses = None
        else:
            ids, copy = self._losses
            losses = dict(zip(ids, copy.tolist(), strict=True))
        refused = []
        for a in stepping:
            if losses is not None and not math.isfinite(losses[a]):
                refused.append((a, f"loss {losses[a]}"))
            elif norms is not None and not math.isfinite(norms[a]):
                refused.append((a, f"gradient norm {norms[a]}"))
        out = []
        for a, what in refused:
            self.steps[a] -= 1
            self.stopped.add(a)
            out.append(
                (
                    a,
                    f"adapter {self.adapters[a].name!r}: {what} at step {self.steps[a] + 1}; "
                    "it stopped before that step (its last checkpoint holds the weights "
                    "before it); lower its lr or set its max_grad_norm",
                )
            )
        return out

    def grad_norm(self, adapter_id: int) -> float:
        """Gradient norm (before clipping) of the adapter at the last `step` (a host read)."""
        if self._norms is None:
            return float("nan")
        return self._host_norms()[adapter_id]

    def _host_norms(self) -> list[float]:
        if self._norms_host is None:
            self._norms_host = [math.sqrt(s) for s in self._norms.tolist()]
        return self._norms_host

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

    counted = None if tp_rank == 0 else ~lora.replicated_columns()  # (S,) or every column

    def reduce(grads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        squared = row_squared_norms(grads, rows, counted)  # (A,)
        dist.all_reduce(squared, group=tp_group)
        return squared

    return reduce
