"""`swiglu_fp8`: SwiGLU that quantizes for the FP8 linears around it, and the hand-over.

The kernels must give `swiglu`'s values and `quantize_rows`' e4m3 rows bit for bit (CPU: the
interpreter, whose e4m3 bytes are the kernels' grid values; GPU: the hardware cast). An MLP of
FP8 linears (fc1 → SwiGLU → fc2) must compute exactly what it computes without the hand-over,
with two quantizations fewer per microbatch.
"""

import sys

import pytest
import torch

from megatron_lorafusion.ops import (
    fused_lora_linear,
    grad_col_scale,
    quantize_rows_ref,
    quantize_weight,
    swiglu,
    swiglu_fp8,
)
from megatron_lorafusion.ops.fp8_quant import (
    attach_quantized,
    attach_row_maxima,
    take_quantized,
    take_row_maxima,
)
from megatron_lorafusion.ops.swiglu import swiglu_bwd, swiglu_fp8_bwd, swiglu_fp8_fwd, swiglu_fwd


def _inputs(tokens, width, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(tokens, 2 * width, generator=gen)).to(device, dtype)
    dout = torch.randn(tokens, width, generator=gen).to(device, dtype)
    col_scale = torch.exp2(torch.randint(-9, -3, (2 * width,), generator=gen).float()).to(device)
    return x, dout, col_scale


def _quantized_from_maxima(dx, parts, col_scale):
    """The backward's hand-over as fc1's plain FP8 linear takes it (one read of ``dx``)."""
    attach_row_maxima(dx, parts, col_scale)
    return take_quantized(dx, col_scale)


def _check_kernels(tokens, width, dtype, device, assert_quantized):
    """Both kernels write `swiglu`'s values and, with the backward's row maxima, `quantize_rows`'
    e4m3 rows, bit for bit."""
    x, dout, col_scale = _inputs(tokens, width, dtype, device)
    out, q, scale = swiglu_fp8_fwd(x)
    assert torch.equal(out, swiglu_fwd(x))
    assert_quantized(q, scale, out)
    dx, parts = swiglu_fp8_bwd(dout, x, col_scale)
    assert torch.equal(dx, swiglu_bwd(dout, x))
    want_amax = (dx.float() * col_scale).abs().amax(1)
    assert torch.equal(parts.amax(1), want_amax), "the maxima of the rows' tiles"
    assert_quantized(*_quantized_from_maxima(dx, parts, col_scale), dx, col_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "width"), [(7, 45), (4, 64)], ids=["ragged", "round"])
def test_swiglu_fp8_kernels_write_swiglu_and_its_quantization(
    tokens, width, dtype, device, assert_quantized
):
    _check_kernels(tokens, width, dtype, device, assert_quantized)


def test_swiglu_fp8_quantizes_zero_rows_and_huge_values(device, assert_quantized):
    x, dout, col_scale = _inputs(4, 40, torch.float32, device)
    x[1] = 0.0  # an all-zero row: the floor scale, zeros
    x[2, :40] = 30.0  # silu(30) · up: values far above 448 before scaling
    x[2, 40:] = 1e4
    out, q, scale = swiglu_fp8_fwd(x)
    assert_quantized(q, scale, out)
    assert torch.all(q[1].float() == 0)
    dx, parts = swiglu_fp8_bwd(dout, x, col_scale)
    assert_quantized(*_quantized_from_maxima(dx, parts, col_scale), dx, col_scale)


def test_take_quantized_only_returns_the_very_values_once(device):
    x = torch.randn(6, 32, device=device)
    q, scale = quantize_rows_ref(x)
    col = torch.ones(32, device=device)
    attach_quantized(x, q, scale)
    assert take_quantized(x, col) is None, "another col_scale"
    assert take_quantized(x[:, :16], None) is None, "a part of the columns"
    assert take_quantized(x[:3], None) is None, "a part of the rows"
    assert take_quantized(x.view(torch.int32), None) is None, "another dtype"
    assert take_quantized(x.view(3, 2, 32).view(6, 32)) == (q, scale), "a view of the whole"
    assert take_quantized(x) is None, "taken once"
    attach_quantized(x.view(2, 3, 32), q, scale, col)  # attached to the storage's owner
    x.add_(1.0)
    assert take_quantized(x, col) is None, "written since"


def test_row_maxima_are_taken_once_and_quantize_on_demand(device, assert_quantized):
    x = torch.randn(6, 32, device=device)
    col = torch.rand(32, device=device) + 0.5
    parts = (x * col).abs().view(6, 4, 8).amax(2)  # (6, 4): maxima of 8-column blocks
    attach_row_maxima(x, parts, col)
    assert take_row_maxima(x, None) is None, "another col_scale"
    assert take_row_maxima(x[:3], col) is None, "a part of the rows"
    assert take_row_maxima(x, col) is parts
    assert take_row_maxima(x, col) is None, "taken once"
    assert take_quantized(x, col) is None, "taken once"
    attach_row_maxima(x, parts, col)
    assert_quantized(*take_quantized(x, col), x, col)  # quantized from the maxima
    q, scale = torch.zeros(6, 32, device=device), torch.ones(6, device=device)
    attach_quantized(x, q, scale, col)
    assert take_row_maxima(x, col) is None, "a quantization already done stays for the linear"
    assert take_quantized(x, col) == (q, scale)


def test_grad_col_scale_only_for_all_of_the_marked_values(device):
    from megatron_lorafusion.ops.fp8_quant import mark_grad_col_scale

    y = torch.randn(6, 32, device=device)
    col = torch.ones(32, device=device)
    mark_grad_col_scale(y, col)
    assert grad_col_scale(y.view(2, 3, 32)) is col
    assert grad_col_scale(y[:3]) is None, "its gradient would reach the linear as a copy"
    assert grad_col_scale(y.t()) is None


def test_swiglu_fp8_attaches_nothing_in_inference_mode(device):
    x, _, _ = _inputs(4, 40, torch.float32, device)
    with torch.inference_mode():
        out = swiglu_fp8(x)
    assert torch.equal(out, swiglu(x))
    assert take_quantized(out) is None, "inference tensors keep no version to check"


def _mlp_grads(activation, leaves, weights, layout, grad_out, gemm):
    """fc1 → activation → fc2 of fused FP8 LoRA linears: output and every leaf's gradient."""
    x, a1, b1, a2, b2 = (t.detach().clone().requires_grad_() for t in leaves)
    fc1, fc2 = weights
    common = dict(layout=layout, gemm=gemm)
    h = fused_lora_linear(x, fc1, None, a1, b1, [2.0, 0.5], [0.1, 0.2], layer_seed=1, **common)
    y = fused_lora_linear(
        activation(h), fc2, None, a2, b2, [1.0, 3.0], [0.0, 0.3], layer_seed=2, **common
    )
    y.backward(grad_out)
    return [y.detach()] + [t.grad for t in (x, a1, b1, a2, b2)]


@pytest.mark.parametrize("gemm", ["scaled_mm", "triton"])
def test_fp8_mlp_takes_swiglus_quantization_and_keeps_every_bit(
    gemm, device, make_layout, make_lora, quantize_launches, skip_without_cpu_scaled_mm, monkeypatch
):
    skip_without_cpu_scaled_mm(device)
    hidden, width, dtype = 32, 48, torch.float32
    gen = torch.Generator().manual_seed(3)
    layout = make_layout([21, 13], device, seed=5)
    x = torch.randn(layout.num_tokens, hidden, generator=gen).to(device, dtype)
    fc1 = quantize_weight((torch.randn(2 * width, hidden, generator=gen) / 6).to(device))
    fc2 = quantize_weight((torch.randn(hidden, width, generator=gen) / 7).to(device))
    a1, b1 = make_lora(2 * width, hidden, [8, 4], dtype, device, gen)
    a2, b2 = make_lora(hidden, width, [4, 8], dtype, device, gen)
    grad_out = torch.randn(layout.num_tokens, hidden, generator=gen).to(device, dtype)
    calls = quantize_launches
    module = sys.modules["megatron_lorafusion.ops.fused_lora_linear"]
    fused, fused_calls = module.lora_up_bwd_quantized, []
    monkeypatch.setattr(
        module, "lora_up_bwd_quantized", lambda *a, **k: fused_calls.append(1) or fused(*a, **k)
    )
    args = ((x, a1, b1, a2, b2), (fc1, fc2), layout, grad_out, gemm)
    want = _mlp_grads(swiglu, *args)
    assert len(calls) == 4, "without the hand-over: X and dY of both linears"
    assert not fused_calls
    calls.clear()
    got = _mlp_grads(lambda h: swiglu_fp8(h, grad_col_scale(h)), *args)
    assert len(calls) == 2, "fc2's X and fc1's dY come from SwiGLU's kernels"
    assert len(fused_calls) == 1, "fc1's LoRA backward quantized its dY from SwiGLU's maxima"
    for name, g, w in zip(["y", "dx", "dA1", "dB1", "dA2", "dB2"], got, want, strict=True):
        assert torch.equal(g, w), name


@pytest.mark.gpu
@pytest.mark.parametrize("width", [14336, 18944])  # Llama-3.1-8B's; Qwen2.5-7B's (ragged tiles)
def test_swiglu_fp8_bf16_at_8b_widths_on_gpu(width, assert_quantized):
    from megatron_lorafusion.ops import fp8_problem

    if fp8_problem(torch.device("cuda")) is not None:
        pytest.skip(fp8_problem(torch.device("cuda")))
    _check_kernels(1000, width, torch.bfloat16, "cuda", assert_quantized)


@pytest.mark.gpu
def test_fp8_floor_mlp_takes_swiglus_quantization_on_gpu(quantize_launches):
    """The frozen floor's MLP (`fp8_linear`, no adapters) keeps every bit with the hand-over."""
    from megatron_lorafusion.ops import fp8_linear, fp8_problem

    if fp8_problem(torch.device("cuda")) is not None:
        pytest.skip(fp8_problem(torch.device("cuda")))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=gen).to("cuda", torch.bfloat16)
    fc1 = quantize_weight((torch.randn(1024, 256, generator=gen) / 16).cuda(), transposed=True)
    fc2 = quantize_weight((torch.randn(256, 512, generator=gen) / 22).cuda(), transposed=True)
    grad_out = torch.randn(512, 256, generator=gen).to("cuda", torch.bfloat16)
    calls = quantize_launches
    results = []
    for activation in (swiglu, lambda h: swiglu_fp8(h, grad_col_scale(h))):
        leaf = x.clone().requires_grad_()
        y = fp8_linear(activation(fp8_linear(leaf, fc1)), fc2)
        y.backward(grad_out)
        results.append((y.detach(), leaf.grad, len(calls)))
        calls.clear()
    (want_y, want_dx, want_count), (y, dx, count) = results
    assert (want_count, count) == (4, 2), "fc2's X and fc1's dY come from SwiGLU's kernels"
    assert torch.equal(y, want_y), f"y differs by {(y - want_y).abs().max()}"
    assert torch.equal(dx, want_dx), f"dx differs by {(dx - want_dx).abs().max()}"
