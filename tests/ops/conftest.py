"""Fixtures of the ops tests: on a machine without CUDA, Triton kernels run in the interpreter.

Triton decides between compiled and interpreted kernels when ``@triton.jit`` runs (at import),
so when another test package imported Triton first, the jit modules (Triton's own helpers, then
ours) are reloaded here with ``TRITON_INTERPRET=1``. `importlib.reload` re-executes a module in
place, so functions imported earlier see the interpreted kernels. The variable is then restored
(subprocesses started by later test packages must not inherit it) and set again only around
each test of this folder. Setting it in ``tests/conftest.py`` before anything imports Triton
would make these reloads unnecessary.
"""

import importlib
import os

import pytest
import torch

from megatron_lorafusion.ops import AdapterLayout

_KERNEL_MODULES = (  # dependency order: helpers first
    "megatron_lorafusion.ops._utils",
    "megatron_lorafusion.ops.lora_dropout",
    "megatron_lorafusion.ops.lora_shrink",
    "megatron_lorafusion.ops.lora_expand",
    "megatron_lorafusion.ops.lora_wgrad",
    "megatron_lorafusion.ops.lora_up_bwd",
    "megatron_lorafusion.ops.lora_gemm",
    "megatron_lorafusion.ops.fused_lora_linear",
    "megatron_lorafusion.ops.adapter_adamw",
    "megatron_lorafusion.ops.linear_cross_entropy",
    "megatron_lorafusion.ops.rms_norm",
    "megatron_lorafusion.ops.swiglu",
    "megatron_lorafusion.ops.rope",
)

# triton.language's own @jit helpers (tl.zeros, tl.max, tl.cdiv, ...), re-made in interpreter
# mode and re-exported by reloading the package.
_TRITON_MODULES = ("triton.language.standard", "triton.language.random", "triton.language")

_INTERPRET = not torch.cuda.is_available()

if _INTERPRET and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _name in _TRITON_MODULES + _KERNEL_MODULES:
            importlib.reload(importlib.import_module(_name))
    finally:
        del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    """Keep ``TRITON_INTERPRET=1`` set while a test of this folder runs without CUDA."""
    if _INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """Where the kernels under test run: CUDA when present, else the CPU interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _make_layout(counts, device, seed=0):
    adapters = [a for a, n in enumerate(counts) if n > 0]
    lengths = [n for n in counts if n > 0]
    return AdapterLayout.from_samples(adapters, lengths, len(counts), device, dropout_seed=seed)


def _make_lora(out, hidden, ranks, dtype, device, generator):
    rank, adapters = max(ranks), len(ranks)
    lora_a = torch.randn(adapters, rank, hidden, generator=generator) / hidden**0.5
    lora_b = torch.randn(adapters, out, rank, generator=generator) / rank**0.5
    for a, r in enumerate(ranks):
        lora_a[a, r:] = 0
        lora_b[a, :, r:] = 0
    return lora_a.to(device, dtype), lora_b.to(device, dtype)


@pytest.fixture
def make_layout():
    """``make_layout(counts, device, seed=0)``: one sample per adapter of ``counts[a]`` tokens."""
    return _make_layout


@pytest.fixture
def make_lora():
    """``make_lora(N, H, ranks, dtype, device, generator)``: packed A (A,R,H), B (A,N,R),
    zero beyond each adapter's rank."""
    return _make_lora
