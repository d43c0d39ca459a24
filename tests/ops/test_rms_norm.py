"""`rms_norm` (frozen-weight RMSNorm, forward and dX) against `rms_norm_ref` (``F.rms_norm``).

CPU: Triton interpreter in fp32 and fp16 (no dots: differences are summation order and one
rounding of fp16 outputs). GPU: bf16 at the Llama-3-8B width.
"""

import pytest
import torch

from megatron_lorafusion.ops import rms_norm, rms_norm_ref

# dtype -> (atol, rtol) of output and dX.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _check(shape, dtype, device, eps=1e-5):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    w = (1 + torch.randn(shape[-1], generator=gen) / 4).to(device, dtype)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    outs = []
    for fn in (rms_norm, rms_norm_ref):
        xi = x.clone().requires_grad_(True)
        y = fn(xi, w, eps)
        y.backward(dy)
        outs.append((y.detach(), xi.grad))
    (y, dx), (want_y, want_dx) = outs
    atol, rtol = TOL[dtype]
    assert y.shape == x.shape
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), want_y.float(), atol=atol, rtol=rtol, msg="y")
    torch.testing.assert_close(dx.float(), want_dx.float(), atol=atol, rtol=rtol, msg="dX")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape", [(32, 64), (13, 1, 40), (3, 2, 100)], ids=["round", "ragged-sbh", "ragged-batch"]
)
def test_rms_norm_matches_reference(shape, dtype, device):
    _check(shape, dtype, device)


def test_rms_norm_refuses_trainable_weight_and_bad_shapes(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(NotImplementedError, match="freeze weight"):
        rms_norm(x, torch.ones(8, device=device, requires_grad=True))
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), torch.ones(4, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 1, 4096), (1000, 1, 5120)])
def test_rms_norm_bf16_matches_reference_on_gpu(shape):
    _check(shape, torch.bfloat16, "cuda")
