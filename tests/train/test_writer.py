"""The background writer: atomic files, a full disk named with path and bytes, tasks of one
adapter in order, failures re-raised in the training thread, staging memory that blocks only
when full."""

import errno
import threading

import pytest
import torch

from megatron_lorafusion.train import writer as writer_module
from megatron_lorafusion.train.writer import BackgroundWriter, StagingPool, WriteError, write_file


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


def test_staging_pool_blocks_only_when_full_and_reuses_buffers():
    pool = StagingPool(capacity_bytes=3 * 4 * 10, pinned=False)  # room for one (3, 10) buffer
    table = torch.arange(30, dtype=torch.float32).view(3, 10)
    first = pool.copy_rows((table, table, table), 1, None)
    torch.testing.assert_close(first.wait()[0], table[1], atol=0, rtol=0, msg="row copied")
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire((3, 10))))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "a second buffer must wait while the pool is full"
    buf = first.rows
    first.release()
    waiter.join(5)
    assert got, "the waiting acquire must return once a buffer is released"
    assert got[0] is buf, "the released buffer is handed out again"
    pool.release(got[0])
    assert pool.in_use == 0
