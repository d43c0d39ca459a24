"""One AdamW for all adapters, each stepping on its own schedule, in one fused launch.

Adapter ``a``'s weights, gradients and moments are row ``a`` of (A, S) fp32 tables
(`mcore.LoRAContext.weights`), so the adapters whose global batch ends at a microbatch step
together in one `ops.adapter_adamw_` launch, each with its own learning rate (its schedule at
its own step count), betas, epsilon and weight decay. Each adapter's state stays its own:
step count and moments are saved and restored per adapter (`adapter_state`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.mcore.context import LoRAContext, load_views
from megatron_lorafusion.ops import copy_to_device
from megatron_lorafusion.ops.adapter_adamw import HYPER_COLUMNS, adapter_adamw_

_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, as PEFT recipes use them
_EPS = 1e-8


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

    Raises:
        ValueError: when ``adapters`` or ``total_steps`` do not match the context's adapters.
    """

    def __init__(
        self, lora: LoRAContext, adapters: Sequence[AdapterConfig], total_steps: Sequence[int]
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

    def lr(self, adapter_id: int) -> float:
        """Learning rate of adapter ``adapter_id``'s next step."""
        adapter = self.adapters[adapter_id]
        return adapter.lr * lr_multiplier(
            self.steps[adapter_id], self.total_steps[adapter_id], adapter
        )

    def step(self, adapter_ids: Iterable[int]) -> None:
        """Step the given adapters (one launch) and zero their gradients.

        The other adapters' weights, moments and accumulated gradients are left untouched.
        """
        stepping = set(adapter_ids)
        if not stepping:
            return
        rows = []
        for a in range(self.lora.num_adapters):
            if a not in stepping:
                rows.append([0.0] * HYPER_COLUMNS)
                continue
            step = self.steps[a] + 1
            beta1, beta2 = _BETAS
            rows.append(
                [
                    self.lr(a),
                    beta1,
                    beta2,
                    _EPS,
                    self.adapters[a].weight_decay,
                    1.0 - beta1**step,
                    1.0 - beta2**step,
                    1.0,
                ]
            )
        hyper = copy_to_device(torch.tensor(rows, dtype=torch.float32), self.lora.weights.device)
        adapter_adamw_(self.lora.weights, self.lora.grads, self.exp_avg, self.exp_avg_sq, hyper)
        for a in stepping:
            self.steps[a] += 1

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
        name = self.adapters[adapter_id].name
        for key in ("exp_avg", "exp_avg_sq"):
            views = self.lora.adapter_views(getattr(self, key), adapter_id)
            load_views(views, state[key], f"the {key} of adapter {adapter_id} ({name!r})")
        self.steps[adapter_id] = int(state["step"])
