"""`FileBackend` under a review's attacks (2026-11-25): instances starting while another
compacts, closing while writes are queued or the disk is full, a store that cannot open,
and page formats too large for the journal.

Every page read is checked against the bytes written for its key. Each test failed before
its fix.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from aiohicache import ConfigError
from aiohicache.errors import ClosedError
from aiohicache.storage import FileBackend, PageFormat, StorageError, _appender
from aiohicache.storage import _journal as seg

from .conftest import FMT, make_keys
from .test_file_sharing import OBJECT, pages, read, served_after_restart, written


def open_files_under(root: Path) -> list[str]:
    """The files under `root` this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
        if target.startswith(f"{root}{os.sep}"):
            held.append(target)
    return sorted(held)


def locked_segments(root: Path) -> list[str]:
    """The segments under `root` some open file holds locked (a writer may still append:
    no instance compacts them)."""
    return sorted(p.name for p in root.glob("*.seg") if seg.is_locked(os.fspath(p)))


def journal_sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in root.glob("*.log")]


def journals_in_listing_order(root: Path) -> list[int]:
    """The journal ids under `root` in the order a look at the directory lists them."""
    return [int(e.name[:16], 16) for e in os.scandir(root) if e.name.endswith(".log")]


# ---------------------------------------------------------------------------- compaction


async def test_an_instance_starting_while_another_compacts_keeps_the_moved_pages(
        tmp_path: Path) -> None:
    """A starting instance read a write and its compaction's move (one stamp, one origin)
    in one look, and the tie went to the journal the directory listed last: listed after
    the move's, the victim won. The key was bound into the victim, missed once it was
    removed, and this instance then compacted the move's segment, which it took for dead:
    the pages were lost for every instance."""
    xs, others = make_keys(10, seed=1), make_keys(4, seed=2)
    for attempt in range(64):  # until the directory lists the move's journal first
        root = tmp_path / str(attempt)
        x = FileBackend(root, FMT, segment_bytes=10 * OBJECT, max_concurrency=1)
        await x.__aenter__()
        for key in xs + others:  # xs fill the victim; others the lane the moves go to
            await x.set_from([key], pages([key]))
        victim, lane = (x._index.entries[keys[0]].seg_id for keys in (xs, others))
        order = journals_in_listing_order(root)
        if order.index(lane) < order.index(victim):
            break
        await x.aclose()
    else:
        pytest.fail("the directory never listed the later journal first")
    moved, go_on = threading.Event(), threading.Event()
    real_log = x._appender.log

    def log(entries: Sequence[seg.Entry]) -> None:
        real_log(entries)
        if x._index.compacting:  # the moves are journaled, the victim not yet removed
            moved.set()
            go_on.wait(10)
    x._appender.log = log  # type: ignore[method-assign]
    y = FileBackend(root, FMT)
    try:
        deleting = asyncio.ensure_future(x.delete(xs[:6]))  # the victim is compacted
        await asyncio.to_thread(moved.wait, 10)
        await y.__aenter__()  # starts in the window: reads the write and its move
    finally:
        go_on.set()
    try:
        assert await deleting == 6
        assert x.stats().extra["compactions"] == 1
        assert await read(x, xs[6:]) == written(xs[6:])
        assert await read(y, xs[6:]) == written(xs[6:])
        await x.aclose()  # the moves' segment is sealed: y may compact it
        assert await y.delete(others[:1]) == 1
        assert await read(y, xs[6:] + others[1:]) == written(xs[6:] + others[1:])
    finally:
        await x.aclose()
        await y.aclose()
    assert await served_after_restart(root, xs[6:] + others[1:]) == written(
        xs[6:] + others[1:])


# ---------------------------------------------------------------------------- closing


async def test_a_close_racing_queued_writes_leaves_every_segment_sealed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of a `set_from` still queued when `aclose` sealed the lanes went on to the pool
    and made a new lane after the close: its files stayed open and its segment locked for
    the life of the process (no instance could compact it)."""
    real = _appender.write_run

    def slow_write_run(*args: Any) -> Any:
        time.sleep(0.05)  # the close is queued behind the runs in flight
        return real(*args)
    monkeypatch.setattr(_appender, "write_run", slow_write_run)
    keys = make_keys(256)
    store = FileBackend(tmp_path, FMT, max_concurrency=2)  # 4 runs of 64: 2 wait
    await store.__aenter__()
    writing = asyncio.ensure_future(store.set_from(keys, pages(keys)))
    await asyncio.sleep(0.01)
    await store.aclose()
    with pytest.raises((ClosedError, StorageError)):
        await writing
    assert open_files_under(tmp_path) == []
    assert locked_segments(tmp_path) == []
    served = await served_after_restart(tmp_path, keys)  # whatever landed is exact
    assert all(page in (None, want) for page, want in zip(served, written(keys), strict=True))


async def test_a_close_that_cannot_journal_its_reads_still_seals_every_lane(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the disk full, journaling the reads at close failed, and the close skipped
    sealing the lanes: all but the failed one stayed open and locked for good. (A file
    size limit stands in for a full disk: appends past it fail, as with ENOSPC.)"""
    real = _appender._pwritev_all

    def slow_pwritev_all(*args: Any) -> None:
        time.sleep(0.1)  # each run holds its lane a while: 4 runs, 4 lanes
        real(*args)
    monkeypatch.setattr(_appender, "_pwritev_all", slow_pwritev_all)
    keys = make_keys(256)
    store = FileBackend(tmp_path, FMT, max_concurrency=4)
    await store.__aenter__()
    try:
        assert await store.set_from(keys, pages(keys)) == [True] * 256
        assert len(journal_sizes(tmp_path)) >= 2  # each lane but the one failing stays open
        assert await read(store, keys) == written(keys)  # touches to journal at close
        full = min(journal_sizes(tmp_path))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (full, hard))
        try:
            await store.aclose()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    finally:
        await store.aclose()
    assert open_files_under(tmp_path) == []
    assert locked_segments(tmp_path) == []
    assert await served_after_restart(tmp_path, keys) == written(keys)


async def test_a_store_that_cannot_open_leaves_no_thread_running(tmp_path: Path) -> None:
    """`async with` on a root that cannot be a directory raised, and left the I/O thread
    of the failed start running (and an unclosed backend to warn about)."""
    (tmp_path / "taken").write_bytes(b"")
    before = set(threading.enumerate())
    with pytest.raises(StorageError, match="cannot open"):
        async with FileBackend(tmp_path / "taken", FMT):
            pass
    left = [t.name for t in set(threading.enumerate()) - before
            if t.name.startswith("aiohicache-file") and t.is_alive()]
    assert left == []


# ---------------------------------------------------------------------------- huge pages


def test_a_page_too_large_for_a_journal_entry_is_a_config_error(tmp_path: Path) -> None:
    """A journal entry holds a record's length in 32 bits: a larger page object was
    accepted, then every write of one wrote it whole and failed packing its entry
    (``struct.error``: "'I' format requires ...") and left it as dead bytes."""
    huge = PageFormat.make(namespace="huge", spec_fingerprint="mha", page_size=1,
                           payload_bytes=4 << 30)
    with pytest.raises(ConfigError, match="payload_bytes"):
        FileBackend(tmp_path, huge)
    FileBackend(tmp_path, PageFormat.make(namespace="big", spec_fingerprint="mha",
                                          page_size=1, payload_bytes=(4 << 30) - 65))
