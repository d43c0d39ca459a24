"""Adapter checkpoints: one file per adapter and step, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_adapter_checkpoint(
    folder: str | Path,
    step: int,
    adapter_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    losses: list[float],
) -> Path:
    """Write ``folder/step_{step:06d}.pt`` holding weights, optimizer and schedule states.

    The file is written under a temporary name and renamed, so a crash never leaves a
    checkpoint that looks complete.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    payload = {
        "step": step,
        "adapter": {k: v.detach().cpu() for k, v in adapter_state.items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "losses": list(losses),
    }
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_adapter_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by `save_adapter_checkpoint`.

    Raises:
        ValueError: when the file is unreadable or lacks a field; the message names the file.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a damaged file
        raise ValueError(f"checkpoint {str(path)!r} cannot be read: {err}") from err
    missing = {"step", "adapter", "optimizer", "scheduler", "losses"} - set(payload)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {sorted(missing)}")
    return payload
