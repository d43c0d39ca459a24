"""Deferred LoRA weight gradients: the queue's order rules and the gradients it produces."""

import dataclasses

import pytest
import torch
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

from megatron_lorafusion.mcore import WgradQueue, apply_lora, build_gpt_model

TOL = dict(atol=1e-6, rtol=1e-6)  # fp32; the deferred dA sums the same products


def _logger(log: list, name: str):
    return lambda: log.append(name)


def test_queue_runs_passes_in_order_and_by_adapter():
    log: list[str] = []
    queue = WgradQueue(max_pending=3)
    queue.push(_logger(log, "mb0.l0"))
    queue.push(_logger(log, "mb0.l1"))
    queue.seal([0])
    queue.push(_logger(log, "mb1"))
    queue.seal([1, 2])
    queue.push(_logger(log, "mb2"))
    queue.seal([0])
    queue.seal([2])  # a backward that deferred nothing adds no pass
    assert len(queue) == 3
    queue.run_for([0])
    assert log == ["mb0.l0", "mb0.l1", "mb2"], "a step runs every pass of its adapter, in order"
    assert len(queue) == 1
    assert queue.run_oldest()
    assert log[-1] == "mb1"
    assert not queue.run_oldest(), "an empty queue has nothing to run"


def test_queue_runs_the_oldest_when_too_many_wait():
    log: list[str] = []
    queue = WgradQueue(max_pending=2)
    for k in range(4):
        queue.push(_logger(log, f"mb{k}"))
        queue.seal([k])
    assert log == ["mb0", "mb1"], "at most max_pending passes may hold their inputs"
    queue.run_all()
    assert log == ["mb0", "mb1", "mb2", "mb3"]
    queue.push(_logger(log, "dropped"))
    queue.seal([0])
    queue.clear()
    queue.run_all()
    assert log[-1] == "mb3", "clear drops waiting work"
    with pytest.raises(ValueError, match="max_pending must be >= 1, got 0"):
        WgradQueue(max_pending=0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_deferred_lora_a_grads_equal_immediate_ones(megatron_single_process, dropout):
    adapters = [dataclasses.replace(ADAPTERS[0], dropout=dropout), *ADAPTERS[1:]]
    batches = [
        make_packed_batch([0, 1, 2], [6, 5, 7], 3, seed=4, dropout_seed=9),
        make_packed_batch([0, 2, 2], [3, 8, 4], 3, seed=5, dropout_seed=10),
    ]
    grads = {}
    for defer in (False, True):
        model = build_gpt_model(TINY).train()
        context = apply_lora(model, adapters, seed=2)
        randomize_lora_b(context, seed=3)  # non-zero B so that A gets gradients
        queue = WgradQueue(max_pending=4) if defer else None
        context.wgrad_queue = queue
        for batch in batches:
            labels = torch.roll(batch.input_ids, -1, dims=1)
            run_model(model, context, batch, labels=labels).sum().backward()
            if defer:
                queue.seal(batch.adapters)
                grads_0 = context.adapter_grads(0)
                a_grads = [g for n, g in grads_0.items() if "lora_A" in n]
                assert not any(g.any() for g in a_grads), "dA must wait in the queue"
                b_grads = [g for n, g in grads_0.items() if "lora_B" in n]
                assert all(g.any() for g in b_grads), "dB is never deferred"
        if defer:
            assert len(queue) == 2
            queue.run_all()
        grads[defer] = {
            (a, n): g.clone() for a in range(3) for n, g in context.adapter_grads(a).items()
        }
    assert grads[True].keys() == grads[False].keys()
    for key, value in grads[False].items():
        torch.testing.assert_close(grads[True][key], value, **TOL, msg=f"grad of {key}")
