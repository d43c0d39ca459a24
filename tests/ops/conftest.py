"""Fixtures of the ops tests: on a machine without CUDA, Triton kernels run in the interpreter.

The kernel modules are reloaded in interpreter mode (`interpreter_testing.reload_interpreted`)
and ``TRITON_INTERPRET=1`` is set again only around each test of this folder. Setting it in
``tests/conftest.py`` before anything imports Triton would make these reloads unnecessary.
"""

import sys

import pytest
import torch
from interpreter_testing import reload_interpreted

from megatron_lorafusion.ops import AdapterLayout, quantize_rows_ref

_INTERPRET = not torch.cuda.is_available()

if _INTERPRET:
    reload_interpreted()


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


def _skip_without_cpu_scaled_mm(device: str) -> None:
    if device != "cpu":
        return
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"this torch has no CPU torch._scaled_mm ({err})")


@pytest.fixture
def skip_without_cpu_scaled_mm():
    """``skip_without_cpu_scaled_mm(device)``: skip a CPU run of FP8 GEMMs when this torch has
    no CPU ``torch._scaled_mm`` (torch >= 2.6 has it)."""
    return _skip_without_cpu_scaled_mm


def _assert_quantized(q, scale, values, col_scale=None) -> None:
    want_q, want_scale = quantize_rows_ref(values, col_scale=col_scale)
    assert torch.equal(scale, want_scale), f"{(scale != want_scale).sum()} scales differ"
    wrong = q.view(torch.uint8) != want_q.view(torch.uint8)
    assert not wrong.any(), f"{wrong.sum()} e4m3 values differ, rows {wrong.any(1).nonzero()[:5]}"


@pytest.fixture
def assert_quantized():
    """``assert_quantized(q, scale, values, col_scale=None)``: ``(q, scale)`` are
    ``quantize_rows_ref(values, col_scale)``'s e4m3 rows and scales, bit for bit."""
    return _assert_quantized


@pytest.fixture
def quantize_launches(monkeypatch) -> list:
    """A list that grows by one at each `quantize_rows` launch of the FP8 linears."""
    module = sys.modules["megatron_lorafusion.ops.fp8_linear"]
    quantize, calls = module.quantize_rows, []

    def counted(*args, **kwargs):
        calls.append(1)
        return quantize(*args, **kwargs)

    monkeypatch.setattr(module, "quantize_rows", counted)
    return calls
