"""PEFT export: Hugging Face tensor names and shapes, fused projections split correctly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_lorafusion.config import AdapterConfig, ModelConfig
from megatron_lorafusion.train import peft_state_dict, write_peft_folder

MODEL = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                    num_query_groups=2)  # 4 heads of 16 in 2 groups
HEAD = MODEL.hidden_size // MODEL.num_attention_heads
QKV_OUT = (MODEL.num_attention_heads + 2 * MODEL.num_query_groups) * HEAD


def _megatron_state(rank):
    state = {}
    outs = {"self_attention.linear_qkv": (MODEL.hidden_size, QKV_OUT),
            "self_attention.linear_proj": (MODEL.hidden_size, MODEL.hidden_size),
            "mlp.linear_fc1": (MODEL.hidden_size, 2 * MODEL.ffn_hidden_size),
            "mlp.linear_fc2": (MODEL.ffn_hidden_size, MODEL.hidden_size)}
    for layer in range(MODEL.num_layers):
        for module, (fan_in, fan_out) in outs.items():
            state[f"decoder.layers.{layer}.{module}.lora_A"] = torch.randn(rank, fan_in)
            state[f"decoder.layers.{layer}.{module}.lora_B"] = torch.randn(fan_out, rank)
    return state


def test_export_names_and_shapes():
    rank = 4
    out = peft_state_dict(_megatron_state(rank), MODEL)
    prefix = "base_model.model.model.layers.1"
    shapes = {
        "self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
        "self_attn.o_proj": (64, 64), "mlp.gate_proj": (176, 64), "mlp.up_proj": (176, 64),
        "mlp.down_proj": (64, 176),
    }
    for module, (fan_out, fan_in) in shapes.items():
        assert out[f"{prefix}.{module}.lora_A.weight"].shape == (rank, fan_in), module
        assert out[f"{prefix}.{module}.lora_B.weight"].shape == (fan_out, rank), module
    assert len(out) == MODEL.num_layers * len(shapes) * 2


def test_export_splits_grouped_qkv_rows():
    state = _megatron_state(2)
    b = state["decoder.layers.0.self_attention.linear_qkv.lora_B"]
    out = peft_state_dict(state, MODEL)
    q = out["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    k = out["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    # Group g's rows are [q head 2g | q head 2g+1 | k head g | v head g], 16 rows each.
    torch.testing.assert_close(q[16:32], b[16:32], msg="query head 1 sits in group 0")
    torch.testing.assert_close(q[32:48], b[64:80], msg="query head 2 opens group 1")
    torch.testing.assert_close(k[16:32], b[96:112], msg="key head 1 follows group 1's queries")


def test_export_folder_is_loadable_by_peft(tmp_path):
    transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
    peft = pytest.importorskip("peft", reason="dev extra: peft")
    adapter = AdapterConfig(name="x", rank=4, alpha=8, dropout=0.1)
    folder = write_peft_folder(tmp_path / "x", adapter, _megatron_state(4), MODEL)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4
    assert config["lora_alpha"] == 8
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=MODEL.vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    model = peft.PeftModel.from_pretrained(base, str(folder))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    loaded = peft.get_peft_model_state_dict(model)
    assert set(loaded) == set(saved), "peft must find every exported tensor, and no other"
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name], tensor, msg=f"{name} changed on load")
