"""Per-projection targets on the fused linears: stacked blocks, a block-diagonal B kept so.

An adapter naming Hugging Face projections gets, on linear_qkv / linear_fc1, rank k·r: its k
blocks' A rows stacked and a B whose entries outside the blocks are masked in every forward,
so they change nothing and get exactly zero gradient (PEFT equality itself:
tests/train/test_export_projections.py).
"""

import pytest
import torch
from mcore_testing import TINY, make_packed_batch, run_model

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.mcore import apply_lora, build_gpt_model

# dtype -> tolerances; the same network with and without the masked entries, in fp32.
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6)}
ADAPTERS = [
    AdapterConfig(name="qv", rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"]),
    AdapterConfig(name="all", rank=3, alpha=3.0, target_modules=["all-linear"]),
    AdapterConfig(name="fused", rank=4, alpha=8.0, target_modules=["linear_qkv", "up_proj"]),
]
HEAD = TINY.hidden_size // TINY.num_attention_heads  # 16: a group's rows are [q 32 | k 16 | v 16]
QKV = "decoder.layers.0.self_attention.linear_qkv"
FC1 = "decoder.layers.0.mlp.linear_fc1"


def test_projection_targets_stack_blocks_per_fused_linear(tiny_model):
    context = apply_lora(tiny_model, ADAPTERS, seed=3)
    shapes = {
        a: {k: tuple(v.shape) for k, v in context.adapter_tensors(a).items()}
        for a in range(len(ADAPTERS))
    }
    hidden, qkv_out, fc1_out = TINY.hidden_size, 4 * 2 * HEAD, 2 * TINY.ffn_hidden_size
    assert shapes[0] == {
        f"decoder.layers.{i}.self_attention.linear_qkv.lora_{f}": s
        for i in range(2)
        for f, s in (("A", (4, hidden)), ("B", (qkv_out, 4)))
    }
    assert shapes[1][f"{QKV}.lora_A"] == (9, hidden), "q, k, v: 3 blocks of rank 3"
    assert shapes[1][f"{FC1}.lora_B"] == (fc1_out, 6), "gate, up: 2 blocks of rank 3"
    assert shapes[1]["decoder.layers.0.mlp.linear_fc2.lora_A"] == (3, TINY.ffn_hidden_size)
    assert shapes[2][f"{QKV}.lora_A"] == (4, hidden), "linear_qkv: one LoRA, A shared"
    assert shapes[2][f"{FC1}.lora_B"] == (fc1_out, 4), "up_proj alone: one block"

    off = context.wrappers[QKV].lora_B_off  # (A, N, R) with R = 9
    group = off[0, : 4 * HEAD]  # adapter qv, query group 0: rows [q 32 | k 16 | v 16]
    expected = torch.ones(4 * HEAD, 9, dtype=torch.bool)
    expected[: 2 * HEAD, :2] = False  # q rows: rank columns 0-1 (block 0)
    expected[3 * HEAD :, 2:4] = False  # v rows: rank columns 2-3 (block 1); k rows: none
    torch.testing.assert_close(group, expected, atol=0, rtol=0, msg="adapter qv's blocks")
    torch.testing.assert_close(
        off[0, 4 * HEAD :], group, atol=0, rtol=0, msg="query group 1 repeats group 0's pattern"
    )
    assert not off[2, :, :4].any(), "a fused target has no mask in its rank"
    up = context.wrappers[FC1].lora_B_off[2]
    assert up[: TINY.ffn_hidden_size].all(), "gate rows of an up_proj adapter: all masked"
    assert not up[TINY.ffn_hidden_size :, :4].any(), "up rows: its one block"


def test_off_block_b_is_ignored_and_gets_zero_gradient(megatron_single_process):
    model = build_gpt_model(TINY).train()
    context = apply_lora(model, ADAPTERS, seed=3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every entry of B random, off-block ones included
        for wrapper in context.wrappers.values():
            wrapper.lora_B.copy_(torch.randn(wrapper.lora_B.shape, generator=generator) * 0.1)
    batch = make_packed_batch([0, 1, 1, 2], [7, 5, 6, 4], 3, seed=2)
    logits = run_model(model, context, batch)
    logits.square().sum().backward()
    masked = build_gpt_model(TINY).eval()
    with torch.no_grad():
        for name, wrapper in context.wrappers.items():
            assert wrapper.lora_B_off is None or name.endswith(("linear_qkv", "linear_fc1"))
            if wrapper.lora_B_off is not None:
                assert not wrapper.lora_B_grad[wrapper.lora_B_off].any(), (
                    f"{name}: off-block entries of B must get exactly zero gradient"
                )
                assert wrapper.lora_B_grad[~wrapper.lora_B_off].any(), f"{name}: B untrained"
                wrapper.lora_B.masked_fill_(wrapper.lora_B_off, 0.0)
        for a in range(len(ADAPTERS)):
            model.eval()
            for name, weight in context.merged_weights(a).items():
                masked.get_submodule(name.removesuffix(".weight")).weight.copy_(weight)
            merged = run_model(masked, None, batch)[0]
            for i in (i for i, owner in enumerate(batch.adapters) if owner == a):
                torch.testing.assert_close(
                    merged[batch.sample(i)],
                    logits.detach()[0, batch.sample(i)],
                    atol=2e-5,
                    rtol=2e-5,  # W·x + s·(x·Aᵀ)·Bᵀ vs (W + s·B·A)·x, as test_lora
                    msg=f"adapter {a}: merged weights (blocks only) != LoRA output",
                )
        zeroed = run_model(model, context, batch)
    torch.testing.assert_close(
        zeroed,
        logits.detach(),
        **TOL[torch.float32],
        msg="zeroing the off-block entries must change nothing",
    )


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["linear_fc1", "gate_proj"], "'gate_proj' in both 'linear_fc1' and 'gate_proj'"),
        (["q_proj", "lm_head"], "got 'lm_head'"),
    ],
)
def test_apply_lora_refuses_bad_targets(tiny_model, targets, message):
    with pytest.raises(ValueError, match=rf"adapters\[0\]\.target_modules .*{message}"):
        apply_lora(tiny_model, [AdapterConfig(name="x", target_modules=targets)], seed=1)


def test_apply_lora_refuses_a_fused_rank_above_the_kernels(tiny_model):
    adapter = AdapterConfig(name="x", rank=100, target_modules=["all-linear"])
    with pytest.raises(NotImplementedError, match=r"adapters\[0\] has rank 100 × 3 projections"):
        apply_lora(tiny_model, [adapter], seed=1)
