"""Test helper: Megatron's sequence-parallel code on CPU (gloo), for the SP tests only.

The package runs sequence parallelism on CUDA alone (`train.main` turns it off on CPU);
the equivalence tests still check the SP math over gloo, inside this context.
"""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def sequence_parallel_on_cpu(device: torch.device | str) -> Iterator[None]:
    """Let Megatron's sequence-parallel code run on the CPU (gloo), around a whole run.

    Megatron allocates the outputs of its first-dimension all-gather and reduce-scatter on
    ``torch.cuda.current_device()`` and forks the CUDA RNG tracker around the embedding's
    dropout; on a CPU run both can only fail. For a ``cpu`` ``device`` this context makes
    ``torch.cuda.current_device()`` return the CPU device (so those buffers land next to the
    gloo tensors) and installs Megatron's no-op RNG tracker (our models have no dropout
    outside LoRA, whose masks come from `AdapterLayout` seeds). Both are undone on exit. On
    any other device it does nothing: CUDA runs (NCCL) are untouched.

    Backward runs must happen inside the context too (Megatron's reduce-scatter is the
    backward of its all-gather).
    """
    if torch.device(device).type != "cpu":
        yield
        return
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        torch.cuda.current_device = saved
        initialize_rng_tracker(force_reset=True)
