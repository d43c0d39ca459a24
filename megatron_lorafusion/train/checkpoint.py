"""Resumable training checkpoints: all adapters at one point of the plan stream, atomically.

Adapters step at different times (each after its own global batch), so a checkpoint is taken
*between microbatches*: after microbatch ``position - 1`` of the (deterministic) plan stream,
every adapter's weights, accumulated gradients, partial loss, optimizer and LR-schedule
states are saved together with the RNG states and a digest of the stream so far. Resuming
regenerates the plan, checks the digest, and continues at microbatch ``position``.

On disk, ``<output_dir>/checkpoints/ckpt_{position:08d}/`` holds ``job.json``, one
``shard_tp{t}_pp{p}.pt`` per model-parallel rank (TP-local tensors; data-parallel replica
``d > 0`` writes ``shard_tp{t}_pp{p}_dp{d}.pt``), and ``manifest.json``
with every file's size and SHA-256. Files are written into ``ckpt_….tmp/``; the manifest is
written last and the folder renamed only then, so a crash never leaves a checkpoint that
looks complete, and a file damaged later fails its size or hash check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "Checkpointer",
    "checkpoint_folders",
    "checkpoint_problems",
    "find_resume_checkpoint",
    "full_adapter_tensors",
    "non_finite_tensors",
    "read_shard",
    "shard_name",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: one AdamW state per adapter (step, moments by factor name)
_NAME = re.compile(r"^ckpt_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, or written by another run layout)."""


def shard_name(tp_rank: int, pp_rank: int, dp_rank: int = 0) -> str:
    """File name of one rank's shard.

    Data-parallel replicas share weights and optimizer states but not the gradients and loss
    they have accumulated in a global batch that straddles the checkpoint, so each replica
    writes its own shard; replica 0's keeps the plain name (what export reads).
    """
    suffix = f"_dp{dp_rank}" if dp_rank else ""
    return f"shard_tp{tp_rank}_pp{pp_rank}{suffix}.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_problems(folder: str | Path) -> list[str]:
    """Why ``folder`` is not a complete checkpoint (empty when it is).

    Checks the manifest, then every listed file's existence, size and SHA-256.
    """
    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        return [f"{folder}: no manifest.json (the write did not finish)"]
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return [f"{manifest_path}: unreadable manifest ({err!r})"]
    if manifest.get("format") != FORMAT_VERSION:
        return [f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}"]
    problems = []
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {meta['bytes']}")
        elif _sha256(path) != meta["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest")
    return problems


def checkpoint_folders(root: str | Path) -> list[Path]:
    """Every finished checkpoint folder (``ckpt_<position>``) under ``root``, oldest first.

    Finished means renamed into place; a folder may still fail `checkpoint_problems` if it
    was damaged since.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return [f for f in sorted(root.glob("ckpt_*")) if f.is_dir() and _NAME.match(f.name)]


def _complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first; damaged ones are warned about."""
    found = []
    for folder in checkpoint_folders(root):
        problems = checkpoint_problems(folder)
        if problems:
            logger.warning("skipping incomplete checkpoint %s: %s", folder, "; ".join(problems))
            continue
        found.append(folder)
    return found


def find_resume_checkpoint(root: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from under policy ``resume``.

    Args:
        root: the run's ``checkpoints`` folder.
        resume: ``"never"``; ``"auto"`` (the newest complete checkpoint, or None); or the path
            of one checkpoint folder.

    Raises:
        CheckpointError: when an explicitly named checkpoint is incomplete or damaged.
    """
    if resume == "never":
        return None
    if resume == "auto":
        root = Path(root)
        found = _complete_checkpoints(root) if root.is_dir() else []
        return found[-1] if found else None
    problems = checkpoint_problems(resume)
    if problems:
        raise CheckpointError(
            f"train.resume checkpoint {resume!r} is not usable:\n  - " + "\n  - ".join(problems)
        )
    return Path(resume)


def read_shard(folder: str | Path, name: str) -> dict:
    """Load one shard file of a checkpoint (CPU tensors, ``weights_only``).

    Raises:
        CheckpointError: when the file holds anything but tensors and plain data (a pickled
            object is never run) or is not a torch file.
    """
    path = Path(folder) / name
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint shard {str(path)!r} is refused: it holds more than "
            f"tensors and plain data ({first})"
        ) from None


def non_finite_tensors(tree: object, where: str) -> list[str]:
    """Names (``where`` plus dotted keys) of the floating tensors in ``tree`` holding NaN/inf."""
    if isinstance(tree, torch.Tensor):
        bad = tree.is_floating_point() and not bool(torch.isfinite(tree).all())
        return [where] if bad else []
    if isinstance(tree, dict):
        return [
            n for key, value in tree.items() for n in non_finite_tensors(value, f"{where}.{key}")
        ]
    if isinstance(tree, list | tuple):
        return [
            n for i, value in enumerate(tree) for n in non_finite_tensors(value, f"{where}.{i}")
        ]
    return []


def _refuse_non_finite(folder: Path, names: list[str]) -> None:
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise CheckpointError(
            f"checkpoint {str(folder)!r} holds NaN or infinite values in "
            f"{shown}; it is refused (resume from an older checkpoint with "
            f"train.resume: <folder>, or start fresh)"
        )


def full_adapter_tensors(folder: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every adapter's full (unsharded) factors from a checkpoint, by adapter name.

    Pipeline stages hold disjoint layers; tensor-parallel shards are concatenated along the
    dimension (and partition stride) recorded with each tensor (`pipeline.gather.unshard_tp`).

    Raises:
        CheckpointError: when the checkpoint is incomplete or damaged.
    """
    from megatron_lorafusion.pipeline.gather import unshard_tp

    folder = Path(folder)
    problems = checkpoint_problems(folder)
    if problems:
        raise CheckpointError(
            f"checkpoint {str(folder)!r} is not usable:\n  - " + "\n  - ".join(problems)
        )
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    tp, pp = manifest["tp"], manifest["pp"]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for p in range(pp):
        shards = [read_shard(folder, shard_name(t, p)) for t in range(tp)]
        _refuse_non_finite(
            folder,
            [
                n
                for t, shard in enumerate(shards)
                for e in shard["adapters"]
                for n in non_finite_tensors(e["tensors"], f"{e['name']} (tp{t} pp{p})")
            ],
        )
        for a, entry in enumerate(shards[0]["adapters"]):
            tensors = out.setdefault(entry["name"], {})
            for key, value in entry["tensors"].items():
                split = shards[0]["sharding"][key]
                if split is None or tp == 1:
                    tensors[key] = value
                else:
                    parts = [s["adapters"][a]["tensors"][key] for s in shards]
                    tensors[key] = unshard_tp(parts, split[0], split[1])
    return out


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Writes and restores this rank's part of the run's checkpoints.

    Args:
        root: the run's ``checkpoints`` folder.
        job: the job config as a JSON-able dict (copied into every checkpoint).
        tp_rank, tp_size, pp_rank, pp_size: this rank's model-parallel coordinates.
        dp_rank, dp_size: this rank's data-parallel coordinates (every replica writes its
            own shard: see `shard_name`).
        coordinator: whether this rank writes the manifest, renames and rotates (global rank 0).
        barrier: synchronises all ranks (a no-op in a one-process run).
        keep_last: complete checkpoints to keep (older ones are deleted); 0 keeps all.
    """

    def __init__(
        self,
        root: str | Path,
        job: dict,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        coordinator: bool = True,
        barrier: Callable[[], None] = lambda: None,
        keep_last: int = 0,
    ):
        self.root = Path(root)
        self.job = job
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, pp_rank, pp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.coordinator = coordinator
        self.barrier = barrier
        self.keep_last = keep_last

    def _payload(self, position: int, digest: str, runs, optimizer, lora) -> dict:
        adapters = []
        for a, run in enumerate(runs):
            adapters.append(
                {
                    "name": run.name,
                    "tensors": {
                        n: t.detach().cpu().clone() for n, t in lora.adapter_tensors(a).items()
                    },
                    "grads": {
                        n: t.detach().cpu().clone() for n, t in lora.adapter_grads(a).items()
                    },
                    "optimizer": optimizer.adapter_state(a),
                    "losses": list(run.losses),
                    "pending_loss": run.pending_loss,
                }
            )
        sharding = {n: None if rule is None else list(rule) for n, rule in lora.sharding().items()}
        return {
            "format": FORMAT_VERSION,
            "position": position,
            "stream_digest": digest,
            "adapters": adapters,
            "sharding": sharding,
            "rng": _rng_state(),
        }

    def save(self, position: int, digest: str, runs, optimizer, lora) -> Path:
        """Save every adapter's state after ``position`` microbatches of the stream.

        Args:
            position: microbatches consumed so far (the next one to run has this index).
            digest: SHA-256 hex of the stream's first ``position`` microbatches.
            runs: per adapter id, its `AdapterRun` (losses).
            optimizer: the adapters' `AdapterAdamW` (step counts and moments).
            lora: the `LoRAContext` holding the adapters' parameters on this rank.

        Returns:
            The final checkpoint folder.
        """
        final = self.root / f"ckpt_{position:08d}"
        if self._same_as(final, digest):
            return final  # this job at this point of the same stream: the same state
        tmp = final.with_name(final.name + ".tmp")
        if self.coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        path = tmp / shard_name(self.tp_rank, self.pp_rank, self.dp_rank)
        torch.save(self._payload(position, digest, runs, optimizer, lora), path)
        _fsync(path)
        self.barrier()
        if self.coordinator:
            (tmp / "job.json").write_text(json.dumps(self.job, indent=2) + "\n", encoding="utf-8")
            files = {
                p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.iterdir())
            }
            manifest = {
                "format": FORMAT_VERSION,
                "position": position,
                "tp": self.tp_size,
                "pp": self.pp_size,
                "dp": self.dp_size,
                "stream_digest": digest,
                "steps": {run.name: run.step for run in runs},
                "files": files,
            }
            (tmp / "manifest.json").write_text(
                json.dumps(manifest, indent=2) + "\n", encoding="utf-8"
            )
            _fsync(tmp / "manifest.json")
            if final.exists():  # another job's checkpoint here: moved aside, then deleted
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
            self._rotate()
            logger.info(
                "saved checkpoint %s (%s)",
                final,
                ", ".join(f"{run.name} step {run.step}" for run in runs),
            )
        self.barrier()
        return final

    def _same_as(self, folder: Path, digest: str) -> bool:
        """Whether ``folder`` is a complete checkpoint of this job at the same stream point."""
        if not folder.is_dir() or checkpoint_problems(folder):
            return False
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
        return manifest["stream_digest"] == digest and job == json.loads(json.dumps(self.job))

    def _rotate(self) -> None:
        if self.keep_last <= 0:
            return
        complete = [
            f
            for f in sorted(self.root.glob("ckpt_*"))
            if _NAME.match(f.name) and (f / "manifest.json").is_file()
        ]
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self, folder: str | Path, runs, optimizer, lora) -> tuple[int, str]:
        """Load this rank's shard of ``folder`` into ``runs``, ``optimizer`` and ``lora``.

        Returns:
            ``(position, digest)``: microbatches already consumed and their SHA-256.

        Raises:
            CheckpointError: when the checkpoint was written with another TP/PP/DP layout or
                other adapters.
        """
        from megatron_lorafusion.mcore.context import load_views  # Megatron: training only

        folder = Path(folder)
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        # Older checkpoints hold no "dp" and only replica 0's shards: usable at DP = 1 only.
        written = (manifest["tp"], manifest["pp"], manifest.get("dp", 1))
        if written != (self.tp_size, self.pp_size, self.dp_size):
            raise CheckpointError(
                f"checkpoint {str(folder)!r} was written with tp={written[0]}, "
                f"pp={written[1]}, dp={written[2]}; this run has tp={self.tp_size}, "
                f"pp={self.pp_size}, dp={self.dp_size} "
                f"(set train.resume: never or another train.output_dir to start fresh)"
            )
        shard = read_shard(folder, shard_name(self.tp_rank, self.pp_rank, self.dp_rank))
        names = [entry["name"] for entry in shard["adapters"]]
        if names != [run.name for run in runs]:
            raise CheckpointError(
                f"checkpoint {str(folder)!r} holds adapters {names}, this run has "
                f"{[run.name for run in runs]} (set train.resume: never or another "
                f"train.output_dir to start fresh)"
            )
        _refuse_non_finite(
            folder,
            [
                n
                for e in shard["adapters"]
                for key in ("tensors", "grads", "optimizer")
                for n in non_finite_tensors(e[key], f"{e['name']}.{key}")
            ],
        )
        for a, (entry, run) in enumerate(zip(shard["adapters"], runs, strict=True)):
            lora.load_adapter_state_dict(a, entry["tensors"])
            load_views(lora.adapter_grads(a), entry["grads"], f"the gradients of adapter {a}")
            optimizer.load_adapter_state(a, entry["optimizer"])
            run.losses[:] = entry["losses"]
            run.pending_loss = entry["pending_loss"]
        _set_rng_state(shard["rng"])
        logger.info("resumed from %s at microbatch %d", folder, shard["position"])
        return shard["position"], shard["stream_digest"]
