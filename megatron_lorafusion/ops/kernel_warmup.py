"""Triton's once-per-process work for our kernels, done on a thread while the model is built.

With a warm cache, the first launch of each Triton kernel in a process still pays what later
launches do not: Triton's own cache key (a hash of its compiler's sources and of libtriton,
~0.4 s, once per process), each kernel's source key (its syntax tree and the helpers it calls)
and its argument binder. On the H200 these made the first microbatch of Llama-3.2-1B with one
adapter 12.7x the median (docs/throughput.md, issue 33). `start_kernel_warmup` does them on a
background thread; the model's build (seconds, mostly waiting on the GPU and on imports)
hides them. Loading the compiled kernels themselves still happens at their first launch
(their specializations depend on the shapes).
"""

from __future__ import annotations

import logging
import sys
import threading

import torch

from megatron_lorafusion.ops._utils import interpreter_enabled, triton

logger = logging.getLogger(__name__)


def jit_functions() -> list:
    """Every Triton function (kernels and their ``@triton.jit`` helpers) that `ops` defines."""
    if triton is None:
        return []
    from triton.runtime.jit import JITFunction

    found: dict[int, JITFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron_lorafusion.ops."):
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                found[id(value)] = value
    return list(found.values())


def warm_up_kernels(device: torch.device | None) -> int:
    """Compute Triton's process key and each of our functions' key and binder.

    Args:
        device: the CUDA device the kernels will launch on, with its index (a binder is per
            device), or None for the keys alone.

    Returns:
        How many Triton functions were prepared.
    """
    from triton.runtime.cache import triton_key

    if device is not None:
        torch.cuda.set_device(device)  # the current device is per thread
    triton_key()  # cached for the process
    functions = jit_functions()
    for fn in functions:
        fn.cache_key  # noqa: B018 - a property: the syntax tree's walk, cached on fn
        caches = getattr(fn, "device_caches", None)  # Triton >= 3.2: binders per device
        if device is not None and caches is not None:
            caches[device.index]
    return len(functions)


def start_kernel_warmup(device: torch.device) -> threading.Thread | None:
    """`warm_up_kernels` on a daemon thread; None where no Triton kernel will launch.

    Join the thread before the first launch. A failure (e.g. a Triton whose internals moved)
    is logged and costs nothing but the warm-up.
    """
    if device.type != "cuda" or triton is None or interpreter_enabled():
        return None
    if device.index is None:  # the caller's current device, which the thread does not share
        device = torch.device("cuda", torch.cuda.current_device())

    def warm() -> None:
        try:
            warm_up_kernels(device)
        except Exception as error:  # an optimization only: training goes on without it
            logger.warning("Triton's kernels were not prepared ahead: %r", error)

    thread = threading.Thread(target=warm, name="lorafusion-kernel-warmup", daemon=True)
    thread.start()
    return thread
