"""What an adapter variant provides, in one place: LoRA and DoRA (docs/adapters.md).

Every variant is a LoRA at heart (its ``A`` (r, H) and ``B`` (N, r) per adapted linear, the
fused multi-adapter kernels, the stacked per-projection blocks); an `AdapterType` says what
it adds on top: its config fields and their rules, an optional trainable vector per output
row of each adapted linear (DoRA's magnitude) with its init, the fused hook (a per-column
scale of the fused LoRA output), the one-adapter torch reference, the merged weight and the
PEFT export names. `mcore.lora`, `mcore.context`, `train.export` and `validation` read the
variant of an adapter through `adapter_type` only.

Imports no torch at module level (`validation` runs without it); the tensor hooks import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: config imports validation, which imports this module
    import torch

    from megatron_lorafusion.config import AdapterConfig

__all__ = ["ADAPTER_TYPES", "DORA", "LORA", "AdapterType", "adapter_type"]


@dataclass(frozen=True)
class AdapterType:
    """One adapter variant.

    Attributes:
        name: the variant's name (``lora``, ``dora``).
        config_fields: `AdapterConfig` fields that select or shape it (documented there).
        problems: ``(adapter, where, tp) -> [message]``, its config rules (`validation`).
        peft_config: entries of PEFT's ``adapter_config.json`` it sets (``use_dora``).
        row_vector: name of its trainable per-output-row vector (N,) on each adapted linear
            (packed with ``lora_A`` / ``lora_B``: checkpoints, optimizer, export see it), or
            None.
        peft_row_vector: the vector's PEFT key part (``lora_magnitude_vector``).
        init_row_vector: ``(‖W_n‖² (N,) fp32) -> (N,)`` initial vector.
        column_scale: fused hook, ``(W, ‖W_n‖², A, B, s, vector) -> (N,)`` scale of the
            adapter's tokens' output columns (without bias), batched over k adapters of the
            variant as ``(k, R, H)``, ``(k, N, R)``, ``(k,)``, ``(k, N)`` -> ``(k, N)`` (one
            call per linear and microbatch); None: no scale (plain LoRA).
        reference: ``(x, W, bias, A, B, s, vector, keep, p) -> y``, the one-adapter torch
            forward the fused path is tested against (``keep``: (T, H) bool or None).
        merged_weight: ``(W, A, B, s, vector) -> W'`` fp32, the weight of the merged model.
    """

    name: str
    config_fields: tuple[str, ...]
    problems: Callable[[AdapterConfig, str, int], list[str]]
    reference: Callable[..., torch.Tensor]
    merged_weight: Callable[..., torch.Tensor]
    peft_config: Mapping[str, Any] = field(default_factory=dict)
    row_vector: str | None = None
    peft_row_vector: str | None = None
    init_row_vector: Callable[[torch.Tensor], torch.Tensor] | None = None
    column_scale: Callable[..., torch.Tensor] | None = None


def _lora_delta(x, lora_a, lora_b, scaling, keep, p):
    """``s·drop(x)·Aᵀ·Bᵀ`` (T, N) with inverted dropout (``keep`` None: none)."""
    if keep is not None and p > 0:
        x = x * keep / (1.0 - p)
    return scaling * (x @ lora_a.t() @ lora_b.t())


def _lora_reference(x, weight, bias, lora_a, lora_b, scaling, vector, keep=None, p=0.0):
    """LoRA: ``x·Wᵀ + b + s·drop(x)·Aᵀ·Bᵀ``."""
    import torch.nn.functional as F

    return F.linear(x, weight, bias) + _lora_delta(x, lora_a, lora_b, scaling, keep, p)


def _lora_merged(weight, lora_a, lora_b, scaling, vector):
    """LoRA: ``W + s·B·A`` in fp32."""
    return weight.float() + scaling * (lora_b.float() @ lora_a.float())


def _lora_problems(adapter: AdapterConfig, where: str, tp: int) -> list[str]:
    return []


def _dora_problems(adapter: AdapterConfig, where: str, tp: int) -> list[str]:
    if adapter.use_dora and tp > 1:
        return [
            f"{where}.use_dora must be false with parallel.tp > 1 (adapter {adapter.name!r}): "
            f"DoRA supports tp = 1 only (its row norm on linear_proj / linear_fc2 needs a sum "
            f"over the TP-sharded input), got tp={tp}"
        ]
    return []


def _dora_column_scale(weight, weight_sq, lora_a, lora_b, scaling, vector):
    """DoRA: ``m / ‖W + s·B·A‖_row``, the norm detached (PEFT's rule); grad flows to ``m``.

    One adapter's (R, H), (N, R), s, (N,) or k adapters' (k, R, H), (k, N, R), (k,), (k, N).
    """
    from megatron_lorafusion.ops import dora_weight_norm

    return vector / dora_weight_norm(weight, weight_sq, lora_a, lora_b, scaling)


def _dora_reference(x, weight, bias, lora_a, lora_b, scaling, vector, keep=None, p=0.0):
    """DoRA: ``(m / ‖W + s·B·A‖_row) ⊙ (x·Wᵀ + s·drop(x)·Aᵀ·Bᵀ) + b``, the norm detached."""
    import torch
    import torch.nn.functional as F

    norm = torch.linalg.vector_norm(weight + scaling * (lora_b @ lora_a), dim=1).detach()
    out = F.linear(x, weight) + _lora_delta(x, lora_a, lora_b, scaling, keep, p)
    return (vector / norm) * out + (0.0 if bias is None else bias)


def _dora_merged(weight, lora_a, lora_b, scaling, vector):
    """DoRA: ``(m / ‖W + s·B·A‖_row) ⊙ (W + s·B·A)`` in fp32."""
    import torch

    merged = _lora_merged(weight, lora_a, lora_b, scaling, vector)
    return (vector.float() / torch.linalg.vector_norm(merged, dim=1))[:, None] * merged


def _magnitude_init(weight_sq):
    """DoRA: ``m = ‖W_n‖``, so a fresh adapter (B = 0) is the base model."""
    return weight_sq.sqrt()


LORA = AdapterType(
    name="lora",
    config_fields=("rank", "alpha", "dropout", "use_rslora", "target_modules"),
    problems=_lora_problems,
    reference=_lora_reference,
    merged_weight=_lora_merged,
)
DORA = AdapterType(
    name="dora",
    config_fields=("use_dora",),
    problems=_dora_problems,
    reference=_dora_reference,
    merged_weight=_dora_merged,
    peft_config={"use_dora": True},
    row_vector="lora_magnitude",
    peft_row_vector="lora_magnitude_vector",
    init_row_vector=_magnitude_init,
    column_scale=_dora_column_scale,
)
ADAPTER_TYPES = (LORA, DORA)
"""Every variant, LoRA first (its fields are every variant's too)."""


def adapter_type(adapter: AdapterConfig) -> AdapterType:
    """The variant ``adapter`` trains: `DORA` when ``use_dora``, else `LORA`."""
    return DORA if adapter.use_dora else LORA
