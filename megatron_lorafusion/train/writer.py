"""Saving in the background: pinned staging buffers and writer threads.

A save gathers one adapter's values of the fp32 tables (weights and both AdamW moments,
without zero blocks) and copies them into a host buffer, on a side CUDA stream that waits for
the optimizer step (`StagingPool`), and a writer thread turns them into files while training
goes on (`BackgroundWriter`). The
training loop waits only when every staging byte is taken (a disk slower than the saves),
and says so in a warning. A save of a job that will not train again needs no staging: its
rows stay in the tables, and the writer copies them out when it gets to them
(`DeferredRows`). A task that fails (disk full, permission denied) is re-raised by the next
`BackgroundWriter.check`, naming the path and the bytes it needed.
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

import numpy as np
import torch

__all__ = [
    "DIRECT_ALIGN",
    "SAVES_IN_FLIGHT",
    "WRITER_THREADS",
    "BackgroundWriter",
    "DeferredRows",
    "HostRows",
    "StagingPool",
    "WriteError",
    "direct_bytes",
    "host_staging_limit",
    "staging_pool",
    "write_file",
]

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0  # at most one "saving is behind" warning per this many seconds


class WriteError(RuntimeError):
    """A file could not be written (disk full, no permission, ...): names path and bytes."""


SAVES_IN_FLIGHT = 2
"""Saves of each job a pool sized to the jobs holds: at 8B with 64 adapters saving every
step, room for 1.25 saves each kept training at its saves-off rate, 0.63 did not (0.88x;
docs/throughput.md)."""

WRITER_THREADS = 4
"""Writer threads of a run: files of four adapters written, hashed and synced at once (enough
to keep a disk busy); a save is a few calls on one packed buffer, so the threads hardly take
the GIL from training."""


def host_staging_limit(local_ranks: int) -> int:
    """A quarter of this machine's memory (or of its cgroup's limit), split over its ranks.

    Pinned buffers are rounded up to a power of two by torch, so at most half the memory is
    pinned for saves, whatever the jobs.
    """
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total // 4 // max(1, local_ranks)


def staging_pool(save_buffer_gib: float | None, *, pinned: bool) -> StagingPool:
    """The run's pool: ``train.save_buffer_gib`` GiB, or sized to its jobs when None."""
    if save_buffer_gib is not None:
        return StagingPool(int(save_buffer_gib * 2**30), pinned=pinned)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return StagingPool(None, pinned=pinned, limit_bytes=host_staging_limit(local_ranks))


DIRECT_ALIGN = 4096
"""Alignment of memory, file offset and length for a write that bypasses the page cache."""
_DIRECT_MIN = 1 << 20  # smaller pieces go through the page cache
_direct = {"ok": hasattr(os, "O_DIRECT"), "bytes": 0}  # off after a file system refuses it
_direct_lock = threading.Lock()


def write_file(path: Path, chunks: list[memoryview | bytes], digest=None) -> int:
    """Write ``chunks`` to ``path`` atomically (a hidden temporary sibling, fsync, rename).

    A chunk that starts at a 4096-aligned address and file offset (a checkpoint's packed
    values: `StagingPool` buffers are aligned, its header is padded) is written with
    ``O_DIRECT`` up to its last whole 4096 bytes: no copy into the page cache, and the
    disk's direct rate (1.3 against 1.0 GB/s buffered on the H200 machine's disk). The rest
    goes through the page cache; where a direct write fails for any reason but a full disk
    or quota, this process writes everything through the page cache from then on.

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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            for chunk in chunks:
                if digest is not None:
                    digest.update(chunk)
                offset = _write_at(fd, tmp, memoryview(chunk).cast("B"), offset)
            os.fsync(fd)
        finally:
            os.close(fd)
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


def _write_at(fd: int, path: Path, view: memoryview, offset: int) -> int:
    """Write ``view`` at ``offset`` of ``fd`` (its aligned part direct); returns the end."""
    direct = 0
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
    aligned = offset % DIRECT_ALIGN == 0 and address % DIRECT_ALIGN == 0
    if _direct["ok"] and aligned and len(view) >= _DIRECT_MIN:
        direct = len(view) - len(view) % DIRECT_ALIGN
        try:
            direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            try:
                _pwrite_all(direct_fd, view[:direct], offset)
            finally:
                os.close(direct_fd)
            with _direct_lock:
                _direct["bytes"] += direct
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            _direct["ok"], direct = False, 0  # no O_DIRECT here (EINVAL, EOPNOTSUPP, ...)
            logger.info("%s: O_DIRECT refused (%s); writing through the page cache", path, err)
    _pwrite_all(fd, view[direct:], offset + direct)
    return offset + len(view)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def direct_bytes() -> int:
    """Bytes this process wrote with ``O_DIRECT`` so far (0 where the file system refuses)."""
    return _direct["bytes"]


@dataclass
class HostRows:
    """One adapter's packed rows of the fp32 tables, on their way to the host.

    Attributes:
        rows: (T, K) fp32 host tensor: the first T of weights, exp_avg, exp_avg_sq, packed
            by the adapter's `checkpoint.RowPacking` (a view of a staging buffer).
        done: the side stream's event after the copy (None on CPU: already copied).
    """

    rows: torch.Tensor
    done: torch.cuda.Event | None = None
    _pool: StagingPool | None = field(default=None, repr=False)
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _held: bool = field(default=False, repr=False)

    def wait(self) -> torch.Tensor:
        """The rows, once copied (blocks the calling thread, never the GPU)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.rows

    def hold(self, held: bool) -> None:
        """Mark the rows held by the training thread (a save waiting for its evaluation).

        `StagingPool.acquire` never waits for held buffers: only the thread that would be
        waiting can release them.
        """
        if self._pool is not None and held != self._held:
            self._pool._count_held(self._buffer, held)
            self._held = held

    def release(self) -> None:
        """Give the buffer back to its pool (the rows must no longer be read)."""
        if self._pool is not None:
            self.hold(False)
            self._pool.release(self._buffer)
            self._pool = self._buffer = None


class DeferredRows:
    """A finished job's rows, copied out of the tables by whoever needs them first.

    A job that will not train again leaves its row unchanged (it steps no more), so its
    last save needs no staging buffer and the training loop does nothing for it: a writer
    thread copies the rows to pageable host memory when it reaches the save (`wait`), or the
    session does before the row goes to another job (`settle`). The copy runs on a side
    stream after the event of the job's last step; only the copying thread waits.

    Args:
        tables: the (A, S) fp32 tables to copy a row of (the weights alone for an export).
        row: the job's row.
        columns: (K,) int64 CPU columns to keep (`checkpoint.RowPacking.columns`).
        ready: recorded after the job's last optimizer step (None on CPU).
        stream: the side CUDA stream of the copy (None on CPU).
    """

    def __init__(
        self,
        tables: tuple[torch.Tensor, ...],
        row: int,
        columns: torch.Tensor,
        ready: torch.cuda.Event | None = None,
        stream=None,
    ):
        self._tables, self._row, self._columns = tables, row, columns
        self._ready, self._stream = ready, stream
        self._rows: torch.Tensor | None = None
        self._released = False
        self._lock = threading.Lock()

    def wait(self) -> torch.Tensor:
        """(T, K) fp32 host rows, packed by the job's `checkpoint.RowPacking`.

        Copied now where no one did yet.
        """
        with self._lock:
            if self._rows is None:
                if self._released:
                    raise RuntimeError(f"the rows of table row {self._row} were released")
                self._rows = self._copy()
            return self._rows

    def settle(self) -> None:
        """Copy the rows out now unless released: the row is about to change."""
        with self._lock:
            if self.pending:
                self._rows = self._copy()

    def _copy(self) -> torch.Tensor:
        rows = torch.empty(len(self._tables), self._columns.numel(), dtype=torch.float32)
        for i, table in enumerate(self._tables):
            whole = table[self._row].detach()
            if whole.is_cuda:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._ready)
                    whole = whole.to("cpu")  # pageable: this thread waits, training does not
            torch.index_select(whole, 0, self._columns, out=rows[i])
        self._tables, self._columns = (), None
        return rows

    @property
    def pending(self) -> bool:
        """Neither copied nor released yet."""
        return self._rows is None and not self._released

    def hold(self, held: bool) -> None:
        """Nothing to hold: no staging buffer is taken."""

    def release(self) -> None:
        """Drop the copied rows (a row never copied is no longer wanted)."""
        with self._lock:
            self._released, self._rows, self._tables, self._columns = True, None, (), None


class StagingPool:
    """Flat fp32 host buffers for staged rows, about ``capacity_bytes`` in use at once.

    On CUDA the buffers are pinned (so the device-to-host copy is asynchronous) and reused:
    a request takes the smallest free buffer that holds it. `acquire` blocks while the pool
    is full, the only point where saving can stall the training loop, and warns with the
    wait. Free buffers are unpinned when new ones of another size would pass the capacity.

    Sized to the jobs (``capacity_bytes=None``), the capacity is `SAVES_IN_FLIGHT` saves of
    every job trained at once (`add_job`, `remove_job`) at their largest total, at most
    ``limit_bytes``.

    Args:
        capacity_bytes: most bytes handed out at once (one buffer is always allowed, however
            large), and most bytes kept pinned; None: sized to the jobs.
        pinned: allocate pinned memory (CUDA runs).
        limit_bytes: the most a pool sized to the jobs grows to.
    """

    def __init__(self, capacity_bytes: int | None, *, pinned: bool, limit_bytes: int | None = None):
        self.sized_to_jobs = capacity_bytes is None
        self.capacity = 0 if capacity_bytes is None else capacity_bytes
        self.limit = limit_bytes
        self._wanted = 0  # a pool sized to the jobs: the bytes its jobs would like
        self.pinned = pinned
        self.in_use = 0  # bytes handed out
        self.held = 0  # of those, bytes held by the training thread (`HostRows.hold`)
        self.allocated = 0  # bytes of every buffer, free or handed out
        self.waited_s = 0.0
        self._free: list[torch.Tensor] = []  # smallest first
        self._cond = threading.Condition()
        self._warned = -_WARN_EVERY_S

    def _new(self, numel: int) -> torch.Tensor:
        """A new buffer; frees unused ones first where it would pass the capacity (locked)."""
        while self._free and self.allocated + 4 * numel > self.capacity:
            self.allocated -= 4 * self._free.pop(0).numel()
        self.allocated += 4 * numel
        return self._allocate(numel)

    def _allocate(self, numel: int) -> torch.Tensor:
        """A buffer of ``numel`` fp32 values (no pool state: callable without the lock)."""
        # Buffers start on a 4096-byte boundary (written with O_DIRECT). Pinned memory is
        # page-aligned: no pad there, which could double a buffer torch rounds up to a power
        # of two. Other memory is padded when it is not aligned.
        buf = torch.empty(numel, dtype=torch.float32, pin_memory=self.pinned)
        if buf.data_ptr() % DIRECT_ALIGN == 0:
            return buf
        raw = torch.empty(numel + DIRECT_ALIGN // 4, dtype=torch.float32, pin_memory=self.pinned)
        skip = (-raw.data_ptr() % DIRECT_ALIGN) // 4
        return raw[skip : skip + numel]

    def _put(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
        self._free.sort(key=torch.Tensor.numel)

    def reserve(self, numel: int, count: int) -> int:
        """Allocate up to ``count`` more buffers of ``numel`` now, within the capacity.

        The room is taken under the lock and the buffer made outside it: pinning takes
        ~0.15 s per GB, during which other threads (a run admitting its next jobs, saves)
        keep using the pool.

        Returns:
            How many were allocated.
        """
        made = 0
        while made < count:
            with self._cond:
                if self.allocated + 4 * numel > self.capacity:
                    break
                self.allocated += 4 * numel
            buf = self._allocate(numel)
            with self._cond:
                self._put(buf)
                self._cond.notify_all()
            made += 1
        return made

    def add_job(self, numel: int, *, pin_now: bool) -> None:
        """A job whose saves take ``numel`` values each joins; it may pin one buffer.

        Pinning host memory takes time (~0.15-0.25 s per GB, during which kernel launches
        wait; the first save would pay it in the training loop). ``pin_now`` pins the job's
        buffer here (a job that saves before its end: at admission).
        """
        with self._cond:
            if self.sized_to_jobs:
                self._wanted += SAVES_IN_FLIGHT * 4 * numel
                wanted = min(self._wanted, self.limit) if self.limit else self._wanted
                self.capacity = max(self.capacity, wanted)
                self._cond.notify_all()
        if pin_now:
            self.reserve(numel, 1)

    def remove_job(self, numel: int) -> None:
        """A job added with ``numel`` left (its last save may still be staged).

        The capacity never shrinks: it stays at its jobs' largest total, so the last saves of
        jobs ending together have the room they had, and a server's next jobs reuse the
        buffers.
        """
        with self._cond:
            if self.sized_to_jobs:
                self._wanted -= SAVES_IN_FLIGHT * 4 * numel

    def acquire(self, numel: int) -> torch.Tensor:
        """A flat fp32 host buffer of >= ``numel``; waits while the pool is full."""
        start = time.perf_counter()
        with self._cond:
            # Wait only while a writer will free something: held buffers wait for this thread.
            while self.in_use > self.held and self.in_use + 4 * numel > self.capacity:
                self._cond.wait(timeout=1.0)
            fits = [i for i, b in enumerate(self._free) if b.numel() >= numel]
            buf = self._free.pop(fits[0]) if fits else self._new(numel)
            self.in_use += 4 * buf.numel()
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
        return buf

    def _count_held(self, buf: torch.Tensor, held: bool) -> None:
        with self._cond:
            self.held += (4 if held else -4) * buf.numel()

    def release(self, buf: torch.Tensor) -> None:
        """Return ``buf`` for reuse and wake a waiting `acquire`."""
        with self._cond:
            self.in_use -= 4 * buf.numel()
            self._put(buf)
            self._cond.notify_all()

    def copy_rows(
        self, tables: tuple[torch.Tensor, ...], row: int, columns: torch.Tensor, stream=None
    ) -> HostRows:
        """Queue the copy of ``columns`` of row ``row`` of each (A, S) table to the host.

        The gather runs on the tables' device, so only the packed values cross. On CUDA it
        runs on ``stream`` once the current stream's work queued so far (the optimizer step)
        is done; the caller must keep the rows unchanged until the returned rows' ``done``
        event (the optimizer waits for it before its next step).

        Args:
            tables: the (A, S) fp32 tables (weights, then the moments).
            row: the adapter's row.
            columns: (K,) int32 or int64 columns to keep, on the tables' device
                (`checkpoint.RowPacking.columns`).
            stream: the side CUDA stream of the copies (None on CPU).
        """
        width = columns.numel()
        buf = self.acquire(len(tables) * width)
        rows = buf[: len(tables) * width].view(len(tables), width)
        if tables[0].device.type != "cuda":
            for i, table in enumerate(tables):
                torch.index_select(table[row].detach(), 0, columns, out=rows[i])
            return HostRows(rows, None, self, buf)
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for i, table in enumerate(tables):
                rows[i].copy_(table[row].detach().index_select(0, columns), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return HostRows(rows, done, self, buf)


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
