"""The FP8 frozen base (``model.base_precision: fp8``): its linears, and how they are loaded.

`Fp8ColumnParallelLinear` and `Fp8RowParallelLinear` take the place of Megatron's linears in
the layer spec (`mcore.model.get_gpt_lora_layer_spec`): their ``weight`` is e4m3 (N / tp, H) or
(N, H / tp) with ``weight_scale``, one power-of-two scale per output channel of the whole row
(so every TP size quantizes alike), and their forward is `ops.fp8_linear` between Megatron's
own TP / SP collectives. The LoRA wrappers wrap them like any Megatron linear.

`materialize_fp8_model` loads a model built on the meta device one tensor at a time: each
frozen linear's shard is read (checkpoint slice or random draw), moved to the device in the
compute dtype, quantized there and dropped, so neither host nor GPU ever holds the model in
bf16 (Llama-3.1-70B: ~70 GB in e4m3 instead of ~140 GB; docs/fp8.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from torch import nn

from megatron_lorafusion.ops import Fp8Weight, fp8_linear, quantize_weight

ValueSource = Callable[[str, torch.Tensor], torch.Tensor]
"""``(global parameter name, meta parameter) -> this rank's values`` (any device, any float
dtype; the shape of the parameter)."""

_KEPT_ATTRIBUTES = (  # Megatron's marks on a parameter, carried to its materialized tensor
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "sequence_parallel",
    "is_embedding_or_output_parameter",
)


def _linear_fp8(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_linear` on ``[s, b, H]`` (any leading dims): ``[s, b, N]``."""
    rows = x.reshape(-1, x.shape[-1])  # (s·b, H), a view of a contiguous input
    return fp8_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _register_fp8(module: nn.Module) -> None:
    """Give a just-built linear its (unset) FP8 state: scale and optional transposed copy."""
    out_features = module.weight.shape[0]
    module.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
    module.register_buffer("weight_t", None, persistent=False)


def fp8_weight(module: nn.Module) -> Fp8Weight:
    """The `Fp8Weight` of an FP8 linear (`Fp8ColumnParallelLinear`, `Fp8RowParallelLinear`)."""
    return Fp8Weight(module.weight, module.weight_scale, module.weight_t)


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """Megatron's `ColumnParallelLinear` with a frozen e4m3 weight (N / tp, H).

    A LoRA wrapper around it shards B like the weight, on N. Built through the layer spec with
    Megatron's arguments, on the meta device (`mcore.model.build_gpt_model`);
    `materialize_fp8_model` sets ``weight`` (e4m3), ``weight_scale`` ((N / tp,) fp32) and
    ``weight_t`` ((H, N / tp) e4m3 or None).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _register_fp8(self)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, bias)`` as Megatron's: input ``[s, b, H]``, out ``[s, b, N / tp]``.

        Under sequence parallelism the input is this rank's ``[s / tp, b, H]``, all-gathered
        first.

        Raises:
            NotImplementedError: when a ``weight`` is passed (tied output layers stay bf16).
        """
        if weight is not None:
            raise NotImplementedError(
                f"{type(self).__name__} computes with its own FP8 weight, got a weight argument"
            )
        group = self.tp_group
        if self.sequence_parallel:  # backward: reduce-scatter of dX
            x = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=group
            )
        else:  # backward: all-reduce of dX over TP (identity at tp = 1)
            x = copy_to_tensor_model_parallel_region(input_, group=group)
        bias = None if self.skip_bias_add else self.bias
        out = _linear_fp8(x, fp8_weight(self), bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and group.size() > 1:
            out = gather_from_tensor_model_parallel_region(out, group=group)
        return out, (self.bias if self.skip_bias_add else None)


class Fp8RowParallelLinear(RowParallelLinear):
    """Megatron's `RowParallelLinear` with a frozen e4m3 weight (N, H / tp).

    A LoRA wrapper around it shards A like the weight, on H. Activations are quantized per
    token over this rank's H / tp columns (no collective); the weight's scales cover its whole
    rows (`materialize_fp8_model` all-reduces their maxima).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _register_fp8(self)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, bias)`` as Megatron's: input ``[s, b, H / tp]``, out ``[s, b, N]``.

        Under sequence parallelism the output is this rank's ``[s / tp, b, N]``
        (reduce-scattered).

        Raises:
            NotImplementedError: for a base without ``input_is_parallel``.
        """
        if not self.input_is_parallel:
            raise NotImplementedError(f"{type(self).__name__} needs input_is_parallel=True")
        partial = _linear_fp8(input_, fp8_weight(self), None)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


FP8_LINEARS = (Fp8ColumnParallelLinear, Fp8RowParallelLinear)


def fp8_weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's e4m3 linear weights (one copy; shapes read, nothing allocated)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, FP8_LINEARS))


def _new_parameter(old: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    new = nn.Parameter(data, requires_grad=False)
    for name in _KEPT_ATTRIBUTES:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
    return new


def _quantize_into(
    module: nn.Module,
    values: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup | None,
    keep_transposed: bool,
) -> None:
    """Quantize ``values`` (this rank's (N, H_local) shard, on the device) into ``module``.

    A row-parallel shard's channel scales come from the whole row: the row maxima are
    all-reduced over ``tp_group`` (one (N,) vector), so any TP size stores the same e4m3.
    """
    amax = None
    if isinstance(module, RowParallelLinear) and tp_group is not None and tp_group.size() > 1:
        amax = values.float().abs().amax(dim=1)
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    fp8 = quantize_weight(values, amax, transposed=keep_transposed)
    module.weight = _new_parameter(module.weight, fp8.data)
    module.weight_scale = fp8.scale
    module.weight_t = fp8.data_t


def _tensors(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(name, owner, attribute, parameter)`` of every parameter, in ``named_parameters`` order."""
    owners = dict(model.named_modules())
    out = []
    for name, param in model.named_parameters():
        owner_name, _, attribute = name.rpartition(".")
        out.append((name, owners[owner_name], attribute, param))
    return out


def _pipelined(
    items: list, produce: Callable, workers: int
) -> Iterator[tuple[object, torch.Tensor]]:
    """``(item, produce(item))`` in order, up to ``workers + 2`` produced ahead in threads.

    The window bounds host memory (a few tensors in flight, never the model); torch's ops
    release the GIL, so draws and reads run in parallel with the device copies.
    """
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        pending: list[tuple[object, Future]] = []
        ahead = max(1, workers) + 2
        for item in items:
            pending.append((item, pool.submit(produce, item)))
            if len(pending) >= ahead:
                first, done = pending.pop(0)
                yield first, done.result()
        for item, done in pending:
            yield item, done.result()


def materialize_fp8_model(
    model: nn.Module,
    values: ValueSource,
    global_name: Callable[[str], str],
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp_group: torch.distributed.ProcessGroup | None,
    keep_transposed: bool,
    workers: int,
) -> None:
    """Give every meta parameter of ``model`` its values on ``device``, quantizing FP8 linears.

    Args:
        model: built under ``torch.device("meta")`` with FP8 linears in its spec.
        values: this rank's values of a parameter (`ValueSource`), called in worker threads.
        global_name: the global name of a local parameter name (pipeline stages' layers).
        device: where the model lives.
        dtype: compute dtype: every other parameter's, and what linear weights are cast to
            before quantizing (so FP8 quantizes exactly the bf16 model's weights).
        tp_group: the tensor-parallel group (row-parallel scales are all-reduced over it).
        keep_transposed: also keep each weight's (H, N) e4m3 copy for the backward.
        workers: threads producing values ahead of the device copies.

    Raises:
        ValueError: when a source gives a tensor of the wrong shape (names it).
        RuntimeError: when a tensor of ``model`` is left on the meta device.
    """
    items = _tensors(model)

    def produce(item) -> torch.Tensor:
        name, _, _, param = item
        value = values(global_name(name), param)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"the values of {global_name(name)} have shape {tuple(value.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        return value.to(dtype)  # the bf16 model's values, on the host

    for (_, owner, attribute, param), value in _pipelined(items, produce, workers):
        on_device = value.to(device, non_blocking=False)
        if isinstance(owner, FP8_LINEARS) and attribute == "weight":
            _quantize_into(owner, on_device, tp_group, keep_transposed)
        else:
            setattr(owner, attribute, _new_parameter(param, on_device))
        del value, on_device
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"materialize_fp8_model left tensors on the meta device: {left}")
