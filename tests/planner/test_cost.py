import json

import pytest

from megatron_lorafusion.planner import CostModel


def test_cost_model_is_affine_plus_quadratic():
    cost = CostModel(fixed_ms=1.0, per_token_ms=0.5, attention_ms=0.25)
    assert cost.forward_ms(10, 100) == pytest.approx(1.0 + 5.0 + 25.0)
    assert cost.forward_ms(0, 0) == 0.0


def test_cost_model_fits_measured_points(tmp_path):
    truth = CostModel(fixed_ms=2.0, per_token_ms=0.01, attention_ms=1e-6, backward_ratio=2.5)
    points = [
        {
            "tokens": t,
            "squared_lengths": q,
            "forward_ms": truth.forward_ms(t, q),
            "backward_ms": 2.5 * truth.forward_ms(t, q),
        }
        for t, q in [(1000, 10**5), (4000, 4 * 10**6), (6000, 10**6), (2000, 2 * 10**6)]
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"points": points}))
    fitted = CostModel.from_profile(path)
    assert fitted.per_token_ms == pytest.approx(0.01, rel=1e-6)
    assert fitted.attention_ms == pytest.approx(1e-6, rel=1e-6)
    assert fitted.backward_ratio == pytest.approx(2.5)


def test_cost_model_rejects_unknown_keys_and_negatives(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"per_tok_ms": 1.0}))
    with pytest.raises(ValueError, match="unknown cost model keys"):
        CostModel.from_profile(path)
    with pytest.raises(ValueError, match="fixed_ms must be >= 0"):
        CostModel(fixed_ms=-1.0)
