"""The fused base model (SwiGLU, QKV split + RoPE, chunked linear cross-entropy) equals unfused.

On CUDA the model runs the Triton ops; on CPU the ops' references. Here the Triton path is
forced on the CPU by patching `fused_base.use_fused_kernels` with the kernels reloaded in
Triton's interpreter (as tests/ops/conftest.py does; ``TRITON_INTERPRET=1`` is then set during
the test, so the LoRA ops run their interpreted Triton path in both runs), and compared in fp32
with the reference path: per-token loss, logits and every adapter gradient.
"""

import contextlib
import importlib
from unittest import mock

import pytest
import torch
from interpreter_testing import reload_interpreted
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

from megatron_lorafusion.mcore import apply_lora, build_gpt_model
from megatron_lorafusion.mcore.fused_base import (
    FrozenRMSNorm,
    FusedSwiGLU,
    ResidualRMSNorm,
    input_rebuild,
)

# dtype -> tolerances: fp32, the fused ops differ from the references in summation order.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5)}


@pytest.fixture
def _interpreted_kernels(monkeypatch):
    """Without CUDA: the kernels re-made in interpreter mode, ``TRITON_INTERPRET=1`` set."""
    if torch.cuda.is_available():
        return
    reload_interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(fused: bool, labels_weight: torch.Tensor | None = None):
    model = build_gpt_model(TINY).eval()
    context = apply_lora(model, ADAPTERS, seed=2)
    randomize_lora_b(context, seed=3)
    batch = make_packed_batch([0, 0, 1, 2], [5, 9, 4, 7], 3, seed=4)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    with mock.patch("megatron_lorafusion.mcore.fused_base.use_fused_kernels", return_value=fused):
        loss = run_model(model, context, batch, labels=labels)
        # An arbitrary upstream gradient per token (loss mask times per-adapter weights).
        (loss * labels_weight).sum().backward()
        with torch.no_grad():
            logits = run_model(model, context, batch)
    grads = {n: g.clone() for a in range(3) for n, g in context.adapter_grads(a).items()}
    return loss.detach(), logits, grads


def test_built_model_uses_fused_modules(tiny_model):
    layer = tiny_model.decoder.layers[0]
    assert isinstance(layer.input_layernorm, ResidualRMSNorm)
    assert isinstance(layer.pre_mlp_layernorm, ResidualRMSNorm)
    assert isinstance(tiny_model.decoder.final_layernorm, FrozenRMSNorm)
    assert isinstance(layer.mlp.activation_func, FusedSwiGLU)


def test_norm_weights_share_the_compute_dtype(megatron_single_process):
    """A bf16 model's norms hold bf16 weights: torch's fused ``F.rms_norm`` needs one dtype."""
    model = build_gpt_model(TINY, params_dtype=torch.bfloat16)
    norms = [m for m in model.modules() if isinstance(m, FrozenRMSNorm)]
    assert len(norms) == 2 * TINY.num_layers + 1
    assert {m.weight.dtype for m in norms} == {torch.bfloat16}


@pytest.mark.usefixtures("_interpreted_kernels")
def test_fused_base_matches_unfused(megatron_single_process):
    weight = torch.rand(1, 25, generator=torch.Generator().manual_seed(5))
    weight[0, ::4] = 0.0  # masked-out tokens
    loss, logits, grads = _run(False, weight)
    launchers = {
        "rms_norm": "rms_norm_bwd",
        "swiglu": "swiglu_fwd",
        "qkv_rope": "qkv_rope_fwd",
        "linear_cross_entropy": "cross_entropy_fwd",
    }
    with contextlib.ExitStack() as stack:
        spies = {
            op: stack.enter_context(
                mock.patch(
                    f"megatron_lorafusion.ops.{op}.{fn}",
                    wraps=getattr(importlib.import_module(f"megatron_lorafusion.ops.{op}"), fn),
                )
            )
            for op, fn in launchers.items()
        }
        fused_loss, fused_logits, fused_grads = _run(True, weight)
    assert all(spy.called for spy in spies.values()), {op: s.called for op, s in spies.items()}
    assert loss.shape == (1, 25)
    torch.testing.assert_close(fused_loss, loss, **TOL[torch.float32], msg="per-token loss")
    torch.testing.assert_close(fused_logits, logits, **TOL[torch.float32], msg="logits")
    assert grads, "no adapter gradients"
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, **TOL[torch.float32], msg=name)


def test_fused_loss_keeps_megatron_loss_without_fusion(tiny_model):
    """On CPU (no patch) the loss is Megatron's own cross-entropy of the logits."""
    batch = make_packed_batch([0, 1], [6, 3], 2, seed=2)
    labels = torch.roll(batch.input_ids, -1, dims=1)
    with torch.no_grad():
        loss = run_model(tiny_model, None, batch, labels=labels)
        logits = run_model(tiny_model, None, batch)
    want = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="none")[None]
    torch.testing.assert_close(loss, want, **TOL[torch.float32])


# bf16 on the GPU: the fused ops round once where the references round after every step.
GPU_TOL = {torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


@pytest.mark.gpu
def test_fused_base_matches_unfused_on_gpu_bf16(megatron_single_process):
    """CUDA, bf16: fused base (Triton) against the same model with the torch references."""
    batch = make_packed_batch([0, 0, 1, 2], [200, 37, 120, 155], 3, seed=4, device="cuda")
    batch.input_ids = batch.input_ids.cuda()
    labels = torch.roll(batch.input_ids, -1, dims=1)
    weight = torch.rand(labels.shape, device="cuda")
    results = {}
    for fused in (False, True):
        model = build_gpt_model(TINY, device="cuda", params_dtype=torch.bfloat16).eval()
        context = apply_lora(model, ADAPTERS, seed=2)
        randomize_lora_b(context, seed=3)
        with mock.patch(
            "megatron_lorafusion.mcore.fused_base.use_fused_kernels", return_value=fused
        ):
            loss = run_model(model, context, batch, labels=labels)
            (loss * weight).sum().backward()
        grads = {n: g.float().cpu() for a in range(3) for n, g in context.adapter_grads(a).items()}
        results[fused] = (loss.detach().float().cpu(), grads)
    tol = GPU_TOL[torch.bfloat16]
    torch.testing.assert_close(results[True][0], results[False][0], **tol, msg="loss")
    for name, grad in results[False][1].items():
        scale = grad.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(results[True][1][name] / scale, grad / scale, **tol, msg=name)


def test_norm_and_swiglu_outputs_carry_their_rebuild(tiny_model):
    """`input_rebuild` of a norm / SwiGLU output recomputes it bit for bit from the module's
    input; no mark without autograd, on a view, after an in-place write or when the input needs
    no gradient (then nothing else saves it)."""
    layer = tiny_model.decoder.layers[0]
    source = torch.randn(6, 1, TINY.hidden_size)
    out, residual = layer.input_layernorm(source)
    assert residual is source, "off the fused path the residual is the input itself"
    cases = {
        "norm": (lambda x: layer.input_layernorm(x)[0], TINY.hidden_size),
        "swiglu": (layer.mlp.activation_func, 2 * TINY.ffn_hidden_size),
    }
    for name, (module, width) in cases.items():
        source = torch.randn(6, 1, width, requires_grad=True)
        out = module(source)
        fn, kept = input_rebuild(out)
        assert kept is source, f"{name}: the mark must hold the module's input"
        with torch.no_grad():
            torch.testing.assert_close(fn(kept), out, atol=0, rtol=0, msg=f"{name} rebuild")
        assert input_rebuild(out.view(-1, out.shape[-1])) is None, f"{name}: a view is marked"
        with torch.no_grad():
            assert input_rebuild(module(source)) is None, f"{name}: marked without autograd"
        assert input_rebuild(module(source.detach())) is None, f"{name}: input needs no grad"
        out.mul_(2.0)
        assert input_rebuild(out) is None, f"{name}: still marked after an in-place write"
