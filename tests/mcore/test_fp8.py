"""The FP8 frozen base (``model.base_precision: fp8``) on CPU: built on meta, loaded tensor by
tensor, its linears e4m3 with per-channel scales, running the fake-quant reference.

Tolerance table (the mcore tests' model: 2 layers, hidden 64, init std 0.02, seed 3; 123 packed
tokens), measured on this CPU:

| what | rel. error of logits |
|---|---|
| bf16 base against fp32 | 0.005 |
| FP8 base against bf16, both computing in bf16 | 0.019 |

A random base of larger init std amplifies any perturbation: the tiny preset's (std 0.15)
moves by 0.02 in bf16 and 0.21 in FP8 (docs/fp8.md).
"""

import dataclasses
import sys
from unittest import mock

import pytest
import torch
from interpreter_testing import reload_interpreted
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from megatron_lorafusion.mcore import (
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    apply_lora,
    build_gpt_model,
    fp8_weight,
)
from megatron_lorafusion.mcore.fused_base import (
    Fp8ResidualRMSNorm,
    Fp8SwiGLU,
    FusedSwiGLU,
    fp8_bias_dropout_add,
)
from megatron_lorafusion.ops import FP8_DTYPE, Fp8Weight, quantize_weight

FP8 = dataclasses.replace(TINY, base_precision="fp8")
FP8_V256 = dataclasses.replace(FP8, vocab_size=256)  # V a multiple of 16: an FP8 output layer
FP8_LOGITS_REL_ERR = 0.03  # FP8 against bf16 (measured 0.019, table above)
GRAD_REL_ERR = 0.15  # adapter grads, FP8 base vs fp32 base (measured 0.014-0.070)
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")
LINEARS += ("mlp.linear_fc1", "mlp.linear_fc2")


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _linear(model, layer, name):
    module = model.decoder.layers[layer]
    for part in name.split("."):
        module = getattr(module, part)
    return module


def test_fp8_model_quantizes_the_full_precision_weights(megatron_single_process):
    full = build_gpt_model(TINY, params_dtype=torch.bfloat16)
    fp8 = build_gpt_model(FP8, params_dtype=torch.bfloat16)
    for layer in range(TINY.num_layers):
        for name in LINEARS:
            module = _linear(fp8, layer, name)
            kind = Fp8RowParallelLinear if "proj" in name or "fc2" in name else None
            assert isinstance(module, kind or Fp8ColumnParallelLinear), name
            assert module.weight.dtype == FP8_DTYPE
            assert not module.weight.requires_grad
            want = quantize_weight(_linear(full, layer, name).weight)
            got = fp8_weight(module)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), name
            assert torch.equal(got.scale, want.scale), name
            assert got.data_t is None, "CPU runs keep no transposed copy"
        activation = fp8.decoder.layers[layer].mlp.activation_func
        assert isinstance(activation, Fp8SwiGLU), "SwiGLU quantizes for the FP8 linears"
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            module = getattr(fp8.decoder.layers[layer], norm)
            assert isinstance(module, Fp8ResidualRMSNorm), f"{norm} quantizes for qkv / fc1"
        assert fp8.decoder.layers[layer].self_attn_bda is fp8_bias_dropout_add
        assert fp8.decoder.layers[layer].mlp_bda is fp8_bias_dropout_add
    fp8_params = dict(fp8.named_parameters())
    for name, param in full.named_parameters():
        if param.dim() == 2 and ".layers." in name:
            continue
        assert torch.equal(fp8_params[name], param), f"{name}: not a linear, must be equal"
    left = [n for n, t in [*fp8.named_parameters(), *fp8.named_buffers()] if t.is_meta]
    assert not left, f"tensors left on meta: {left}"


def test_fp8_output_layer_is_fp8_where_its_vocabulary_fits(megatron_single_process):
    """V a multiple of 16: the output layer is quantized like the decoder's linears; the tiny
    preset's V = 260 cannot take FP8 GEMMs, so its output layer stays bf16."""
    full = build_gpt_model(dataclasses.replace(TINY, vocab_size=256), params_dtype=torch.bfloat16)
    fp8 = build_gpt_model(FP8_V256, params_dtype=torch.bfloat16)
    assert isinstance(fp8.output_layer, Fp8ColumnParallelLinear)
    want, got = quantize_weight(full.output_layer.weight), fp8_weight(fp8.output_layer)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)
    odd = build_gpt_model(FP8, params_dtype=torch.bfloat16).output_layer
    assert type(odd) is ColumnParallelLinear
    assert odd.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_output_layer_fused_loss_matches_the_reference(
    megatron_single_process, monkeypatch, dtype
):
    """The fused loss of an FP8 output layer (chunked FP8 GEMMs, interpreted Triton) against the
    CPU path (the FP8 linear's fake-quant logits, Megatron's cross-entropy): the same loss, in
    bf16 and in fp32 (``train.precision``'s default)."""
    reload_interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build_gpt_model(FP8_V256, params_dtype=dtype).eval()
    ids = torch.randint(0, FP8_V256.vocab_size, (1, 63), generator=torch.Generator())
    batch = make_packed_batch([0, 1, 2], [20, 13, 30], 3, input_ids=ids)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    module = sys.modules["megatron_lorafusion.mcore.fused_base"]
    fused_loss, weights = module.linear_cross_entropy, []
    monkeypatch.setattr(
        module,
        "linear_cross_entropy",
        lambda h, w, *a, **k: weights.append(type(w)) or fused_loss(h, w, *a, **k),
    )
    losses = {}
    for fused in (False, True):
        with mock.patch(
            "megatron_lorafusion.mcore.fused_base.use_fused_kernels", return_value=fused
        ):
            with torch.no_grad():
                losses[fused] = run_model(model, None, batch, labels=labels).float()
    assert weights == [Fp8Weight], "the fused path ran once, on the FP8 weight"
    assert losses[True].shape == labels.shape
    torch.testing.assert_close(losses[True], losses[False], atol=2e-2, rtol=2e-2)


def test_fp8_model_logits_stay_close_to_bf16(megatron_single_process):
    batch = make_packed_batch([0, 1, 2], [40, 33, 50], 3, seed=1)
    logits = {}
    for cfg in (TINY, FP8):
        model = build_gpt_model(cfg, params_dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits[cfg.base_precision] = run_model(model, None, batch)
    err = _rel(logits["fp8"], logits["bf16"])
    assert 0 < err < FP8_LOGITS_REL_ERR, f"FP8 logits moved by {err:.3f} against bf16"


def test_fp8_model_trains_lora_like_the_full_precision_one(megatron_single_process):
    """Adapter gradients through the FP8 base: finite, present where the adapters have tokens,
    and near those of the fp32 base (the quantization noise is all that differs)."""
    batch = make_packed_batch([0, 0, 2], [30, 21, 40], 3, seed=2)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    grads = {}
    for cfg in (TINY, FP8):
        model = build_gpt_model(cfg).train()
        context = apply_lora(model, ADAPTERS, seed=4)
        randomize_lora_b(context, seed=5)
        run_model(model, context, batch, labels=labels).sum().backward()
        grads[cfg.base_precision] = {
            a: dict(context.adapter_grads(a)) for a in range(context.num_adapters)
        }
    for a in (0, 2):  # adapter 1 has no tokens
        for name, want in grads["bf16"][a].items():
            got = grads["fp8"][a][name]
            assert got.isfinite().all(), name
            assert _rel(got, want) < GRAD_REL_ERR, f"adapter {a} {name}: {_rel(got, want):.3f}"
    assert not any(g.any() for g in grads["fp8"][1].values()), "absent adapter 1 got gradients"


def test_fp8_model_refuses_dora_adapters(megatron_single_process):
    model = build_gpt_model(FP8)
    dora = [dataclasses.replace(ADAPTERS[0], use_dora=True)]
    with pytest.raises(NotImplementedError, match="supports LoRA adapters only"):
        apply_lora(model, dora, seed=0)


def test_fp8_model_merged_weight_is_dequantized_plus_delta(megatron_single_process):
    model = build_gpt_model(FP8)
    context = apply_lora(model, ADAPTERS, seed=4)
    randomize_lora_b(context, seed=5)
    name = "decoder.layers.1.mlp.linear_fc2"
    wrapper = context.wrappers[name]
    factor_a, factor_b = wrapper.lora_A[0, :4], wrapper.lora_B[0, :, :4]
    want = fp8_weight(wrapper.base).dequantize() + wrapper.scalings[0] * factor_b @ factor_a
    torch.testing.assert_close(wrapper.merged_weight(0), want, atol=1e-6, rtol=1e-6)


def test_fp8_model_refuses_gpus_without_fp8_tensor_cores(megatron_single_process, monkeypatch):
    from megatron_lorafusion.ops import _utils as ops_utils

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(ops_utils, "capability", lambda index: (7, 0))
    with pytest.raises(RuntimeError, match=r"FP8 tensor cores .* Tesla V100 \(sm_70\)"):
        build_gpt_model(FP8, device="cuda:0")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fp8_hf_import_quantizes_the_checkpoint_shard_by_shard(
    kind, megatron_single_process, tmp_path
):
    pytest.importorskip("transformers", reason="dev extra: transformers")
    from hf_testing import model_config, save_tiny_hf_model

    save_tiny_hf_model(kind, tmp_path, tie=kind == "qwen2", shard=True)
    cfg = model_config(tmp_path)
    full = build_gpt_model(cfg)
    fp8 = build_gpt_model(dataclasses.replace(cfg, base_precision="fp8"))
    fp8_params = dict(fp8.named_parameters())
    for name, param in full.named_parameters():
        if param.dim() == 2 and ".layers." in name:
            module = dict(fp8.named_modules())[name.removesuffix(".weight")]
            want, got = quantize_weight(param), fp8_weight(module)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), name
            assert torch.equal(got.scale, want.scale), name
        else:  # embeddings, norms, the output layer, Qwen2's q/k/v biases
            assert torch.equal(fp8_params[name], param), name


@pytest.mark.gpu
def test_fp8_cuda_load_quantizes_the_full_precision_weights(megatron_single_process):
    """Loaded on CUDA (with the transposed copies kept), the weights are those of quantizing
    the CUDA bf16 model."""
    full = build_gpt_model(TINY, device="cuda", params_dtype=torch.bfloat16)
    fp8 = build_gpt_model(FP8, device="cuda", params_dtype=torch.bfloat16)
    for layer in range(TINY.num_layers):
        for name in LINEARS:
            got = fp8_weight(_linear(fp8, layer, name))
            want = quantize_weight(_linear(full, layer, name).weight, transposed=True)
            assert got.data.device.type == "cuda", name
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), name
            assert torch.equal(got.data_t.view(torch.uint8), want.data_t.view(torch.uint8)), name
            assert torch.equal(got.scale, want.scale), name
    fp8_params = dict(fp8.named_parameters())
    for name, param in full.named_parameters():
        if param.dim() != 2 or ".layers." not in name:
            assert torch.equal(fp8_params[name], param), f"{name}: not a linear, must be equal"


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_fp8_hand_overs_keep_every_bit_of_training(megatron_single_process, recompute, monkeypatch):
    """`Fp8SwiGLU` (its kernels quantize fc2's X and fc1's dY) and `Fp8ResidualRMSNorm` (qkv's
    and fc1's X, proj's and fc2's dY) against `FusedSwiGLU` and norms that do not quantize
    (the linears quantize all of them): the same loss and adapter gradients, bit for bit."""
    from megatron_lorafusion.mcore.recompute import apply_recompute

    module = sys.modules["megatron_lorafusion.ops.fp8_linear"]
    quantize, calls = module.quantize_rows, []
    monkeypatch.setattr(
        module, "quantize_rows", lambda *a, **k: calls.append(1) or quantize(*a, **k)
    )
    batch = make_packed_batch([0, 0, 2], [30, 21, 45], 3, seed=2, device="cuda")
    labels = torch.roll(batch.input_ids, -1, dims=1)
    results, counts = [], []
    for handover in (True, False):
        model = build_gpt_model(FP8, device="cuda", params_dtype=torch.bfloat16).train()
        if not handover:
            for layer in model.decoder.layers:
                layer.mlp.activation_func = FusedSwiGLU(model.config)
                layer.input_layernorm.quantize_output = False
                layer.pre_mlp_layernorm.quantize_output = False
        context = apply_lora(model, ADAPTERS, seed=4)
        randomize_lora_b(context, seed=5)
        apply_recompute(model, context, recompute)
        loss = run_model(model, context, batch, labels=labels)
        loss.sum().backward()
        grads = {a: dict(context.adapter_grads(a)) for a in range(context.num_adapters)}
        results.append((loss.detach(), grads))
        counts.append(len(calls))
        calls.clear()
    assert counts[0] < counts[1], f"the linears quantized {counts} times: no hand-over"
    if recompute == "none":  # per layer: qkv's, fc1's, fc2's X; fc1's, proj's, fc2's dY (from
        # the next layer's norm: not the last layer's)
        assert counts[1] - counts[0] == 6 * FP8.num_layers - 1, f"quantized {counts} times"
    (loss, grads), (want_loss, want_grads) = results
    assert torch.equal(loss, want_loss), f"loss differs by {(loss - want_loss).abs().max()}"
    for a, named in want_grads.items():
        for name, want in named.items():
            diff = (grads[a][name] - want).abs().max()
            assert torch.equal(grads[a][name], want), f"adapter {a} {name}: differs by {diff}"


# The 8B preset's random base: this test measured 0.578 on the H200 (twentieth session, device
# run 5), as `scripts.bench_fp8 --sections model` did in the fourteenth, and 0.5789 with the
# output layer in FP8 too (twenty-fifth session, device run 1).
FP8_8B_LOGITS_REL_ERR = 0.65


@pytest.mark.gpu
@pytest.mark.slow
def test_fp8_logits_of_the_8b_preset_stay_within_their_measured_bound(megatron_single_process):
    """Llama-3.1-8B's preset (its random base, init std 0.02) on one 2048-token sample: the
    FP8 base's logits against the bf16 base's. A random base amplifies any perturbation layer
    after layer (32 here), so the bound is the measured error with some margin, not small."""
    from megatron_lorafusion.config import MODEL_PRESETS, ModelConfig

    tokens = 2048
    preset = MODEL_PRESETS["llama3.1-8b"]
    ids = torch.randint(0, preset["vocab_size"], (1, tokens), generator=torch.Generator())
    batch = make_packed_batch([0], [tokens], 1, input_ids=ids.cuda(), device="cuda")
    logits = {}
    for precision in ("bf16", "fp8"):
        cfg = ModelConfig(**{**preset, "base_precision": precision})
        model = build_gpt_model(cfg, device="cuda", params_dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits[precision] = run_model(model, None, batch).float().cpu()
        del model
        torch.cuda.empty_cache()
    err = _rel(logits["fp8"], logits["bf16"])
    print(f"8B preset, FP8 logits against bf16: relative error {err:.4f}")
    assert 0 < err < FP8_8B_LOGITS_REL_ERR, f"FP8 logits moved by {err:.3f} against bf16"
