"""`swiglu` (``silu(gate) · up`` of ``[gate | up]``) against `swiglu_ref` (Megatron's GLU).

CPU: Triton interpreter in fp32 and fp16 (elementwise: differences are roundings; the
reference rounds twice in fp16, the kernel once). GPU: bf16 at the Llama-3-8B width.
"""

import pytest
import torch

from megatron_lorafusion.ops import swiglu, swiglu_ref

# dtype -> (atol, rtol) of output and d[gate | up].
TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _check(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(shape, generator=gen)).to(device, dtype)
    dout = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(device, dtype)
    outs = []
    for fn in (swiglu, swiglu_ref):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(dout)
        outs.append((y.detach(), xi.grad))
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
def test_swiglu_matches_reference(shape, dtype, device):
    _check(shape, dtype, device)


def test_swiglu_refuses_odd_width(device):
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.randn(4, 7, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 1, 2 * 14336), (999, 1, 2 * 1000)])
def test_swiglu_bf16_matches_reference_on_gpu(shape):
    _check(shape, torch.bfloat16, "cuda")
