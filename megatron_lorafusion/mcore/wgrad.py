"""Deferred LoRA weight gradients: each microbatch's zero-bubble "W" pass, run in idle time.

With a `WgradQueue` on the `LoRAContext`, a LoRA wrapper's backward computes the input
gradient and ``dS`` (the gradient of ``S = drop(X)·Aᵀ``, T × R) but not
``dA = dSᵀ·drop(X)``, the pass over X that only the down-projection's weight gradient needs.
That pass waits in the queue, holding X, ``dS`` and the dropout mask, until the pipeline
runner runs it: while its stage waits for a peer, before an optimizer step of an adapter it
touches, when more than ``max_pending`` microbatches wait, and at the end of a run. ``dB``
comes from the same pass over dY as ``dS`` and is never deferred. docs/pipeline.md has the
measurements that decide whether to turn it on.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_lorafusion.ops import (
    AdapterLayout,
    dropout_keep_mask,
    fused_dropout_keep_mask,
    lora_down,
)

__all__ = ["WgradQueue", "accumulate_lora_a_grads", "down_projection"]


@dataclass
class _Pass:
    """The deferred work of one microbatch's backward on this stage."""

    adapters: frozenset[int]
    work: list[Callable[[], None]]


class WgradQueue:
    """FIFO of deferred ``dA`` passes, one entry per microbatch backward.

    Wrappers `push` work during a backward; the runner `seal`s it with the microbatch's
    adapters right after that backward and later runs it (`run_oldest`, `run_for`,
    `run_all`).

    Args:
        max_pending: microbatches whose passes may wait (their X stays alive); sealing one
            more runs the oldest. The stage count keeps memory at 1F1B's in-flight level.

    Raises:
        ValueError: when ``max_pending < 1``.
    """

    def __init__(self, max_pending: int):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._open: list[Callable[[], None]] = []
        self._passes: deque[_Pass] = deque()

    def __len__(self) -> int:
        """Sealed passes waiting to run."""
        return len(self._passes)

    def push(self, work: Callable[[], None]) -> None:
        """Add one layer's deferred work to the backward in progress."""
        self._open.append(work)

    def seal(self, adapters: Iterable[int]) -> None:
        """Close the finished backward's work into one pass tagged with its adapters."""
        if self._open:
            self._passes.append(_Pass(frozenset(adapters), self._open))
            self._open = []
        while len(self._passes) > self.max_pending:
            self.run_oldest()

    def run_oldest(self) -> bool:
        """Run the oldest pass; False when none waits."""
        if not self._passes:
            return False
        for work in self._passes.popleft().work:
            work()
        return True

    def run_for(self, adapters: Iterable[int]) -> None:
        """Run, oldest first, every pass that touched one of ``adapters`` (before a step)."""
        wanted = frozenset(adapters)
        keep: deque[_Pass] = deque()
        while self._passes:
            item = self._passes.popleft()
            if item.adapters & wanted:
                for work in item.work:
                    work()
            else:
                keep.append(item)
        self._passes = keep

    def run_all(self) -> None:
        """Run every waiting pass, oldest first."""
        while self.run_oldest():
            pass

    def clear(self) -> None:
        """Drop all waiting work (after a failed run)."""
        self._open.clear()
        self._passes.clear()


def accumulate_lora_a_grads(
    grad: torch.Tensor,
    x: torch.Tensor,
    grad_s: torch.Tensor,
    keep_mask: torch.Tensor | None,
    dropouts: list[float],
    segments: list[tuple[int, int, int]],
) -> None:
    """``dA[a] += dS[seg_a]ᵀ·drop_a(X[seg_a])`` for each adapter segment, in place.

    Args:
        grad: (A, R, H_local) the wrapper's ``lora_A_grad`` (a view into the context's
            gradient rows); rows beyond an adapter's rank get zeros, since ``dS`` is zero there.
        x: (T, H_local) the layer's input, as saved in forward.
        grad_s: (T, R) gradient of ``S`` (TP-reduced where the wrapper reduces it).
        keep_mask: (T, H_local) dropout keep-mask, or None without dropout.
        dropouts: (A,) dropout probability per adapter.
        segments: ``(adapter, start, end)`` rows of each adapter (`AdapterLayout.segments`).
    """
    for adapter, start, end in segments:
        x_seg = x[start:end]
        p = dropouts[adapter]
        if keep_mask is not None and p > 0:
            x_seg = x_seg * keep_mask[start:end] / (1.0 - p)
        grad[adapter] += (grad_s[start:end].t() @ x_seg).to(grad.dtype)  # (R, H_local)


def down_projection(
    wrapper,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    layout: AdapterLayout,
    col_offset: int = 0,
    full_width: int | None = None,
) -> torch.Tensor:
    """``S = drop(X)·Aᵀ`` (T, R) by `lora_down`, or with A's gradient deferred.

    With a `WgradQueue` on the context (training), ``A`` enters detached, so this backward
    gives dX and ``dS`` only; a hook on ``S`` queues ``dA = dSᵀ·drop(X)`` for the runner,
    which regenerates the dropout mask when it runs it. ``wrapper`` is a LoRA wrapper
    (`mcore.lora`): its context, dropouts, layer seed, factors and TP mode are read.
    """
    queue = wrapper.context.wgrad_queue
    if queue is None or not wrapper.training or not torch.is_grad_enabled():
        return lora_down(
            x,
            lora_a,
            wrapper.dropouts,
            layout,
            layer_seed=wrapper.layer_seed,
            training=wrapper.training,
            col_offset=col_offset,
            full_width=full_width,
        )
    if wrapper.sequence_parallel and wrapper.is_column:
        raise NotImplementedError(
            f"{type(wrapper).__name__}: deferred LoRA weight gradients do not combine with "
            "sequence parallelism (each rank's dA covers its rows only and would need a TP "
            "all-reduce inside the deferred pass); set parallel.sequence_parallel=false"
        )
    s = lora_down(
        x,
        lora_a.detach(),
        wrapper.dropouts,
        layout,
        layer_seed=wrapper.layer_seed,
        training=True,
        col_offset=col_offset,
        full_width=full_width,
    )
    if not s.requires_grad:  # X needs no gradient (first layer): make S a leaf to get dS
        s = s.detach().requires_grad_()
    width = full_width or x.shape[1]
    s.register_hook(
        functools.partial(
            _defer_lora_a_grads,
            wrapper,
            queue,
            x.detach(),
            layout,
            slice(col_offset, col_offset + x.shape[1]),
            width,
        )
    )
    return s


def _defer_lora_a_grads(
    wrapper,
    queue: WgradQueue,
    x: torch.Tensor,
    layout: AdapterLayout,
    columns: slice,
    width: int,
    grad_s: torch.Tensor,
) -> None:
    """Backward hook on ``S``: queue ``dA`` instead of computing it now."""

    def lora_a_grads() -> None:
        draw = fused_dropout_keep_mask if x.is_cuda else dropout_keep_mask  # lora_down's mask
        keep = draw(layout, wrapper.dropouts, width, wrapper.layer_seed, x.device)
        keep = None if keep is None else keep[:, columns]
        accumulate_lora_a_grads(
            wrapper.lora_A_grad, x, grad_s.detach(), keep, wrapper.dropouts, layout.segments()
        )

    queue.push(lora_a_grads)
