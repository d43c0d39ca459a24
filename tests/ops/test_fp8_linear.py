"""The frozen FP8 linear: the fake-quant reference's semantics, the device checks, and (GPU)
the scaled GEMMs against the reference.

Tolerances: the reference's forward is ``(X_q·W_qᵀ)·s_x·s_w`` with fp32 sums, so against the
same formula written out it differs by summation order only (1e-5); against the unquantized
product, e4m3's 3 mantissa bits (steps of 6-12 %, ~2-3 % RMS per operand) leave ~3-5 %.
GPU: bf16 outputs and fast accumulation against the fp32 reference, 1e-2 relative.
"""

import pytest
import torch

from megatron_lorafusion.ops import (
    Fp8Weight,
    fp8_linear,
    fp8_linear_ref,
    fp8_problem,
    quantize_rows_ref,
    quantize_weight,
)
from megatron_lorafusion.ops import _utils as ops_utils
from megatron_lorafusion.ops.fp8_linear import fp8_matmul

FP8_REL_ERR = 0.06  # ||fp8 - exact|| / ||exact||, random normal operands (measured 0.025-0.038)
GPU_REL_ERR = 1e-2  # ||kernel - reference|| / ||reference||, bf16 on the GPU


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _problem(tokens=40, hidden=64, out=48, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(out, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    bias = torch.randn(out, generator=gen).to(device, dtype)
    grad_y = torch.randn(tokens, out, generator=gen).to(device, dtype)
    return x, weight, bias, grad_y


def test_fp8_linear_ref_forward_is_the_dequantized_product():
    x, weight, bias, _ = _problem()
    fp8 = quantize_weight(weight)
    x_q, x_scale = quantize_rows_ref(x)
    want = (x_q.float() * x_scale[:, None]) @ fp8.dequantize().t() + bias
    got = fp8_linear_ref(x, fp8, bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert _rel(got, x @ weight.t() + bias) < FP8_REL_ERR


def test_fp8_linear_ref_backward_quantizes_the_scaled_gradient():
    x, weight, bias, grad_y = _problem(seed=1)
    fp8 = quantize_weight(weight)
    leaf = x.clone().requires_grad_()
    bias_leaf = bias.clone().requires_grad_()
    fp8_linear_ref(leaf, fp8, bias_leaf).backward(grad_y)
    # dX = dY·W = (dY·diag(s_w))·W_q: the channel scales move into dY before it is quantized.
    dy_q, dy_scale = quantize_rows_ref(grad_y * fp8.scale[None, :])
    want = (dy_q.float() * dy_scale[:, None]) @ fp8.data.float()
    torch.testing.assert_close(leaf.grad, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias_leaf.grad, grad_y.sum(0))
    assert _rel(leaf.grad, grad_y @ weight) < FP8_REL_ERR


def test_fp8_linear_on_cpu_is_the_reference():
    x, weight, bias, _ = _problem(seed=2)
    fp8 = quantize_weight(weight)
    assert torch.equal(fp8_linear(x, fp8, bias), fp8_linear_ref(x, fp8, bias))
    with pytest.raises(ValueError, match="e4m3 weight"):
        fp8_linear(x, Fp8Weight(weight, fp8.scale), bias)


def test_fp8_matmul_names_the_alignment():
    a = torch.zeros(8, 24, dtype=torch.float8_e4m3fn)
    b = torch.zeros(16, 24, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_matmul(a, b, torch.ones(8), torch.ones(16), torch.float32)


def test_fp8_problem_refuses_gpus_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(ops_utils, "capability", lambda index: (8, 0))
    problem = fp8_problem(torch.device("cuda", 0))
    assert "FP8 tensor cores" in problem
    assert "A100" in problem
    assert "sm_80" in problem
    assert "base_precision: bf16" in problem
    monkeypatch.setattr(ops_utils, "capability", lambda index: (9, 0))
    assert fp8_problem(torch.device("cuda", 0)) is None
    assert fp8_problem(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("keep_transposed", [False, True])
def test_fp8_linear_kernels_match_reference(keep_transposed):
    if fp8_problem(torch.device("cuda")) is not None:
        pytest.skip(fp8_problem(torch.device("cuda")))
    x, weight, bias, grad_y = _problem(1000, 4096, 1024, seed=3, device="cuda")
    fp8 = quantize_weight(weight, transposed=keep_transposed)
    results = {}
    for name, fn in (("kernel", fp8_linear), ("ref", fp8_linear_ref)):
        leaf = x.bfloat16().requires_grad_()
        y = fn(leaf, fp8, bias.bfloat16())
        y.backward(grad_y.bfloat16())
        results[name] = (y, leaf.grad)
    for i, what in enumerate(("y", "dx")):
        err = _rel(results["kernel"][i], results["ref"][i])
        assert err < GPU_REL_ERR, f"{what}: {err:.2e}"
