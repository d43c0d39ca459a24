"""`lora_down` / `lora_up` (the op split at S for tensor parallelism): the Triton path against
`lora_down_ref` / `lora_up_ref` with the same mask, outputs and every gradient, and the halves
composed (summed over column shards, as a row-parallel all-reduce would) against the one fused
op. With an `InputRebuild`, `lora_down` keeps the bits of every output and gradient and saves
no tensor of X.

On CPU the Triton path (`fused_lora_down`, `fused_lora_up`: what `lora_down` / `lora_up` run on
CUDA) runs in the interpreter, fp32 (IEEE dots: differences are summation order) and fp16.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_lorafusion.ops import (
    dropout_keep_mask,
    fused_dropout_keep_mask,
    fused_lora_down,
    fused_lora_linear,
    fused_lora_up,
    lora_down,
    lora_down_ref,
    lora_up,
    lora_up_ref,
)
from megatron_lorafusion.ops.lora_linear import InputRebuild

# dtype -> (atol, rtol) against the fp32 reference; values and gradients are O(1).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}

# name -> (tokens per adapter, ranks, scalings, dropouts, H, N)
CASES = {
    "ragged": ([37, 0, 50, 13], [8, 3, 5, 1], [0.5, 2.0, 1.0, 3.0], [0.1, 0.2, 0.0, 0.3], 48, 40),
    "rank_40": ([9, 5], [40, 7], [0.25, 1.0], [0.1, 0.0], 24, 16),  # BLOCK_R = 64: two-pass dY
    "no_dropout": ([7, 20, 9], [2, 6, 4], [1.0, 2.0, 0.5], [0.0, 0.0, 0.0], 24, 56),
}
# name -> (col_offset, H_l) of a shard of rows T/5 : T - T/5; None = the whole microbatch
SHARDS = {"whole": None, "shard": (8, 16)}


def _inputs(case, dtype, device, make_layout, make_lora):
    counts, ranks, scalings, dropouts, hidden, out = CASES[case]
    gen = torch.Generator().manual_seed(0)
    layout = make_layout(counts, device, seed=11)
    x = torch.randn(layout.num_tokens, hidden, generator=gen).to(device, dtype)
    lora_a, lora_b = make_lora(out, hidden, ranks, dtype, device, gen)
    return layout, x, lora_a, lora_b, scalings, dropouts


def _shard(shard, layout, x, lora_a):
    """The shard's layout, x and A, and its (col_offset, full_width)."""
    if SHARDS[shard] is None:
        return layout, x, lora_a, 0, x.shape[1]
    col, width = SHARDS[shard]
    start, end = layout.num_tokens // 5, layout.num_tokens - layout.num_tokens // 5
    return (
        layout.shard(start, end),
        x[start:end, col : col + width].contiguous(),
        lora_a[:, :, col : col + width].contiguous(),
        col,
        x.shape[1],
    )


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(grad_out)
    return [y.detach()] + [t.grad for t in leaves]


def _assert_close(got, want, names, dtype, label):
    atol, rtol = TOL[dtype]
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(
            g.float(), w.float(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shard", list(SHARDS))
@pytest.mark.parametrize("case", list(CASES))
def test_lora_down_fused_matches_reference(case, shard, dtype, device, make_layout, make_lora):
    layout, x, lora_a, _, _, dropouts = _inputs(case, dtype, device, make_layout, make_lora)
    layout, x, lora_a, col, full = _shard(shard, layout, x, lora_a)
    keep = fused_dropout_keep_mask(layout, dropouts, full, 5, device)
    if keep is not None:
        keep = keep[:, col : col + x.shape[1]]
    grad_s = torch.randn(x.shape[0], lora_a.shape[1], generator=torch.Generator().manual_seed(1))
    got = _grads(
        lambda x_, a_: fused_lora_down(
            x_, a_, dropouts, layout, layer_seed=5, training=True, col_offset=col, full_width=full
        ),
        (x, lora_a),
        grad_s.to(device, dtype),
    )
    want = _grads(
        lambda x_, a_: lora_down_ref(x_, a_, dropouts, layout, keep),
        (x.float(), lora_a.float()),
        grad_s.to(device),
    )
    _assert_close(got, want, ["s", "dx", "da"], dtype, f"{case}/{shard}/{dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_lora_up_fused_matches_reference(case, dtype, device, make_layout, make_lora):
    layout, _, _, lora_b, scalings, _ = _inputs(case, dtype, device, make_layout, make_lora)
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(layout.num_tokens, lora_b.shape[2], generator=gen).to(device, dtype)
    grad_y = torch.randn(layout.num_tokens, lora_b.shape[1], generator=gen)
    got = _grads(
        lambda s_, b_: fused_lora_up(s_, b_, scalings, layout),
        (s, lora_b),
        grad_y.to(device, dtype),
    )
    want = _grads(
        lambda s_, b_: lora_up_ref(s_, b_, scalings, layout),
        (s.float(), lora_b.float()),
        grad_y.to(device),
    )
    _assert_close(got, want, ["y", "ds", "db"], dtype, f"{case}/{dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [None, (20, 90)])
def test_lora_split_over_column_shards_equals_fused_lora_linear(
    rows, dtype, device, make_layout, make_lora
):
    """Row-parallel use: S summed over two column shards (the all-reduce), then `lora_up`,
    plus the frozen product, equals the one fused op (same mask) in value and gradients."""
    layout, x, lora_a, lora_b, scalings, dropouts = _inputs(
        "ragged", dtype, device, make_layout, make_lora
    )
    if rows is not None:
        layout = layout.shard(*rows)
        x = x[rows[0] : rows[1]].contiguous()
    gen = torch.Generator().manual_seed(3)
    hidden, out = x.shape[1], lora_b.shape[1]
    weight = (torch.randn(out, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    bias = torch.randn(out, generator=gen).to(device, dtype)
    grad_y = torch.randn(x.shape[0], out, generator=gen).to(device, dtype)

    def split(x_, a_, b_):
        s = sum(
            fused_lora_down(
                x_[:, c : c + 24],
                a_[:, :, c : c + 24],
                dropouts,
                layout,
                layer_seed=7,
                training=True,
                col_offset=c,
                full_width=hidden,
            )
            for c in (0, 24)
        )
        return F.linear(x_, weight, bias) + fused_lora_up(s, b_, scalings, layout)

    def fused(x_, a_, b_):
        return fused_lora_linear(x_, weight, bias, a_, b_, scalings, dropouts, layout, layer_seed=7)

    got = _grads(split, (x, lora_a, lora_b), grad_y)
    want = _grads(fused, (x, lora_a, lora_b), grad_y)
    _assert_close(got, want, ["y", "dx", "da", "db"], dtype, f"rows {rows}/{dtype}")


def test_lora_down_column_shards_sum_to_whole(device, make_layout, make_lora):
    """`lora_down` as dispatched (the reference on CPU, Triton on CUDA): the partial S of
    column shards of a row shard add up to those rows of the unsharded S."""
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    whole = lora_down(x, lora_a, dropouts, layout, layer_seed=3, training=True)
    shard = layout.shard(20, 90)
    parts = sum(
        lora_down(
            x[20:90, c : c + 16].contiguous(),
            lora_a[:, :, c : c + 16].contiguous(),
            dropouts,
            shard,
            layer_seed=3,
            training=True,
            col_offset=c,
            full_width=48,
        )
        for c in (0, 16, 32)
    )
    torch.testing.assert_close(parts, whole[20:90], atol=1e-5, rtol=1e-5, msg="sharded S")


def test_lora_down_and_up_reference_path(make_layout, make_lora):
    """On CPU the dispatchers run the torch reference with `dropout_keep_mask`'s columns."""
    layout, x, lora_a, lora_b, scalings, dropouts = _inputs(
        "ragged", torch.float32, "cpu", make_layout, make_lora
    )
    x, lora_a = x[:, 8:32].contiguous(), lora_a[:, :, 8:32].contiguous()
    s = lora_down(
        x, lora_a, dropouts, layout, layer_seed=2, training=True, col_offset=8, full_width=48
    )
    keep = dropout_keep_mask(layout, dropouts, 48, 2, "cpu")[:, 8:32]
    torch.testing.assert_close(
        s, lora_down_ref(x, lora_a, dropouts, layout, keep), atol=0, rtol=0, msg="S"
    )
    evaluated = lora_down(
        x, lora_a, dropouts, layout, layer_seed=2, training=False, col_offset=8, full_width=48
    )
    torch.testing.assert_close(
        evaluated, lora_down_ref(x, lora_a, dropouts, layout, None), atol=0, rtol=0, msg="eval S"
    )
    torch.testing.assert_close(
        lora_up(s, lora_b, scalings, layout),
        lora_up_ref(s, lora_b, scalings, layout),
        atol=0,
        rtol=0,
        msg="up",
    )


def test_lora_down_fused_eval_uses_no_mask(device, make_layout, make_lora):
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    got = fused_lora_down(x, lora_a, dropouts, layout, layer_seed=1, training=False)
    want = lora_down_ref(x, lora_a, dropouts, layout, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg="eval S")


@pytest.mark.parametrize("fn", [lora_down, fused_lora_down])
def test_lora_down_names_bad_input(fn, device, make_layout, make_lora):
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    kw = {"layer_seed": 0, "training": True}
    with pytest.raises(ValueError, match="x has shape"):
        fn(x[:-1], lora_a, dropouts, layout, **kw)
    with pytest.raises(ValueError, match="lora_a has shape"):
        fn(x, lora_a[:, :, :-1], dropouts, layout, **kw)
    with pytest.raises(ValueError, match="lora_a is"):
        fn(x, lora_a.double(), dropouts, layout, **kw)
    with pytest.raises(ValueError, match="dropouts"):
        fn(x, lora_a, dropouts[:-1], layout, **kw)
    with pytest.raises(ValueError, match=r"columns \[8, 56\)"):
        fn(x, lora_a, dropouts, layout, col_offset=8, full_width=48, **kw)


def test_fused_lora_down_rejects_unaligned_columns(device, make_layout, make_lora):
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        fused_lora_down(
            x, lora_a, dropouts, layout, layer_seed=0, training=True, col_offset=4, full_width=52
        )


@pytest.mark.parametrize("fn", [lora_up, fused_lora_up])
def test_lora_up_names_bad_input(fn, device, make_layout, make_lora):
    layout, _, _, lora_b, scalings, _ = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    s = torch.randn(layout.num_tokens, lora_b.shape[2], device=device)
    with pytest.raises(ValueError, match="s has shape"):
        fn(s[:-1], lora_b, scalings, layout)
    with pytest.raises(ValueError, match="lora_b has shape"):
        fn(s, lora_b[:, :, :-1], scalings, layout)
    with pytest.raises(ValueError, match="lora_b is"):
        fn(s, lora_b.half(), scalings, layout)
    with pytest.raises(ValueError, match="scalings"):
        fn(s, lora_b, scalings[:-1], layout)


@pytest.mark.parametrize("needs", ["x", "a"])
def test_lora_down_fused_one_gradient(needs, device, make_layout, make_lora):
    """Only dX (the expand alone) or only dA (wgrad without its expand)."""
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    keep = fused_dropout_keep_mask(layout, dropouts, x.shape[1], 4, device)
    grad_s = torch.randn(x.shape[0], lora_a.shape[1], generator=torch.Generator().manual_seed(5))
    grads = []
    for fn in (
        lambda x_, a_: fused_lora_down(x_, a_, dropouts, layout, layer_seed=4, training=True),
        lambda x_, a_: lora_down_ref(x_, a_, dropouts, layout, keep),
    ):
        x_ = x.clone().requires_grad_(needs == "x")
        a_ = lora_a.clone().requires_grad_(needs == "a")
        fn(x_, a_).backward(grad_s.to(device))
        grads.append(x_.grad if needs == "x" else a_.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5, msg=f"d{needs}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lora_split_bf16_close_to_fp32(make_layout, make_lora):
    """bf16 (wrong in the interpreter, so GPU only): `lora_up(lora_down(x))` and its gradients
    within 1e-2 relative of the fp32 reference with the fused mask, on a row and column shard."""
    counts, ranks = [700, 0, 333, 91], [16, 8, 64, 1]
    scalings, dropouts = [2.0, 1.0, 0.5, 4.0], [0.1, 0.0, 0.05, 0.2]
    full_width, (col, width), out = 512, (128, 256), 384
    gen = torch.Generator().manual_seed(3)
    layout = make_layout(counts, "cuda", seed=4).shard(100, 1000)
    x = torch.randn(layout.num_tokens, width, generator=gen).cuda().bfloat16()
    lora_a, lora_b = make_lora(out, width, ranks, torch.bfloat16, "cuda", gen)
    grad_y = torch.randn(layout.num_tokens, out, generator=gen).cuda().bfloat16()
    keep = fused_dropout_keep_mask(layout, dropouts, full_width, 9, "cuda")[:, col : col + width]

    def split(x_, a_, b_):
        s = lora_down(
            x_,
            a_,
            dropouts,
            layout,
            layer_seed=9,
            training=True,
            col_offset=col,
            full_width=full_width,
        )
        return lora_up(s, b_, scalings, layout)

    def ref(x_, a_, b_):
        return lora_up_ref(lora_down_ref(x_, a_, dropouts, layout, keep), b_, scalings, layout)

    got = _grads(split, (x, lora_a, lora_b), grad_y)
    want = _grads(ref, (x.float(), lora_a.float(), lora_b.float()), grad_y.float())
    for name, g, w in zip(["y", "dx", "da", "db"], got, want, strict=True):
        err = float((g.float() - w).norm() / w.norm())
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


def _producer(source):
    """Stands in for a norm: X = 2·tanh(source) (autograd saves tanh's output, never X)."""
    return torch.tanh(source) * 2.0


def _saved_bytes(fn):
    """``fn()``'s result and ``{storage data_ptr: bytes}`` of every tensor autograd saved."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("shard", list(SHARDS))
@pytest.mark.parametrize("path", ["reference", "fused"])
def test_lora_down_rebuilt_input_keeps_bits_and_is_not_saved(
    path, shard, device, make_layout, make_lora
):
    """S, dX (through the producer) and dA equal the saving path's bit for bit; X's storage
    is not saved, nor any other (T, H_l) tensor (the masked copies, the mask)."""
    device = "cpu" if path == "reference" else device  # on CUDA lora_down runs Triton
    down = lora_down if path == "reference" else fused_lora_down
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, device, make_layout, make_lora
    )
    layout, source, lora_a, col, full = _shard(shard, layout, x, lora_a)
    grad_s = torch.randn(
        source.shape[0], lora_a.shape[1], generator=torch.Generator().manual_seed(6)
    ).to(device)
    runs = {}
    for rebuilt in (False, True):
        src, a = source.clone().requires_grad_(), lora_a.clone().requires_grad_()
        x_ = _producer(src)
        rebuild = InputRebuild(_producer, (src,)) if rebuilt else None
        s, saved = _saved_bytes(
            functools.partial(
                down,
                x_,
                a,
                dropouts,
                layout,
                layer_seed=5,
                training=True,
                col_offset=col,
                full_width=full,
                rebuild=rebuild,
            )
        )
        x_ptr = x_.untyped_storage().data_ptr()
        assert (x_ptr in saved) != rebuilt, f"{path}/{shard}: X saved={x_ptr in saved}"
        if rebuilt:
            others = {
                p: n
                for p, n in saved.items()
                if p not in (src.untyped_storage().data_ptr(), a.untyped_storage().data_ptr())
            }
            assert sum(others.values()) < x_.shape[0], f"{path}/{shard}: also saved {others}"
        s.backward(grad_s)
        runs[rebuilt] = (s.detach(), src.grad, a.grad)
    for name, got, want in zip(["s", "d_source", "da"], runs[True], runs[False], strict=True):
        torch.testing.assert_close(
            got, want, atol=0, rtol=0, msg=lambda m, n=name: f"{path}/{shard} {n}: {m}"
        )


def test_lora_down_rebuild_of_another_shape_is_refused(make_layout, make_lora):
    layout, x, lora_a, _, _, dropouts = _inputs(
        "ragged", torch.float32, "cpu", make_layout, make_lora
    )
    src, a = x.clone().requires_grad_(), lora_a.clone().requires_grad_()
    rebuild = InputRebuild(lambda t: _producer(t)[:-1], (src,))
    s = lora_down(_producer(src), a, dropouts, layout, layer_seed=5, training=True, rebuild=rebuild)
    with pytest.raises(RuntimeError, match=r"rebuilt LoRA input is \(99, 48\)"):
        s.sum().backward()
