"""`adapter_adamw_` (Triton kernel) against `adapter_adamw_ref` and against torch's AdamW.

CPU: the Triton interpreter, fp32 elementwise (no dots): differences are the order of a few
multiplies, so fp32 tolerances are tight. torch's AdamW updates ``m`` by ``lerp`` and folds
the bias corrections differently: a few ulps of the weights per step.
"""

import re

import pytest
import torch

from megatron_lorafusion.ops import adapter_adamw_, adapter_adamw_ref
from megatron_lorafusion.ops.adapter_adamw import (
    BETA1,
    BETA2,
    BIAS_CORRECTION1,
    BIAS_CORRECTION2,
    EPS,
    HYPER_COLUMNS,
    LR,
    LR_B,
    MAX_NORM,
    STEP,
    WEIGHT_DECAY,
    adapter_adamw_fwd,
)

TOL = {torch.float32: (1e-6, 1e-6)}
TORCH_ADAMW_TOL = (1e-6, 1e-5)  # lerp vs multiply-add, bias corrections folded differently


def _hyper(lrs, steps, weight_decays, stepping, device, betas=(0.9, 0.999), eps=1e-8):
    rows = []
    for a, (lr, step, wd) in enumerate(zip(lrs, steps, weight_decays, strict=True)):
        row = [0.0] * HYPER_COLUMNS
        row[LR], row[BETA1], row[BETA2], row[EPS], row[WEIGHT_DECAY] = lr, *betas, eps, wd
        row[BIAS_CORRECTION1] = 1 - betas[0] ** step
        row[BIAS_CORRECTION2] = 1 - betas[1] ** step
        row[STEP] = 1.0 if a in stepping else 0.0
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32, device=device)


def _rows(adapters, device):
    """Every adapter's row, in order (the hyper tables above have one row per adapter)."""
    return torch.arange(adapters, device=device)


def _tables(adapters, width, device, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(adapters, width, generator=gen)
    grads = torch.randn(adapters, width, generator=gen)
    exp_avg = torch.randn(adapters, width, generator=gen) * 0.1
    exp_avg_sq = torch.rand(adapters, width, generator=gen) * 0.01
    return [t.to(device) for t in (weights, grads, exp_avg, exp_avg_sq)]


@pytest.mark.parametrize(
    ("adapters", "width", "stepping"),
    [
        (1, 4096, {0}),  # round: two whole blocks
        (5, 3001, {0, 2, 3}),  # ragged width, a subset of the adapters steps
        (3, 17, set()),  # nothing steps
    ],
)
def test_adapter_adamw_kernel_matches_reference(adapters, width, stepping, device):
    hyper = _hyper(
        [1e-3 * (a + 1) for a in range(adapters)],
        [a + 1 for a in range(adapters)],
        [0.01 * a for a in range(adapters)],
        stepping,
        device,
    )
    fused = _tables(adapters, width, device, seed=3)
    ref = [t.clone() for t in fused]
    before = [t.clone() for t in fused]
    adapter_adamw_fwd(*fused, _rows(adapters, device), hyper)
    adapter_adamw_ref(*ref, _rows(adapters, device), hyper)
    atol, rtol = TOL[torch.float32]
    for name, got, want, old in zip(
        ("weights", "grads", "exp_avg", "exp_avg_sq"), fused, ref, before, strict=True
    ):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=f"{name} != reference")
        for a in range(adapters):
            if a not in stepping:
                torch.testing.assert_close(
                    got[a],
                    old[a],
                    atol=0,
                    rtol=0,
                    msg=f"{name} of non-stepping adapter {a} changed",
                )
    for a in stepping:
        assert not fused[1][a].any(), f"the gradient of stepped adapter {a} must be zeroed"


def test_adapter_adamw_matches_torch_adamw_per_adapter(device):
    """Three steps of two adapters with their own lr and weight decay, one stepping twice."""
    width, lrs, decays = 300, [2e-2, 5e-3], [0.0, 0.1]
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(2, width, generator=gen)
    weights = start.clone().to(device)
    grads, exp_avg, exp_avg_sq = (torch.zeros(2, width, device=device) for _ in range(3))
    params = [torch.nn.Parameter(start[a].clone()) for a in range(2)]
    torch_opts = [
        torch.optim.AdamW([params[a]], lr=lrs[a], weight_decay=decays[a]) for a in range(2)
    ]
    steps = [0, 0]
    for stepping in ({0, 1}, {0}, {0, 1}):
        for a in stepping:
            g = torch.randn(width, generator=gen)
            grads[a] = g.to(device)
            params[a].grad = g.clone()
            torch_opts[a].step()
            steps[a] += 1
        adapter_adamw_(
            weights,
            grads,
            exp_avg,
            exp_avg_sq,
            _rows(2, device),
            _hyper(lrs, [max(s, 1) for s in steps], decays, stepping, device),
        )
    atol, rtol = TORCH_ADAMW_TOL
    for a in range(2):
        torch.testing.assert_close(
            weights[a].cpu(),
            params[a].detach(),
            atol=atol,
            rtol=rtol,
            msg=f"adapter {a} differs from torch.optim.AdamW",
        )


def test_adapter_adamw_names_bad_tensor(device):
    weights, grads, exp_avg, exp_avg_sq = _tables(2, 8, device, seed=1)
    hyper = _hyper([1e-3] * 2, [1, 1], [0.0] * 2, {0}, device)
    rows = _rows(2, device)
    with pytest.raises(ValueError, match="exp_avg_sq must be contiguous fp32 of shape"):
        adapter_adamw_(weights, grads, exp_avg, exp_avg_sq[:, :4], rows, hyper)
    with pytest.raises(ValueError, match="hyper must be fp32 of shape"):
        adapter_adamw_(weights, grads, exp_avg, exp_avg_sq, rows, hyper[:1])
    with pytest.raises(ValueError, match="weights must be a contiguous"):
        adapter_adamw_(weights.t(), grads, exp_avg, exp_avg_sq, rows, hyper)
    with pytest.raises(ValueError, match=r"rows must be contiguous \(k,\) int64"):
        adapter_adamw_(weights, grads, exp_avg, exp_avg_sq, rows.int(), hyper)
    with pytest.raises(ValueError, match=re.escape("squared_norms must be contiguous fp32 of")):
        adapter_adamw_(*_tables(2, 8, device, 1), rows, hyper, squared_norms=torch.ones(3))
    bad_losses = re.escape("losses must be contiguous floating point of shape (2,)")
    with pytest.raises(ValueError, match=bad_losses):
        adapter_adamw_(*_tables(2, 8, device, 1), rows, hyper, losses=torch.ones(1))
    with pytest.raises(ValueError, match=bad_losses):  # a strided view would be misread
        adapter_adamw_(*_tables(2, 8, device, 1), rows, hyper, losses=torch.ones(4)[::2])


def test_max_norm_steps_as_torchs_clipped_gradient(device):
    """MAX_NORM: stepping on the gradient scaled by clip_grad_norm_'s coefficient, bit for bit."""
    weights, grads, exp_avg, exp_avg_sq = _tables(3, 3001, device, seed=5)
    grads[2] *= 1e-3  # below its max norm: not clipped
    hyper = _hyper([1e-3] * 3, [2] * 3, [0.01] * 3, {0, 1, 2}, device)
    hyper[:, MAX_NORM] = torch.tensor([1.0, 0.0, 1.0])  # adapter 1: no clipping
    squared = torch.linalg.vector_norm(grads, dim=1).square()
    tables = [t.clone() for t in (weights, grads, exp_avg, exp_avg_sq)]
    adapter_adamw_(*tables, _rows(3, device), hyper, squared_norms=squared)
    clipped = grads.clone()
    for a in (0, 2):  # clip_grad_norm_'s coefficient, from the norm the kernel is given
        clipped[a] *= (1.0 / (squared[a].sqrt() + 1e-6)).clamp(max=1.0)
    prescaled = [weights.clone(), clipped, exp_avg.clone(), exp_avg_sq.clone()]
    adapter_adamw_(*prescaled, _rows(3, device), hyper)  # no norms: MAX_NORM unread
    for name, got, want in zip(
        ("weights", "grads", "exp_avg", "exp_avg_sq"), tables, prescaled, strict=True
    ):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    assert not torch.equal(clipped[0], grads[0]), "adapter 0 must have been clipped"


@pytest.mark.parametrize("loss_dtype", [torch.float64, torch.float32])  # runner; a DP bucket
@pytest.mark.parametrize("bad", ["nan norm", "inf norm", "nan loss", "inf loss"])
def test_adapter_adamw_leaves_a_row_with_a_non_finite_norm_or_loss(bad, loss_dtype, device):
    """The device gate: that row is not touched (not even its gradient), the others step."""
    tables = _tables(3, 300, device, seed=7)
    rows = torch.tensor([2, 0, 1], device=device)  # any order: hyper row j is adapter rows[j]
    hyper = _hyper([1e-3, 2e-3, 3e-3], [1, 1, 1], [0.0] * 3, {0, 1, 2}, device)
    squared = torch.linalg.vector_norm(tables[1], dim=1).square()
    losses = torch.tensor([1.0, 2.0, 3.0], dtype=loss_dtype, device=device)
    value = float("nan") if bad.startswith("nan") else float("inf")
    if bad.endswith("norm"):
        squared[rows[1]] = value
    else:
        losses[1] = value
    before = [t.clone() for t in tables]
    ref = [t.clone() for t in tables]
    adapter_adamw_(*tables, rows, hyper, squared_norms=squared, losses=losses)
    adapter_adamw_ref(*ref, rows, hyper, squared_norms=squared, losses=losses)
    for i, name in enumerate(("weights", "grads", "exp_avg", "exp_avg_sq")):
        assert torch.equal(tables[i][0], before[i][0]), f"{name} of the refused adapter 0 moved"
        atol, rtol = TOL[torch.float32]
        torch.testing.assert_close(tables[i], ref[i], atol=atol, rtol=rtol, msg=f"{name} != ref")
    for a in (1, 2):
        assert not torch.equal(tables[0][a], before[0][a]), f"adapter {a} must step"
        assert not tables[1][a].any(), f"adapter {a}'s gradient must be zeroed"


def test_adapter_adamw_lr_groups_step_only_their_columns_at_lr_b(device):
    """LoRA+: marked columns step exactly as a plain step at LR_B, the others as at LR."""
    adapters, width = 3, 2500
    lrs, ratios = [1e-3, 2e-3, 5e-4], [16.0, 1.0, 4.0]
    steps, decays, stepping = [1, 3, 2], [0.0, 0.1, 0.01], {0, 1, 2}
    groups = (torch.arange(width) % 7 < 3).to(device)  # B's columns, say
    hyper = _hyper(lrs, steps, decays, stepping, device)
    hyper[:, LR_B] = torch.tensor([lr * k for lr, k in zip(lrs, ratios, strict=True)])
    plain = _hyper(lrs, steps, decays, stepping, device)
    boosted = _hyper(
        [lr * k for lr, k in zip(lrs, ratios, strict=True)], steps, decays, stepping, device
    )
    tables = _tables(adapters, width, device, seed=5)
    results = {}
    for name, h, g in (("plus", hyper, groups), ("plain", plain, None), ("boosted", boosted, None)):
        t = [x.clone() for x in tables]
        adapter_adamw_(*t, _rows(adapters, device), h, lr_groups=g)
        results[name] = t
    ref = [x.clone() for x in tables]
    adapter_adamw_ref(*ref, _rows(adapters, device), hyper, groups)
    for i, name in enumerate(("weights", "grads", "exp_avg", "exp_avg_sq")):
        got = results["plus"][i]
        assert torch.equal(got[:, ~groups], results["plain"][i][:, ~groups]), f"{name}: A moved"
        assert torch.equal(got[:, groups], results["boosted"][i][:, groups]), f"{name}: B's lr"
        atol, rtol = TOL[torch.float32]
        torch.testing.assert_close(got, ref[i], atol=atol, rtol=rtol, msg=f"{name} != reference")
    assert not torch.equal(results["plus"][0], results["plain"][0]), "the ratio had no effect"


def test_adapter_adamw_refuses_bad_lr_groups(device):
    weights, grads, exp_avg, exp_avg_sq = _tables(2, 8, device, seed=0)
    hyper = _hyper([1e-3] * 2, [1, 1], [0.0] * 2, {0}, device)
    with pytest.raises(ValueError, match=r"lr_groups must be bool of shape \(8,\)"):
        adapter_adamw_(
            weights, grads, exp_avg, exp_avg_sq, _rows(2, device), hyper, torch.ones(7, dtype=bool)
        )
