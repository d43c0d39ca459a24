"""DoRA adapters in the LoRA wrappers (TP = 1): fresh = base, magnitudes packed, merge, grads.

A DoRA adapter on the four fused linears, one on q/v only (per-projection rows: k rows keep
scale 1 and their magnitude entries stay 0 with zero gradient) and a plain LoRA adapter
share every wrapper. PEFT's numbers are checked in `tests/ops/test_dora_scale.py` (one
linear) and `tests/train/test_export_dora.py` (the whole model).
"""

import pytest
import torch
from mcore_testing import TINY, make_packed_batch, randomize_lora_b, run_model

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.mcore import apply_lora, build_gpt_model

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5)}  # as tests/mcore/test_lora.py
GPU_TOL = dict(atol=5e-3, rtol=5e-3)  # CUDA fp32: the fused kernels' tl.dot runs in TF32

ADAPTERS = [
    AdapterConfig(name="dora", rank=4, alpha=8.0, use_dora=True),
    AdapterConfig(name="lora", rank=2, alpha=4.0),
    AdapterConfig(name="qv", rank=2, alpha=2.0, use_dora=True, target_modules=["q_proj", "v_proj"]),
]


def _perturb_magnitudes(context, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in range(context.num_adapters):
            for name, m in context.adapter_tensors(a).items():
                if name.endswith("lora_magnitude"):
                    noise = torch.randn(m.shape, generator=generator).to(m.device)
                    m.mul_(1 + 0.2 * noise).mul_(m != 0)


def test_dora_fresh_adapter_is_the_base_and_magnitude_is_row_norm(tiny_model):
    batch = make_packed_batch([0, 1, 2], [6, 5, 7], 3, seed=1)
    with torch.no_grad():
        base = run_model(tiny_model, None, batch)
        context = apply_lora(tiny_model, ADAPTERS, seed=3)
        fresh = run_model(tiny_model, context, batch)
    torch.testing.assert_close(fresh, base, **TOL[torch.float32], msg="fresh DoRA != base")
    names = context.adapter_tensors(0)
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    weight = tiny_model.decoder.layers[0].self_attention.linear_qkv.weight
    torch.testing.assert_close(names[f"{qkv}.lora_magnitude"], weight.norm(dim=1), msg="m init")
    assert not any(n.endswith("lora_magnitude") for n in context.adapter_tensors(1)), "LoRA"
    qv = context.adapter_tensors(2)
    assert set(qv) == {
        f"decoder.layers.{i}.self_attention.linear_qkv.{f}"
        for i in (0, 1)
        for f in ("lora_A", "lora_B", "lora_magnitude")
    }
    k_rows = context.wrappers[qkv].row_vector_on[2] == 0
    assert k_rows.sum() == 2 * 16, "k rows of the two query groups (head dim 16)"
    assert not qv[f"{qkv}.lora_magnitude"][k_rows].any(), "k rows carry no magnitude"


def test_dora_merged_weights_reproduce_the_output(tiny_model):
    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=3, std=0.2)
    _perturb_magnitudes(context, seed=4)
    batch = make_packed_batch([0, 1, 2, 2], [7, 4, 6, 5], 3, seed=5)
    with torch.no_grad():
        logits = run_model(tiny_model, context, batch)[0]
        for a in range(len(ADAPTERS)):
            merged = build_gpt_model(TINY).eval()
            for name, weight in context.merged_weights(a).items():
                merged.get_submodule(name.removesuffix(".weight")).weight.copy_(weight)
            merged_logits = run_model(merged, None, batch)[0]
            for i in (i for i, ad in enumerate(batch.adapters) if ad == a):
                torch.testing.assert_close(
                    logits[batch.sample(i)],
                    merged_logits[batch.sample(i)],
                    **TOL[torch.float32],
                    msg=f"sample {i}: output differs from adapter {a}'s merged weights",
                )


def test_dora_magnitudes_get_gradients_only_where_they_scale(tiny_model):
    context = apply_lora(tiny_model.train(), ADAPTERS, seed=2)
    randomize_lora_b(context, seed=3)
    batch = make_packed_batch([0, 1, 2], [7, 4, 6], 3, seed=5)
    run_model(tiny_model, context, batch).square().mean().backward()
    for a, adapter in enumerate(ADAPTERS):
        for name, grad in context.adapter_grads(a).items():
            if not name.endswith("lora_magnitude"):
                continue
            on = context.wrappers[name.removesuffix(".lora_magnitude")].row_vector_on[a]
            assert grad[on].abs().min() > 0, f"{adapter.name} {name}: a live magnitude got 0"
            assert not grad[~on].any(), f"{adapter.name} {name}: an off-block row got a grad"
    for name in context.wrappers:
        if context.wrappers[name].row_vector is not None:
            view = context.adapter_views(context.grads, 1)
            assert f"{name}.lora_magnitude" not in view, "the LoRA adapter has no magnitude"


@pytest.mark.gpu
def test_dora_on_cuda_matches_cpu(megatron_single_process):
    """CUDA runs the fused `lora_linear` then `dora_scale`'s kernels (TP = 1); CPU references."""
    batch = make_packed_batch([0, 1, 2], [40, 23, 31], 3, seed=9)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    results = {}
    for device in ("cpu", "cuda"):
        model = build_gpt_model(TINY, device=device, params_dtype=torch.float32).eval()
        context = apply_lora(model, ADAPTERS, seed=2)
        randomize_lora_b(context, seed=3, std=0.2)
        _perturb_magnitudes(context, seed=4)
        on_device = make_packed_batch(
            batch.adapters, batch.lengths, 3, input_ids=batch.input_ids.to(device), device=device
        )
        loss = run_model(model, context, on_device, labels=labels.to(device))
        loss.sum().backward()
        grads = {n: g.cpu() for a in range(3) for n, g in context.adapter_grads(a).items()}
        results[device] = (loss.detach().cpu(), grads)
    torch.testing.assert_close(
        results["cuda"][0], results["cpu"][0], **GPU_TOL, msg="DoRA loss on CUDA != CPU"
    )
    for name, grad in results["cpu"][1].items():
        scale = grad.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(
            results["cuda"][1][name] / scale, grad / scale, **GPU_TOL, msg=f"grad of {name}"
        )


@pytest.mark.parametrize("wrapped", ["self_attention.linear_qkv", "mlp.linear_fc2"])
def test_dora_wrapper_matches_its_adapter_type_reference(tiny_model, wrapped):
    """One wrapper on an unpacked [s, b, h] batch: each sample as its variant's reference."""
    from megatron_lorafusion.adapter_types import adapter_type
    from megatron_lorafusion.ops import AdapterLayout

    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=4, std=0.2)
    _perturb_magnitudes(context, seed=5)
    wrapper = tiny_model.decoder.layers[0].get_submodule(wrapped)
    name = f"decoder.layers.0.{wrapped}"
    seq = 5
    x = torch.randn(seq, 2, wrapper.weight.shape[1])  # sample b is x[:, b]
    context.layout = AdapterLayout.from_samples([0, 1], [seq, seq], 3)
    with torch.no_grad():
        out, _ = wrapper(x)
        for b, a in enumerate((0, 1)):
            merged = wrapper.merged_weight(a)  # per-projection B masked as the forward does
            factors = context.adapter_tensors(a)
            lora_a, lora_b = factors[f"{name}.lora_A"], factors[f"{name}.lora_B"]
            vector = factors.get(f"{name}.lora_magnitude")
            want = adapter_type(ADAPTERS[a]).reference(
                x[:, b], wrapper.weight, None, lora_a, lora_b, wrapper.scalings[a], vector
            )
            torch.testing.assert_close(out[:, b], want, **TOL[torch.float32], msg=f"adapter {a}")
            torch.testing.assert_close(
                out[:, b], x[:, b] @ merged.t(), **TOL[torch.float32], msg=f"merged {a}"
            )


def test_apply_lora_refuses_dora_above_tp_one_naming_the_adapter(tiny_model):
    """DoRA is tp = 1 only (docs/adapters.md); a TP group of 2 is refused before any wrap."""

    class TwoRanks:
        def size(self):
            return 2

        def rank(self):
            return 0

    with pytest.raises(NotImplementedError, match="adapter 'dora' uses dora .* tp = 1 only"):
        apply_lora(tiny_model, ADAPTERS, seed=1, tp_group=TwoRanks())
