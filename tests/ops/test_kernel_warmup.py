"""`kernel_warmup`: Triton's per-process keys and binders made ahead of the first launch."""

import sys
import types

import pytest
import torch
import triton.language as tl
from triton.runtime.cache import triton_key
from triton.runtime.jit import JITFunction

from megatron_lorafusion.ops import cast_table, cast_table_ref
from megatron_lorafusion.ops.kernel_warmup import (
    jit_functions,
    start_kernel_warmup,
    warm_up_kernels,
)


def _probe_kernel(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32))


def test_warm_up_finds_the_ops_kernels_and_computes_their_keys(monkeypatch):
    probe = JITFunction(_probe_kernel)  # compiled-mode, whatever the folder's interpreter does
    module = types.ModuleType("megatron_lorafusion.ops._probe")
    module.kernel = probe
    monkeypatch.setitem(sys.modules, module.__name__, module)
    outside = types.ModuleType("elsewhere._probe")  # not ours: left alone
    outside.kernel = JITFunction(_probe_kernel)
    monkeypatch.setitem(sys.modules, outside.__name__, outside)
    triton_key.cache_clear()

    found = jit_functions()
    assert any(fn is probe for fn in found)
    assert not any(fn is outside.kernel for fn in found)
    assert probe.hash is None, "a fresh function has no key yet"

    assert warm_up_kernels(None) == len(found)
    assert probe.hash is not None
    assert len(probe.hash) == 64
    assert outside.kernel.hash is None
    assert triton_key.cache_info().currsize == 1


def test_no_warm_up_thread_where_no_kernel_launches():
    assert start_kernel_warmup(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="binders are made per CUDA device")
def test_warm_up_thread_makes_binders_on_the_device_and_kernels_still_match():
    device = torch.device("cuda", torch.cuda.current_device())
    thread = start_kernel_warmup(torch.device("cuda"))  # no index, as `train` passes it
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    from megatron_lorafusion.ops import packed_factor

    assert device.index in packed_factor._cast_table_kernel.device_caches
    table = torch.randn(3, 1000, device=device)
    torch.testing.assert_close(
        cast_table(table, torch.bfloat16), cast_table_ref(table, torch.bfloat16), atol=0, rtol=0
    )
