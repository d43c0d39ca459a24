"""`VarlenCoreAttention`: packed samples attend causally to themselves only, RoPE restarts.

Also its kernel choice (flash, flex, loop), FlexAttention's document-causal block mask,
sliding windows (Mistral, Gemma 3) on every kernel, and `PackedSelfAttention`'s fused split
(with Qwen3's and Gemma 3's q/k norms) against Megatron's own path.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

from megatron_lorafusion.mcore import apply_lora, attention, varlen_causal_attention_ref
from megatron_lorafusion.mcore import flex as flex_module
from megatron_lorafusion.ops import AdapterLayout

# dtype -> tolerances; fp32 recomputations of the same function in a different order
# (one packed call vs one call per sample) differ by a few ulps.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5)}
# CUDA: FlashAttention (varlen_attn) vs per-sample SDPA; both accumulate in fp32, the
# inputs and outputs are rounded to 16 bits (stack.md measured 2e-3 relative in bf16).
GPU_TOL = {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Ragged (not a multiple of FlexAttention's 128-token blocks, a 1-token sample) and round.
LENGTHS = {"ragged": [300, 17, 1, 129, 64], "round": [256, 256, 128, 384]}


def _cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _block_diagonal_causal(lengths) -> torch.Tensor:
    """(T, T) bool: query token i may attend to key token j."""
    tokens = sum(lengths)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (sample[:, None] == sample[None, :]) & torch.ones(tokens, tokens).tril().bool()


def test_varlen_attention_ref_matches_block_diagonal_causal_mask():
    lengths = [3, 7, 1, 5]
    tokens, heads, groups, head_dim = sum(lengths), 4, 2, 8
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, groups, head_dim)
    v = torch.randn(tokens, groups, head_dim)
    cu = torch.tensor([0, 3, 10, 11, 16], dtype=torch.int32)
    out = varlen_causal_attention_ref(q, k, v, cu, scale=head_dim**-0.5)

    allowed = _block_diagonal_causal(lengths)
    kv_heads = heads // groups  # query head j reads KV group j // kv_heads, as Megatron does
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(kv_heads, 1).transpose(0, 1),
        v.repeat_interleave(kv_heads, 1).transpose(0, 1),
        attn_mask=allowed,
        scale=head_dim**-0.5,
    ).transpose(0, 1)
    torch.testing.assert_close(
        out,
        expected,
        **TOL[torch.float32],
        msg="per-sample SDPA differs from a block-diagonal causal mask",
    )


@pytest.mark.parametrize(
    ("device", "dtype", "dropout", "flash", "flex", "expected"),
    [
        ("cuda", torch.bfloat16, 0.0, True, True, "flash"),
        ("cuda", torch.float16, 0.0, False, True, "flex"),  # torch without the varlen op
        ("cuda", torch.bfloat16, 0.0, False, False, "loop"),
        ("cuda", torch.float32, 0.0, True, True, "loop"),
        ("cuda", torch.bfloat16, 0.1, True, True, "loop"),  # attention dropout
        ("cpu", torch.bfloat16, 0.0, True, True, "loop"),
    ],
)
def test_attention_backend_prefers_flash_then_flex_then_loop(
    monkeypatch, device, dtype, dropout, flash, flex, expected
):
    monkeypatch.setattr(attention, "_flash_available", lambda device: flash)
    monkeypatch.setattr(attention, "_flex_available", lambda: flex)
    assert attention.attention_backend(torch.device(device), dtype, dropout) == expected


def test_attention_backend_forces_what_can_run_and_refuses_the_rest(monkeypatch):
    monkeypatch.setattr(attention, "_flash_available", lambda device: False)
    monkeypatch.setattr(attention, "_flex_available", lambda: True)
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert attention.attention_backend(cuda, bf16, 0.0, "flex") == "flex"
    assert attention.attention_backend(cuda, bf16, 0.0, "loop") == "loop"
    assert attention.attention_backend(cpu, torch.float32, 0.1, "loop") == "loop"
    with pytest.raises(RuntimeError, match="has no FlashAttention varlen op"):
        attention.attention_backend(cuda, bf16, 0.0, "flash")
    with pytest.raises(RuntimeError, match="needs a CUDA fp16/bf16 query"):
        attention.attention_backend(cpu, torch.float32, 0.0, "flex")
    with pytest.raises(ValueError, match="auto, flash, flex or loop, got 'sdpa'"):
        attention.attention_backend(cuda, bf16, 0.0, "sdpa")


def test_set_attention_backend_reaches_every_layer(tiny_model):
    attention.set_attention_backend(tiny_model, "flex")
    cores = [layer.self_attention.core_attention for layer in tiny_model.decoder.layers]
    assert [core.backend for core in cores] == ["flex"] * len(cores)
    context = _lora_model(tiny_model)
    batch = make_packed_batch([0, 1], [5, 9], 3, seed=7)
    with torch.no_grad(), pytest.raises(RuntimeError, match="'flex' needs a CUDA"):
        run_model(tiny_model, context, batch)  # a forced backend never falls back silently
    with pytest.raises(ValueError, match="has no VarlenCoreAttention"):
        attention.set_attention_backend(torch.nn.Linear(2, 2), "flex")
    with pytest.raises(ValueError, match="got 'fast'"):
        attention.set_attention_backend(tiny_model, "fast")


@pytest.mark.parametrize(
    "lengths",
    [*LENGTHS.values(), [5, 0, 700, 3, 0], [1] * 200 + [56]],
    ids=[*LENGTHS, "empty-samples", "many-short"],
)
def test_document_causal_block_mask_equals_create_block_mask(lengths):
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    tokens = sum(lengths)
    mask = flex_module.document_causal_block_mask(_cu_seqlens(lengths), tokens)
    torch.testing.assert_close(
        create_mask(mask.mask_mod, None, None, tokens, tokens, device="cpu")[0, 0],
        _block_diagonal_causal([n for n in lengths if n]),
        atol=0,
        rtol=0,
        msg="mask_mod is not the block-diagonal causal mask",
    )
    # the block arithmetic against flex's own T x T evaluation of the same mask_mod
    expected = create_block_mask(mask.mask_mod, None, None, tokens, tokens, device="cpu")
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        torch.testing.assert_close(
            getattr(mask, name), getattr(expected, name), atol=0, rtol=0, msg=name
        )


def test_document_causal_block_mask_is_cached_per_cu_seqlens_tensor():
    cu = _cu_seqlens(LENGTHS["ragged"])
    mask = flex_module.document_causal_block_mask(cu, 511)
    assert flex_module.document_causal_block_mask(cu, 511) is mask
    assert (
        flex_module.document_causal_block_mask(cu.clone(), 511) is not mask
    )  # identity, not value
    windowed = flex_module.document_causal_block_mask(cu, 511, 64)
    assert windowed is not mask, "a window is another mask"
    assert flex_module.document_causal_block_mask(cu, 511, 64) is windowed
    assert flex_module.document_causal_block_mask(cu, 511) is mask, "both cached side by side"


def test_varlen_attention_flex_matches_reference_forward_on_cpu(monkeypatch):
    """Eager FlexAttention on CPU, forward only (torch has no CPU backward for it): the mask
    and the head mapping; the compiled CUDA kernels' forward and backward are the gpu test."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_module, "_compiled_flex_attention", lambda: flex_attention)
    lengths = [5, 0, 300, 17, 1, 188]
    tokens, heads, groups, head_dim = sum(lengths), 4, 2, 16
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, groups, head_dim), torch.randn(tokens, groups, head_dim)
    cu = _cu_seqlens(lengths)
    torch.testing.assert_close(
        flex_module.varlen_causal_attention_flex(q, k, v, cu, scale=head_dim**-0.5),
        varlen_causal_attention_ref(q, k, v, cu, scale=head_dim**-0.5),
        **TOL[torch.float32],
        msg="FlexAttention with the document-causal mask differs from per-sample SDPA",
    )


def test_packed_layers_share_one_flex_block_mask(tiny_model, monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    context = _lora_model(tiny_model)
    batch = make_packed_batch([0, 1, 1, 2], [6, 4, 7, 5], 3, seed=5)
    with torch.no_grad():
        loop = run_model(tiny_model, context, batch)[0]
    masks = []
    build = flex_module.document_causal_block_mask
    monkeypatch.setattr(attention, "attention_backend", lambda *args: "flex")
    monkeypatch.setattr(flex_module, "_compiled_flex_attention", lambda: flex_attention)
    monkeypatch.setattr(
        flex_module,
        "document_causal_block_mask",
        lambda *args: masks.append(build(*args)) or masks[-1],
    )
    with torch.no_grad():
        flex = run_model(tiny_model, context, batch)[0]
    assert len(masks) == len(tiny_model.decoder.layers), "every layer must take the flex path"
    assert all(m is masks[0] for m in masks), "layers must share one block mask"
    torch.testing.assert_close(flex, loop, **TOL[torch.float32], msg="flex logits != loop logits")


def _lora_model(model):
    context = apply_lora(model, ADAPTERS, seed=5)
    randomize_lora_b(context, seed=6)
    return context


def test_packed_samples_do_not_attend_across_boundaries(tiny_model):
    context = _lora_model(tiny_model)
    batch = make_packed_batch([0, 1, 1, 2], [6, 4, 7, 5], 3, seed=1)
    changed_ids = batch.input_ids.clone()
    second = batch.sample(1)
    changed_ids[0, second] = (changed_ids[0, second] + 17) % 260
    changed = make_packed_batch(batch.adapters, batch.lengths, 3, input_ids=changed_ids)
    with torch.no_grad():
        logits = run_model(tiny_model, context, batch)[0]
        logits_changed = run_model(tiny_model, context, changed)[0]
    for i in (0, 2, 3):  # before and after the changed sample
        torch.testing.assert_close(
            logits_changed[batch.sample(i)],
            logits[batch.sample(i)],
            atol=0,
            rtol=0,
            msg=f"changing sample 1 changed the outputs of sample {i}",
        )
    assert not torch.allclose(logits_changed[second], logits[second])


def test_packed_sample_equals_sample_run_alone(tiny_model):
    context = _lora_model(tiny_model)
    batch = make_packed_batch([0, 1, 1, 2], [6, 4, 7, 5], 3, seed=2)
    with torch.no_grad():
        logits = run_model(tiny_model, context, batch)[0]
        for i, (adapter, length) in enumerate(zip(batch.adapters, batch.lengths, strict=True)):
            alone = make_packed_batch(
                [adapter], [length], 3, input_ids=batch.input_ids[:, batch.sample(i)]
            )
            torch.testing.assert_close(
                run_model(tiny_model, context, alone)[0],
                logits[batch.sample(i)],
                **TOL[torch.float32],
                msg=f"sample {i} (adapter {adapter}) differs from running it alone: "
                "leak across samples or RoPE positions not restarting",
            )


def test_unpacked_batch_matches_packed_samples(tiny_model):
    context = _lora_model(tiny_model)
    batch = make_packed_batch([0, 2], [6, 6], 3, seed=3)
    with torch.no_grad():
        packed = run_model(tiny_model, context, batch)[0]
        # [b=2, s=6] without packed_seq_params: plain causal attention per row; LoRA rows
        # are ordered sample by sample, so the same layout applies.
        context.layout = AdapterLayout.from_samples([0, 2], [6, 6], 3)
        unpacked = tiny_model(batch.input_ids.reshape(2, 6), None, None)
    torch.testing.assert_close(
        unpacked.reshape(12, -1),
        packed,
        **TOL[torch.float32],
        msg="unpacked [b, s] batch differs from the packed samples",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_attention_cuda_path_matches_reference(dtype):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lorafusion.mcore import VarlenCoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        attention_dropout=0.0,  # Megatron's default 0.1 would select the SDPA loop
    )
    attention = VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")
    lengths = [300, 17, 1, 129, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu.cuda(),
        cu_seqlens_kv=cu.cuda(),
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    tokens, head_dim = sum(lengths), 32
    q, k, v = (
        torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        for heads in (8, 2, 2)
    )
    out = attention(q, k, v, None, packed_seq_params=params)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected = varlen_causal_attention_ref(q, k, v, cu.cuda(), scale=head_dim**-0.5)
    expected = expected.reshape(tokens, -1)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    tol = GPU_TOL[dtype]
    torch.testing.assert_close(out, expected, **tol, msg="varlen_attn forward != reference")
    for name, g, e in zip("qkv", grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **tol, msg=f"varlen_attn d{name} != reference")


def test_packed_rope_skips_megatrons_per_sample_loop(tiny_model, monkeypatch):
    # Megatron's THD RoPE loops over samples with host syncs; the core attention rotates
    # instead, from one table per microbatch shared by every layer.
    from megatron.core.models.common.embeddings import rope_utils

    def per_sample_loop(*args, **kwargs):
        raise AssertionError("Megatron's THD RoPE ran on a packed microbatch")

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", per_sample_loop)
    context = _lora_model(tiny_model)
    batch = make_packed_batch([0, 1, 2], [5, 9, 4], 3, seed=4)
    rotary = tiny_model.rotary_pos_emb
    tables = []
    real = rotary.packed_cos_sin

    def recording(*args, **kwargs):
        table = real(*args, **kwargs)
        tables.append(table)
        return table

    monkeypatch.setattr(rotary, "packed_cos_sin", recording)
    with torch.no_grad():
        run_model(tiny_model, context, batch)
    assert len(tables) == len(tiny_model.decoder.layers)
    assert all(t[0] is tables[0][0] for t in tables), "layers must share one cos/sin table"
    positions = torch.cat([torch.arange(n) for n in batch.lengths])
    expected = torch.cos(positions[:, None].float() * rotary.inv_freq[None, :])
    torch.testing.assert_close(tables[0][0][:, 0, : rotary.inv_freq.numel()], expected)


def _logits_and_grads(model, context, batch):
    model.zero_grad(set_to_none=True)
    context.grads.zero_()
    logits = run_model(model, context, batch)
    weight = torch.linspace(-1, 1, logits.shape[-1], device=logits.device)
    (logits * weight).sum().backward()
    return logits.detach(), context.grads.clone()


def _family_model(family: str, device="cpu", **overrides):
    """The tests' tiny model as ``family`` (head size 24, not 64 / 4; Gemma 3 with a window of
    3 tokens on its first layer, another RoPE base there, linear scaling on the second), its
    norm weights drawn around 1 so they matter."""
    from megatron_lorafusion.mcore import build_gpt_model

    sizes = {
        "llama": {},
        "qwen3": dict(family="qwen3", head_dim=24),
        "gemma3": dict(
            family="gemma3",
            head_dim=24,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            rope_local_theta=1e4,
            rope_linear_factor=8.0,
            query_pre_attn_scalar=20.0,
            tie_word_embeddings=True,
        ),
    }[family]
    model = build_gpt_model(dataclasses.replace(TINY, **{**sizes, **overrides}), device=device)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


# (family, fused): Gemma 3's Triton case covers the q/k norms Qwen3's would (9 s in the
# interpreter), plus windows, GeGLU and the local RoPE
@pytest.mark.parametrize(
    ("family", "fused"),
    [("llama", False), ("llama", True), ("qwen3", False), ("gemma3", False), ("gemma3", True)],
    ids=["llama-reference", "llama-triton", "qwen3-reference", "gemma3-reference", "gemma3-triton"],
)
def test_packed_self_attention_equals_megatrons_path(
    megatron_single_process, monkeypatch, fused, family
):
    """`PackedSelfAttention`'s fused QKV split (+ q/k norms) + RoPE computes Megatron's split,
    then norms, then RoPE; with q/k norms the split is given them (never skipped).

    fp32; the Triton kernel runs in the interpreter without CUDA, compiled with it.
    """
    from interpreter_testing import reload_interpreted

    from megatron_lorafusion.mcore import fused_base, self_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if fused and device == "cpu":
        reload_interpreted()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_base, "use_fused_kernels", lambda x: fused)
    model = _family_model(family, device)
    context = _lora_model(model)
    batch = make_packed_batch([0, 0, 1, 2], [5, 3, 9, 4], 3, seed=4, device=device)
    batch.input_ids = batch.input_ids.to(device)
    splits = []
    name = "qkv_rope" if fused else "qkv_rope_ref"
    real_split = getattr(self_attention, name)
    monkeypatch.setattr(
        self_attention,
        name,
        lambda *args, **kw: splits.append(sorted(kw)) or real_split(*args, **kw),
    )
    packed = _logits_and_grads(model, context, batch)
    assert len(splits) == len(model.decoder.layers), "every layer must take the packed path"
    norms = ["eps", "k_norm", "q_norm"] if family != "llama" else []
    assert all(kw == norms for kw in splits), f"the split must get the q/k norms: {splits}"
    monkeypatch.setattr(
        self_attention.PackedSelfAttention, "_packed_path_applies", lambda *a: False
    )
    megatron = _logits_and_grads(model, context, batch)
    assert len(splits) == len(model.decoder.layers), "the patched run must be Megatron's"
    for what, got, want in zip(("logits", "adapter grads"), packed, megatron, strict=True):
        torch.testing.assert_close(got, want, **TOL[torch.float32], msg=f"{family} {what}")


def _windowed(lengths, window) -> torch.Tensor:
    """(T, T) bool: same sample and 0 <= i - j < window."""
    allowed = _block_diagonal_causal(lengths)
    distance = torch.arange(sum(lengths))[:, None] - torch.arange(sum(lengths))[None, :]
    return allowed & (distance < window)


def test_varlen_attention_ref_with_window_matches_masked_sdpa():
    lengths, window = [3, 9, 1, 6], 4
    tokens, heads, groups, head_dim = sum(lengths), 4, 2, 8
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, groups, head_dim), torch.randn(tokens, groups, head_dim)
    out = varlen_causal_attention_ref(
        q, k, v, _cu_seqlens(lengths), scale=head_dim**-0.5, window=window
    )
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=_windowed(lengths, window),
        scale=head_dim**-0.5,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, **TOL[torch.float32], msg="windowed reference")


@pytest.mark.parametrize("window", [1, 100, 128, 129, 300])
@pytest.mark.parametrize("lengths", [LENGTHS["ragged"], [5, 0, 700, 3, 0]], ids=["ragged", "long"])
def test_windowed_block_mask_equals_create_block_mask(lengths, window):
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    tokens = sum(lengths)
    mask = flex_module.document_causal_block_mask(_cu_seqlens(lengths), tokens, window)
    torch.testing.assert_close(
        create_mask(mask.mask_mod, None, None, tokens, tokens, device="cpu")[0, 0],
        _windowed([n for n in lengths if n], window),
        atol=0,
        rtol=0,
        msg="mask_mod is not the windowed block-diagonal causal mask",
    )
    expected = create_block_mask(mask.mask_mod, None, None, tokens, tokens, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        torch.testing.assert_close(
            getattr(mask, name), getattr(expected, name), atol=0, rtol=0, msg=name
        )


def test_varlen_attention_flex_with_window_matches_reference_on_cpu(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_module, "_compiled_flex_attention", lambda: flex_attention)
    lengths, window = [5, 0, 300, 17, 1, 188], 130
    tokens, heads, groups, head_dim = sum(lengths), 4, 2, 16
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, groups, head_dim), torch.randn(tokens, groups, head_dim)
    cu, scale = _cu_seqlens(lengths), head_dim**-0.5
    torch.testing.assert_close(
        flex_module.varlen_causal_attention_flex(q, k, v, cu, scale=scale, window=window),
        varlen_causal_attention_ref(q, k, v, cu, scale=scale, window=window),
        **TOL[torch.float32],
        msg="FlexAttention with the windowed mask differs from per-sample SDPA",
    )


def test_packed_tokens_attend_only_inside_their_sample_and_window(megatron_single_process):
    """Every layer slides (window 3, two layers): changing token j of a sample changes exactly
    the outputs of its tokens j..j + 2·(3 - 1), nothing before, after or in other samples."""
    model = _family_model("gemma3", layer_types=None)
    window, reach = 3, 2 * (3 - 1)
    context = _lora_model(model)
    batch = make_packed_batch([0, 1, 1, 2], [6, 12, 7, 5], 3, seed=1)
    sample = batch.sample(1)
    j = sample.start + 2
    changed_ids = batch.input_ids.clone()
    changed_ids[0, j] = (changed_ids[0, j] + 17) % 260
    changed = make_packed_batch(batch.adapters, batch.lengths, 3, input_ids=changed_ids)
    with torch.no_grad():
        logits = run_model(model, context, batch)[0]
        logits_changed = run_model(model, context, changed)[0]
    moved = (logits_changed - logits).abs().amax(-1) > 1e-6  # (T,)
    expected = torch.zeros_like(moved)
    expected[j : j + reach + 1] = True
    assert model.decoder.layers[0].self_attention.core_attention.window == window
    assert moved.tolist() == expected.tolist(), "a token moved outside its sample or window"


def test_unpacked_input_with_window_matches_packed_and_local_rope_is_refused(
    megatron_single_process,
):
    """[b, s] input: Megatron rotates it with the model's RoPE, so a sliding-only model (one
    base) matches its packed run; a Gemma 3 local layer (another base) refuses it."""
    sliding = _family_model("gemma3", layer_types=None, rope_local_theta=None)
    batch = make_packed_batch([0, 2], [6, 6], 3, seed=3)
    with torch.no_grad():
        packed = run_model(sliding, None, batch)[0]
        unpacked = sliding(batch.input_ids.reshape(2, 6), None, None)
    torch.testing.assert_close(
        unpacked.reshape(12, -1), packed, **TOL[torch.float32], msg="unpacked != packed"
    )
    local = _family_model("gemma3")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="pass packed"):
        local(batch.input_ids.reshape(2, 6), None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100], ids=["causal", "window100"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS)
def test_flex_attention_matches_flash_forward_and_backward(lengths, window):
    """bf16 on CUDA: forced flex against forced flash, both against an fp32 reference, plain
    causal and with a sliding window shorter than the longest samples.

    The second case has another T, so the compiled flex recompiles with dynamic shapes.
    """
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=2,
        attention_dropout=0.0,
    )
    core = attention.VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")
    core.window = window
    cu = _cu_seqlens(lengths, "cuda")
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    tokens, head_dim = sum(lengths), 64
    inputs = [
        torch.randn(
            tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        for heads in (8, 2, 2)
    ]
    grad = torch.randn(tokens, 8 * head_dim, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("flash", "flex"):
        core.backend = backend
        out = core(*inputs, None, packed_seq_params=params)
        results[backend] = (out, *torch.autograd.grad(out, inputs, grad))
    exact = [t.detach().float().requires_grad_() for t in inputs]
    out = varlen_causal_attention_ref(*exact, cu, scale=head_dim**-0.5, window=window)
    out = out.reshape(tokens, -1)
    reference = (out, *torch.autograd.grad(out, exact, grad.float()))
    names = ("output", "dq", "dk", "dv")
    for name, flash, flex, ref in zip(
        names, results["flash"], results["flex"], reference, strict=True
    ):
        torch.testing.assert_close(
            flex, flash, **GPU_TOL[torch.bfloat16], msg=f"flex {name} != flash {name}"
        )
        flex_err, flash_err = ((t.float() - ref).abs().mean() for t in (flex, flash))
        assert flex_err <= 2 * flash_err, f"{name}: flex err {flex_err} > 2 x flash {flash_err}"


def test_window_without_flash_support_falls_back_exactly_or_refuses(monkeypatch):
    """A torch whose FlashAttention op has no window: auto takes an exact kernel (here the
    loop), a forced flash says why it cannot."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2
    )
    core = attention.VarlenCoreAttention(config, 1, AttnMaskType.causal, "self", 0.0)
    core.window = 3
    lengths = [5, 9]
    cu = _cu_seqlens(lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
    )
    q, k, v = (torch.randn(14, heads, 16) for heads in (4, 2, 2))
    monkeypatch.setattr(attention, "attention_backend", lambda *args: "flash")
    monkeypatch.setattr(attention, "flash_window_available", lambda: False)
    monkeypatch.setattr(attention, "_flex_available", lambda: False)
    expected = varlen_causal_attention_ref(q, k, v, cu, scale=0.25, window=3).reshape(14, -1)
    torch.testing.assert_close(
        core.attend_packed(q, k, v, params), expected, **TOL[torch.float32], msg="fallback"
    )
    core.backend = "flash"
    with pytest.raises(RuntimeError, match="has no sliding window"):
        core.attend_packed(q, k, v, params)
