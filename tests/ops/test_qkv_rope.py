"""`qkv_rope` (fused-QKV split with RoPE) against `qkv_rope_ref`.

CPU: Triton interpreter in fp32 and fp16, the fused row given as a strided view (a token
stride wider than the row, as a ``[T, 1, N]`` linear output sliced or padded would have);
forward outputs and the row's gradient. GPU: bf16, Llama-3-8B heads.
"""

import pytest
import torch

from megatron_lorafusion.ops import qkv_rope, qkv_rope_ref

# dtype -> (atol, rtol) of q, k, v and the row's gradient.
TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _tables(tokens, dim, device, dtype, gen):
    positions = torch.randint(0, 300, (tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, D)
    return torch.cos(emb).to(device, dtype), torch.sin(emb).to(device, dtype)


def _check(tokens, groups, q_per_group, dim, dtype, device, grads=(True, True, True)):
    gen = torch.Generator().manual_seed(0)
    width = groups * (q_per_group + 2) * dim
    wide = torch.randn(tokens, width + 8, generator=gen).to(device, dtype)  # token stride > width
    cos, sin = _tables(tokens, dim, device, dtype, gen)
    upstream = [
        torch.randn(tokens, heads, dim, generator=gen).to(device, dtype)
        for heads in (groups * q_per_group, groups, groups)
    ]
    outs = []
    for fn in (qkv_rope, qkv_rope_ref):
        leaf = wide.clone().requires_grad_(True)
        q, k, v = fn(leaf[:, :width], cos, sin, groups, q_per_group, dim)
        assert all(t.is_contiguous() for t in (q, k, v))
        used = [(t, g) for t, g, wanted in zip((q, k, v), upstream, grads, strict=True) if wanted]
        torch.autograd.backward(*zip(*used, strict=True))
        outs.append((q.detach(), k.detach(), v.detach(), leaf.grad))
    atol, rtol = TOL[dtype]
    for name, got, want in zip(("q", "k", "v", "drow"), *outs, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "groups", "q_per_group", "dim"),
    [(16, 2, 2, 16), (9, 1, 3, 20), (5, 3, 1, 8)],
    ids=["round-gqa", "ragged", "mha"],
)
def test_qkv_rope_matches_reference(tokens, groups, q_per_group, dim, dtype, device):
    _check(tokens, groups, q_per_group, dim, dtype, device)


def test_qkv_rope_without_gradient_for_v_matches_reference(device):
    """An output without gradient (v unused) contributes zeros to the row's gradient."""
    _check(7, 2, 2, 8, torch.float32, device, grads=(True, True, False))


def test_qkv_rope_refuses_mismatched_inputs(device):
    row = torch.randn(4, 2 * 4 * 8, device=device)
    cos = torch.ones(4, 1, 8, device=device)
    with pytest.raises(ValueError, match="row has shape"):
        qkv_rope(row[:, :-8], cos, cos, 2, 2, 8)
    with pytest.raises(ValueError, match="cos has shape"):
        qkv_rope(row, torch.ones(3, 1, 8, device=device), cos, 2, 2, 8)
    with pytest.raises(ValueError, match="even head_dim"):
        qkv_rope(torch.randn(4, 2 * 4 * 7, device=device), cos, cos, 2, 2, 7)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "groups", "q_per_group"), [(8192, 8, 4), (777, 2, 4)])
def test_qkv_rope_bf16_matches_reference_on_gpu(tokens, groups, q_per_group):
    _check(tokens, groups, q_per_group, 128, torch.bfloat16, "cuda")
