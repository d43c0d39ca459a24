"""Checkpoint files: atomic folders with a manifest, damage detection, rotation, TP merge."""

import json

import pytest
import torch
from torch import nn

from megatron_lorafusion.config import AdapterConfig, ModelConfig
from megatron_lorafusion.train import AdapterRun, build_optimizer
from megatron_lorafusion.train.checkpoint import (
    Checkpointer,
    _merge_tp,
    checkpoint_problems,
    find_resume_checkpoint,
)


class _FakeLoRA:
    """Stands in for `LoRAContext`: one adapter with two factors."""

    def __init__(self):
        self.params = [("l.lora_A", nn.Parameter(torch.randn(2, 3))),
                       ("l.lora_B", nn.Parameter(torch.randn(4, 2)))]

    def adapter_parameters(self, a):
        return self.params

    def load_adapter_state_dict(self, a, state):
        with torch.no_grad():
            for name, p in self.params:
                p.copy_(state[name])


def _run(lora):
    optimizer, scheduler = build_optimizer([p for _, p in lora.params],
                                           AdapterConfig(name="x"), total_steps=10)
    return AdapterRun("x", optimizer, scheduler, [1] * 10)


def _save(tmp_path, position, keep_last=0):
    lora = _FakeLoRA()
    run = _run(lora)
    lora.params[0][1].grad = torch.ones(2, 3)
    run.pending_loss = 0.25
    ckpt = Checkpointer(tmp_path, {"job": 1}, keep_last=keep_last)
    return ckpt.save(position, "digest", [run], lora), lora


def test_checkpoint_save_restore_round_trip(tmp_path):
    folder, lora = _save(tmp_path, 7)
    assert folder.name == "ckpt_00000007"
    assert not checkpoint_problems(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"job.json", "shard_tp0_pp0.pt"}
    fresh = _FakeLoRA()
    run = _run(fresh)
    position, digest = Checkpointer(tmp_path, {}).restore(folder, [run], fresh)
    assert (position, digest, run.pending_loss) == (7, "digest", 0.25)
    for (name, p), (_, q) in zip(fresh.params, lora.params, strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=f"{name} not restored")
    torch.testing.assert_close(fresh.params[0][1].grad, torch.ones(2, 3), atol=0, rtol=0,
                               msg="accumulated gradient not restored")
    assert fresh.params[1][1].grad is None


def test_checkpoint_unfinished_write_is_never_picked(tmp_path):
    _save(tmp_path, 3)
    unfinished = tmp_path / "ckpt_00000009.tmp"
    unfinished.mkdir()
    (unfinished / "shard_tp0_pp0.pt").write_bytes(b"partial")
    no_manifest = tmp_path / "ckpt_00000011"
    no_manifest.mkdir()
    assert find_resume_checkpoint(tmp_path, "auto").name == "ckpt_00000003"
    assert find_resume_checkpoint(tmp_path, "never") is None


def test_checkpoint_keep_last_rotates_oldest(tmp_path):
    for position in (2, 4, 6, 8):
        _save(tmp_path, position, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000006", "ckpt_00000008"]


def test_checkpoint_flipped_byte_fails_hash(tmp_path):
    folder, _ = _save(tmp_path, 5)
    shard = folder / "shard_tp0_pp0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_problems(folder) == [f"{shard}: SHA-256 differs from the manifest"]


@pytest.mark.parametrize("stride", [1, 2])
def test_merge_tp_inverts_megatron_split(stride):
    full = torch.arange(48.0).reshape(12, 4)
    tp = 2
    shards = [torch.cat(full.chunk(tp * stride, dim=0)[r::tp]) for r in range(tp)]
    torch.testing.assert_close(_merge_tp(shards, 0, stride), full, atol=0, rtol=0,
                               msg="TP shards must merge back into the full tensor")


TP_MODEL = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=2, vocab_size=260, max_position_embeddings=64)
TP_ADAPTERS = [AdapterConfig(name="a", rank=4), AdapterConfig(name="b", rank=2,
                                                               target_modules=["linear_fc1"])]


def _filled(lora):
    """Give every factor distinct values from a seed (full, TP = 1 tensors)."""
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for a in range(len(TP_ADAPTERS)):
            for _, p in lora.adapter_parameters(a):
                p.copy_(torch.randn(p.shape, generator=generator))


def _tp_worker(rank, workdir):
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(workdir, "store"), 2),
                            rank=rank, world_size=2)
    try:
        parallel_state.initialize_model_parallel(2, 1)
        lora = apply_lora(build_gpt_model(TP_MODEL), TP_ADAPTERS, seed=1)
        full = torch.load(os.path.join(workdir, "full.pt"))
        for a, adapter in enumerate(TP_ADAPTERS):  # this rank's shard of the full tensors
            shard = {}
            for name, p in lora.adapter_parameters(a):
                value = full[adapter.name][name]
                if getattr(p, "tensor_model_parallel", False):
                    chunks = value.chunk(2 * p.partition_stride, dim=p.partition_dim)
                    value = torch.cat(chunks[rank::2], dim=p.partition_dim)
                shard[name] = value
            lora.load_adapter_state_dict(a, shard)
        runs = [_run_for(lora, a) for a in range(len(TP_ADAPTERS))]
        Checkpointer(os.path.join(workdir, "ckpt"), {}, tp_rank=rank, tp_size=2,
                     coordinator=rank == 0, barrier=dist.barrier).save(3, "d", runs, lora)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _run_for(lora, a):
    params = [p for _, p in lora.adapter_parameters(a)]
    optimizer, scheduler = build_optimizer(params, TP_ADAPTERS[a], total_steps=4)
    return AdapterRun(TP_ADAPTERS[a].name, optimizer, scheduler, [1] * 4)


@pytest.mark.slow
def test_checkpoint_tp2_shards_merge_to_full_tensors(megatron_single_process, tmp_path):
    import torch.multiprocessing as mp

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model
    from megatron_lorafusion.train.checkpoint import full_adapter_tensors

    lora = apply_lora(build_gpt_model(TP_MODEL), TP_ADAPTERS, seed=1)
    _filled(lora)
    full = {ad.name: lora.adapter_state_dict(a) for a, ad in enumerate(TP_ADAPTERS)}
    torch.save(full, tmp_path / "full.pt")
    mp.spawn(_tp_worker, args=(str(tmp_path),), nprocs=2, join=True)
    merged = full_adapter_tensors(find_resume_checkpoint(tmp_path / "ckpt", "auto"))
    for name, tensors in full.items():
        assert merged[name].keys() == tensors.keys()
        for key, value in tensors.items():
            torch.testing.assert_close(merged[name][key], value, atol=0, rtol=0,
                                       msg=f"{name} {key}: TP shards do not merge back")


def test_checkpoint_same_point_of_another_job_is_replaced(tmp_path):
    folder, _ = _save(tmp_path, 4)
    lora = _FakeLoRA()
    again = Checkpointer(tmp_path, {"job": 2}).save(4, "digest", [_run(lora)], lora)
    assert again == folder
    assert json.loads((folder / "job.json").read_text()) == {"job": 2}
    assert not checkpoint_problems(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000004"]
