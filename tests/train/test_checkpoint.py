"""Checkpoint files: atomic folders with a manifest, damage detection, rotation, TP merge."""

import json

import pytest
import torch
from model_testing import TRAIN_MODEL

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.mcore.context import load_views
from megatron_lorafusion.train import AdapterAdamW, AdapterRun
from megatron_lorafusion.train.checkpoint import (
    Checkpointer,
    checkpoint_problems,
    find_resume_checkpoint,
)


class _FakeLoRA:
    """Stands in for `LoRAContext`: one adapter with two factors in a (1, 14) table."""

    num_adapters = 1

    def __init__(self):
        self.weights = torch.randn(1, 14)
        self.grads = torch.zeros(1, 14)

    def adapter_views(self, table, a):
        return {"l.lora_A": table[a, :6].view(2, 3), "l.lora_B": table[a, 6:].view(4, 2)}

    def adapter_tensors(self, a):
        return self.adapter_views(self.weights, a)

    def adapter_grads(self, a):
        return self.adapter_views(self.grads, a)

    def sharding(self):
        return {"l.lora_A": None, "l.lora_B": None}

    def load_adapter_state_dict(self, a, state):
        load_views(self.adapter_tensors(a), state, f"adapter {a}")


def _run(lora):
    optimizer = AdapterAdamW(lora, [AdapterConfig(name="x")], total_steps=[10])
    return AdapterRun("x", [1] * 10), optimizer


def _save(tmp_path, position, keep_last=0):
    lora = _FakeLoRA()
    run, optimizer = _run(lora)
    lora.grads.normal_()
    optimizer.step([0])  # moments and a step count to save
    lora.adapter_grads(0)["l.lora_A"].fill_(1.0)  # a gradient accumulated since
    run.pending_loss = 0.25
    ckpt = Checkpointer(tmp_path, {"job": 1}, keep_last=keep_last)
    return ckpt.save(position, "digest", [run], optimizer, lora), (lora, optimizer)


def test_checkpoint_save_restore_round_trip(tmp_path):
    folder, (lora, optimizer) = _save(tmp_path, 7)
    assert folder.name == "ckpt_00000007"
    assert not checkpoint_problems(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"job.json", "shard_tp0_pp0.pt"}
    fresh = _FakeLoRA()
    run, fresh_optimizer = _run(fresh)
    position, digest = Checkpointer(tmp_path, {}).restore(folder, [run], fresh_optimizer, fresh)
    assert (position, digest, run.pending_loss) == (7, "digest", 0.25)
    for name, value in lora.adapter_tensors(0).items():
        torch.testing.assert_close(
            fresh.adapter_tensors(0)[name], value, atol=0, rtol=0, msg=f"{name} not restored"
        )
    torch.testing.assert_close(
        fresh.adapter_grads(0)["l.lora_A"],
        torch.ones(2, 3),
        atol=0,
        rtol=0,
        msg="accumulated gradient not restored",
    )
    assert not fresh.adapter_grads(0)["l.lora_B"].any(), "a zero gradient must stay zero"
    assert fresh_optimizer.steps == [1], "the adapter's step count must be restored"
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            getattr(fresh_optimizer, key),
            getattr(optimizer, key),
            atol=0,
            rtol=0,
            msg=f"{key} not restored",
        )


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


TP_ADAPTERS = [
    AdapterConfig(name="a", rank=4),
    AdapterConfig(name="b", rank=2, target_modules=["linear_fc1"]),
]


def _filled(lora):
    """Give every factor distinct values from a seed (full, TP = 1 tensors)."""
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for a in range(len(TP_ADAPTERS)):
            for p in lora.adapter_tensors(a).values():
                p.copy_(torch.randn(p.shape, generator=generator))


def _tp_worker(rank, workdir):
    import os

    import torch.distributed as dist
    from dist_testing import gloo_world

    from megatron_lorafusion.train import build_run

    with gloo_world(rank, 2, workdir, tp=2):
        run = build_run(TRAIN_MODEL, TP_ADAPTERS, [[1] * 4] * len(TP_ADAPTERS), seed=1)
        lora = run.lora
        full = torch.load(os.path.join(workdir, "full.pt"))
        sharding = lora.sharding()
        for a, adapter in enumerate(TP_ADAPTERS):  # this rank's shard of the full tensors
            shard = {}
            for name in lora.adapter_tensors(a):
                value = full[adapter.name][name]
                if sharding[name] is not None:
                    dim, stride = sharding[name]
                    value = torch.cat(value.chunk(2 * stride, dim=dim)[rank::2], dim=dim)
                shard[name] = value
            lora.load_adapter_state_dict(a, shard)
        Checkpointer(
            os.path.join(workdir, "ckpt"),
            {},
            tp_rank=rank,
            tp_size=2,
            coordinator=rank == 0,
            barrier=dist.barrier,
        ).save(3, "d", run.runs, run.optimizer, lora)


@pytest.mark.slow
def test_checkpoint_tp2_shards_merge_to_full_tensors(megatron_single_process, tmp_path):
    import torch.multiprocessing as mp

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model
    from megatron_lorafusion.train.checkpoint import full_adapter_tensors

    lora = apply_lora(build_gpt_model(TRAIN_MODEL), TP_ADAPTERS, seed=1)
    _filled(lora)
    full = {ad.name: lora.adapter_state_dict(a) for a, ad in enumerate(TP_ADAPTERS)}
    torch.save(full, tmp_path / "full.pt")
    mp.spawn(_tp_worker, args=(str(tmp_path),), nprocs=2, join=True)
    merged = full_adapter_tensors(find_resume_checkpoint(tmp_path / "ckpt", "auto"))
    for name, tensors in full.items():
        assert merged[name].keys() == tensors.keys()
        for key, value in tensors.items():
            torch.testing.assert_close(
                merged[name][key],
                value,
                atol=0,
                rtol=0,
                msg=f"{name} {key}: TP shards do not merge back",
            )


def test_checkpoint_same_point_of_another_job_is_replaced(tmp_path):
    folder, _ = _save(tmp_path, 4)
    lora = _FakeLoRA()
    run, optimizer = _run(lora)
    again = Checkpointer(tmp_path, {"job": 2}).save(4, "digest", [run], optimizer, lora)
    assert again == folder
    assert json.loads((folder / "job.json").read_text()) == {"job": 2}
    assert not checkpoint_problems(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000004"]


def test_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    from megatron_lorafusion.train.checkpoint import CheckpointError, full_adapter_tensors

    lora = _FakeLoRA()
    run, optimizer = _run(lora)
    lora.weights[0, 8] = float("inf")  # in l.lora_B
    folder = Checkpointer(tmp_path, {}).save(3, "digest", [run], optimizer, lora)
    assert not checkpoint_problems(folder), "the files themselves are intact"
    with pytest.raises(CheckpointError, match=r"NaN or infinite values in x \(tp0 pp0\)"):
        full_adapter_tensors(folder)
    fresh = _FakeLoRA()
    before = fresh.weights.clone()
    run, fresh_optimizer = _run(fresh)
    with pytest.raises(CheckpointError, match=r"NaN or infinite values in x\.tensors\.l\.lora_B"):
        Checkpointer(tmp_path, {}).restore(folder, [run], fresh_optimizer, fresh)
    torch.testing.assert_close(
        fresh.weights, before, atol=0, rtol=0, msg="a refused checkpoint must load nothing"
    )


class _Payload:
    """Any object a pickle would construct when loaded without weights_only."""


def test_checkpoint_shard_holding_a_pickled_object_is_refused(tmp_path):
    from megatron_lorafusion.train.checkpoint import CheckpointError, read_shard

    torch.save({"adapters": [], "payload": _Payload()}, tmp_path / "shard_tp0_pp0.pt")
    with pytest.raises(CheckpointError, match="holds more than tensors and plain data") as info:
        read_shard(tmp_path, "shard_tp0_pp0.pt")
    assert "\n" not in str(info.value), "the refusal is one line"
