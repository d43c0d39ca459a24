"""Per-projection targets (PEFT's q_proj, v_proj, all-linear, ...) train what PEFT trains.

On an imported tiny Llama / Qwen2 / Qwen3 / Gemma 3, adapters with per-projection,
all-linear, MLP-only and fused targets run together in one packed microbatch; each one's
export has exactly the keys and shapes PEFT writes for its targets, and PEFT, loading it,
reproduces our logits and our gradients of every factor (so training steps what PEFT would
step: the off-block entries of a stacked B get exactly zero gradient; a fused target's
shared A gets the sum of PEFT's). The merged checkpoint reproduces the logits too.
"""

import json

import pytest
import torch
from hf_testing import save_tiny_hf_model

from megatron_lorafusion.config import AdapterConfig, lora_blocks
from megatron_lorafusion.train.export import peft_state_dict, write_merged_checkpoint

transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
peft = pytest.importorskip("peft", reason="dev extra: peft")

# dtype -> tolerances of the same LoRA model in Megatron and in transformers/peft (issue 6).
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4)}
# Gradients (entries up to ~400: the loss sums T·V weighted logits) are compared divided by
# their largest entry: the two fp32 sums run in different orders, measured <= 3e-6 apart.
GRAD_TOL = {torch.float32: dict(atol=2e-5, rtol=0.0)}
ADAPTERS = [
    AdapterConfig(name="qv", rank=4, alpha=8.0, target_modules=["v_proj", "q_proj"]),
    AdapterConfig(name="all", rank=2, alpha=4.0, use_rslora=True, target_modules=["all-linear"]),
    AdapterConfig(
        name="mlp", rank=3, alpha=6.0, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    AdapterConfig(name="fused", rank=2, alpha=4.0, target_modules=["linear_qkv", "o_proj"]),
]
OWNERS, LENGTHS = [0, 0, 1, 2, 2, 3], [9, 6, 11, 7, 5, 8]


def _hf_targets(adapter: AdapterConfig) -> list[str]:
    return sorted(
        {
            p
            for blocks in lora_blocks(adapter.target_modules).values()
            for block in blocks
            for p in block
        }
    )


def _our_run(model_cfg, ids, weights, adapters=ADAPTERS, owners=OWNERS, lengths=LENGTHS):
    """Our LoRA model on one packed microbatch: logits, and every adapter's weights and grads.

    B is random (zero off its blocks) and DoRA magnitudes are moved off their init, so every
    factor matters; the loss is ``Σ logits·w``.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model
    from megatron_lorafusion.ops import AdapterLayout

    model = build_gpt_model(model_cfg).train()
    lora = apply_lora(model, adapters, seed=7)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for wrapper in lora.wrappers.values():
            wrapper.lora_B.copy_(torch.randn(wrapper.lora_B.shape, generator=generator) * 0.3)
            if wrapper.lora_B_off is not None:
                wrapper.lora_B.masked_fill_(wrapper.lora_B_off, 0.0)
        for wrapper in lora.wrappers.values():
            if wrapper.row_vector is not None:  # DoRA's magnitude, 0 where it does not scale
                vector = getattr(wrapper, wrapper.row_vector)
                vector.mul_(1 + 0.2 * torch.randn(vector.shape, generator=generator))
    layout = AdapterLayout.from_samples(owners, lengths, len(adapters))
    lora.layout = layout
    cu = layout.cu_seqlens
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(ids[None], positions, None, packed_seq_params=params)[0]  # (T, V)
    (logits * weights).sum().backward()
    states = [lora.adapter_state_dict(a) for a in range(len(adapters))]
    grads = [{k: g.clone() for k, g in lora.adapter_grads(a).items()} for a in range(len(adapters))]
    return logits.detach(), states, grads


def _peft_run(base, folder, samples, weights):
    """PEFT's logits of ``samples`` (each alone) and the gradients of its LoRA weights."""
    model = peft.PeftModel.from_pretrained(_fresh(base), str(folder), is_trainable=True)
    logits = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
    (logits * weights).sum().backward()
    grads = {
        _state_key(n.replace(".default", "")): p.grad
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    return logits.detach(), grads


def _state_key(name: str) -> str:
    """A PEFT parameter name as its adapter file names it (DoRA's vector has no ``.weight``)."""
    return name.removesuffix(".weight") if "lora_magnitude_vector" in name else name


def _shared_a_grads(adapter: AdapterConfig, grads: dict) -> dict:
    """PEFT's gradients as our factors see them: a fused target's one ``A`` (shared by q, k
    and v) gets the sum of PEFT's q, k and v ``A`` gradients; per-projection ones their own."""
    out = dict(grads)
    shared = [
        block
        for blocks in lora_blocks(adapter.target_modules).values()
        for block in blocks
        if len(block) > 1
    ]
    for block in shared:
        for key in grads:
            if f".{block[0]}.lora_A." in key:
                names = [key.replace(block[0], p) for p in block]
                total = sum(grads[n] for n in names)
                out.update(dict.fromkeys(names, total))
    return out


def _fresh(base):
    return transformers.AutoModelForCausalLM.from_pretrained(str(base)).eval()


def check_exports_against_peft(tmp_path, kind, adapters, owners, lengths, check_config):
    """Our run of ``adapters`` on one packed microbatch of an imported tiny ``kind`` model,
    each adapter against PEFT: its export's keys and shapes are PEFT's for its targets (and
    variant), PEFT loading it gives our logits and factor gradients, and the merged
    checkpoint gives our logits. ``check_config(adapter, adapter_config.json dict)``."""
    from hf_testing import model_config

    from megatron_lorafusion.adapter_types import adapter_type
    from megatron_lorafusion.train import write_peft_folder

    base = tmp_path / "base"
    save_tiny_hf_model(kind, base)
    model_cfg = model_config(base)
    total = sum(lengths)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model_cfg.vocab_size, (total,), generator=generator)
    weights = torch.randn(total, model_cfg.vocab_size, generator=generator)
    logits, states, grads = _our_run(model_cfg, ids, weights, adapters, owners, lengths)
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    for a, adapter in enumerate(adapters):
        variant = adapter_type(adapter)
        mine = [i for i, owner in enumerate(owners) if owner == a]
        rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in mine])
        samples = [ids[bounds[i] : bounds[i + 1]] for i in mine]
        folder = write_peft_folder(tmp_path / adapter.name, adapter, states[a], model_cfg)
        check_config(adapter, json.loads((folder / "adapter_config.json").read_text()))
        expected = peft.get_peft_model_state_dict(
            peft.get_peft_model(
                _fresh(base),
                peft.LoraConfig(
                    r=adapter.rank, target_modules=_hf_targets(adapter), use_dora=adapter.use_dora
                ),
            )
        )
        exported = peft_state_dict(states[a], model_cfg, adapter.target_modules, variant)
        assert {k: v.shape for k, v in exported.items()} == {
            k: v.shape for k, v in expected.items()
        }, f"{adapter.name}: not PEFT's keys/shapes"

        peft_logits, peft_grads = _peft_run(base, folder, samples, weights[rows])
        torch.testing.assert_close(
            peft_logits,
            logits[rows],
            **TOL[torch.float32],
            msg=f"{kind} {adapter.name}: peft logits differ from ours",
        )
        # off-block entries of B: exactly 0
        our_grads = peft_state_dict(grads[a], model_cfg, adapter.target_modules, variant)
        assert our_grads.keys() == peft_grads.keys(), f"{adapter.name}: gradient keys differ"
        peft_grads = _shared_a_grads(adapter, peft_grads)
        for name, grad in our_grads.items():
            scale = peft_grads[name].abs().max()
            torch.testing.assert_close(
                grad / scale,
                peft_grads[name] / scale,
                **GRAD_TOL[torch.float32],
                msg=f"{kind} {adapter.name}: gradient of {name}",
            )

        merged = write_merged_checkpoint(
            tmp_path / f"{adapter.name}-merged", adapter, states[a], model_cfg
        )
        with torch.no_grad():
            merged_model = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).eval()
            merged_logits = torch.cat([merged_model(input_ids=s[None]).logits[0] for s in samples])
        torch.testing.assert_close(
            merged_logits,
            logits[rows],
            **TOL[torch.float32],
            msg=f"{kind} {adapter.name}: merged logits differ from ours",
        )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_projection_targets_match_peft_logits_grads_and_merge(
    megatron_single_process, tmp_path, kind
):
    def check_config(adapter, config):
        assert config["target_modules"] == _hf_targets(adapter), adapter.name

    check_exports_against_peft(tmp_path, kind, ADAPTERS, OWNERS, LENGTHS, check_config)


def test_train_main_mixed_targets_and_ranks_export_what_peft_loads(tmp_path):
    """One run (tiny preset, CPU): q/v, all-linear and MLP-only adapters of three ranks,
    written with PEFT's and our key names; each export loads in peft with PEFT's own keys."""
    import yaml
    from safetensors.torch import load_file

    from megatron_lorafusion.config import MODEL_PRESETS, load_config
    from megatron_lorafusion.data import write_task
    from megatron_lorafusion.train.main import main as train_main

    adapters = []
    for task, keys in (
        ("sort", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
        ("add", dict(r=2, lora_alpha=4, lora_dropout=0.1, target_modules="all-linear")),
        ("upper", dict(rank=3, alpha=6, target_modules=["gate_proj", "up_proj", "down_proj"])),
    ):
        path = write_task(task, tmp_path / f"{task}.jsonl", 24, seed=1)
        adapters.append(
            {
                "name": task,
                "lr": 2e-2,
                "global_batch_size": 3,
                "dataset": {"path": str(path)},
                **keys,
            }
        )
    job = {
        "model": {"preset": "tiny"},
        "adapters": adapters,
        "data": {"max_seq_length": 48},
        "planner": {"token_capacity": 96},
        "train": {"steps": 3, "device": "cpu", "output_dir": str(tmp_path / "run")},
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cfg = load_config(tmp_path / "job.yaml")
    train_main(cfg)

    tiny = MODEL_PRESETS["tiny"]
    hf_config = transformers.LlamaConfig(
        vocab_size=tiny["vocab_size"],
        hidden_size=tiny["hidden_size"],
        intermediate_size=tiny["ffn_hidden_size"],
        num_hidden_layers=tiny["num_layers"],
        num_attention_heads=tiny["num_attention_heads"],
        num_key_value_heads=tiny["num_query_groups"],
    )
    for adapter in cfg.adapters:
        folder = tmp_path / "run" / "adapters" / adapter.name
        config = json.loads((folder / "adapter_config.json").read_text())
        assert (config["r"], config["target_modules"]) == (adapter.rank, _hf_targets(adapter))
        saved = load_file(str(folder / "adapter_model.safetensors"))
        expected = peft.get_peft_model_state_dict(
            peft.get_peft_model(
                transformers.LlamaForCausalLM(hf_config),
                peft.LoraConfig(r=adapter.rank, target_modules=_hf_targets(adapter)),
            )
        )
        assert {k: v.shape for k, v in saved.items()} == {
            k: v.shape for k, v in expected.items()
        }, f"{adapter.name}: not PEFT's keys/shapes"
        model = peft.PeftModel.from_pretrained(
            transformers.LlamaForCausalLM(hf_config), str(folder)
        )
        loaded = peft.get_peft_model_state_dict(model)
        assert loaded.keys() == saved.keys(), f"{adapter.name}: missing or unexpected keys"
        for name, tensor in saved.items():
            torch.testing.assert_close(
                loaded[name], tensor, atol=0, rtol=0, msg=f"{adapter.name}: {name} changed on load"
            )
            if "lora_B" in name:
                assert tensor.any(), f"{adapter.name}: {name} untrained"
