"""`build_gpt_model`: a deterministic, frozen Llama-like GPTModel running packed batches."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from mcore_testing import TINY, make_packed_batch, run_model

from megatron_lorafusion.mcore import VarlenCoreAttention, build_gpt_model
from megatron_lorafusion.mcore.model import _name_seed

# dtype -> tolerances of fp32 recomputations of the same function.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}


def test_build_gpt_model_is_deterministic_and_frozen(megatron_single_process):
    torch.manual_seed(123)
    model = build_gpt_model(TINY)
    rng_after = torch.rand(1)
    torch.manual_seed(123)
    torch.rand(1)
    again = build_gpt_model(TINY)
    other = build_gpt_model(dataclasses.replace(TINY, init_seed=TINY.init_seed + 1))

    state, state_again, state_other = (
        {k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
        for m in (model, again, other)
    )
    for key, value in state.items():
        torch.testing.assert_close(
            state_again[key], value, atol=0, rtol=0, msg=f"{key} differs for the same init_seed"
        )
    assert not torch.equal(
        state["decoder.layers.0.mlp.linear_fc1.weight"],
        state_other["decoder.layers.0.mlp.linear_fc1.weight"],
    )
    assert all(not p.requires_grad for p in model.parameters()), "base parameters must be frozen"
    # Building draws from a private RNG: the caller's global stream is untouched.
    torch.manual_seed(123)
    torch.testing.assert_close(
        torch.rand(1), rng_after, atol=0, rtol=0, msg="build_gpt_model consumed the global RNG"
    )

    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.core_attention, VarlenCoreAttention)
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm, model.decoder.final_layernorm):
        assert isinstance(norm, torch.nn.RMSNorm), f"{type(norm).__name__} is not an RMSNorm"
    assert all(
        getattr(m, "bias", None) is None
        for m in model.modules()
        if type(m).__name__.endswith("ParallelLinear")
    ), "Llama linears have no bias"
    assert model.output_layer.weight is not model.embedding.word_embeddings.weight
    assert tuple(layer.self_attention.linear_qkv.weight.shape) == (
        TINY.hidden_size + 2 * TINY.num_query_groups * TINY.hidden_size // TINY.num_attention_heads,
        TINY.hidden_size,
    ), "GQA: qkv rows = H + 2 · groups · head_dim"
    assert tuple(layer.mlp.linear_fc1.weight.shape) == (2 * TINY.ffn_hidden_size, TINY.hidden_size)


def test_random_base_holds_each_weights_own_draw_and_megatrons_marks(megatron_single_process):
    """Built empty and drawn tensor by tensor: the values of a generator keyed by the weight's
    name, Megatron's tensor-parallel marks kept (a TP shard is cut by them)."""
    model = build_gpt_model(TINY, params_dtype=torch.bfloat16)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    fc1 = model.get_parameter(name)
    generator = torch.Generator().manual_seed(_name_seed(TINY.init_seed, name))
    drawn = torch.randn(tuple(fc1.shape), generator=generator) * TINY.init_method_std
    torch.testing.assert_close(fc1, drawn.to(torch.bfloat16), atol=0, rtol=0)
    assert (fc1.tensor_model_parallel, fc1.partition_dim, fc1.partition_stride) == (True, 0, 2)
    proj = model.decoder.layers[0].self_attention.linear_proj.weight
    assert (proj.tensor_model_parallel, proj.partition_dim) == (True, 1)
    norm = model.decoder.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert norm.sequence_parallel is False
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    biased = build_gpt_model(dataclasses.replace(TINY, add_qkv_bias=True))
    bias = biased.decoder.layers[0].self_attention.linear_qkv.bias
    assert torch.equal(bias, torch.zeros_like(bias)), "a random base's biases are zeros"


def test_build_gpt_model_needs_parallel_state():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        build_gpt_model(TINY)


def test_packed_forward_returns_per_token_loss(tiny_model):
    batch = make_packed_batch([0, 0, 1], [5, 9, 4], 2, seed=1)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    with torch.no_grad():
        loss = run_model(tiny_model, None, batch, labels=labels)
        logits = run_model(tiny_model, None, batch)
    assert loss.shape == (1, 18), f"per-token loss must be [1, T], got {tuple(loss.shape)}"
    assert logits.shape == (1, 18, TINY.vocab_size)
    expected = F.cross_entropy(logits[0], labels[0], reduction="none")[None]
    torch.testing.assert_close(
        loss,
        expected,
        **TOL[torch.float32],
        msg="loss is not the per-token cross-entropy of the logits",
    )


@pytest.mark.gpu
def test_cuda_build_equals_the_cpu_build(megatron_single_process):
    """The same random base on every device (drawn on the CPU, copied where the model lives)."""
    cpu = build_gpt_model(TINY).state_dict()
    cuda = build_gpt_model(TINY, device="cuda").state_dict()
    for name, value in cpu.items():
        if isinstance(value, torch.Tensor):
            assert cuda[name].device.type == "cuda", f"{name} is on {cuda[name].device}"
            torch.testing.assert_close(cuda[name].cpu(), value, atol=0, rtol=0, msg=name)
