"""`lora_gemm` (design (a): Triton GEMM with the LoRA term in its epilogue) against
`lora_gemm_ref`, in both operand layouts (forward ``Wᵀ``, backward ``W``).

CPU: Triton interpreter, fp32 with IEEE dots, so differences are summation order.
"""

import pytest
import torch

from megatron_lorafusion.ops import fused_dropout_keep_mask
from megatron_lorafusion.ops._utils import mixed_seed
from megatron_lorafusion.ops.lora_gemm import lora_gemm, lora_gemm_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("transposed", [True, False])
def test_lora_gemm_matches_reference(transposed, dtype, device, make_layout, make_lora):
    gen = torch.Generator().manual_seed(4)
    counts, dropouts = [20, 0, 13], [0.2, 0.0, 0.4]
    layout = make_layout(counts, device, seed=8)
    inner, width = 40, 36  # K not a multiple of BLOCK_K, D not a multiple of BLOCK_N
    z = torch.randn(layout.num_tokens, inner, generator=gen).to(device, dtype)
    weight = torch.randn(width, inner, generator=gen).to(device, dtype) / inner**0.5
    w = weight.t() if transposed else weight.t().contiguous()  # (K, D), two stride layouts
    s = torch.randn(layout.num_tokens, 6, generator=gen).to(device, dtype)
    m, _ = make_lora(8, width, [6, 2, 4], dtype, device, gen)  # (A, R, D)
    bias = torch.randn(width, generator=gen).to(device, dtype)
    drop = torch.tensor(dropouts, device=device)
    keep = fused_dropout_keep_mask(layout, dropouts, width, 1, device)
    got = lora_gemm(z, w, s, m, bias, drop, layout, mixed_seed(layout.dropout_seed, 1))
    want = lora_gemm_ref(z, w, s, m, bias, keep, drop, layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg="gemm")


def test_lora_gemm_names_bad_tensor(device, make_layout):
    layout = make_layout([4, 4], device)
    z, s = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match="w has shape"):
        lora_gemm(z, torch.randn(15, 8, device=device), s, torch.randn(2, 4, 8, device=device),
                  None, None, layout, 0)
