"""The background writer: atomic files, a full disk named with path and bytes, tasks of one
adapter in order, failures re-raised in the training thread, staging memory that blocks only
when full, packed values written past the page cache where the file system allows."""

import errno
import os
import threading
import time

import pytest
import torch

from megatron_lorafusion.train import writer as writer_module
from megatron_lorafusion.train.writer import (
    DIRECT_ALIGN,
    SAVES_IN_FLIGHT,
    BackgroundWriter,
    DeferredRows,
    StagingPool,
    WriteError,
    direct_bytes,
    host_staging_limit,
    staging_pool,
    write_file,
)


def _disk_full(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module.os, "fsync", fsync)


def test_write_file_is_atomic_and_hashes_what_it_writes(tmp_path):
    import hashlib

    digest = hashlib.sha256()
    path = tmp_path / "f.bin"
    data = [b"abc", memoryview(torch.arange(4, dtype=torch.uint8).numpy()).cast("B")]
    assert write_file(path, data, digest) == 7
    assert path.read_bytes() == b"abc\x00\x01\x02\x03"
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"], "no temporary file is left"


def test_write_file_on_a_full_disk_names_path_and_bytes_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")  # an earlier file of the same name stays as it was
    _disk_full(monkeypatch)
    with pytest.raises(WriteError, match=r"could not write .*f\.bin.* \(1,000 bytes\): No space"):
        write_file(path, [b"x" * 1000])
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"], "the temporary file is removed"


def test_writer_runs_one_adapters_tasks_in_order_and_reraises_failures():
    writer = BackgroundWriter(threads=3)
    order, gate = [], threading.Event()

    def slow():
        gate.wait(5)
        order.append("a1")
        return 10

    writer.submit("a", slow, "first")
    writer.submit("a", lambda: order.append("a2") or 5, "second")
    writer.submit("b", lambda: order.append("b1") or 1, "other adapter")
    writer.submit("c", lambda: (_ for _ in ()).throw(WriteError("disk full at /x")), "failing")
    gate.set()
    with pytest.raises(WriteError, match="disk full at /x"):
        writer.drain()
    writer.drain()  # reported once
    assert order.index("a1") < order.index("a2"), f"adapter a's tasks ran out of order: {order}"
    assert writer.bytes_written == 16
    writer.close()


def test_writer_skips_an_adapters_tasks_after_its_failure():
    writer = BackgroundWriter(threads=2)
    ran = []

    def fail():
        raise RuntimeError("boom")

    writer.submit("a", fail, "first save of a")
    writer.submit("a", lambda: ran.append("after") or 0, "second save of a")
    with pytest.raises(RuntimeError, match="first save of a failed: boom"):
        writer.drain()
    assert ran == [], "nothing of an adapter is written after its failed write"
    writer.close()


def _acquire_waits(pool: StagingPool, numel: int, why: str):
    """Start ``pool.acquire(numel)`` on a thread and check it waits; returns a function that
    gives what it acquired (``[buffer]``, or ``[]`` if it still waits 5 s later)."""
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(numel)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), why

    def result() -> list:
        waiter.join(5)
        return got

    return result


def test_staging_pool_blocks_only_when_full_and_reuses_buffers():
    pool = StagingPool(capacity_bytes=3 * 4 * 10, pinned=False)  # room for 30 values
    table = torch.arange(30, dtype=torch.float32).view(3, 10)
    columns = torch.tensor([7, 0, 3], dtype=torch.int32)
    first = pool.copy_rows((table, 2 * table, 3 * table), 1, columns, None)
    want = torch.stack([k * table[1, [7, 0, 3]] for k in (1, 2, 3)])
    torch.testing.assert_close(first.wait(), want, atol=0, rtol=0, msg="the packed columns")
    pool.release(pool.acquire(20))  # fits beside the first: not a wait
    got = _acquire_waits(pool, 25, "a buffer must wait while the pool would pass its capacity")
    first.release()
    assert got(), "the waiting acquire must return once a buffer is released"
    assert got()[0].numel() == 25, "no free buffer held 25 values: a new one, the others unpinned"
    assert pool.allocated == 4 * 25, "buffers that would pass the capacity are freed"
    pool.release(got()[0])
    assert pool.acquire(9).numel() == 25, "the smallest free buffer that fits is reused"
    assert pool.reserve(5, 3) == 1, "a reservation makes only what fits in the capacity"


def test_staging_pool_sized_to_its_jobs_grows_to_their_largest_total_and_its_limit():
    pool = StagingPool(None, pinned=False, limit_bytes=4 * 100)
    assert pool.capacity == 0
    pool.add_job(10, pin_now=True)
    assert pool.capacity == SAVES_IN_FLIGHT * 4 * 10, "two saves of the one job"
    assert pool.allocated == 4 * 10, "pin_now makes the job's buffer at admission"
    pool.add_job(20, pin_now=False)
    assert pool.capacity == SAVES_IN_FLIGHT * 4 * 30
    assert pool.allocated == 4 * 10, "a job that saves only at its end pins nothing yet"
    pool.remove_job(10)
    pool.remove_job(20)
    assert pool.capacity == SAVES_IN_FLIGHT * 4 * 30, "the last saves keep their room"
    pool.add_job(40, pin_now=False)
    assert pool.capacity == 4 * 80, "the jobs of now (40 values) want less than the largest"
    pool.add_job(30, pin_now=False)
    assert pool.capacity == 4 * 100, "at most the limit"
    fixed = StagingPool(4 * 7, pinned=False)
    fixed.add_job(50, pin_now=True)
    assert fixed.capacity == 4 * 7, "a set capacity stays"
    assert fixed.allocated == 0, "no room for the job's buffer: nothing pinned"


def test_deferred_rows_are_copied_by_whoever_needs_them_first():
    """A finished job's rows stay in the table: the writer's `wait` copies the packed columns
    then, `settle` copies them before the row changes, and a released save copies nothing."""
    table = torch.arange(40, dtype=torch.float32).view(4, 10)
    moments = -table
    columns = torch.tensor([7, 0, 3])
    rows = DeferredRows((table, moments), 2, columns)
    want = torch.stack([table[2, [7, 0, 3]], moments[2, [7, 0, 3]]])
    assert rows.pending
    rows.settle()
    assert not rows.pending, "copied: the session forgets it"
    table[2] = 0.0  # a new job's factors bound into the row
    torch.testing.assert_close(rows.wait(), want, atol=0, rtol=0, msg="settled before")
    late = DeferredRows((table,), 1, columns)
    table[1] += 100.0  # unchanged rows are the contract; a late copy sees what is there
    torch.testing.assert_close(late.wait(), table[1, [7, 0, 3]][None], atol=0, rtol=0)
    late.release()
    assert not late.pending
    late.settle()  # released: nothing to copy
    with pytest.raises(RuntimeError, match="released"):
        late.wait()


def test_host_staging_limit_is_a_quarter_of_the_memory_split_over_local_ranks(monkeypatch):
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    one = host_staging_limit(1)
    assert 0 < one <= total // 4
    assert host_staging_limit(4) == one // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    pool = staging_pool(None, pinned=False)
    assert pool.sized_to_jobs
    assert pool.limit == one // 2
    assert staging_pool(0.5, pinned=False).capacity == 2**29


def _direct_supported(folder) -> bool:
    """Whether ``folder``'s file system takes O_DIRECT writes (tmpfs and some others do not)."""
    probe = folder / ".probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.close(fd)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink(missing_ok=True)


def _staged_chunks() -> tuple[list, bytes]:
    """A padded header, an aligned staging buffer of 1.5 MiB + 100 bytes, a small tail."""
    pool = StagingPool(capacity_bytes=8 << 20, pinned=False)
    values = pool.acquire((3 << 19) // 4 + 25)
    values.copy_(torch.arange(values.numel(), dtype=torch.float32))
    assert values.data_ptr() % DIRECT_ALIGN == 0, "staging buffers start 4096-byte aligned"
    data = memoryview(values.numpy()).cast("B")
    chunks = [b"h" * DIRECT_ALIGN, data, b"tail"]
    return chunks, b"".join(bytes(c) for c in chunks)


def test_write_file_writes_aligned_values_direct_and_the_rest_through_the_cache(tmp_path):
    chunks, want = _staged_chunks()
    before = direct_bytes()
    assert write_file(tmp_path / "f", chunks) == len(want)
    assert (tmp_path / "f").read_bytes() == want
    if _direct_supported(tmp_path) and writer_module._direct["ok"]:
        aligned = len(chunks[1]) - len(chunks[1]) % DIRECT_ALIGN
        assert direct_bytes() - before == aligned, "the aligned whole blocks go direct"


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT])
def test_write_file_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch, refusal):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("this platform has no O_DIRECT")
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(refusal, os.strerror(refusal))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setitem(writer_module._direct, "ok", True)
    chunks, want = _staged_chunks()
    before = direct_bytes()
    write_file(tmp_path / "f", chunks)
    assert (tmp_path / "f").read_bytes() == want, "a refused O_DIRECT write goes buffered"
    assert direct_bytes() == before
    assert writer_module._direct["ok"] is False, "not tried again on this file system"


def test_a_full_disk_on_a_direct_write_is_a_write_error(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("this platform has no O_DIRECT")
    real_open = os.open

    def full_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", full_open)
    monkeypatch.setitem(writer_module._direct, "ok", True)
    chunks, _ = _staged_chunks()
    with pytest.raises(WriteError, match="No space left on device"):
        write_file(tmp_path / "f", chunks)
    assert not list(tmp_path.iterdir()), "nothing half-written is left"


def test_held_rows_never_make_the_training_thread_wait():
    """A save held for its evaluation is released by the training thread only: an acquire
    that waited for it would wait forever."""
    pool = StagingPool(capacity_bytes=4 * 30, pinned=False)  # one (3, 10) buffer
    table = torch.zeros(3, 10)
    held = pool.copy_rows((table, table, table), 0, torch.arange(10), None)
    held.hold(True)
    start = time.perf_counter()
    extra = pool.acquire(30)  # the pool is full, of held rows only
    assert time.perf_counter() - start < 0.5, "no wait for rows only this thread releases"
    pool.release(extra)
    held.hold(False)
    got = _acquire_waits(pool, 30, "once handed to a writer, the rows are waited for again")
    held.release()
    assert got(), "released by the writer's side: the wait ends"
    assert pool.held == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staged_rows_are_written_direct(tmp_path):
    """The CUDA path end to end: the GPU gathers into a pinned buffer, which the writer
    hands to O_DIRECT (pinned pages are ordinary locked pages for the kernel)."""
    pool = StagingPool(capacity_bytes=64 << 20, pinned=True)
    table = torch.randn(2, 1 << 20, device="cuda")
    columns = torch.arange(0, 1 << 20, 2, device="cuda", dtype=torch.int32)
    staged = pool.copy_rows((table, table, table), 1, columns, torch.cuda.Stream())
    rows = staged.wait()
    assert rows.is_pinned()
    torch.testing.assert_close(rows[0], table[1, ::2].cpu(), atol=0, rtol=0)
    before = direct_bytes()
    data = memoryview(rows.numpy()).cast("B")
    write_file(tmp_path / "f", [b"h" * DIRECT_ALIGN, data])
    assert (tmp_path / "f").read_bytes()[DIRECT_ALIGN:] == bytes(data)
    if _direct_supported(tmp_path):
        assert direct_bytes() > before, "pinned staging buffers go through O_DIRECT"
    staged.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deferred_rows_wait_for_the_last_step_on_the_gpu():
    """The copy waits for the event of the job's last step, on a side stream, into pageable
    memory (the copying thread waits; nothing is pinned)."""
    table = torch.zeros(2, 1 << 20, device="cuda")
    torch.cuda._sleep(100_000_000)  # the last step still running when the save is queued
    table[1].fill_(3.0)
    ready = torch.cuda.Event()
    ready.record()
    columns = torch.arange(0, 1 << 20, 2)
    rows = DeferredRows((table,), 1, columns, ready, torch.cuda.Stream())
    got = rows.wait()
    assert not got.is_pinned()
    assert got.shape == (1, columns.numel())
    assert torch.all(got == 3.0), "copied before the step that wrote it ended"
