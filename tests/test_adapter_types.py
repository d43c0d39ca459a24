"""`adapter_types`: each variant's reference and merged weight against PEFT's layer (fp32).

The references are what the fused path is tested against (`tests/mcore/test_lora_dora.py`),
so they are pinned to PEFT's own `Linear` (plain and ``use_dora``) on the same weights.
"""

import pytest
import torch

from megatron_lorafusion.adapter_types import ADAPTER_TYPES, DORA, LORA, adapter_type
from megatron_lorafusion.config import AdapterConfig

peft = pytest.importorskip("peft", reason="dev extra: peft")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}  # two fp32 evaluations of one formula


def _weights(seed=0, hidden=24, out=20, rank=4):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, hidden, generator=gen)
    return {
        "x": torch.randn(9, hidden, generator=gen),
        "weight": weight,
        "bias": torch.randn(out, generator=gen),
        "lora_a": torch.randn(rank, hidden, generator=gen) / hidden**0.5,
        "lora_b": torch.randn(out, rank, generator=gen) * 0.5,
        "vector": weight.norm(dim=1) * (1 + 0.2 * torch.randn(out, generator=gen)),
    }


def _peft_linear(w, rank, alpha, use_dora):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(w["weight"].shape[1], w["weight"].shape[0])

    base = Tiny()
    with torch.no_grad():
        base.proj.weight.copy_(w["weight"])
        base.proj.bias.copy_(w["bias"])
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"], use_dora=use_dora)
    layer = peft.get_peft_model(base, config).base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(w["lora_a"])
        layer.lora_B["default"].weight.copy_(w["lora_b"])
        if use_dora:
            layer.lora_magnitude_vector["default"].weight.copy_(w["vector"])
    return layer


@pytest.mark.parametrize("kind", ADAPTER_TYPES, ids=lambda t: t.name)
def test_adapter_type_reference_and_merge_match_peft(kind):
    w, rank, alpha = _weights(), 4, 8.0
    scaling = alpha / rank
    args = (w["weight"], w["bias"], w["lora_a"], w["lora_b"], scaling, w["vector"])
    with torch.no_grad():
        want = _peft_linear(w, rank, alpha, kind is DORA)(w["x"])
        got = kind.reference(w["x"], *args)
        merged = kind.merged_weight(w["weight"], w["lora_a"], w["lora_b"], scaling, w["vector"])
    torch.testing.assert_close(got, want, **TOL[torch.float32], msg=f"{kind.name} reference")
    torch.testing.assert_close(
        torch.nn.functional.linear(w["x"], merged, w["bias"]),
        want,
        **TOL[torch.float32],
        msg=f"{kind.name} merged weight",
    )


def test_dora_column_scale_times_lora_output_is_the_reference():
    w, scaling = _weights(seed=1), 1.5
    weight, lora_a, lora_b = w["weight"], w["lora_a"], w["lora_b"]
    scale = DORA.column_scale(weight, weight.square().sum(1), lora_a, lora_b, scaling, w["vector"])
    lora_out = LORA.reference(w["x"], weight, None, lora_a, lora_b, scaling, None)
    want = DORA.reference(w["x"], weight, w["bias"], lora_a, lora_b, scaling, w["vector"])
    torch.testing.assert_close(
        scale * lora_out + w["bias"], want, **TOL[torch.float32], msg="the fused hook"
    )
    fresh = DORA.init_row_vector(weight.square().sum(1))
    torch.testing.assert_close(fresh, weight.norm(dim=1), msg="m starts at ||W||_row")


def test_adapter_type_follows_use_dora():
    assert adapter_type(AdapterConfig(name="a")) is LORA
    assert adapter_type(AdapterConfig(name="a", use_dora=True)) is DORA
    assert DORA.problems(AdapterConfig(name="a", use_dora=True), "adapters.0", 1) == []
    assert (
        "adapter 'a'" in DORA.problems(AdapterConfig(name="a", use_dora=True), "adapters.0", 2)[0]
    )
