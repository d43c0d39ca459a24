"""Apply multi-adapter LoRA to a built `GPTModel` and manage the adapters' parameters.

`apply_lora` swaps each targeted linear of every decoder layer for a LoRA wrapper (after the
base weights exist, before any DDP wrapping) and returns the `LoRAContext` through which the
caller sets each microbatch's `AdapterLayout` and reads or loads one adapter's weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from megatron_lorafusion.config import TARGET_MODULES, AdapterConfig
from megatron_lorafusion.mcore.lora import LoRAColumnParallelLinear, LoRARowParallelLinear
from megatron_lorafusion.mcore.wgrad import WgradQueue
from megatron_lorafusion.ops import AdapterLayout

# target -> (parent attribute in the layer, wrapper class); the order numbers the layer seeds.
_TARGETS: dict[str, tuple[str, type[nn.Module]]] = {
    "linear_qkv": ("self_attention", LoRAColumnParallelLinear),
    "linear_proj": ("self_attention", LoRARowParallelLinear),
    "linear_fc1": ("mlp", LoRAColumnParallelLinear),
    "linear_fc2": ("mlp", LoRARowParallelLinear),
}
assert tuple(_TARGETS) == TARGET_MODULES  # internal invariant: one wrapper per known target

LoRAWrapper = LoRAColumnParallelLinear | LoRARowParallelLinear


class LoRAContext:
    """The adapters of one model: the current microbatch layout and per-adapter weights.

    Attributes:
        layout: the `AdapterLayout` of the next forward; set it before every forward (the
            LoRA op saves the layout it ran with, so backward needs no further setting).
        adapters: the run's adapters; adapter id = position.
        wrappers: LoRA wrapper of each adapted linear, keyed by its global name
            (``decoder.layers.{global layer index}.self_attention.linear_qkv``, ...).
        wgrad_queue: when set, training backwards defer each down-projection's weight
            gradient into this queue (zero-bubble; `mcore.wgrad`); None computes it at once.
    """

    def __init__(self, adapters: Sequence[AdapterConfig], wrappers: dict[str, LoRAWrapper]):
        self.layout: AdapterLayout | None = None
        self.wgrad_queue: WgradQueue | None = None
        self.adapters = tuple(adapters)
        self.wrappers = wrappers

    @property
    def num_adapters(self) -> int:
        """``A``, adapters in the run."""
        return len(self.adapters)

    def _check_id(self, adapter_id: int) -> None:
        if not 0 <= adapter_id < self.num_adapters:
            raise ValueError(f"adapter_id must lie in [0, {self.num_adapters}), got {adapter_id}")

    def adapter_parameters(self, adapter_id: int) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of one adapter on this rank, names like ``<linear>.lora_A``.

        Tensors are this rank's TP shards (A: (r, H_local), B: (N_local, r)), fp32, trainable.
        """
        self._check_id(adapter_id)
        key = str(adapter_id)
        params = []
        for name, wrapper in self.wrappers.items():
            if key in wrapper.lora_A:
                params.append((f"{name}.lora_A", wrapper.lora_A[key]))
                params.append((f"{name}.lora_B", wrapper.lora_B[key]))
        return params

    def parameters(self) -> list[nn.Parameter]:
        """Every adapter parameter on this rank (all adapters)."""
        return [p for a in range(self.num_adapters) for _, p in self.adapter_parameters(a)]

    def adapter_state_dict(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """Detached copies of one adapter's TP-local factors, keyed as `adapter_parameters`."""
        return {name: p.detach().clone() for name, p in self.adapter_parameters(adapter_id)}

    def load_adapter_state_dict(self, adapter_id: int, state_dict: Mapping[str, torch.Tensor]):
        """Copy ``state_dict`` into one adapter's factors (strict: same keys, same shapes).

        Raises:
            ValueError: naming every missing or unexpected key and every shape mismatch;
                nothing is copied when any problem is found.
        """
        params = dict(self.adapter_parameters(adapter_id))
        problems = [f"missing key {k!r}" for k in params if k not in state_dict]
        problems += [f"unexpected key {k!r}" for k in state_dict if k not in params]
        problems += [
            f"{k} has shape {tuple(state_dict[k].shape)}, expected {tuple(p.shape)}"
            for k, p in params.items()
            if k in state_dict and tuple(state_dict[k].shape) != tuple(p.shape)
        ]
        if problems:
            raise ValueError(
                f"cannot load adapter {adapter_id} ({self.adapters[adapter_id].name!r}):\n  - "
                + "\n  - ".join(problems)
            )
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(state_dict[k])

    def merged_weights(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """``W + s·B·A`` of each adapted linear (``<linear>.weight``), TP-local shards."""
        self._check_id(adapter_id)
        return {f"{n}.weight": w.merged_weight(adapter_id) for n, w in self.wrappers.items()}


def _check_adapters(adapters: Sequence[AdapterConfig]) -> None:
    if not adapters:
        raise ValueError("apply_lora needs at least one adapter")
    for i, adapter in enumerate(adapters):
        unknown = sorted(set(adapter.target_modules) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(
                f"adapters[{i}].target_modules must be a subset of {list(TARGET_MODULES)}, "
                f"got unknown {unknown}"
            )
        if adapter.rank <= 0:
            raise ValueError(f"adapters[{i}].rank must be > 0, got {adapter.rank}")


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
    (linear_qkv, linear_fc1) or `LoRARowParallelLinear` (linear_proj, linear_fc2). Factors
    are drawn from ``(seed, adapter id, 4·i + target index)`` (A kaiming-uniform, B zero),
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
        ValueError: on an empty adapter list or unknown target modules.
        RuntimeError: when the model already carries LoRA wrappers.
    """
    _check_adapters(adapters)
    decoder = getattr(model, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"apply_lora needs a GPTModel with decoder.layers, got {type(model).__name__}; "
            "apply LoRA before wrapping the model in DDP"
        )
    context = LoRAContext(adapters, {})
    for layer in decoder.layers:
        index = layer.layer_number - 1  # global, 0-based
        for target_index, (target, (parent_name, wrapper_cls)) in enumerate(_TARGETS.items()):
            targeted = [a for a, ad in enumerate(adapters) if target in ad.target_modules]
            if not targeted:
                continue
            parent = getattr(layer, parent_name)
            base = getattr(parent, target)
            if isinstance(base, LoRAColumnParallelLinear | LoRARowParallelLinear):
                raise RuntimeError(f"decoder.layers.{index}: LoRA is already applied")
            wrapper = wrapper_cls(
                base,
                adapters,
                targeted,
                context,
                seed=seed,
                layer_seed=4 * index + target_index,
                tp_group=tp_group,
            )
            setattr(parent, target, wrapper)
            context.wrappers[f"decoder.layers.{index}.{parent_name}.{target}"] = wrapper
    return context
