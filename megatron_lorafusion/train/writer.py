"""Saving in the background: pinned staging buffers and writer threads.

A save copies one adapter's rows of the fp32 tables (weights and both AdamW moments) into a
host buffer, on a side CUDA stream that waits for the optimizer step (`StagingPool`), and a
writer thread turns them into files while training goes on (`BackgroundWriter`). The
training loop waits only when every staging byte is taken (a disk slower than the saves),
and says so in a warning. A task that fails (disk full, permission denied) is re-raised by
the next `BackgroundWriter.check`, naming the path and the bytes it needed.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["BackgroundWriter", "HostRows", "StagingPool", "WriteError", "write_file"]

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0  # at most one "saving is behind" warning per this many seconds


class WriteError(RuntimeError):
    """A file could not be written (disk full, no permission, ...): names path and bytes."""


def write_file(path: Path, chunks: list[memoryview | bytes], digest=None) -> int:
    """Write ``chunks`` to ``path`` atomically (a hidden temporary sibling, fsync, rename).

    Args:
        path: the final file.
        chunks: the file's bytes, in order (memoryviews of host tensors are not copied).
        digest: a hashlib object updated with every byte written, or None.

    Returns:
        Bytes written.

    Raises:
        WriteError: naming ``path``, the bytes it needed and the OS error; the temporary file
            is removed, so nothing half-written is left.
    """
    total = sum(len(c) for c in chunks)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                if digest is not None:
                    digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        hint = {
            errno.ENOSPC: "free space on that disk or set another train.output_dir",
            errno.EDQUOT: "the disk quota is full",
            errno.EACCES: "the folder is not writable by this user",
            errno.EROFS: "the file system is read-only",
        }.get(err.errno, "check the disk")
        raise WriteError(
            f"could not write {str(path)!r} ({total:,} bytes): {err.strerror or err} ({hint}); "
            "earlier checkpoints are untouched"
        ) from None
    return total


@dataclass
class HostRows:
    """One adapter's rows of the fp32 tables, on their way to the host.

    Attributes:
        rows: (3, S) fp32 host tensor: weights, exp_avg, exp_avg_sq (a staging buffer).
        done: the side stream's event after the copy (None on CPU: already copied).
    """

    rows: torch.Tensor
    done: torch.cuda.Event | None = None
    _pool: StagingPool | None = field(default=None, repr=False)

    def wait(self) -> torch.Tensor:
        """The rows, once copied (blocks the calling thread, never the GPU)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.rows

    def release(self) -> None:
        """Give the buffer back to its pool (the rows must no longer be read)."""
        if self._pool is not None:
            self._pool.release(self.rows)
            self._pool = None


class StagingPool:
    """Host buffers for adapter rows, at most ``capacity_bytes`` in use at once.

    On CUDA the buffers are pinned (so the device-to-host copy is asynchronous) and reused by
    size; `acquire` blocks while the pool is full, the only point where saving can stall the
    training loop, and warns with the wait.

    Args:
        capacity_bytes: most bytes handed out at once (one buffer is always allowed, however
            large).
        pinned: allocate pinned memory (CUDA runs).
    """

    def __init__(self, capacity_bytes: int, *, pinned: bool):
        self.capacity = capacity_bytes
        self.pinned = pinned
        self.in_use = 0
        self.waited_s = 0.0
        self._free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._cond = threading.Condition()
        self._warned = -_WARN_EVERY_S

    def reserve(self, shape: tuple[int, ...], count: int) -> int:
        """Allocate up to ``count`` (shape) buffers now, within the capacity; returns how many.

        Pinning host memory takes time (and the first saves would pay it in the training
        loop): a run reserves the buffers of one save of every adapter at start-up.
        """
        nbytes = 4 * int(torch.Size(shape).numel())
        count = max(0, min(count, self.capacity // max(nbytes, 1)))
        with self._cond:
            free = self._free.setdefault(tuple(shape), [])
            while len(free) < count:
                free.append(torch.empty(shape, dtype=torch.float32, pin_memory=self.pinned))
        return count

    def acquire(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A (shape) fp32 host buffer; waits while handing it out would pass the capacity."""
        nbytes = 4 * int(torch.Size(shape).numel())
        start = time.perf_counter()
        with self._cond:
            while self.in_use and self.in_use + nbytes > self.capacity:
                self._cond.wait(timeout=1.0)
            self.in_use += nbytes
            free = self._free.get(tuple(shape))
            buf = free.pop() if free else None
        waited = time.perf_counter() - start
        self.waited_s += waited
        if waited > 0.5 and time.perf_counter() - self._warned > _WARN_EVERY_S:
            self._warned = time.perf_counter()
            logger.warning(
                "saving is behind: training waited %.1f s for %.1f GB of staging memory to "
                "reach the disk (train.save_buffer_gib; a faster disk or fewer saves helps)",
                waited,
                self.capacity / 1e9,
            )
        if buf is None:
            buf = torch.empty(shape, dtype=torch.float32, pin_memory=self.pinned)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return ``buf`` for reuse and wake a waiting `acquire`."""
        with self._cond:
            self.in_use -= 4 * buf.numel()
            self._free.setdefault(tuple(buf.shape), []).append(buf)
            self._cond.notify_all()

    def copy_rows(self, tables: tuple[torch.Tensor, ...], row: int, stream=None) -> HostRows:
        """Queue the copy of row ``row`` of each (A, S) table into a staging buffer.

        On CUDA the copy runs on ``stream`` once the current stream's work queued so far
        (the optimizer step) is done; the caller must keep the rows unchanged until the
        returned rows' ``done`` event (the optimizer waits for it before its next step).
        """
        buf = self.acquire((len(tables), tables[0].shape[1]))
        if tables[0].device.type != "cuda":
            for i, table in enumerate(tables):
                buf[i].copy_(table[row].detach())
            return HostRows(buf, None, self)
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for i, table in enumerate(tables):
                buf[i].copy_(table[row].detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return HostRows(buf, done, self)


class BackgroundWriter:
    """Runs save and export tasks on writer threads, in order per key (an adapter).

    Tasks of one key run one after another in submission order (a checkpoint, then its
    rotation, then the export); tasks of different keys run in parallel. A task that raises
    is re-raised by `check` (or `drain`) in the training thread.

    Args:
        threads: writer threads (files are written and hashed in parallel across adapters).
    """

    def __init__(self, threads: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lorafusion-save")
        self._tails: dict[str, Future] = {}
        self._pending: list[tuple[str, Future]] = []
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.bytes_written = 0

    def submit(self, key: str, task: Callable[[], int | None], what: str) -> Future:
        """Run ``task`` after the earlier tasks of ``key``; it returns the bytes it wrote.

        Args:
            key: orders the tasks (an adapter's name).
            task: the work, run on a writer thread.
            what: names it in errors (``checkpoint of adapter 'a' at step 4``).
        """
        before = self._tails.get(key)

        def run() -> None:
            if before is not None:
                try:
                    before.result()
                except BaseException:  # noqa: BLE001 - the earlier task reports its own error
                    return  # never write on after a failed write of the same adapter
            start = time.perf_counter()
            written = task() or 0
            with self._lock:
                self.busy_s += time.perf_counter() - start
                self.bytes_written += written

        future = self._pool.submit(run)
        self._tails[key] = future
        self._pending.append((what, future))
        return future

    def check(self) -> None:
        """Re-raise the first failed task's error (`WriteError` for file errors).

        Raises:
            WriteError: or whatever the task raised, with what it was doing.
        """
        for i, (what, future) in enumerate(self._pending):
            if future.done() and future.exception() is not None:
                del self._pending[i]
                err = future.exception()
                if isinstance(err, WriteError):
                    raise err
                raise RuntimeError(f"{what} failed: {err}") from err
        self._pending = [(w, f) for w, f in self._pending if not f.done()]

    def drain(self) -> None:
        """Wait for every task, then `check`."""
        for _, future in list(self._pending):
            future.exception()  # waits; the error is raised by `check`
        self.check()

    @property
    def pending(self) -> int:
        """Tasks not yet finished."""
        return sum(not f.done() for _, f in self._pending)

    def close(self) -> None:
        """Wait for the running tasks and stop the threads (queued ones still run)."""
        self._pool.shutdown(wait=True)
