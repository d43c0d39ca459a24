"""What a LoRA op saves for its input X in backward: X itself, or the sources that rebuild it.

`InputRebuild` lets the LoRA ops (`fused_lora_linear`, `lora_split`) rebuild X in backward
instead of saving it (selective recompute); `save_input` and `saved_input` are the two ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class InputRebuild:
    """How a LoRA op rebuilds its input X in backward instead of saving it (selective recompute).

    ``fn(*sources)`` must return X bit for bit: the very function that produced X (the same
    kernel on CUDA, the same reference elsewhere) on the tensors it read. Worth it when the
    producer's own backward saves ``sources`` anyway (a norm's input, SwiGLU's input): the
    op then keeps no tensor of its own for X. The op saves ``sources`` (detached, so an
    in-place write to them before backward fails autograd's version check) in X's place and
    calls ``fn`` under ``torch.no_grad()`` in backward; ``fn`` must be pure (no state read
    that may change between forward and backward).

    Attributes:
        fn: ``(*sources) -> X``, the (T, H) input of the op.
        sources: the tensors ``fn`` reads.
    """

    fn: Callable[..., torch.Tensor]
    sources: tuple[torch.Tensor, ...]


def save_input(
    ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, rebuild: InputRebuild | None
) -> tuple[torch.Tensor, ...]:
    """What an autograd function saves for X: X, or the (detached) sources that rebuild it."""
    ctx.rebuild_fn = None if rebuild is None else rebuild.fn
    ctx.input_meta = (tuple(x.shape), x.dtype, x.is_contiguous())
    ctx.num_input_tensors = 1 if rebuild is None else len(rebuild.sources)
    return (x,) if rebuild is None else tuple(t.detach() for t in rebuild.sources)


def saved_input(
    ctx: torch.autograd.function.FunctionCtx, saved: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """X back from what `save_input` saved (rebuilt without autograd when sources were saved).

    Raises:
        RuntimeError: when the rebuilt X has another shape or dtype than the forward's.
    """
    if ctx.rebuild_fn is None:
        return saved[0]
    shape, dtype, contiguous = ctx.input_meta
    with torch.no_grad():
        x = ctx.rebuild_fn(*saved)
    if (tuple(x.shape), x.dtype) != (shape, dtype):
        raise RuntimeError(
            f"the rebuilt LoRA input is {tuple(x.shape)} {x.dtype}, the forward's "
            f"was {shape} {dtype}"
        )
    return x.contiguous() if contiguous else x
