"""`AdapterAdamW`'s per-adapter gradient clipping and stopped adapters, against torch's rule."""

from types import SimpleNamespace

import pytest
import torch

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.train.optim import AdapterAdamW, DivergenceError

# fp32 on the CPU: clipping is one row scale, the same multiply torch's clip_grad_norm_ does.
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6)}


def _table(grads: torch.Tensor) -> SimpleNamespace:
    """The two (A, S) tables `AdapterAdamW.step` reads (a `LoRAContext` stand-in)."""
    weights = torch.linspace(-1.0, 1.0, grads.numel()).view_as(grads).clone()
    return SimpleNamespace(weights=weights, grads=grads.clone(), num_adapters=grads.shape[0])


def _optimizer(lora, max_norms):
    adapters = [
        AdapterConfig(name=f"a{i}", lr=1e-2, max_grad_norm=m) for i, m in enumerate(max_norms)
    ]
    return AdapterAdamW(lora, adapters, [10] * len(adapters))


def test_clip_scales_each_adapter_to_its_max_norm_like_torch():
    grads = torch.randn(4, 37, generator=torch.Generator().manual_seed(0)) * 3.0
    grads[2] *= 1e-3  # below its max: untouched
    max_norms = [1.0, 0.0, 1.0, 0.5]  # adapter 1: clipping off
    clipped = _table(grads)
    opt = _optimizer(clipped, max_norms)
    opt.step([0, 1, 2, 3])

    expected_grads = grads.clone()
    for a, m in enumerate(max_norms):
        if m > 0:
            row = expected_grads[a].clone().requires_grad_()
            row.grad = expected_grads[a].clone()
            torch.nn.utils.clip_grad_norm_([row], m)
            expected_grads[a] = row.grad
    reference = _table(expected_grads)
    _optimizer(reference, [0.0] * 4).step([0, 1, 2, 3])
    torch.testing.assert_close(
        clipped.weights,
        reference.weights,
        **TOL[torch.float32],
        msg="clipped step differs from torch's clip + unclipped step",
    )
    for a in range(4):
        torch.testing.assert_close(
            torch.tensor(opt.grad_norm(a)),
            grads[a].norm(),
            **TOL[torch.float32],
            msg=f"norm of adapter {a}",
        )
    assert torch.equal(clipped.weights[[1, 2]], reference.weights[[1, 2]]), (
        "adapters that are not clipped must step bit-identically"
    )
    assert torch.count_nonzero(clipped.grads) == 0, "stepping zeroes the gradient rows"


def test_stopped_adapter_keeps_weights_and_drops_gradients():
    grads = torch.randn(2, 11, generator=torch.Generator().manual_seed(1))
    lora = _table(grads)
    before = lora.weights.clone()
    opt = _optimizer(lora, [1.0, 1.0])
    opt.stopped.add(1)
    opt.step([0, 1])
    assert torch.equal(lora.weights[1], before[1]), "a stopped adapter must not move"
    assert not torch.equal(lora.weights[0], before[0]), "the other adapter steps"
    assert opt.steps == [1, 0], f"a stopped adapter's step count stays, got {opt.steps}"
    assert torch.count_nonzero(lora.grads) == 0, "a stopped adapter's gradients are dropped"


def test_warm_up_launches_a_step_that_changes_nothing():
    """`warm_up` (a run's first microbatch, trained and forgotten) leaves every table, step
    count and learning rate as they were, with norms (clipping) and losses read."""
    grads = torch.randn(3, 13, generator=torch.Generator().manual_seed(3))
    lora = _table(grads)
    opt = _optimizer(lora, [1.0, 0.0, 0.5])
    tables = [t.clone() for t in (lora.weights, lora.grads, opt.exp_avg, opt.exp_avg_sq)]
    opt.warm_up([0, 2], losses=torch.zeros(2, dtype=torch.float64))
    opt.warm_up([1], losses=None)
    for name, before, after in zip(
        ("weights", "grads", "exp_avg", "exp_avg_sq"),
        tables,
        (lora.weights, lora.grads, opt.exp_avg, opt.exp_avg_sq),
        strict=True,
    ):
        assert torch.equal(after, before), f"warm_up changed {name}"
    assert opt.steps == [0, 0, 0]
    assert opt.last_lr == [0.0, 0.0, 0.0]
    opt.check()  # nothing left to confirm
    assert opt.confirm() == []
    opt.step([0])
    assert not torch.equal(lora.weights[0], tables[0][0]), "a real step still steps"


def test_step_on_a_nan_gradient_or_loss_is_refused_and_changes_nothing():
    """The step is refused on the device; `check` (the next step's first act) raises."""
    grads = torch.randn(3, 11, generator=torch.Generator().manual_seed(2))
    grads[1, 4] = float("nan")
    lora = _table(grads)
    adapters = [AdapterConfig(name=f"a{i}", lr=1e-2) for i in range(3)]
    opt = AdapterAdamW(lora, adapters, [10] * 3, track_grad_norms=True)
    before = lora.weights.clone()
    opt.step([0, 1])  # queued: no host read
    torch.testing.assert_close(
        lora.weights[1:],
        before[1:],
        atol=0,
        rtol=0,
        msg="the adapter with a NaN gradient (and the one not stepping) must not move",
    )
    assert not torch.equal(lora.weights[0], before[0]), "adapter a0's gradient is finite"
    with pytest.raises(DivergenceError, match=r"adapter 'a1': gradient norm nan at step 1"):
        opt.step([2])  # checks the last step first, queues nothing
    assert opt.steps == [1, 0, 0], f"a refused step is not counted, got {opt.steps}"
    assert torch.equal(lora.weights[2], before[2]), "no step is queued after a refused one"
    opt.check()  # checked once: no error

    lora = _table(torch.randn(2, 11, generator=torch.Generator().manual_seed(3)))
    unclipped = [AdapterConfig(name=f"a{i}", lr=1e-2, max_grad_norm=0.0) for i in range(2)]
    opt = AdapterAdamW(lora, unclipped, [10] * 2)  # no norms: the loss alone gates the step
    before, grads = lora.weights.clone(), lora.grads.clone()
    opt.step([0, 1], losses=torch.tensor([1.5, float("inf")], dtype=torch.float64))
    assert torch.equal(lora.weights[1], before[1]), "a step on an infinite loss must not move"
    assert torch.equal(lora.grads[1], grads[1]), "nor drop its gradient"
    assert not torch.equal(lora.weights[0], before[0]), "adapter a0's loss is finite"
    refused = opt.confirm()
    assert [a for a, _ in refused] == [1]
    assert refused[0][1].startswith("adapter 'a1': loss inf at step 1; it stopped"), refused
    assert opt.steps == [1, 0], f"a refused step is not counted, got {opt.steps}"
    assert opt.step([0, 1], losses=torch.tensor([1.5, 2.0], dtype=torch.float64)) == (0,)
    opt.check()  # finite: no error
    assert opt.steps == [2, 0], "a refused adapter steps no more (it failed)"


def test_stopped_adapter_with_a_nan_loss_neither_steps_nor_stops_the_run():
    lora = _table(torch.randn(2, 11, generator=torch.Generator().manual_seed(4)))
    opt = _optimizer(lora, [1.0, 1.0])
    opt.stopped.add(1)
    before = lora.weights.clone()
    opt.step([0, 1], losses=torch.tensor([1.5, float("nan")], dtype=torch.float64))
    opt.check()  # adapter 1 is stopped: its loss is not checked
    assert torch.equal(lora.weights[1], before[1]), "a stopped adapter must not move"
    assert opt.steps == [1, 0]


def _lora_plus_run(ratio: float, grads: torch.Tensor | None = None):
    """One AdamW step of a DoRA adapter on a tiny model with LoRA+ ratio ``ratio``."""
    from model_testing import TRAIN_MODEL

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model

    model = build_gpt_model(TRAIN_MODEL)
    adapter = AdapterConfig(
        name="plus", rank=4, lr=1e-2, weight_decay=0.1, use_dora=True, loraplus_lr_ratio=ratio
    )
    lora = apply_lora(model, [adapter], seed=1)
    if grads is None:
        grads = torch.randn(lora.grads.shape, generator=torch.Generator().manual_seed(0))
    lora.grads.copy_(grads)
    AdapterAdamW(lora, [adapter], [10]).step([0])
    return lora.adapter_state_dict(0), grads


def test_loraplus_ratio_changes_only_b_and_magnitude_steps(megatron_single_process):
    plain, grads = _lora_plus_run(1.0)
    plus, _ = _lora_plus_run(16.0, grads)
    for name, weight in plus.items():
        if name.endswith("lora_A"):
            assert torch.equal(weight, plain[name]), f"{name}: A must step at lr"
        else:  # B and DoRA's magnitude: PEFT's LoRA+ puts both at lr × ratio
            assert not torch.equal(weight, plain[name]), f"{name}: lr × ratio had no effect"
    assert any(n.endswith("lora_magnitude") for n in plus), "the adapter has magnitudes"
