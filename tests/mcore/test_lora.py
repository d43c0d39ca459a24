"""LoRA wrappers and `apply_lora` at TP = 1: exact base at B = 0, merged weights, gradients."""

import dataclasses
import math

import pytest
import torch
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

from megatron_lorafusion.config import adapter_scaling
from megatron_lorafusion.mcore import (
    LoRAColumnParallelLinear,
    LoRARowParallelLinear,
    apply_lora,
    build_gpt_model,
)
from megatron_lorafusion.ops import AdapterLayout, lora_linear_ref

# dtype -> tolerances; W·x + s·(x·Aᵀ)·Bᵀ and (W + s·B·A)·x round differently in fp32.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5)}
# CUDA vs CPU: the fused Triton kernels' tl.dot runs fp32 inputs in TF32 (10-bit mantissa).
# bf16: the whole model runs in bf16 against an fp32 CPU run (per-token loss ~5.5).
GPU_TOL = {
    torch.float32: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
}

TARGETS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def test_apply_lora_wraps_targets_and_inits_like_peft(tiny_model):
    context = apply_lora(tiny_model, ADAPTERS, seed=7)
    layer = tiny_model.decoder.layers[1]
    assert isinstance(layer.self_attention.linear_qkv, LoRAColumnParallelLinear)
    assert isinstance(layer.self_attention.linear_proj, LoRARowParallelLinear)
    assert isinstance(layer.mlp.linear_fc1, LoRAColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, LoRARowParallelLinear)
    names = list(context.adapter_tensors(1))
    assert names == [
        f"decoder.layers.{i}.{t}.lora_{f}"
        for i in range(2)
        for t in ("self_attention.linear_qkv", "mlp.linear_fc2")
        for f in "AB"
    ]
    for a, adapter in enumerate(ADAPTERS):
        for name, param in context.adapter_tensors(a).items():
            assert param.dtype == torch.float32, name
            if name.endswith("lora_B"):
                assert param.shape[1] == adapter.rank, name
                assert not param.any(), f"{name} must start at 0"
            else:
                bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform(a=sqrt(5))
                assert param.shape[0] == adapter.rank, name
                assert param.abs().max() <= bound, name
    assert not any(p.requires_grad for p in tiny_model.parameters()), "the base must be frozen"
    assert context.weights.requires_grad, "the adapters' weight table must be trainable"
    assert context.weights.shape[0] == len(ADAPTERS), "one row of weights per adapter"

    again = apply_lora(build_gpt_model(TINY), ADAPTERS, seed=7)
    other = apply_lora(build_gpt_model(TINY), ADAPTERS, seed=8)
    sd, sd_again, sd_other = (c.adapter_state_dict(0) for c in (context, again, other))
    key = "decoder.layers.0.self_attention.linear_qkv.lora_A"
    torch.testing.assert_close(
        sd_again[key], sd[key], atol=0, rtol=0, msg="same seed must give the same init"
    )
    assert not torch.equal(sd_other[key], sd[key])
    assert not torch.equal(sd[key], sd["decoder.layers.1.self_attention.linear_qkv.lora_A"])


def test_lora_with_zero_b_equals_base_model(tiny_model):
    batch = make_packed_batch([0, 0, 1, 2], [5, 8, 6, 3], 3, seed=4)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    with torch.no_grad():
        base_logits = run_model(tiny_model, None, batch)
        base_loss = run_model(tiny_model, None, batch, labels=labels)
        context = apply_lora(tiny_model, ADAPTERS, seed=1)
        lora_logits = run_model(tiny_model, context, batch)
        lora_loss = run_model(tiny_model, context, batch, labels=labels)
    torch.testing.assert_close(
        lora_logits, base_logits, **TOL[torch.float32], msg="B = 0 must leave the logits unchanged"
    )
    torch.testing.assert_close(
        lora_loss,
        base_loss,
        **TOL[torch.float32],
        msg="B = 0 must leave the per-token loss unchanged",
    )


def test_merged_weights_reproduce_lora_output(tiny_model):
    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=3)
    batch = make_packed_batch([0, 1, 1, 2], [7, 4, 6, 5], 3, seed=5)
    with torch.no_grad():
        logits = run_model(tiny_model, context, batch)[0]
        for a in range(len(ADAPTERS)):
            merged = build_gpt_model(TINY).eval()  # same init_seed: same base
            for name, weight in context.merged_weights(a).items():
                merged.get_submodule(name.removesuffix(".weight")).weight.copy_(weight)
            merged_logits = run_model(merged, None, batch)[0]
            for i in (i for i, ad in enumerate(batch.adapters) if ad == a):
                torch.testing.assert_close(
                    logits[batch.sample(i)],
                    merged_logits[batch.sample(i)],
                    **TOL[torch.float32],
                    msg=f"sample {i}: LoRA output differs from W + s·B·A of adapter {a}",
                )
            assert not torch.allclose(
                merged_logits, run_model(build_gpt_model(TINY).eval(), None, batch)[0]
            )


@pytest.mark.parametrize("wrapped", TARGETS)
def test_wrapper_matches_reference_op_on_unpacked_batch(tiny_model, wrapped):
    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=4)
    wrapper = tiny_model.decoder.layers[0].get_submodule(wrapped)
    seq, batch = 5, 2
    in_features = wrapper.weight.shape[1]
    x = torch.randn(seq, batch, in_features)  # [s, b, h]: sample b is x[:, b]
    context.layout = AdapterLayout.from_samples([0, 2], [seq, seq], 3)
    with torch.no_grad():
        out, bias = wrapper(x)
        lora_a, lora_b = (
            torch.zeros(3, 8, in_features),
            torch.zeros(3, wrapper.weight.shape[0], 8),
        )
        name = f"decoder.layers.0.{wrapped}"
        for a, adapter in enumerate(ADAPTERS):
            views = context.adapter_tensors(a)
            if f"{name}.lora_A" in views:
                lora_a[a, : adapter.rank] = views[f"{name}.lora_A"]
                lora_b[a, :, : adapter.rank] = views[f"{name}.lora_B"]
        expected = (
            lora_linear_ref(
                x.transpose(0, 1).reshape(-1, in_features),
                wrapper.weight,
                None,
                lora_a,
                lora_b,
                [adapter_scaling(ad) for ad in ADAPTERS],
                [0.0] * 3,
                context.layout,
            )
            .reshape(batch, seq, -1)
            .transpose(0, 1)
        )
    assert bias is None
    torch.testing.assert_close(
        out, expected, **TOL[torch.float32], msg=f"{wrapped} differs from lora_linear_ref"
    )


def test_gradients_reach_only_adapters_in_the_microbatch(tiny_model):
    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=3)  # non-zero B so that A gets gradients too
    batch = make_packed_batch([0, 0, 2], [5, 7, 6], 3, seed=6)  # adapter 1 absent
    labels = torch.roll(batch.input_ids, -1, dims=1)
    run_model(tiny_model, context, batch, labels=labels).sum().backward()

    assert all(p.grad is None for n, p in tiny_model.named_parameters() if ".lora_" not in n), (
        "frozen base parameters got gradients"
    )
    assert not any(g.any() for g in context.adapter_grads(1).values()), (
        "adapter 1 has no tokens in this microbatch and must get a zero gradient"
    )
    packed_grads = {a: {n: g.clone() for n, g in context.adapter_grads(a).items()} for a in (0, 2)}
    for a, grads in packed_grads.items():
        assert all(g.abs().sum() > 0 for g in grads.values()), f"adapter {a} lacks gradients"
    # Samples are independent: each adapter's gradient equals that of its samples run alone.
    for a, samples in ((0, [0, 1]), (2, [2])):
        context.grads.zero_()
        ids = torch.cat([batch.input_ids[:, batch.sample(i)] for i in samples], dim=1)
        alone = make_packed_batch(
            [a] * len(samples), [batch.lengths[i] for i in samples], 3, input_ids=ids
        )
        alone_labels = torch.cat([labels[:, batch.sample(i)] for i in samples], dim=1)
        run_model(tiny_model, context, alone, labels=alone_labels).sum().backward()
        for name, grad in context.adapter_grads(a).items():
            torch.testing.assert_close(
                packed_grads[a][name],
                grad,
                **TOL[torch.float32],
                msg=f"{name}: packed gradient != gradient run alone",
            )


def test_forward_without_layout_raises(tiny_model):
    apply_lora(tiny_model, ADAPTERS, seed=1)
    batch = make_packed_batch([0], [4], 3)
    with pytest.raises(RuntimeError, match="no AdapterLayout set"):
        run_model(tiny_model, None, batch)
    context = apply_lora(build_gpt_model(TINY), ADAPTERS, seed=1)
    context.layout = AdapterLayout.from_samples([0], [5], 3)
    with pytest.raises(ValueError, match="covers 5 tokens, the input has 4"):
        context.wrappers["decoder.layers.0.self_attention.linear_qkv"](torch.zeros(4, 1, 64))
    with pytest.raises(RuntimeError, match="already applied"):
        apply_lora(tiny_model, ADAPTERS, seed=1)


def test_lora_dropout_is_seeded_and_training_only(tiny_model):
    adapters = [
        dataclasses.replace(ADAPTERS[0], dropout=0.3),
        ADAPTERS[1],
        dataclasses.replace(ADAPTERS[2], dropout=0.1),
    ]
    context = apply_lora(tiny_model, adapters, seed=2)
    randomize_lora_b(context, seed=3, std=0.5)
    batch = make_packed_batch([0, 1, 2], [6, 5, 4], 3, seed=7, dropout_seed=11)
    reseeded = make_packed_batch(
        [0, 1, 2], [6, 5, 4], 3, input_ids=batch.input_ids, dropout_seed=12
    )
    with torch.no_grad():
        eval_logits = run_model(tiny_model, context, batch)[0]
        tiny_model.train()
        train_logits = run_model(tiny_model, context, batch)[0]
        train_again = run_model(tiny_model, context, batch)[0]
        train_reseeded = run_model(tiny_model, context, reseeded)[0]
    torch.testing.assert_close(
        train_again,
        train_logits,
        atol=0,
        rtol=0,
        msg="the same dropout_seed must give the same masks (recompute)",
    )
    torch.testing.assert_close(
        train_logits[batch.sample(1)],
        eval_logits[batch.sample(1)],
        **TOL[torch.float32],
        msg="adapter 1 has no dropout",
    )
    for i in (0, 2):
        assert not torch.allclose(train_logits[batch.sample(i)], eval_logits[batch.sample(i)])
        assert not torch.allclose(train_logits[batch.sample(i)], train_reseeded[batch.sample(i)])


def test_adapter_state_dict_roundtrip_and_strict_load(tiny_model):
    context = apply_lora(tiny_model, ADAPTERS, seed=1)
    source = apply_lora(build_gpt_model(TINY), ADAPTERS, seed=9)
    randomize_lora_b(source, seed=10)
    state = source.adapter_state_dict(2)
    context.load_adapter_state_dict(2, state)
    for name, value in context.adapter_state_dict(2).items():
        torch.testing.assert_close(value, state[name], atol=0, rtol=0, msg=f"{name} not loaded")
    assert not torch.equal(
        context.adapter_state_dict(0)["decoder.layers.0.mlp.linear_fc1.lora_A"],
        source.adapter_state_dict(0)["decoder.layers.0.mlp.linear_fc1.lora_A"],
    )

    before = context.adapter_state_dict(2)
    broken = dict(state)
    del broken["decoder.layers.1.mlp.linear_fc2.lora_B"]
    broken["decoder.layers.0.mlp.linear_fc1.lora_A"] = torch.zeros(3, 64)
    broken["decoder.layers.0.mlp.lora_C"] = torch.zeros(1)
    with pytest.raises(ValueError, match="cannot load adapter 2") as info:
        context.load_adapter_state_dict(2, broken)
    message = str(info.value)
    assert "missing key 'decoder.layers.1.mlp.linear_fc2.lora_B'" in message
    assert "unexpected key 'decoder.layers.0.mlp.lora_C'" in message
    assert "decoder.layers.0.mlp.linear_fc1.lora_A has shape (3, 64), expected (8, 64)" in message
    for name, value in context.adapter_state_dict(2).items():
        torch.testing.assert_close(
            value, before[name], atol=0, rtol=0, msg=f"{name} changed by a failed load"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_on_cuda_matches_cpu(megatron_single_process, dtype):
    """CUDA runs the fused `lora_linear` (TP = 1) and, in bf16, varlen_attn; CPU the references."""
    batch = make_packed_batch([0, 0, 2], [40, 23, 31], 3, seed=9)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    results = {}
    for device, params_dtype in (("cpu", torch.float32), ("cuda", dtype)):
        model = build_gpt_model(TINY, device=device, params_dtype=params_dtype).eval()
        context = apply_lora(model, ADAPTERS, seed=2)
        randomize_lora_b(context, seed=3)
        on_device = make_packed_batch(
            batch.adapters,
            batch.lengths,
            3,
            input_ids=batch.input_ids.to(device),
            device=device,
        )
        loss = run_model(model, context, on_device, labels=labels.to(device))
        loss.sum().backward()
        grads = {n: g.cpu() for a in (0, 2) for n, g in context.adapter_grads(a).items()}
        results[device] = (loss.detach().float().cpu(), grads)
    tol = GPU_TOL[dtype]
    torch.testing.assert_close(
        results["cuda"][0], results["cpu"][0], **tol, msg=f"{dtype} loss on CUDA != fp32 CPU"
    )
    if dtype != torch.float32:
        return  # bf16 activations: gradients are checked in fp32 only
    for name, grad in results["cpu"][1].items():
        torch.testing.assert_close(
            results["cuda"][1][name], grad, **tol, msg=f"{name}: gradient on CUDA != CPU"
        )


@pytest.mark.parametrize("wrapped", ["self_attention.linear_qkv", "mlp.linear_fc2"])
def test_wrapper_rebuilds_a_fused_base_output_and_keeps_any_other_input(tiny_model, wrapped):
    """Selective recompute in the wrapper: the output of the norm (or SwiGLU) feeding it is
    not saved; a plain input, or any input with ``rebuild_inputs`` off, is (as before)."""
    context = apply_lora(tiny_model.train(), ADAPTERS, seed=2)
    layer = tiny_model.decoder.layers[1]
    wrapper = layer.get_submodule(wrapped)
    if wrapped.endswith("qkv"):
        producer = lambda x: layer.input_layernorm(x)[0]  # noqa: E731 - (output, residual)
    else:
        producer = layer.mlp.activation_func
    width = TINY.hidden_size if wrapped.endswith("qkv") else 2 * TINY.ffn_hidden_size
    context.layout = AdapterLayout.from_samples([0, 2], [4, 3], 3)
    source = torch.randn(7, 1, width, requires_grad=True)
    for rebuild, marked in ((True, True), (True, False), (False, True)):
        context.rebuild_inputs = rebuild
        x = producer(source) if marked else torch.randn(7, 1, wrapper.weight.shape[1])
        saved = set()

        def pack(t, saved=saved):
            saved.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            wrapper(x)
        kept = x.untyped_storage().data_ptr() in saved
        assert kept != (rebuild and marked), (
            f"rebuild_inputs={rebuild}, marked={marked}: X saved={kept}"
        )


def test_factors_are_views_of_one_cast_per_version_of_the_weights(tiny_model):
    """Every wrapper reads its factors from one compute-dtype copy of the table, made again
    only after the weights change in place (here: as the optimizer's kernel marks them)."""
    from megatron_lorafusion.mcore.lora import _compute_factors

    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    compute = context.compute_weights(torch.float16)
    start, end = compute.data_ptr(), compute.data_ptr() + compute.nbytes
    layout = AdapterLayout.from_samples([0], [4], len(ADAPTERS))
    for name, wrapper in context.wrappers.items():
        lora_a, lora_b = _compute_factors(wrapper, torch.float16, layout)
        for factor, fp32 in ((lora_a, wrapper.lora_A), (lora_b, wrapper.lora_B)):
            assert start <= factor.data_ptr() < end, f"{name}: a copy, not a view of the cast"
            torch.testing.assert_close(factor, fp32.half(), atol=0, rtol=0, msg=name)
    assert context.compute_weights(torch.float16) is compute, "cast again without a change"
    torch.autograd.graph.increment_version(context.weights)  # what ops.adapter_adamw_ does
    assert context.compute_weights(torch.float16) is not compute, "stale after a step"
    with torch.no_grad():
        next(iter(context.adapter_tensors(0).values())).add_(1.0)
    again = context.compute_weights(torch.float16)
    assert again is not context.compute_weights(torch.float32), "one cast per dtype"


@pytest.mark.gpu
def test_cuda_wrapper_forward_copies_no_factor(megatron_single_process):
    """The fused path reads the factors through their strides: no per-layer copy of them."""
    model = build_gpt_model(TINY, device="cuda", params_dtype=torch.bfloat16).train()
    context = apply_lora(model, ADAPTERS, seed=2)
    context.layout = AdapterLayout.from_samples([0, 2], [40, 24], 3, "cuda")
    wrapper = model.decoder.layers[0].mlp.linear_fc1
    x = torch.randn(64, 1, TINY.hidden_size, device="cuda", dtype=torch.bfloat16)
    wrapper(x)  # compiles, casts the table once
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wrapper(x)
    copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone")]
    assert not copies, f"the wrapper's forward copied: {copies}"


def test_backward_adds_the_gradients_of_the_microbatchs_adapters_only(tiny_model, monkeypatch):
    """Every layer's gradient add gets the layout's adapters (here 0 and 2, not 1), and the
    absent adapter's row of the gradient table stays exactly zero."""
    import megatron_lorafusion.ops.packed_factor as packed_factor

    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=3)
    given = []
    add = packed_factor.packed_factors_bwd

    def spy(grads, column, grad_a, grad_b, rows=None):
        given.append(None if rows is None else rows.tolist())
        add(grads, column, grad_a, grad_b, rows)

    monkeypatch.setattr(packed_factor, "packed_factors_bwd", spy)
    batch = make_packed_batch([0, 2], [5, 7], len(ADAPTERS), seed=4)
    run_model(tiny_model.train(), context, batch, labels=batch.input_ids).sum().backward()
    assert given, "no gradient was added"
    assert all(rows == [0, 2] for rows in given), given
    assert not context.grads[1].any(), "adapter 1 has no tokens: its gradients stay zero"
    assert context.grads[0].any(), "adapter 0 has tokens"
    assert context.grads[2].any(), "adapter 2 has tokens"


def test_replicated_columns_cover_every_replicated_factor_and_nothing_else(tiny_model):
    """The TP norm's column mask: every entry of a factor TP does not split, for every
    adapter; no entry of a split one (columns outside every adapter's views, the padding
    beyond its rank, hold zero gradients and may go either way)."""
    context = apply_lora(tiny_model, ADAPTERS, seed=2)
    replicated = {name for name, split in context.sharding().items() if split is None}
    assert replicated, "a column-parallel lora_A and a row-parallel lora_B are replicated"
    mask = context.replicated_columns().expand(context.num_adapters, -1).contiguous()
    for a in range(context.num_adapters):
        for name, view in context.adapter_views(mask, a).items():
            want = name in replicated
            assert bool(view.all()) == want, (a, name)
            assert bool(view.any()) == want, (a, name)


def test_apply_lora_draws_in_one_pool_that_ends_with_the_call(tiny_model):
    """Every linear's A factors are drawn by one pool of `apply_lora`'s own, and none of its
    threads outlives the call (a process forked later must not inherit a pool)."""
    import threading
    from unittest import mock

    from megatron_lorafusion.mcore import lora

    pools = []
    real = lora._init_factors

    def spy(*args, **kwargs):
        pools.append(kwargs["draw_pool"])
        return real(*args, **kwargs)

    with mock.patch.object(lora, "_init_factors", spy):
        context = apply_lora(tiny_model, ADAPTERS, seed=7)
    assert len(pools) == len(context.wrappers), "one draw per wrapped linear"
    assert pools[0] is not None, "apply_lora passes its pool"
    assert all(pool is pools[0] for pool in pools), "one pool for every linear"
    left = [t.name for t in threading.enumerate() if t.name.startswith("lorafusion-draw")]
    assert not left, f"draw threads outlived apply_lora: {left}"
