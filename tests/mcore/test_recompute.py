"""`apply_recompute` (``train.recompute``) on the tiny model, fp32 on the CPU, against ``none``.

``selective`` (the LoRA wrappers rebuild their norm / SwiGLU inputs) and ``full`` (every layer
re-run in backward) must keep every bit of the losses and adapter gradients, with LoRA
dropout on, also when two microbatches' forwards run before their backwards (the pipelined
runner's order). The bytes autograd saves for one microbatch (storages counted once, weights
left out) must fall by exactly the rebuilt inputs (selective), and to the layers' inputs plus
what is saved outside the layers (full).
"""

import dataclasses
import gc
from unittest import mock

import pytest
import torch
from interpreter_testing import reload_interpreted
from mcore_testing import ADAPTERS, TINY, make_packed_batch, randomize_lora_b, run_model

from megatron_lorafusion.mcore import apply_lora, build_gpt_model
from megatron_lorafusion.mcore.recompute import RecomputedLayer, apply_recompute

# LoRA dropout on two of the three adapters: the recompute must draw the same masks.
DROPOUT_ADAPTERS = [
    dataclasses.replace(a, dropout=p) for a, p in zip(ADAPTERS, (0.1, 0.0, 0.2), strict=True)
]
# Two microbatches of the same T = 22 (a recompute under the other's layout would not fail
# on the token count), other adapter mixes and dropout seeds: (adapters, lengths, seed).
MICROBATCHES = [([0, 0, 1, 2], [5, 8, 6, 3], 9), ([0, 1, 2, 2], [4, 7, 6, 5], 10)]


def _model(mode: str, adapters=DROPOUT_ADAPTERS, cfg=TINY):
    model = build_gpt_model(cfg).train()
    context = apply_lora(model, adapters, seed=1)
    randomize_lora_b(context, seed=2)  # non-zero B, so that A gets gradients
    apply_recompute(model, context, mode)
    return model, context


def _batch(index: int):
    adapters, lengths, dropout_seed = MICROBATCHES[index]
    return make_packed_batch(adapters, lengths, 3, seed=4 + index, dropout_seed=dropout_seed)


def _interleaved_run(mode: str, cfg=TINY):
    """Both forwards, then both backwards: each microbatch's losses and the summed gradients.

    The context holds the second microbatch's layout when the first one's backward runs.
    """
    model, context = _model(mode, cfg=cfg)
    losses = []
    for i in range(len(MICROBATCHES)):
        batch = _batch(i)
        losses.append(run_model(model, context, batch, torch.roll(batch.input_ids, -1, dims=1)))
    for loss in losses:
        loss.sum().backward()
    return [loss.detach() for loss in losses], context.grads.clone()


@pytest.mark.parametrize(
    ("mode", "base"), [("selective", "bf16"), ("full", "bf16"), ("full", "fp8")]
)
def test_recompute_keeps_losses_and_gradients_of_none(megatron_single_process, mode, base):
    cfg = dataclasses.replace(TINY, base_precision=base)  # fp8: the layer's quantization again
    want_losses, want_grads = _interleaved_run("none", cfg)
    assert (want_grads.abs().sum(1) > 0).all(), "every adapter must get a gradient"
    losses, grads = _interleaved_run(mode, cfg)
    for i, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"{mode}: loss of mb {i}")
    torch.testing.assert_close(grads, want_grads, atol=0, rtol=0, msg=f"{mode}: adapter grads")


@pytest.mark.usefixtures("megatron_single_process")
def test_recompute_selective_with_fused_base_kernels_keeps_gradients(monkeypatch):
    """The Triton SwiGLU (interpreted on CPU) recomputed in backward gives the same bits."""
    if not torch.cuda.is_available():
        reload_interpreted()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = {}
    with mock.patch("megatron_lorafusion.mcore.fused_base.use_fused_kernels", return_value=True):
        for mode in ("none", "selective"):
            model, context = _model(mode)
            batch = _batch(0)
            run_model(model, context, batch, torch.roll(batch.input_ids, -1, 1)).sum().backward()
            results[mode] = context.grads.clone()
    torch.testing.assert_close(
        results["selective"],
        results["none"],
        atol=0,
        rtol=0,
        msg="adapter gradients with the fused base",
    )


def _saved_bytes(mode: str) -> tuple[int, int]:
    """Bytes autograd saves in one training forward: in all, and outside the decoder layers.

    Storages are counted once, base weights and the adapters' weight table not at all. No
    LoRA dropout: the CPU reference then saves X itself (with dropout, masked copies of X and
    the mask instead, which selective recompute drops as well).
    """
    model, context = _model(mode, ADAPTERS)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights.add(context.weights.untyped_storage().data_ptr())
    inside = [False]
    for layer in model.decoder.layers:
        inner = layer.layer if isinstance(layer, RecomputedLayer) else layer
        inner.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        inner.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            outside = not inside[0] or saved.get(storage.data_ptr(), (0, False))[1]
            saved[storage.data_ptr()] = (storage.nbytes(), outside)
        return t

    batch = _batch(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_model(model, context, batch, torch.roll(batch.input_ids, -1, dims=1))
    return sum(n for n, _ in saved.values()), sum(n for n, out in saved.values() if out)


def test_recompute_saves_less(megatron_single_process):
    (none, outside), (selective, _), (full, _) = (
        _saved_bytes(m) for m in ("none", "selective", "full")
    )
    print(
        f"saved bytes, one microbatch of the tiny model: none {none}, selective {selective}, "
        f"full {full}"
    )
    tokens, hidden, ffn = sum(MICROBATCHES[0][1]), TINY.hidden_size, TINY.ffn_hidden_size
    # Per layer the inputs of linear_qkv and linear_fc1 (T·H each) and of linear_fc2 (T·F),
    # fp32; but layer 0's input norm reads the embedding output, which needs no gradient:
    # nothing saves it, so that norm's output is kept as before.
    rebuilt = 4 * (TINY.num_layers * (2 * tokens * hidden + tokens * ffn) - tokens * hidden)
    assert none - selective == rebuilt, f"selective saves {none - selective} B less, not {rebuilt}"
    layer_inputs = 4 * TINY.num_layers * tokens * hidden
    assert full == outside + layer_inputs, (
        f"full saves {full} B, expected {outside} outside the layers + {layer_inputs} of inputs"
    )
    assert full < none / 5


def test_apply_recompute_wraps_layers_and_refuses_misuse(megatron_single_process):
    model, context = _model("full")
    assert all(isinstance(layer, RecomputedLayer) for layer in model.decoder.layers)
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2]
    assert not context.rebuild_inputs, "full recomputes whole layers: nothing to rebuild"
    batch = _batch(0)
    with torch.no_grad():  # eval: the layers run as they are
        logits = run_model(model.eval(), context, batch)
        plain_model, plain_context = _model("none")
        want = run_model(plain_model.eval(), plain_context, batch)
    torch.testing.assert_close(logits, want, atol=0, rtol=0, msg="eval logits under full")
    with pytest.raises(RuntimeError, match="already recomputed"):
        apply_recompute(model, context, "selective")
    with pytest.raises(RuntimeError, match="apply LoRA before apply_recompute"):
        apply_lora(model, ADAPTERS, seed=1)
    with pytest.raises(ValueError, match=r"recompute must be one of \['none', 'selective', "):
        apply_recompute(build_gpt_model(TINY), context, "partial")
    _, selective = _model("selective")
    assert selective.rebuild_inputs


def _live_storages() -> set[int]:
    """Data pointers of every live tensor with real storage (earlier tests may leave fakes)."""
    gc.collect()
    live = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter):
            try:
                live.add(o.untyped_storage().data_ptr())
            except RuntimeError:  # FakeTensor, FunctionalTensor: no data
                continue
    return live


@pytest.mark.parametrize("mode", ["none", "full"])
def test_recompute_full_frees_the_recomputed_layers_after_backward(megatron_single_process, mode):
    """Once a step's backward is done, full recompute leaves no more tensors alive than none
    (a checkpoint that stops its recompute early kept 45 more here, ~11 GiB on an 8B)."""
    model, context = _model(mode)
    batch = _batch(0)
    run_model(model, context, batch, torch.roll(batch.input_ids, -1, 1)).sum().backward()
    before = _live_storages()
    run_model(model, context, batch, torch.roll(batch.input_ids, -1, 1)).sum().backward()
    left = _live_storages() - before
    assert not left, f"{mode}: {len(left)} more tensors alive after the second step"
