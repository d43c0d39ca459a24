"""`rope` (packed q/k rotation with per-token tables) against `rope_ref`.

CPU: Triton interpreter in fp32 and fp16, q/k given as strided views of one fused QKV row as
Megatron's split leaves them (elementwise: differences are roundings). GPU: bf16, Llama-3-8B
heads.
"""

import pytest
import torch

from megatron_lorafusion.ops import rope, rope_ref

# dtype -> (atol, rtol) of rotated q, k and their gradients.
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


def _check(tokens, q_heads, kv_heads, dim, dtype, device):
    gen = torch.Generator().manual_seed(0)
    # One fused row per token, [q | k | v], sliced into strided views (last stride 1).
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    cos, sin = _tables(tokens, dim, device, dtype, gen)
    dq = torch.randn(tokens, q_heads, dim, generator=gen).to(device, dtype)
    dk = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, dtype)
    outs = []
    for fn in (rope, rope_ref):
        leaf = qkv.clone().requires_grad_(True)
        q = leaf[:, : q_heads * dim].view(tokens, q_heads, dim)
        k = leaf[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        rq, rk = fn(q, k, cos, sin)
        torch.autograd.backward((rq, rk), (dq, dk))
        outs.append((rq.detach(), rk.detach(), leaf.grad))
    atol, rtol = TOL[dtype]
    for name, got, want in zip(("q", "k", "dqkv"), *outs, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "dim"),
    [(16, 4, 2, 16), (9, 3, 1, 20), (5, 6, 6, 8)],
    ids=["round-gqa", "ragged", "mha"],
)
def test_rope_matches_reference(tokens, q_heads, kv_heads, dim, dtype, device):
    _check(tokens, q_heads, kv_heads, dim, dtype, device)


def test_rope_refuses_mismatched_inputs(device):
    q = torch.randn(4, 2, 8, device=device)
    cos = torch.ones(4, 1, 8, device=device)
    with pytest.raises(ValueError, match="key has shape"):
        rope(q, torch.randn(4, 2, 6, device=device), cos, cos)
    with pytest.raises(ValueError, match="cos has shape"):
        rope(q, q, torch.ones(3, 1, 8, device=device), cos)


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "q_heads", "kv_heads"), [(8192, 32, 8), (777, 8, 2)])
def test_rope_bf16_matches_reference_on_gpu(tokens, q_heads, kv_heads):
    _check(tokens, q_heads, kv_heads, 128, torch.bfloat16, "cuda")
