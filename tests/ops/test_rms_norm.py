"""`rms_norm` / `rms_norm_residual`: a frozen-weight RMSNorm, its residual and its quantization.

Forward and the input's gradient against `rms_norm_ref` (fp32 math rounded once, as the
kernels do it), with the residual's gradient joined in the norm's backward; the FP8 output
against `quantize_rows_ref` of the very values, bit for bit (CPU: the interpreter; GPU: the
hardware cast).
"""

import sys

import pytest
import torch

from megatron_lorafusion.ops import (
    fused_lora_linear,
    quantize_weight,
    rms_norm,
    rms_norm_ref,
    rms_norm_residual,
)
from megatron_lorafusion.ops.fp8_quant import take_quantized
from megatron_lorafusion.ops.rms_norm import MAX_WIDTH

TOLERANCES = {  # dtype -> (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
EPS = 1e-5


def _inputs(tokens, width, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(tokens, width, generator=gen)).to(device, dtype)
    weight = (1 + torch.randn(width, generator=gen) / 4).to(device, dtype)
    dy = torch.randn(tokens, width, generator=gen).to(device, dtype)
    dres = torch.randn(tokens, width, generator=gen).to(device, dtype)
    return x, weight, dy, dres


def _ref_grads(x, weight, dy, dres=None):
    """``y`` and ``dx`` of the reference, ``x`` also used as the residual when ``dres``."""
    leaf = x.detach().clone().requires_grad_()
    y = rms_norm_ref(leaf, weight, EPS)
    loss = (y.float() * dy.float()).sum()
    if dres is not None:
        loss = loss + (leaf.float() * dres.float()).sum()
    loss.backward()
    return y.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "width"), [(7, 48), (4, 64)], ids=["ragged", "round"])
def test_rms_norm_matches_reference_forward_and_backward(tokens, width, dtype, device):
    x, weight, dy, _ = _inputs(tokens, width, dtype, device)
    atol, rtol = TOLERANCES[dtype]
    want_y, want_dx = _ref_grads(x, weight, dy)
    leaf = x.clone().requires_grad_()
    y = rms_norm(leaf.view(1, tokens, width), weight, EPS)  # any (..., H)
    assert y.shape == (1, tokens, width)
    y.backward(dy.view(1, tokens, width))
    torch.testing.assert_close(y.view(tokens, width), want_y, atol=atol, rtol=rtol, msg="y")
    torch.testing.assert_close(leaf.grad, want_dx, atol=atol, rtol=rtol, msg="dx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_residual_joins_both_gradients_in_its_backward(dtype, device, monkeypatch):
    module = sys.modules["megatron_lorafusion.ops.rms_norm"]
    launches, launch = [], module.rms_norm_bwd
    monkeypatch.setattr(
        module, "rms_norm_bwd", lambda *a: launches.append(a[4] is not None) or launch(*a)
    )
    x, weight, dy, dres = _inputs(9, 40, dtype, device, seed=1)
    atol, rtol = TOLERANCES[dtype]
    want_y, want_dx = _ref_grads(x, weight, dy, dres)
    leaf = x.clone().requires_grad_()
    h = leaf * 1  # a non-leaf input, as a layer's hidden states are
    y, residual = rms_norm_residual(h, weight, EPS)
    assert torch.equal(residual, x)
    torch.autograd.backward([y, residual], [dy, dres])
    assert launches == [True], "one backward launch, given the residual's gradient"
    torch.testing.assert_close(y, want_y, atol=atol, rtol=rtol, msg="y")
    torch.testing.assert_close(leaf.grad, want_dx, atol=atol, rtol=rtol, msg="dx")


def test_rms_norm_residual_passes_either_gradient_alone(device):
    x, weight, dy, dres = _inputs(5, 32, torch.float32, device, seed=2)
    atol, rtol = TOLERANCES[torch.float32]
    leaf = x.clone().requires_grad_()
    y, residual = rms_norm_residual(leaf * 1, weight, EPS)
    residual.backward(dres)
    assert torch.equal(leaf.grad, dres), "the residual alone: its gradient, as is"
    leaf.grad = None
    y, residual = rms_norm_residual(leaf * 1, weight, EPS)
    y.backward(dy)
    torch.testing.assert_close(leaf.grad, _ref_grads(x, weight, dy)[1], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_quantize_writes_quantize_rows_of_its_output(dtype, device, assert_quantized):
    x, weight, _, _ = _inputs(7, 48, dtype, device, seed=3)
    x[2] = 0.0  # an all-zero row: the floor scale, zeros
    x[4] *= 1e3  # large rows: the same output, normalised
    y, residual = rms_norm_residual(x, weight, EPS, quantize=True)
    assert torch.equal(y, rms_norm(x, weight, EPS)), "quantizing leaves the values as they are"
    assert_quantized(*take_quantized(y), y)
    assert take_quantized(y) is None, "taken once"
    assert torch.equal(residual, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_residual_quantizes_its_gradient_with_the_linears_scales(
    dtype, device, assert_quantized
):
    x, weight, dy, dres = _inputs(7, 48, dtype, device, seed=7)
    col_scale = torch.exp2(torch.randint(-9, -3, (48,), generator=torch.Generator())).float()
    col_scale = col_scale.to(device)
    dres[3] = 0.0
    dy[3] = 0.0  # an all-zero gradient row: the floor scale, zeros
    h = x.clone().requires_grad_() * 1
    y, residual = rms_norm_residual(h, weight, EPS, grad_col_scale=col_scale)
    (dx,) = torch.autograd.grad([y, residual], [h], [dy, dres])
    assert take_quantized(dx) is None, "only for the linear with these scales"
    assert_quantized(*take_quantized(dx, col_scale), dx, col_scale)
    with pytest.raises(ValueError, match="grad_col_scale has shape"):
        rms_norm_residual(x, weight, EPS, grad_col_scale=col_scale[:8])


def test_rms_norm_rejects_what_its_kernels_do_not_take(device):
    x, weight, _, _ = _inputs(4, 32, torch.float32, device)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, weight[:16], EPS)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rms_norm(x.t(), weight[:4], EPS)
    wide = torch.zeros(1, MAX_WIDTH + 8, device=device)
    with pytest.raises(NotImplementedError, match=f"at most {MAX_WIDTH} values, got H="):
        rms_norm(wide, torch.ones(MAX_WIDTH + 8, device=device), EPS)


@pytest.mark.parametrize("gemm", ["scaled_mm", "triton"])
def test_fp8_linear_takes_the_norms_quantization_and_keeps_every_bit(
    gemm, device, make_layout, make_lora, quantize_launches, skip_without_cpu_scaled_mm
):
    skip_without_cpu_scaled_mm(device)
    hidden, out, dtype = 32, 48, torch.float32
    gen = torch.Generator().manual_seed(4)
    layout = make_layout([11, 6], device, seed=5)
    x, weight, _, _ = _inputs(layout.num_tokens, hidden, dtype, device, seed=6)
    linear = quantize_weight((torch.randn(out, hidden, generator=gen) / 6).to(device))
    lora_a, lora_b = make_lora(out, hidden, [8, 4], dtype, device, gen)
    grad_out = torch.randn(layout.num_tokens, out, generator=gen).to(device, dtype)
    calls = quantize_launches
    results = []
    for quantize in (False, True):
        leaf = x.clone().requires_grad_()
        y, _ = rms_norm_residual(leaf, weight, EPS, quantize=quantize)
        z = fused_lora_linear(
            y, linear, None, lora_a, lora_b, [2.0, 0.5], [0.1, 0.0], layout=layout, gemm=gemm
        )
        z.backward(grad_out)
        results.append((z.detach(), leaf.grad, len(calls)))
        calls.clear()
    (want_z, want_dx, want_count), (z, dx, count) = results
    assert (want_count, count) == (2, 1), "the linear's X comes from the norm's kernel"
    assert torch.equal(z, want_z), f"z differs by {(z - want_z).abs().max()}"
    assert torch.equal(dx, want_dx), f"dx differs by {(dx - want_dx).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4096, 8192, 3840])  # Llama-3.1-8B's, 70B's; Gemma 3 12B's
def test_rms_norm_bf16_at_model_widths_on_gpu(width, assert_quantized):
    x, weight, dy, dres = _inputs(1000, width, torch.bfloat16, "cuda")
    atol, rtol = TOLERANCES[torch.bfloat16]
    want_y, want_dx = _ref_grads(x, weight, dy, dres)
    col_scale = torch.exp2(torch.randint(-9, -3, (width,), generator=torch.Generator()))
    col_scale = col_scale.float().cuda()
    h = x.clone().requires_grad_() * 1
    y, residual = rms_norm_residual(h, weight, EPS, quantize=True, grad_col_scale=col_scale)
    (dx,) = torch.autograd.grad([y, residual], [h], [dy, dres])
    torch.testing.assert_close(y, want_y, atol=atol, rtol=rtol, msg="y")
    torch.testing.assert_close(dx, want_dx, atol=atol, rtol=rtol, msg="dx")
    for values, scales in ((y, None), (dx, col_scale)):
        assert_quantized(*take_quantized(values, scales), values, scales)
