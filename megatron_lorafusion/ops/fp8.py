"""The FP8 format of the frozen base: e4m3 values, one power-of-two scale per row.

`Fp8Weight` is what the FP8 ops take in place of a (N, H) weight tensor; `fp8_problem` says
whether a device has FP8 tensor cores. The quantizers are in `fp8_quant`, the GEMMs in
`fp8_linear`; docs/fp8.md explains the choices. (A module of its own, without Triton kernels,
so the class stays one class when tests reload the kernel modules for the interpreter.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_lorafusion.ops import _utils

FP8_DTYPE = torch.float8_e4m3fn
"""Storage dtype of quantized weights, activations and gradients."""
FP8_MAX = 448.0
"""Largest finite e4m3 value."""
FP8_MIN_CAPABILITY = (8, 9)
"""First CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)."""


class Fp8Weight(NamedTuple):
    """A frozen weight in FP8: what the FP8 linear ops take in place of a (N, H) tensor.

    Attributes:
        data: (N, H) e4m3, row-major (the forward's K-major operand).
        scale: (N,) fp32 power-of-two dequantization scale of each output channel (row).
        data_t: (H, N) e4m3 copy of ``data`` transposed (the backward's K-major operand),
            or None: the backward transposes ``data`` when it runs.
    """

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """``(N, H)``, like the weight it stands for."""
        return self.data.shape

    def transposed(self) -> torch.Tensor:
        """(H, N) contiguous e4m3: ``data_t``, or a fresh transpose of ``data``."""
        return self.data_t if self.data_t is not None else self.data.t().contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, H) ``data · scale`` in ``dtype`` (exact in fp32)."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


def fp8_problem(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on ``device``, or None when they can (any CPU: reference)."""
    if device.type != "cuda":
        return None
    major, minor = _utils.capability(device.index)
    if (major, minor) < FP8_MIN_CAPABILITY:
        return (
            f"FP8 base weights need a GPU with FP8 tensor cores (compute capability >= 8.9: "
            f"Ada, Hopper or later), got {torch.cuda.get_device_name(device)} "
            f"(sm_{major}{minor}); use model.base_precision: bf16"
        )
    return None


def check_fp8_device(device: torch.device) -> None:
    """Raise unless FP8 GEMMs can run on ``device`` (see `fp8_problem`).

    Raises:
        RuntimeError: on a GPU without FP8 tensor cores, naming it.
    """
    problem = fp8_problem(torch.device(device))
    if problem is not None:
        raise RuntimeError(problem)
