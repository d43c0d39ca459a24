"""`geglu` (``gelu_tanh(gate) · up`` of ``[gate | up]``) against `geglu_ref` (Gemma's MLP).

CPU: Triton interpreter in fp32 and fp16. GPU: bf16 at the Gemma-3-12B width. The reference
runs in fp64 and is rounded once to the dtype: torch's fp32 tanh-GELU backward loses up to
8e-6 absolute on gates near -5 (a cancellation the kernel avoids), more than fp32 roundings.
"""

import pytest
import torch

from megatron_lorafusion.ops import geglu, geglu_ref

# dtype -> (atol, rtol) of output and d[gate | up].
TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _check(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)  # gates far past ±3 too
    dout = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(device, dtype)
    outs = []
    for fn, precision in ((geglu, dtype), (geglu_ref, torch.float64)):
        xi = x.to(precision, copy=True).requires_grad_(True)
        y = fn(xi)
        y.backward(dout.to(precision))
        outs.append((y.detach().to(dtype), xi.grad.to(dtype)))
    (y, dx), (want_y, want_dx) = outs
    atol, rtol = TOL[dtype]
    assert y.shape == dout.shape
    torch.testing.assert_close(y.float(), want_y.float(), atol=atol, rtol=rtol, msg="y")
    torch.testing.assert_close(dx.float(), want_dx.float(), atol=atol, rtol=rtol, msg="dX")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [(16, 128), (7, 1, 2 * 45), (3, 2, 2 * 33)],
    ids=["round", "ragged-sbh", "ragged-batch"],
)
def test_geglu_matches_reference(shape, dtype, device):
    _check(shape, dtype, device)


def test_geglu_refuses_odd_width(device):
    with pytest.raises(ValueError, match="even last dim"):
        geglu(torch.randn(4, 7, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 1, 2 * 15360), (999, 1, 2 * 1000)])
def test_geglu_bf16_matches_reference_on_gpu(shape):
    _check(shape, torch.bfloat16, "cuda")
