"""Per-adapter checkpoints: each adapter's own state, saved at its own global-batch boundary.

An adapter is checkpointed right after one of its optimizer steps, when its gradients are
zero and no loss is pending: its fp32 factors and both AdamW moments (no gradients, and a
per-projection adapter's ``B`` without its off-block zeros), plus a small state (step, data
cursor, losses, evaluations, early-stopping state, the config that trained it). No other
adapter and no position of a shared stream is involved, so adapters save, resume, join and
leave independently (DESIGN.md "Every adapter on its own").

On disk, ``<folder>/step_<step:08d>/`` holds per tensor/pipeline shard ``shard_tp{t}_pp{p}``
a safetensors file and a JSON state file; the state file, written last by an atomic rename,
is the commit marker and records the tensor file's size and SHA-256. A checkpoint is
complete when every shard's state file is there. ``<folder>/done.json`` marks an adapter
whose training ended and whose export is written. Nothing here imports Megatron:
``lorafusion export`` reads these files on any machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from megatron_lorafusion.train.writer import DIRECT_ALIGN, write_file

if TYPE_CHECKING:
    from megatron_lorafusion.mcore.context import SlotView

__all__ = [
    "FORMAT_VERSION",
    "TABLES",
    "AdapterCheckpoints",
    "CheckpointError",
    "RowPacking",
    "Shard",
    "full_adapter_tensors",
    "non_finite_tensors",
    "row_packing",
    "rows_to_tensors",
    "table_tensors",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: one adapter per checkpoint, safetensors + a JSON state per shard
TABLES = ("weight", "exp_avg", "exp_avg_sq")
"""The rows saved per adapter: its factors and AdamW's two moments, in this order."""

_STEP = re.compile(r"^step_(\d{8})$")
_DTYPES = {torch.float32: "F32", torch.uint8: "U8"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, foreign, or from another run layout."""


@dataclass(frozen=True)
class Shard:
    """This rank's tensor/pipeline shard (one writer per shard: data-parallel replica 0)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def name(self) -> str:
        """File stem of this shard: ``shard_tp{t}_pp{p}``."""
        return f"shard_tp{self.tp_rank}_pp{self.pp_rank}"

    def coordinates(self) -> list[int]:
        """``[tp_rank, tp_size, pp_rank, pp_size]``, as state files record them."""
        return [self.tp_rank, self.tp_size, self.pp_rank, self.pp_size]

    def names(self) -> list[str]:
        """Stems of every shard of the layout."""
        return [f"shard_tp{t}_pp{p}" for p in range(self.pp_size) for t in range(self.tp_size)]


@dataclass(frozen=True)
class RowPacking:
    """Where one adapter's checkpoint lies in a row of the tables, packed without zeros.

    A save gathers ``columns`` of each table's row into a (len(TABLES), K) buffer (on the
    GPU, so only K values per table cross to the host) and writes that buffer as it is: the
    checkpoint file's fp32 tensors are consecutive slices of it, table after table.

    Attributes:
        columns: (K,) int64 columns of a row, factor after factor (a per-projection ``B``'s
            live entries only).
        factors: ``(name, offset, shape)`` of each factor within the K packed columns.
        live: ``name -> (N_local, rank)`` uint8 live masks of per-projection ``B`` s, views
            of one buffer (they follow the fp32 data in the file).
    """

    columns: torch.Tensor
    factors: tuple[tuple[str, int, tuple[int, ...]], ...]
    live: dict[str, torch.Tensor]

    @property
    def width(self) -> int:
        """K: packed values per table."""
        return int(self.columns.numel())


def row_packing(slots: Sequence[SlotView], row_width: int) -> RowPacking:
    """The `RowPacking` of an adapter whose factors lie at ``slots`` in rows of ``row_width``."""
    positions = torch.arange(row_width, dtype=torch.int64)
    columns, factors, offset = [], [], 0
    live_masks = []
    for slot in slots:
        cols = slot.view(positions)
        if slot.live is not None:
            cols = cols[slot.live]
            live_masks.append((slot.name, slot.live.to(torch.uint8)))
        factors.append((slot.name, offset, tuple(cols.shape)))
        columns.append(cols.reshape(-1))
        offset += cols.numel()
    flat = torch.cat([m.reshape(-1) for _, m in live_masks]) if live_masks else None
    live, start = {}, 0
    for name, mask in live_masks:
        live[name] = flat[start : start + mask.numel()].view(mask.shape)
        start += mask.numel()
    empty = torch.zeros(0, dtype=torch.int64)
    return RowPacking(torch.cat(columns) if columns else empty, tuple(factors), live)


def rows_to_tensors(packed: torch.Tensor, packing: RowPacking) -> dict[str, torch.Tensor]:
    """Named tensors of one adapter from its packed rows (what a checkpoint file holds).

    Args:
        packed: (T, K) fp32 host rows, the first T of `TABLES` (weights, exp_avg,
            exp_avg_sq; an export's: the weights alone), packed by ``packing`` (the staging
            buffer the GPU gathered its ``columns`` into).
        packing: the adapter's `RowPacking`.

    Returns:
        ``"<table>/<factor name>"`` fp32 tensors, views of ``packed`` in its memory order
        (a per-projection ``B`` flattened to its live entries: its off-block zeros are not
        stored), then ``"live/<factor name>"`` (N_local, rank) uint8, the live mask of
        those (a byte per entry, a twelfth of B's three dense fp32 tables).
    """
    out: dict[str, torch.Tensor] = {}
    for table, row in zip(TABLES[: len(packed)], packed, strict=True):
        for name, offset, shape in packing.factors:
            out[f"{table}/{name}"] = row[offset : offset + math.prod(shape)].view(shape)
    for name, mask in packing.live.items():
        out[f"live/{name}"] = mask
    return out


def table_tensors(tensors: Mapping[str, torch.Tensor], table: str) -> dict[str, torch.Tensor]:
    """One table's tensors by factor name, a per-projection ``B`` back to its full shape.

    Args:
        tensors: what `rows_to_tensors` made, or `AdapterCheckpoints.load` read.
        table: one of `TABLES`.
    """
    prefix = f"{table}/"
    out = {}
    for key, value in tensors.items():
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        live = tensors.get(f"live/{name}")
        if live is not None and value.dim() == 1:  # its live entries only
            full = torch.zeros(live.shape, dtype=value.dtype)
            full[live.bool()] = value
            value = full
        out[name] = value
    return out


def _header(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """The safetensors header and the tensors' bytes (views of host memory, not copies).

    Tensors that lie back to back in one buffer (as `rows_to_tensors` returns them) come out
    as one chunk: a save writes and hashes a few large chunks, not thousands of small ones.
    """
    meta: dict[str, Any] = {}
    runs: list[list] = []  # [storage, first byte, bytes] of consecutive memory
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: checkpoints hold fp32 or uint8 tensors, got {tensor.dtype}")
        tensor = tensor.contiguous()
        storage = tensor.untyped_storage()
        first = tensor.storage_offset() * tensor.element_size()
        nbytes = tensor.numel() * tensor.element_size()
        meta[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        last = runs[-1] if runs else None
        if last and last[0].data_ptr() == storage.data_ptr() and last[1] + last[2] == first:
            last[2] += nbytes
        else:
            runs.append([storage, first, nbytes])
    chunks = [
        memoryview(torch.empty(0, dtype=torch.uint8).set_(storage, first, (nbytes,)).numpy())
        for storage, first, nbytes in runs
    ]
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DIRECT_ALIGN)  # the data starts 4096-byte aligned
    return struct.pack("<Q", len(text)) + text, chunks


def non_finite_tensors(tree: object, where: str) -> list[str]:
    """Names (``where`` plus dotted keys) of the floating tensors in ``tree`` holding NaN/inf."""
    if isinstance(tree, torch.Tensor):
        bad = tree.is_floating_point() and not bool(torch.isfinite(tree).all())
        return [where] if bad else []
    if isinstance(tree, dict):
        return [
            n for key, value in tree.items() for n in non_finite_tensors(value, f"{where}.{key}")
        ]
    return []


class AdapterCheckpoints:
    """One adapter's checkpoints on this shard, under ``folder``.

    Args:
        folder: the adapter's checkpoint folder (``<output_dir>/checkpoints/<name>``).
        name: the adapter's name (every state file records it; another name is foreign).
        shard: this rank's shard.
        keep_last: complete checkpoints kept (older ones deleted; the best of early stopping
            is kept too); 0 keeps all.
    """

    def __init__(self, folder: str | Path, name: str, shard: Shard, keep_last: int = 0):
        self.folder = Path(folder)
        self.name = name
        self.shard = shard
        self.keep_last = keep_last

    def step_folder(self, step: int) -> Path:
        """The folder of the checkpoint after optimizer step ``step``."""
        return self.folder / f"step_{step:08d}"

    # -- writing (a writer thread) --------------------------------------------------------
    def save(self, step: int, tensors: Mapping[str, torch.Tensor], state: dict) -> int:
        """Write this shard of the checkpoint at ``step``: tensors, then the state file.

        Args:
            step: the adapter's optimizer steps so far.
            tensors: `rows_to_tensors` of its rows.
            state: JSON-able state (the job's; the file also records the tensor file).

        Returns:
            Bytes written.

        Raises:
            WriteError: naming the file and bytes when the disk refuses (the state file is
                then never written, so the checkpoint never looks complete).
        """
        folder = self.step_folder(step)
        folder.mkdir(parents=True, exist_ok=True)
        header, chunks = _header(tensors)
        digest = hashlib.sha256()
        tensor_file = folder / f"{self.shard.name}.safetensors"
        written = write_file(tensor_file, [header, *chunks], digest)
        marker = {
            "format": FORMAT_VERSION,
            "adapter": self.name,
            "step": step,
            "shard": self.shard.coordinates(),
            "file": {"name": tensor_file.name, "bytes": written, "sha256": digest.hexdigest()},
            **state,
        }
        text = (json.dumps(marker, indent=1) + "\n").encode()
        written += write_file(folder / f"{self.shard.name}.json", [text])
        return written

    def write_done(self, state: dict) -> None:
        """Record that the adapter's training ended and its export is written (``done.json``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        payload = {"format": FORMAT_VERSION, "adapter": self.name, **state}
        write_file(self.folder / "done.json", [(json.dumps(payload, indent=1) + "\n").encode()])

    def rotate(self, keep: Iterable[int] = ()) -> None:
        """Delete this shard's files of all but the newest ``keep_last`` complete checkpoints.

        Only once a newer checkpoint is complete on every shard; steps in ``keep`` (the best
        of early stopping) stay. A step folder left empty is removed.
        """
        if self.keep_last <= 0:
            return
        complete = [s for s in self.steps() if self.is_complete(s)]
        kept = set(complete[: self.keep_last]) | set(keep)
        newest = complete[0] if complete else None
        for step in self.steps():
            if step in kept or newest is None or step > newest:
                continue
            folder = self.step_folder(step)
            for suffix in (".json", ".safetensors"):  # marker first: never a marker alone
                (folder / f"{self.shard.name}{suffix}").unlink(missing_ok=True)
            _remove_if_empty(folder)

    def clean_leftovers(self) -> None:
        """Remove this shard's half-written files (a save killed mid-write) and empty folders."""
        if not self.folder.is_dir():
            return
        for folder in self.folder.iterdir():
            if not (folder.is_dir() and _STEP.match(folder.name)):
                continue
            for tmp in folder.glob(f".{self.shard.name}.*.tmp"):
                tmp.unlink(missing_ok=True)
            tensors = folder / f"{self.shard.name}.safetensors"
            if tensors.exists() and not (folder / f"{self.shard.name}.json").exists():
                tensors.unlink(missing_ok=True)  # written, never committed
            _remove_if_empty(folder)

    # -- reading ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with this shard's state file, newest first (nothing is read or verified)."""
        if not self.folder.is_dir():
            return []
        found = []
        for folder in self.folder.iterdir():
            match = _STEP.match(folder.name)
            if match and (folder / f"{self.shard.name}.json").is_file():
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def is_complete(self, step: int) -> bool:
        """Every shard of the layout committed its part of the checkpoint at ``step``."""
        folder = self.step_folder(step)
        return all((folder / f"{n}.json").is_file() for n in self.shard.names())

    def read_state(self, step: int) -> dict:
        """This shard's state file at ``step``, checked against this adapter and layout.

        Raises:
            CheckpointError: unreadable, another format, another adapter's (foreign), or
                written by another TP × PP layout.
        """
        path = self.step_folder(step) / f"{self.shard.name}.json"
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            fmt, name, layout = state["format"], state["adapter"], state["shard"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{str(path)!r} is not a readable state file ({err})") from None
        if fmt != FORMAT_VERSION:
            raise CheckpointError(f"{str(path)!r} has format {fmt!r}, expected {FORMAT_VERSION}")
        if name != self.name:
            raise CheckpointError(
                f"{str(path)!r} belongs to adapter {name!r}, not {self.name!r} (a foreign "
                "checkpoint in this adapter's folder)"
            )
        mine = self.shard.coordinates()
        if list(layout) != mine:
            raise CheckpointError(
                f"{str(path)!r} was written by shard {layout} (tp rank, tp, pp rank, pp); "
                f"this rank is {mine}: resume needs the TP × PP layout it was saved with"
            )
        return state

    def load(self, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        """This shard's tensors and state at ``step``, verified (size, SHA-256, finite).

        Raises:
            CheckpointError: naming the file, for a missing, truncated, altered, foreign or
                non-finite checkpoint.
        """
        state = self.read_state(step)
        path = self.step_folder(step) / state["file"]["name"]
        tensors = read_verified(path, state["file"]["bytes"], state["file"]["sha256"])
        _check_live(tensors, path)
        bad = non_finite_tensors(tensors, path.name)
        if bad:
            raise CheckpointError(f"{str(path)!r} holds NaN or infinite values in {bad[0]}")
        return tensors, state

    def read_done(self) -> dict | None:
        """``done.json`` of an adapter whose training ended, or None."""
        path = self.folder / "done.json"
        if not path.is_file():
            return None
        try:
            done = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{str(path)!r} is not readable ({err})") from None
        if done.get("adapter") != self.name:
            raise CheckpointError(f"{str(path)!r} belongs to adapter {done.get('adapter')!r}")
        return done


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (another shard's files) or already gone


def read_verified(path: Path, nbytes: int, sha256: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, once its size and SHA-256 match the state file's.

    Raises:
        CheckpointError: naming ``path`` and what is wrong.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{str(path)!r} cannot be read ({err.strerror or err})") from None
    if len(data) != nbytes:
        raise CheckpointError(f"{str(path)!r} has {len(data)} bytes, its state file says {nbytes}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{str(path)!r}: SHA-256 differs from its state file (damaged)")
    try:
        return load_safetensors(data)
    except (SafetensorError, ValueError) as err:
        raise CheckpointError(f"{str(path)!r} is not a safetensors file ({err})") from None


def _check_live(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Every live-masked tensor has as many values as its mask has live entries.

    Raises:
        CheckpointError: naming the tensor that does not fit.
    """
    for key, mask in tensors.items():
        if not key.startswith("live/"):
            continue
        name = key.removeprefix("live/")
        for table in TABLES:
            values = tensors.get(f"{table}/{name}")
            if values is None or values.numel() != int(mask.bool().sum()):
                raise CheckpointError(f"{str(path)!r}: {table}/{name} does not fit its live mask")


def full_adapter_tensors(folder: str | Path, name: str) -> dict[str, torch.Tensor]:
    """One adapter's full (unsharded) fp32 factors from a complete checkpoint folder.

    Pipeline stages hold disjoint layers; tensor-parallel shards are concatenated along the
    dimension (and partition stride) each state file records (`pipeline.gather.unshard_tp`).

    Args:
        folder: a ``step_<n>`` folder.
        name: the adapter's name.

    Raises:
        CheckpointError: when a shard is missing, damaged or foreign.
    """
    from megatron_lorafusion.pipeline.gather import unshard_tp

    folder = Path(folder)
    first = folder / "shard_tp0_pp0.json"
    try:
        layout = json.loads(first.read_text(encoding="utf-8"))["shard"]
        tp, pp = int(layout[1]), int(layout[3])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise CheckpointError(f"{str(first)!r} is not a readable state file ({err})") from None
    step = int(_STEP.match(folder.name).group(1)) if _STEP.match(folder.name) else -1
    out: dict[str, torch.Tensor] = {}
    for p in range(pp):
        parts, rules = [], {}
        for t in range(tp):
            store = AdapterCheckpoints(folder.parent, name, Shard(t, tp, p, pp))
            tensors, state = store.load(step)
            parts.append(table_tensors(tensors, TABLES[0]))
            rules = state["sharding"]
        for key in parts[0]:
            split = rules.get(key)
            if split is None or tp == 1:
                out[key] = parts[0][key]
            else:
                out[key] = unshard_tp([part[key] for part in parts], split[0], split[1])
    return out
