"""The SSD tier's pipelined reads (`SsdStore.read_run`, Linux AIO): the same
verdicts and bytes as one `read` after another, errors that leave nothing in
flight, and a queue that refuses bad use without changing state."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import signal
import threading
import time

import pytest
from test_ssd import SLOT, aligned, block, key, store

from sidecar.tiers.ssd import store as ssd_store
from sidecar.tiers.ssd.store import ReadBlock

aio = pytest.importorskip("sidecar.tiers.ssd._aio")


def aio_or_skip(s: ssd_store.SsdStore) -> None:
    if not s.direct or ssd_store.aio_queue() is None:
        pytest.skip("no O_DIRECT here, or Linux AIO refused")


def read_through(path: str, s: ssd_store.SsdStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `s`'s reads through Linux AIO ("aio") or one `read` after another."""
    if path == "aio":
        aio_or_skip(s)
    else:
        monkeypatch.setattr(ssd_store._local, "queue", None, raising=False)


@pytest.mark.parametrize("path", ["aio", "one_by_one"])
def test_a_run_of_reads_gives_what_reads_one_by_one_give(tmp_path, monkeypatch, path):
    s = store(tmp_path, capacity=4 * SLOT)
    read_through(path, s, monkeypatch)
    for slot in range(8):
        s.write(slot, block(slot), key(slot + 1), key(slot), slot == 0)
    # Slot 5's bytes rot on disk (directory 1, its third slot).
    with open(tmp_path / "d1" / "t.data", "r+b") as f:
        f.seek(2 * SLOT + 7)
        f.write(b"\xff\x00")
    # (slot, key): slot 6 asked under a wrong key
    wanted = [(0, 1), (3, 4), (5, 6), (6, 99), (7, 8), (2, 3)]
    run = [ReadBlock(slot, aligned(), key(k)) for slot, k in wanted]
    got = s.read_run(run)
    assert got == [True, True, False, False, True, True]
    assert got == [s.read(slot, aligned(), key(k)) for slot, k in wanted]
    for (slot, _), b, ok in zip(wanted, run, got, strict=True):
        if ok:
            assert bytes(b.block) == bytes(block(slot))
    assert bytes(run[3].block) == bytes(SLOT)  # a wrong key: not read at all
    assert s.read_run([]) == []
    s.close()


@pytest.mark.parametrize("path", ["aio", "one_by_one"])
def test_blocks_the_device_cannot_read_are_none_and_the_run_goes_on(tmp_path, monkeypatch, path):
    s = store(tmp_path, dirs=1, capacity=4 * SLOT)
    read_through(path, s, monkeypatch)
    for slot in range(4):
        s.write(slot, block(slot), key(slot + 1), key(slot), slot == 0)
    os.truncate(tmp_path / "d0" / "t.data", 2 * SLOT)  # slots 2 and 3: EIO
    run = [ReadBlock(slot, aligned(), key(slot + 1)) for slot in (2, 0, 3, 1)]
    assert s.read_run(run) == [None, True, None, True]
    assert [bytes(b.block) for b in run[1::2]] == [bytes(block(0)), bytes(block(1))]
    assert ssd_store.aio_queue() is None or ssd_store.aio_queue().pending == 0
    s.close()


def test_a_failure_mid_run_leaves_no_read_in_flight(tmp_path, monkeypatch):
    s = store(tmp_path, dirs=1)
    aio_or_skip(s)
    for slot in range(3):
        s.write(slot, block(slot), key(slot + 1), key(slot), slot == 0)
    real, calls = ssd_store.checksum, []

    def failing(data, k):  # the second check fails while the third read is in flight
        calls.append(k)
        if len(calls) == 2:
            raise MemoryError("checksum failed")
        return real(data, k)

    monkeypatch.setattr(ssd_store, "checksum", failing)
    with pytest.raises(MemoryError):
        s.read_run([ReadBlock(slot, aligned(), key(slot + 1)) for slot in range(3)])
    assert ssd_store.aio_queue().pending == 0
    monkeypatch.setattr(ssd_store, "checksum", real)
    again = [ReadBlock(slot, aligned(), key(slot + 1)) for slot in range(3)]
    assert s.read_run(again) == [True] * 3
    s.close()


def test_a_read_cut_short_by_the_end_of_the_file_is_an_error(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    queue = aio.Queue(1)
    try:
        view = aligned(2 * 4096)
        queue.submit(fd, view, 0, False)
        with pytest.raises(OSError) as err:
            ssd_store._finish(queue, fd, view, 0)
        assert err.value.errno == errno.EIO and queue.pending == 0
    finally:
        queue.close()
        os.close(fd)


def test_a_wait_interrupted_by_signals_still_gets_every_completion_asked(tmp_path):
    """A signal makes io_getevents return the completions it has so far:
    `wait(n)` must go on until n are in (the store checks each write's
    result, and reaps the rest later on the next user's behalf)."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    bufs = [aligned() for _ in range(32)]
    os.posix_fallocate(fd, 0, len(bufs) * SLOT)
    got: list[int] = []

    def writer() -> None:
        queue = aio.Queue(len(bufs))
        try:
            for _ in range(100):
                for i, buf in enumerate(bufs):
                    queue.submit(fd, buf, i * SLOT, True)
                got.append(len(queue.wait(len(bufs))))
                if queue.pending:
                    queue.wait(queue.pending)
        finally:
            queue.close()

    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    thread = threading.Thread(target=writer)
    try:
        thread.start()
        while thread.is_alive():
            with contextlib.suppress(ProcessLookupError):
                signal.pthread_kill(thread.ident, signal.SIGUSR1)
            time.sleep(0.0005)
    finally:
        thread.join()
        signal.signal(signal.SIGUSR1, previous)
        os.close(fd)
    assert got == [len(bufs)] * 100


def test_the_queue_refuses_bad_use_and_changes_nothing(tmp_path):
    for depth in (0, 65):
        with pytest.raises(ValueError, match="depth"):
            aio.Queue(depth)
    path = tmp_path / "f"
    path.write_bytes(bytes(SLOT))
    fd = os.open(path, os.O_RDWR)
    queue = aio.Queue(1)
    try:
        with pytest.raises(BufferError):  # a read into bytes it may not write
            queue.submit(fd, memoryview(bytes(SLOT)), 0, False)
        with pytest.raises(ValueError, match="offset"):
            queue.submit(fd, aligned(), -1, False)
        with pytest.raises(OSError) as bad:
            queue.submit(10_000, aligned(), 0, False)
        assert bad.value.errno == errno.EBADF and queue.pending == 0
        with pytest.raises(ValueError, match="1 completions asked, 0 in flight"):
            queue.wait(1)
        buf = memoryview(mmap.mmap(-1, SLOT))
        assert queue.submit(fd, buf, 0, False) == 0
        with pytest.raises(RuntimeError, match="full"):
            queue.submit(fd, aligned(), 0, False)
        assert queue.pending == 1 and queue.wait(1) == [(0, SLOT)]
        queue.submit(fd, buf, 0, False)
        queue.close()  # waits for the read in flight, then lets go of its buffer
        assert queue.pending == 0
        with pytest.raises(ValueError, match="closed"):
            queue.submit(fd, buf, 0, False)
    finally:
        queue.close()
        os.close(fd)


def test_a_read_the_device_fails_raises_and_leaves_nothing_in_flight(tmp_path):
    s = store(tmp_path, dirs=1)
    aio_or_skip(s)
    s.write(0, block(0), key(1), key(0), True)
    # O_DIRECT into a buffer off alignment: submitted, then failed (EINVAL)
    # by the kernel in the completion, as an I/O error comes back.
    off = memoryview(mmap.mmap(-1, 2 * SLOT))[1 : SLOT + 1]
    with pytest.raises(OSError) as err:
        s.read_run([ReadBlock(0, off, key(1))])
    assert err.value.errno == errno.EINVAL and ssd_store.aio_queue().pending == 0
    assert s.read_run([ReadBlock(0, aligned(), key(1))]) == [True]
    s.close()
