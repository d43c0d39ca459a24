"""Activation recomputation of a LoRA model, the job's ``train.recompute``: none, selective, full.

- ``selective`` (exact): a LoRA wrapper fed by a norm or SwiGLU rebuilds that input in
  backward from the producer's own saved input instead of keeping it
  (`LoRAContext.rebuild_inputs`, `mcore.lora`): recompute what is large and cheap, as
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022).
- ``full``: every decoder layer keeps only its input hidden states and runs its forward again
  in backward (`RecomputedLayer`, non-reentrant ``torch.utils.checkpoint``; Chen et al.,
  "Training Deep Nets with Sublinear Memory Cost", 2016).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from megatron_lorafusion.mcore.context import LoRAContext

__all__ = ["RECOMPUTE_MODES", "RecomputedLayer", "apply_recompute"]

RECOMPUTE_MODES = ("none", "selective", "full")
"""The values of ``train.recompute``."""


class RecomputedLayer(nn.Module):
    """A decoder layer whose training forward runs again in backward; only its input is kept.

    The LoRA wrappers read the microbatch's `AdapterLayout` from the shared context, which the
    pipelined runner sets to later microbatches' before an earlier one's backward. The
    layout of the forward is captured and set again around the recompute (then the current
    one is put back), so the recompute sees its own microbatch; the LoRA dropout masks,
    counter-based on ``(layout.dropout_seed, layer seed, row)``, come out the same, and the
    torch RNG state is restored by the checkpoint as well (the base has no dropout).

    Args:
        layer: a built `TransformerLayer`, LoRA already applied.
        context: the model's `LoRAContext`.

    Attributes:
        layer: the wrapped layer.
        layer_number: the wrapped layer's (1-based, global), which Megatron's block reads.
    """

    def __init__(self, layer: nn.Module, context: LoRAContext):
        super().__init__()
        self.layer = layer
        self.context = context
        self.layer_number = layer.layer_number
        self.train(layer.training)

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        """The layer's output for ``[s, b, H]`` ``hidden_states``; recomputed when training."""
        if not (self.training and torch.is_grad_enabled()):
            return self.layer(hidden_states=hidden_states, **kwargs)
        # Positional: the checkpoint saves positional tensors for backward; keyword ones are
        # only referenced (the layout, packed_seq_params and RoPE tables stay alive anyway).
        # No early stop: a recompute cut short after its last saved tensor kept its partial
        # graph alive past the backward (the tiny model: 43 tensors; 8B, 32 layers, T = 8192:
        # ~11 GiB until the next forward), and it would only skip the final residual add.
        return checkpoint(
            self._run,
            self.context.layout,
            hidden_states,
            use_reentrant=False,
            early_stop=False,
            **kwargs,
        )

    def _run(self, layout, hidden_states: torch.Tensor, **kwargs):
        previous, self.context.layout = self.context.layout, layout
        try:
            return self.layer(hidden_states=hidden_states, **kwargs)
        finally:  # also when the checkpoint stops a recompute early
            self.context.layout = previous


def apply_recompute(model: nn.Module, context: LoRAContext, mode: str) -> None:
    """Set the activation recomputation of a LoRA model to ``mode``, in place.

    Call after `apply_lora` (which cannot wrap `RecomputedLayer`s), before any DDP wrapping.

    Args:
        model: a `GPTModel` (or one pipeline stage of it) with LoRA applied.
        context: its `LoRAContext`.
        mode: ``"none"`` (every op keeps what it saves), ``"selective"`` (the LoRA wrappers
            rebuild norm and SwiGLU outputs in backward; gradients bit for bit those of
            ``"none"``) or ``"full"`` (every decoder layer becomes a `RecomputedLayer`).

    Raises:
        ValueError: for a mode not in `RECOMPUTE_MODES`.
        TypeError: when ``model`` has no ``decoder.layers``.
        RuntimeError: when the layers already are `RecomputedLayer`s.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE_MODES)}, got {mode!r}")
    decoder = getattr(model, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"apply_recompute needs a GPTModel with decoder.layers, got {type(model).__name__}"
        )
    layers = decoder.layers
    if any(isinstance(layer, RecomputedLayer) for layer in layers):
        raise RuntimeError("apply_recompute: the decoder layers are already recomputed")
    context.rebuild_inputs = mode == "selective"  # under full the whole layer is recomputed
    if mode == "full":
        for i, layer in enumerate(layers):
            layers[i] = RecomputedLayer(layer, context)
