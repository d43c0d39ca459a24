"""`dora_scale` (DoRA's per-adapter column scale) against `dora_scale_ref` and PEFT's DoRA.

CPU: Triton interpreter. The scale op is elementwise plus a per-adapter column sum, so fp32
differences are summation order; fp16 rounds ``out`` once where the reference rounds once
too. The whole DoRA linear (fused LoRA linear in the interpreter, IEEE dots, then
`dora_scale`) is compared with PEFT's ``use_dora`` `Linear` on the same weights in fp32.
"""

import pytest
import torch

from megatron_lorafusion.ops import (
    dora_scale,
    dora_scale_ref,
    dora_weight_norm,
    dora_weight_norm_ref,
    fused_lora_linear,
    weight_sq_norm,
)

# dtype -> (atol, rtol) of the scale op against its reference (outputs, dOut, dScale ~ O(1..10)).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}
PEFT_TOL = dict(atol=1e-4, rtol=1e-4)  # fp32, the bar: two implementations of DoRA

# tokens per adapter: round, ragged with a zero-token adapter, one adapter.
COUNTS = {"round": [16, 16], "ragged": [7, 0, 13, 3], "single": [9]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("case", "width"), [("round", 32), ("ragged", 45), ("single", 17)])
def test_dora_scale_matches_reference(case, width, dtype, device, make_layout):
    counts = COUNTS[case]
    layout = make_layout(counts, device)
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(sum(counts), width, generator=gen).to(device, dtype)
    scale = (1.0 + 0.3 * torch.randn(len(counts), width, generator=gen)).to(device)
    dy = torch.randn(sum(counts), width, generator=gen).to(device, dtype)
    results = []
    for fn in (dora_scale, dora_scale_ref):
        o = out.clone().requires_grad_(True)
        s = scale.clone().requires_grad_(True)
        y = fn(o, s, layout)
        y.backward(dy)
        results.append((y.detach(), o.grad, s.grad))
    atol, rtol = TOL[dtype]
    for name, got, want in zip(("y", "dOut", "dScale"), *results, strict=True):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=name)
    zero = [a for a, n in enumerate(counts) if n == 0]
    assert not results[0][2][zero].any(), "an adapter without tokens got a dScale"


def test_dora_scale_refuses_wrong_scale_shape(device, make_layout):
    layout = make_layout([3, 2], device)
    with pytest.raises(ValueError, match=r"scale has shape \(2, 7\).*expected \(A, N\)=\(2, 8\)"):
        dora_scale(torch.zeros(5, 8, device=device), torch.ones(2, 7, device=device), layout)


def test_dora_weight_norm_matches_formed_weight():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen, dtype=torch.float32)
    lora_a = torch.randn(6, 24, generator=gen)
    lora_b = torch.randn(40, 6, generator=gen)
    got = dora_weight_norm(weight, weight_sq_norm(weight), lora_a, lora_b, 0.7)
    want = dora_weight_norm_ref(weight, lora_a, lora_b, 0.7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg="row norm of W + sBA")


def _peft_dora_linear(weight, bias, lora_a, lora_b, magnitude, rank, alpha):
    """PEFT's DoRA ``Linear`` on a plain ``nn.Linear`` with the given weights (fp32)."""
    peft = pytest.importorskip("peft", reason="dev extra: peft")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)

    base = Tiny()
    with torch.no_grad():
        base.proj.weight.copy_(weight)
        if bias is not None:
            base.proj.bias.copy_(bias)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"], use_dora=True)
    model = peft.get_peft_model(base, config)
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(lora_a)
        layer.lora_B["default"].weight.copy_(lora_b)
        layer.lora_magnitude_vector["default"].weight.copy_(magnitude)
    return layer


@pytest.mark.parametrize("with_bias", [False, True])
def test_dora_linear_matches_peft_forward_and_gradients(with_bias, device, make_layout):
    """Two DoRA adapters and one plain LoRA adapter in one microbatch, every gradient."""
    counts, ranks, alphas, dora = [11, 6, 9], [4, 2, 3], [8.0, 2.0, 6.0], [True, False, True]
    hidden, width, rmax = 24, 20, max(ranks)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(width, hidden, generator=gen)
    bias = torch.randn(width, generator=gen) if with_bias else None
    x = torch.randn(sum(counts), hidden, generator=gen)
    dy = torch.randn(sum(counts), width, generator=gen)
    a_list = [torch.randn(r, hidden, generator=gen) / hidden**0.5 for r in ranks]
    b_list = [torch.randn(width, r, generator=gen) * 0.5 for r in ranks]
    # a trained-looking magnitude: the fresh one (||W||) perturbed
    m_list = [weight.norm(dim=1) * (1 + 0.2 * torch.randn(width, generator=gen)) for _ in ranks]
    scalings = [al / r for al, r in zip(alphas, ranks, strict=True)]
    layout = make_layout(counts, device)

    lora_a = torch.zeros(len(ranks), rmax, hidden)
    lora_b = torch.zeros(len(ranks), width, rmax)
    for i, r in enumerate(ranks):
        lora_a[i, :r], lora_b[i, :, :r] = a_list[i], b_list[i]
    lora_a, lora_b = (t.to(device).requires_grad_(True) for t in (lora_a, lora_b))
    mags = torch.stack(m_list).to(device).requires_grad_(True)
    xd, w = x.to(device, copy=True).requires_grad_(True), weight.to(device)
    out = fused_lora_linear(xd, w, None, lora_a, lora_b, scalings, [0.0] * 3, layout, gemm="triton")
    sq = weight_sq_norm(w)
    norms = torch.stack(
        [
            dora_weight_norm(w, sq, lora_a[i, :r].detach(), lora_b[i, :, :r].detach(), scalings[i])
            if dora[i]
            else torch.ones(width, device=device)
            for i, r in enumerate(ranks)
        ]
    )
    on = torch.tensor(dora, device=device)[:, None]
    scale = torch.where(on, mags / norms, torch.ones_like(mags))
    y = dora_scale(out, scale, layout)
    if bias is not None:
        y = y + bias.to(device)
    y.backward(dy.to(device))

    offsets = [0, *torch.cumsum(torch.tensor(counts), 0).tolist()]
    for i, r in enumerate(ranks):
        rows = slice(offsets[i], offsets[i + 1])
        xi = x[rows].clone().requires_grad_(True)
        if dora[i]:
            layer = _peft_dora_linear(weight, bias, a_list[i], b_list[i], m_list[i], r, alphas[i])
            want = layer(xi)
        else:
            a, b = (t.clone().requires_grad_(True) for t in (a_list[i], b_list[i]))
            want = torch.nn.functional.linear(xi, weight, bias) + scalings[i] * (xi @ a.t() @ b.t())
        want.backward(dy[rows])
        name = f"adapter {i} ({'DoRA' if dora[i] else 'LoRA'})"
        torch.testing.assert_close(y[rows].detach().cpu(), want.detach(), **PEFT_TOL, msg=name)
        torch.testing.assert_close(xd.grad[rows].cpu(), xi.grad, **PEFT_TOL, msg=f"{name} dX")
        if dora[i]:
            grads = (
                layer.lora_A["default"].weight.grad,
                layer.lora_B["default"].weight.grad,
                layer.lora_magnitude_vector["default"].weight.grad,
            )
        else:
            grads = (a.grad, b.grad, None)
        torch.testing.assert_close(lora_a.grad[i, :r].cpu(), grads[0], **PEFT_TOL, msg=f"{name} dA")
        torch.testing.assert_close(
            lora_b.grad[i, :, :r].cpu(), grads[1], **PEFT_TOL, msg=f"{name} dB"
        )
        if dora[i]:
            torch.testing.assert_close(mags.grad[i].cpu(), grads[2], **PEFT_TOL, msg=f"{name} dm")
        else:
            assert not mags.grad[i].any(), f"{name}: a LoRA adapter's magnitude got a gradient"


def test_dora_weight_norm_batched_equals_one_adapter_at_a_time():
    """k adapters in one call (ranks padded with zero rows, as packed) = one call each."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 16, generator=gen)
    ranks, scalings = [4, 2, 3], [0.5, 2.0, 1.25]
    lora_a = torch.zeros(3, 4, 16)
    lora_b = torch.zeros(3, 24, 4)
    for i, r in enumerate(ranks):
        lora_a[i, :r] = torch.randn(r, 16, generator=gen)
        lora_b[i, :, :r] = torch.randn(24, r, generator=gen)
    sq = weight_sq_norm(weight)
    got = dora_weight_norm(weight, sq, lora_a, lora_b, torch.tensor(scalings))
    for i, r in enumerate(ranks):
        want = dora_weight_norm(weight, sq, lora_a[i, :r], lora_b[i, :, :r], scalings[i])
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5, msg=f"adapter {i}")
        torch.testing.assert_close(
            got[i], dora_weight_norm_ref(weight, lora_a[i, :r], lora_b[i, :, :r], scalings[i])
        )
