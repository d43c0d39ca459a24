"""`linear_cross_entropy` (chunked output layer + CE) against `linear_cross_entropy_ref`.

CPU: Triton interpreter for the row kernel, torch matmuls for the GEMMs (fp32 and fp16), so
differences are summation order and the rounding of the fp16 gradient of the logits. GPU:
bf16 at the Llama-3 vocabulary (TF32-free: the GEMMs are cuBLAS in bf16). With an `Fp8Weight`
the GEMMs are torch's scaled matmul on both (CPU and GPU) and the quantizer Triton's, against
the fake-quantized reference.
"""

import pytest
import torch

from megatron_lorafusion.ops import (
    Fp8Weight,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    quantize_weight,
)
from megatron_lorafusion.ops.fp8_quant import empty_quantized
from megatron_lorafusion.ops.linear_cross_entropy import _default_chunk_rows, cross_entropy_fwd

# dtype -> (atol, rtol) of loss and dX against the full-logits reference.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _inputs(tokens, hidden, vocab, dtype, device, ignored=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.randperm(tokens, generator=gen)[:ignored]] = -100
    grad = torch.randn(tokens, generator=gen)
    grad[:3] = 0.0  # masked-out tokens
    return x, w, labels.to(device), grad.to(device)


def _loss_and_grad(fn, x, w, labels, grad, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    loss = fn(x, w, labels, **kwargs)
    loss.backward(grad)
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "chunk_rows", "ignored"),
    [(64, 32, 128, 16, 0), (37, 24, 203, 10, 5), (5, 16, 70, None, 2)],
    ids=["round", "ragged", "one-chunk"],
)
def test_linear_cross_entropy_matches_reference(
    tokens, hidden, vocab, chunk_rows, ignored, dtype, device
):
    x, w, labels, grad = _inputs(tokens, hidden, vocab, dtype, device, ignored)
    loss, dx = _loss_and_grad(linear_cross_entropy, x, w, labels, grad, chunk_rows=chunk_rows)
    want_loss, want_dx = _loss_and_grad(linear_cross_entropy_ref, x, w, labels, grad)
    atol, rtol = TOL[dtype]
    assert loss.dtype == torch.float32
    assert loss.shape == (tokens,)
    torch.testing.assert_close(loss, want_loss, atol=atol, rtol=rtol, msg="loss")
    torch.testing.assert_close(dx.float(), want_dx.float(), atol=atol, rtol=rtol, msg="dX")
    assert torch.all(loss[labels == -100] == 0), "ignored tokens must have zero loss"


def test_linear_cross_entropy_without_grad_skips_gradient(device):
    x, w, labels, _ = _inputs(20, 16, 50, torch.float32, device)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, labels, chunk_rows=8)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(x, w, labels), atol=1e-5, rtol=1e-5)


def test_linear_cross_entropy_refuses_bad_inputs(device):
    x, w, labels, _ = _inputs(8, 16, 50, torch.float32, device)
    with pytest.raises(ValueError, match="weight has shape"):
        linear_cross_entropy(x, w[:, :8].contiguous(), labels)
    with pytest.raises(ValueError, match="labels has dtype"):
        linear_cross_entropy(x, w, labels.int())
    with pytest.raises(NotImplementedError, match="freeze weight"):
        linear_cross_entropy(x, w.clone().requires_grad_(True), labels)


def test_default_chunk_rows_bounds_chunk_memory():
    assert _default_chunk_rows(128256) == 1024
    assert _default_chunk_rows(260) == 8192
    assert _default_chunk_rows(10**9) == 16


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "hidden", "vocab"), [(8192, 4096, 128256), (3001, 1024, 32000)])
def test_linear_cross_entropy_bf16_matches_reference_on_gpu(tokens, hidden, vocab):
    x, w, labels, grad = _inputs(tokens, hidden, vocab, torch.bfloat16, "cuda", ignored=100)
    loss, dx = _loss_and_grad(linear_cross_entropy, x, w, labels, grad)
    want_loss, want_dx = _loss_and_grad(linear_cross_entropy_ref, x, w, labels, grad)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(loss, want_loss, atol=atol, rtol=rtol, msg="loss")
    torch.testing.assert_close(dx.float(), want_dx.float(), atol=atol, rtol=rtol, msg="dX")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_weight_matches_the_fake_quantized_reference(dtype, device):
    """Loss and dX of an `Fp8Weight` against `fp8_linear_ref`'s logits: with a unit upstream
    gradient both quantize the same ``softmax − onehot`` rows (dX to bf16 rounding); with any
    other the reference quantizes ``g_t·(softmax − onehot)``, a rounding apart per element.
    fp32 hidden states (``train.precision: fp32``, the default) get fp32 logits."""
    x, w, labels, grad = _inputs(48, 32, 256, dtype, device, ignored=4)
    weight = quantize_weight(w, transposed=True)
    ones = torch.ones_like(grad)
    loss, dx = _loss_and_grad(linear_cross_entropy, x, weight, labels, ones, chunk_rows=16)
    want_loss, want_dx = _loss_and_grad(linear_cross_entropy_ref, x, weight, labels, ones)
    torch.testing.assert_close(loss, want_loss, atol=2e-2, rtol=2e-2, msg="loss")
    torch.testing.assert_close(dx.float(), want_dx.float(), atol=2e-2, rtol=2e-2, msg="dX")
    assert torch.all(dx[labels == -100] == 0), "ignored tokens get no gradient"
    _, dx = _loss_and_grad(linear_cross_entropy, x, weight, labels, grad, chunk_rows=16)
    _, want_dx = _loss_and_grad(linear_cross_entropy_ref, x, weight, labels, grad)
    assert _relative(dx, want_dx) < 0.05, _relative(dx, want_dx)
    # The FP8 GEMMs are not the bf16 ones: the quantized weight moves the loss measurably.
    plain = linear_cross_entropy_ref(x, w, labels)
    assert not torch.allclose(want_loss, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_loss_kernel_quantizes_the_gradient_it_would_write(dtype, assert_quantized, device):
    """The FP8 path's loss kernel stores the quantization of ``softmax − onehot`` times the
    column scales bit for bit as `quantize_rows` of the written gradient would, without writing
    the gradient over the logits; the loss is the same."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 9, 200  # vocab: several column blocks, the last one partial
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    labels[2] = -100
    col_scale = torch.exp2(torch.randint(-3, 4, (vocab,), generator=gen).float()).to(device)
    written, loss = logits.clone(), torch.empty(rows, device=device)
    cross_entropy_fwd(written, labels, loss, -100, write_grad=True)
    kept, got_loss = logits.clone(), torch.empty(rows, device=device)
    q, scale = empty_quantized(rows, vocab, torch.device(device))
    cross_entropy_fwd(
        kept, labels, got_loss, -100, write_grad=True, quantized=(col_scale, q, scale)
    )
    assert torch.equal(got_loss, loss)
    assert torch.equal(kept, logits), "the logits are left as they are"
    assert_quantized(q, scale, written, col_scale=col_scale)
    assert not q[2].float().any(), "an ignored row quantizes to zeros"


def test_fp8_weight_without_transposed_copy_gives_the_same_gradient(device):
    x, w, labels, grad = _inputs(24, 32, 64, torch.bfloat16, device)
    kept = quantize_weight(w, transposed=True)
    dropped = Fp8Weight(kept.data, kept.scale)
    want = _loss_and_grad(linear_cross_entropy, x, kept, labels, grad, chunk_rows=8)
    got = _loss_and_grad(linear_cross_entropy, x, dropped, labels, grad, chunk_rows=8)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fp8_weight_refuses_what_its_gemms_cannot_take(device):
    x, w, labels, _ = _inputs(8, 32, 64, torch.bfloat16, device)
    weight = quantize_weight(w)
    with pytest.raises(ValueError, match=r"V and H multiples of 16.*\(56, 32\)"):
        linear_cross_entropy(x, quantize_weight(w[:56].contiguous()), labels)
    with pytest.raises(ValueError, match="weight.scale has shape"):
        linear_cross_entropy(x, Fp8Weight(weight.data, weight.scale[:8]), labels)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "hidden", "vocab"), [(8192, 4096, 128256), (3001, 1024, 32000)])
def test_fp8_weight_matches_the_fake_quantized_reference_on_gpu(tokens, hidden, vocab):
    x, w, labels, _ = _inputs(tokens, hidden, vocab, torch.bfloat16, "cuda", ignored=100)
    weight = quantize_weight(w, transposed=True)
    ones = torch.ones(tokens, device="cuda")
    loss, dx = _loss_and_grad(linear_cross_entropy, x, weight, labels, ones)
    want_loss, want_dx = _loss_and_grad(linear_cross_entropy_ref, x, weight, labels, ones)
    torch.testing.assert_close(loss, want_loss, atol=2e-2, rtol=2e-2, msg="loss")
    assert _relative(dx, want_dx) < 1e-2, _relative(dx, want_dx)


@pytest.mark.gpu
def test_linear_cross_entropy_peak_memory_stays_below_full_logits():
    tokens, hidden, vocab = 8192, 4096, 128256
    x, w, labels, grad = _inputs(tokens, hidden, vocab, torch.bfloat16, "cuda")
    x.requires_grad_(True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    linear_cross_entropy(x, w, labels).backward(grad)
    extra = torch.cuda.max_memory_allocated() - base
    full_fp32_logits = tokens * vocab * 4
    assert extra < full_fp32_logits / 4, f"peak extra {extra / 2**30:.2f} GiB"
