"""One AdamW and one learning-rate schedule per adapter, so adapters step independently."""

from __future__ import annotations

import math

import torch

from megatron_lorafusion.config import AdapterConfig


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


def build_optimizer(
    params: list[torch.nn.Parameter], adapter: AdapterConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over one adapter's parameters and its schedule (stepped once per optimizer step)."""
    optimizer = torch.optim.AdamW(params, lr=adapter.lr, weight_decay=adapter.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, adapter)
    )
    return optimizer, scheduler
