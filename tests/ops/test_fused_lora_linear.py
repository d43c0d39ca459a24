"""The fused multi-LoRA linear (both forward GEMMs) against `lora_linear_ref`, forward and
gradients.

On CPU the kernels run in the Triton interpreter (fp32 and fp16 only: bf16 ``tl.dot`` is wrong
there); `tl.dot` is pinned to IEEE for fp32 inputs, so fp32 differences are summation order.
The reference runs in fp32 on the same (upcast) inputs with the fused path's dropout mask.
With an `InputRebuild` the op saves X's sources instead of X and keeps every bit.
"""

import sys

import pytest
import torch

from megatron_lorafusion.ops import (
    fused_dropout_keep_mask,
    fused_lora_linear,
    lora_linear_ref,
)
from megatron_lorafusion.ops.lora_linear import InputRebuild

# dtype -> (atol, rtol) of fused vs the fp32 reference; outputs and gradients are O(1).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),  # fp16 inputs, intermediates S/dS rounded to fp16
}
BF16_REL_ERR = 1e-2  # GPU only: ||fused - ref32|| / ||ref32|| for bf16 inputs

# name -> (tokens per adapter, ranks, scalings, dropouts, H, N)
CASES = {
    "round": ([32, 32], [16, 16], [2.0, 0.5], [0.1, 0.1], 64, 32),
    "ragged": ([37, 0, 50, 13], [8, 3, 5, 1], [0.5, 2.0, 1.0, 3.0], [0.1, 0.2, 0.0, 0.3], 48, 40),
    "single": ([45], [4], [1.5], [0.25], 40, 24),
    "no_dropout": ([7, 20, 9], [2, 6, 4], [1.0, 2.0, 0.5], [0.0, 0.0, 0.0], 24, 56),
    "rank_200": ([9, 5], [200, 37], [0.25, 1.0], [0.1, 0.0], 24, 16),
    "many_adapters": (
        [(3 * a) % 7 for a in range(64)],
        [1 + a % 9 for a in range(64)],
        [0.5 + a % 3 for a in range(64)],
        [0.1 * (a % 3) for a in range(64)],
        16,
        24,
    ),
}
GEMMS = ["cublas", "triton"]


def _inputs(case, dtype, device, make_layout, make_lora, seed=0):
    counts, ranks, scalings, dropouts, hidden, out = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(counts, device, seed=11)
    tokens = layout.num_tokens
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(out, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    bias = torch.randn(out, generator=gen).to(device, dtype)
    lora_a, lora_b = make_lora(out, hidden, ranks, dtype, device, gen)
    grad_y = torch.randn(tokens, out, generator=gen).to(device, dtype)
    return layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y


def _grads(fn, x, lora_a, lora_b, grad_y):
    leaves = [t.detach().clone().requires_grad_() for t in (x, lora_a, lora_b)]
    y = fn(*leaves)
    y.backward(grad_y)
    return [y.detach()] + [t.grad for t in leaves]


def _assert_matches_reference(
    x, weight, bias, lora_a, lora_b, scalings, dropouts, layout, keep, grad_y, gemm, label
):
    """Fused output and gradients equal the fp32 reference run with mask ``keep``."""
    got = _grads(
        lambda x_, a_, b_: fused_lora_linear(
            x_, weight, bias, a_, b_, scalings, dropouts, layout, layer_seed=5, gemm=gemm
        ),
        x,
        lora_a,
        lora_b,
        grad_y,
    )
    want = _grads(
        lambda x_, a_, b_: lora_linear_ref(
            x_, weight.float(), bias.float(), a_, b_, scalings, dropouts, layout, keep
        ),
        x.float(),
        lora_a.float(),
        lora_b.float(),
        grad_y.float(),
    )
    atol, rtol = TOL[x.dtype]
    for name, g, w in zip(["y", "dx", "da", "db"], got, want, strict=True):
        torch.testing.assert_close(
            g.float(), w, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


# Every case in fp32 and fp16, except many_adapters in fp16: its 64 segments take the same
# per-adapter paths in either dtype, and the other cases cover fp16's rounding (4 s a case in
# the interpreter).
MATCH_CASES = [
    pytest.param(case, gemm, dtype, id=f"{case}-{gemm}-{str(dtype).removeprefix('torch.')}")
    for case in CASES
    for gemm in GEMMS
    for dtype in (torch.float32, torch.float16)
    if not (case == "many_adapters" and dtype == torch.float16)
]


@pytest.mark.parametrize(("case", "gemm", "dtype"), MATCH_CASES)
def test_fused_lora_linear_matches_reference(case, gemm, dtype, device, make_layout, make_lora):
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _inputs(
        case, dtype, device, make_layout, make_lora
    )
    keep = fused_dropout_keep_mask(layout, dropouts, x.shape[1], 5, device)
    _assert_matches_reference(
        x,
        weight,
        bias,
        lora_a,
        lora_b,
        scalings,
        dropouts,
        layout,
        keep,
        grad_y,
        gemm,
        f"{case}/{gemm}/{dtype}",
    )


@pytest.mark.parametrize("gemm", GEMMS)
def test_fused_lora_linear_eval_uses_no_mask(gemm, device, make_layout, make_lora):
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    got = fused_lora_linear(
        x, weight, bias, lora_a, lora_b, scalings, dropouts, layout, training=False, gemm=gemm
    )
    want = lora_linear_ref(x, weight, bias, lora_a, lora_b, scalings, dropouts, layout, None)
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg="eval output")


def test_fused_lora_linear_without_input_grad(device, make_layout, make_lora):
    """dA and dB alone (x needs no grad: the backward skips the fused dX pass)."""
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    keep = fused_dropout_keep_mask(layout, dropouts, x.shape[1], 1, device)
    grads = {}
    for name, fn in (
        (
            "fused",
            lambda a_, b_: fused_lora_linear(
                x, weight, bias, a_, b_, scalings, dropouts, layout, layer_seed=1
            ),
        ),
        (
            "ref",
            lambda a_, b_: lora_linear_ref(
                x, weight, bias, a_, b_, scalings, dropouts, layout, keep
            ),
        ),
    ):
        a_, b_ = (t.detach().clone().requires_grad_() for t in (lora_a, lora_b))
        fn(a_, b_).backward(grad_y)
        grads[name] = (a_.grad, b_.grad)
    atol, rtol = TOL[torch.float32]
    for got, want, name in zip(grads["fused"], grads["ref"], ["da", "db"], strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, n=name: n + m)


def test_fused_lora_linear_backward_is_bitwise_repeatable(device, make_layout, make_lora):
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _inputs(
        "ragged", torch.float16, device, make_layout, make_lora
    )

    def run():
        return _grads(
            lambda x_, a_, b_: fused_lora_linear(
                x_, weight, bias, a_, b_, scalings, dropouts, layout, layer_seed=2
            ),
            x,
            lora_a,
            lora_b,
            grad_y,
        )

    first, second = run(), run()
    for name, a, b in zip(["y", "dx", "da", "db"], first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_fused_lora_linear_rejects_bad_inputs(device, make_layout, make_lora):
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, _ = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    with pytest.raises(ValueError, match="weight"):
        fused_lora_linear(x, weight.half(), bias, lora_a, lora_b, scalings, dropouts, layout)
    with pytest.raises(ValueError, match="lora_b"):
        fused_lora_linear(x, weight, bias, lora_a, lora_b[:, :-1], scalings, dropouts, layout)
    with pytest.raises(ValueError, match="x has shape"):
        fused_lora_linear(x[:-1], weight, bias, lora_a, lora_b, scalings, dropouts, layout)
    with pytest.raises(ValueError, match="dropouts"):
        fused_lora_linear(x, weight, bias, lora_a, lora_b, scalings, [1.0] * 4, layout)
    with pytest.raises(ValueError, match="gemm"):
        fused_lora_linear(
            x, weight, bias, lora_a, lora_b, scalings, dropouts, layout, gemm="cutlass"
        )
    big_a = torch.zeros(4, 300, x.shape[1], dtype=x.dtype, device=device)
    big_b = torch.zeros(4, weight.shape[0], 300, dtype=x.dtype, device=device)
    with pytest.raises(NotImplementedError, match="rank"):
        fused_lora_linear(x, weight, bias, big_a, big_b, scalings, dropouts, layout)


def test_auto_gemm_is_triton_only_on_hopper(device):
    """``gemm="auto"``: the Triton GEMM forward on Hopper with aligned strides, else cuBLAS."""
    module = sys.modules["megatron_lorafusion.ops.fused_lora_linear"]
    x = torch.zeros(32, 64, dtype=torch.float16, device=device)
    weight = torch.zeros(48, 64, dtype=torch.float16, device=device)
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert module.resolve_gemm("auto", x, weight) == ("triton" if hopper else "cublas")
    x_odd = torch.zeros(32, 60, dtype=torch.float16, device=device)  # 120-byte rows
    weight_odd = torch.zeros(48, 60, dtype=torch.float16, device=device)
    assert module.resolve_gemm("auto", x_odd, weight_odd) == "cublas"
    assert module.resolve_gemm("triton", x, weight) == "triton"
    assert module.resolve_gemm("cublas", x_odd, weight_odd) == "cublas"


def test_triton_gemm_rejects_unaligned_rows(device, make_layout, make_lora):
    """An explicit ``gemm="triton"`` on rows TMA cannot describe names the strides."""
    counts, ranks, hidden, out = [5, 3], [2, 4], 60, 24  # fp16 x rows of 120 bytes
    gen = torch.Generator().manual_seed(1)
    layout = make_layout(counts, device)
    x = torch.randn(layout.num_tokens, hidden, generator=gen).to(device, torch.float16)
    weight = torch.randn(out, hidden, generator=gen).to(device, torch.float16)
    lora_a, lora_b = make_lora(out, hidden, ranks, torch.float16, device, gen)
    with pytest.raises(ValueError, match=r"x strides \(60, 1\), weight strides \(60, 1\)"):
        fused_lora_linear(
            x, weight, None, lora_a, lora_b, [1.0, 1.0], [0.0, 0.0], layout, gemm="triton"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gemm", GEMMS)
def test_fused_lora_linear_bf16_close_to_fp32(gemm, make_layout, make_lora):
    """bf16 fused is no more than 2x further from the fp32 reference than torch-bf16 is."""
    counts, ranks = [700, 0, 333, 1024, 91], [16, 8, 64, 1, 33]
    scalings, dropouts = [2.0, 1.0, 0.5, 4.0, 1.0], [0.1, 0.0, 0.05, 0.2, 0.0]
    hidden, out = 512, 768
    gen = torch.Generator().manual_seed(3)
    layout = make_layout(counts, "cuda", seed=4)
    x = torch.randn(layout.num_tokens, hidden, generator=gen).cuda().bfloat16()
    weight = (torch.randn(out, hidden, generator=gen) / hidden**0.5).cuda().bfloat16()
    lora_a, lora_b = make_lora(out, hidden, ranks, torch.bfloat16, "cuda", gen)
    grad_y = torch.randn(layout.num_tokens, out, generator=gen).cuda().bfloat16()
    keep = fused_dropout_keep_mask(layout, dropouts, hidden, 9, "cuda")
    fused = _grads(
        lambda x_, a_, b_: fused_lora_linear(
            x_, weight, None, a_, b_, scalings, dropouts, layout, layer_seed=9, gemm=gemm
        ),
        x,
        lora_a,
        lora_b,
        grad_y,
    )

    def ref(x_, a_, b_, w_):
        return lora_linear_ref(x_, w_, None, a_, b_, scalings, dropouts, layout, keep)

    ref16 = _grads(lambda x_, a_, b_: ref(x_, a_, b_, weight), x, lora_a, lora_b, grad_y)
    ref32 = _grads(
        lambda x_, a_, b_: ref(x_, a_, b_, weight.float()),
        x.float(),
        lora_a.float(),
        lora_b.float(),
        grad_y.float(),
    )
    for name, f, r16, r32 in zip(["y", "dx", "da", "db"], fused, ref16, ref32, strict=True):
        err_fused = float((f.float() - r32).norm() / r32.norm())
        err_torch = float((r16.float() - r32).norm() / r32.norm())
        assert err_fused < BF16_REL_ERR, f"{name}: relative error {err_fused:.2e}"
        # 1e-3 slack: torch-bf16 can be exact where the fp32 sum happens to round the same way.
        assert err_fused <= 2 * err_torch + 1e-3, f"{name}: {err_fused:.2e} vs {err_torch:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gemm", GEMMS)
def test_fused_lora_linear_shard_uses_rows_of_whole_mask(
    gemm, dtype, device, make_layout, make_lora
):
    """A sequence-parallel shard (rows 20:90 of 109) gives the rows of the unsharded op."""
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _inputs(
        "ragged", dtype, device, make_layout, make_lora
    )
    start, end = 20, 90
    shard = layout.shard(start, end)
    keep = fused_dropout_keep_mask(layout, dropouts, x.shape[1], 5, device)[start:end]
    x, grad_y = x[start:end].contiguous(), grad_y[start:end].contiguous()
    _assert_matches_reference(
        x,
        weight,
        bias,
        lora_a,
        lora_b,
        scalings,
        dropouts,
        shard,
        keep,
        grad_y,
        gemm,
        f"shard/{gemm}/{dtype}",
    )


@pytest.mark.parametrize("gemm", GEMMS)
def test_fused_lora_linear_rebuilt_input_keeps_bits_and_is_not_saved(
    gemm, device, make_layout, make_lora
):
    """X rebuilt in backward from its source: y, d_source, dA, dB bit for bit those of the
    op that saves X, and X's storage is not among the saved tensors."""
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )

    def producer(t):  # stands in for a norm; autograd saves tanh's output, never X
        return torch.tanh(t) * 2.0

    runs = {}
    for rebuilt in (False, True):
        src, a, b = (t.clone().requires_grad_() for t in (x, lora_a, lora_b))
        x_ = producer(src)
        saved = set()

        def pack(t, saved=saved):
            saved.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fused_lora_linear(
                x_,
                weight,
                bias,
                a,
                b,
                scalings,
                dropouts,
                layout,
                layer_seed=5,
                gemm=gemm,
                rebuild=InputRebuild(producer, (src,)) if rebuilt else None,
            )
        assert (x_.untyped_storage().data_ptr() in saved) != rebuilt, f"{gemm}: X saved"
        y.backward(grad_y)
        runs[rebuilt] = (y.detach(), src.grad, a.grad, b.grad)
    for name, got, want in zip(["y", "d_source", "da", "db"], runs[True], runs[False], strict=True):
        torch.testing.assert_close(
            got, want, atol=0, rtol=0, msg=lambda m, n=name: f"{gemm} {n}: {m}"
        )


# FP8 frozen weights (`Fp8Weight`): the reference is `lora_linear_ref` with the same weight,
# which fake-quantizes X and dY exactly as the kernels do; what remains is summation order
# (fp32) or fp16 rounding of outputs, as above. H and N are multiples of 16 (the scaled GEMMs').
FP8_CASES = {
    "round": ([32, 32], [16, 16], [2.0, 0.5], [0.1, 0.1], 64, 32),
    "ragged": ([37, 0, 50, 13], [8, 3, 5, 1], [0.5, 2.0, 1.0, 3.0], [0.1, 0.2, 0.0, 0.3], 48, 80),
}
FP8_GEMMS = ["scaled_mm", "triton"]


def _fp8_inputs(case, dtype, device, make_layout, make_lora):
    from megatron_lorafusion.ops import quantize_weight

    counts, ranks, scalings, dropouts, hidden, out = FP8_CASES[case]
    gen = torch.Generator().manual_seed(7)
    layout = make_layout(counts, device, seed=11)
    x = torch.randn(layout.num_tokens, hidden, generator=gen).to(device, dtype)
    weight = quantize_weight((torch.randn(out, hidden, generator=gen) / hidden**0.5).to(device))
    bias = torch.randn(out, generator=gen).to(device, dtype)
    lora_a, lora_b = make_lora(out, hidden, ranks, dtype, device, gen)
    grad_y = torch.randn(layout.num_tokens, out, generator=gen).to(device, dtype)
    return layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y


@pytest.mark.parametrize(("case", "dtype"), [("ragged", torch.float32), ("round", torch.float16)])
@pytest.mark.parametrize("gemm", FP8_GEMMS)
def test_fused_lora_linear_fp8_matches_fake_quant_reference(
    gemm, case, dtype, device, make_layout, make_lora, skip_without_cpu_scaled_mm
):
    if gemm == "scaled_mm":
        skip_without_cpu_scaled_mm(device)
    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, grad_y = _fp8_inputs(
        case, dtype, device, make_layout, make_lora
    )
    keep = fused_dropout_keep_mask(layout, dropouts, x.shape[1], 5, device)
    got = _grads(
        lambda x_, a_, b_: fused_lora_linear(
            x_, weight, bias, a_, b_, scalings, dropouts, layout, layer_seed=5, gemm=gemm
        ),
        x,
        lora_a,
        lora_b,
        grad_y,
    )
    want = _grads(
        lambda x_, a_, b_: lora_linear_ref(
            x_, weight, bias.float(), a_, b_, scalings, dropouts, layout, keep
        ),
        x.float(),
        lora_a.float(),
        lora_b.float(),
        grad_y.float(),
    )
    # A GPU's tensor cores multiply e4m3 operands and accumulate in less than fp32 (an fp32
    # output ~1e-3 off on the H200): there fp32 is held to fp16's tolerance.
    atol, rtol = TOL[dtype] if device == "cpu" else TOL[torch.float16]
    for name, g, w in zip(["y", "dx", "da", "db"], got, want, strict=True):
        torch.testing.assert_close(
            g.float(), w, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{case}/{gemm} {n}: {m}"
        )


def test_fused_lora_linear_fp8_refuses_gemms_that_cannot_take_it(device, make_layout, make_lora):
    from megatron_lorafusion.ops import Fp8Weight

    layout, x, weight, bias, lora_a, lora_b, scalings, dropouts, _ = _fp8_inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    args = (bias, lora_a, lora_b, scalings, dropouts, layout)
    with pytest.raises(ValueError, match="gemm='cublas' runs cuBLAS addmm, which takes no FP8"):
        fused_lora_linear(x, weight, *args, gemm="cublas")
    with pytest.raises(ValueError, match="gemm='scaled_mm' is the GEMM of FP8 weights"):
        fused_lora_linear(x, weight.dequantize(), *args, gemm="scaled_mm")
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    module = sys.modules["megatron_lorafusion.ops.fused_lora_linear"]
    assert module.resolve_gemm("auto", x, weight) == ("triton" if hopper else "scaled_mm"), (
        "FP8 'auto' is the Triton op on Hopper (measured faster), scaled_mm elsewhere"
    )
    narrow = Fp8Weight(weight.data[:, :40].contiguous(), weight.scale)  # H = 40: not 16·k
    with pytest.raises(ValueError, match="multiples of 16"):
        fused_lora_linear(x[:, :40].contiguous(), narrow, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["auto", *FP8_GEMMS])
def test_fused_lora_linear_fp8_bf16_matches_fake_quant_reference(gemm, make_layout, make_lora):
    from megatron_lorafusion.ops import fp8_problem, quantize_weight

    if fp8_problem(torch.device("cuda")) is not None:
        pytest.skip(fp8_problem(torch.device("cuda")))
    if gemm == "triton" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("gemm='triton' with FP8 operands runs on Hopper only")
    layout = make_layout([300, 0, 517, 211], "cuda", seed=5)
    gen = torch.Generator().manual_seed(9)
    hidden, out = 1024, 2048 + 64
    x = torch.randn(layout.num_tokens, hidden, generator=gen).cuda().bfloat16()
    weight = quantize_weight((torch.randn(out, hidden, generator=gen) / hidden**0.5).cuda())
    lora_a, lora_b = make_lora(out, hidden, [16, 8, 16, 4], torch.bfloat16, "cuda", gen)
    grad_y = torch.randn(layout.num_tokens, out, generator=gen).cuda().bfloat16()
    scalings, dropouts = [2.0, 1.0, 0.5, 1.0], [0.1, 0.0, 0.1, 0.0]
    keep = fused_dropout_keep_mask(layout, dropouts, hidden, 5, "cuda")
    got = _grads(
        lambda x_, a_, b_: fused_lora_linear(
            x_, weight, None, a_, b_, scalings, dropouts, layout, layer_seed=5, gemm=gemm
        ),
        x,
        lora_a,
        lora_b,
        grad_y,
    )
    want = _grads(
        lambda x_, a_, b_: lora_linear_ref(
            x_, weight, None, a_, b_, scalings, dropouts, layout, keep
        ),
        x.float(),
        lora_a.float(),
        lora_b.float(),
        grad_y.float(),
    )
    for name, g, w in zip(["y", "dx", "da", "db"], got, want, strict=True):
        err = float((g.float() - w).norm() / w.norm())
        assert err < BF16_REL_ERR, f"{gemm} {name}: {err:.2e}"
