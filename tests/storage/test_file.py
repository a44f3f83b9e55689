"""`FileBackend` beyond the shared contract: segments and journals on disk, crash safety,
startup, compaction, processes sharing a directory, and I/O errors.

The conformance suite covers what every backend does; these tests pin what only an
append-only segment store can get wrong: a record is served only once its journal entry is
written, a torn record or entry is a miss (never served), a crashed writer leaves only whole
pages or misses, a new instance (or another process) sees what an old one wrote in the same
least-recently-used order, and compaction reclaims dead records without losing live ones.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiohicache import ConfigError
from aiohicache.storage import (
    FileBackend,
    PageFormat,
    StorageError,
    _appender,
    _reader,
    decode_page,
    encode_header,
)
from aiohicache.storage import _file_upkeep as file_module
from aiohicache.storage import _journal as seg
from aiohicache.storage.base import HEADER_SIZE
from aiohicache.storage.errors import StorageReadError, StorageWriteError
from tests.conftest import until

from .conftest import FMT, PAYLOAD, make_keys, make_page
from .segment_hooks import append_record, latest_entries

OBJECT = HEADER_SIZE + PAYLOAD
REPO = Path(__file__).parents[2]


def pages(keys: list[str], *, version: int = 0) -> list[memoryview]:
    return [memoryview(make_page(key, version=version)) for key in keys]


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def with_suffix(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.suffix == suffix)


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def damage_payload(segment: Path, entry: seg.Entry, at: int = PAYLOAD // 2) -> None:
    """Flip one bit of the payload of `entry`'s record, `at` bytes into it (from the end if
    negative)."""
    with open(segment, "r+b") as f:
        f.seek(entry.offset + HEADER_SIZE + at % PAYLOAD)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))


def segment_bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in with_suffix(root, ".seg"))


async def read(backend: FileBackend, keys: list[str]) -> list[bytes | None]:
    buffers = [bytearray(PAYLOAD) for _ in keys]
    hits = await backend.get_into(keys, [memoryview(b) for b in buffers])
    return [bytes(b) if hit else None for hit, b in zip(hits, buffers, strict=True)]


def record(root: Path, entry: seg.Entry) -> bytes:
    with open(seg.segment_path(str(root), entry.seg_id), "rb") as f:
        f.seek(entry.offset)
        return f.read(entry.length)


# ---------------------------------------------------------------------------- layout

async def test_a_batch_is_appended_to_one_segment_and_journaled(tmp_path: Path) -> None:
    keys = make_keys(40)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * 40
    [log, segment] = names(tmp_path)
    assert log.endswith(".log") and segment == log.replace(".log", ".seg")
    assert (tmp_path / segment).stat().st_size == 40 * OBJECT  # back to back, nothing else
    assert (tmp_path / log).stat().st_size == 40 * seg.ENTRY_SIZE
    entries = latest_entries(tmp_path)
    assert sorted(entries) == sorted(keys)
    assert [entries[k].offset for k in keys] == [i * OBJECT for i in range(40)]
    for key in keys:  # each record is the key's whole object
        assert decode_page(FMT, key, record(tmp_path, entries[key])) == make_page(key)


async def test_segments_roll_at_segment_bytes(tmp_path: Path) -> None:
    keys = make_keys(10)
    async with FileBackend(tmp_path, FMT, segment_bytes=4 * OBJECT,
                           max_concurrency=1) as backend:
        for key in keys:
            await backend.set_from([key], pages([key]))
        assert backend.stats().extra["segments"] == 3
        assert await read(backend, keys) == [make_page(k) for k in keys]


# ---------------------------------------------------------------------------- crash safety

async def test_a_record_without_a_journal_entry_is_never_served(tmp_path: Path) -> None:
    key = make_keys(1)[0]
    async with FileBackend(tmp_path, FMT) as backend:
        await backend.set_from([key], pages([key]))
    # a crash between the record and its entry: the record's bytes, no entry
    [segment] = with_suffix(tmp_path, ".seg")
    [other] = make_keys(1, seed=3)
    append_bytes(segment, encode_header(FMT, other, make_page(other)) + make_page(other))
    async with FileBackend(tmp_path, FMT) as backend:
        assert await backend.exists([other]) == 0
        assert await read(backend, [key, other]) == [make_page(key), None]


async def test_a_torn_record_is_dropped_at_start_and_never_served(tmp_path: Path) -> None:
    keys = make_keys(4)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as backend:  # one run, in order
        await backend.set_from(keys, pages(keys))
    [segment] = with_suffix(tmp_path, ".seg")
    os.truncate(segment, 3 * OBJECT + OBJECT // 2)  # the last record half written
    async with FileBackend(tmp_path, FMT) as backend:
        assert backend.stats().extra["torn_entries"] == 1
        assert await backend.exists(keys) == 3
        assert await read(backend, keys) == [*(make_page(k) for k in keys[:3]), None]


async def test_a_torn_or_damaged_journal_entry_is_ignored(tmp_path: Path) -> None:
    keys = make_keys(3)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as backend:
        await backend.set_from(keys, pages(keys))
    [log] = with_suffix(tmp_path, ".log")
    data = bytearray(log.read_bytes())
    data[seg.ENTRY_SIZE + 40] ^= 0x01  # a bit flip in the second entry
    log.write_bytes(bytes(data) + data[:seg.ENTRY_SIZE // 2])  # and half an entry at the end
    async with FileBackend(tmp_path, FMT) as backend:
        assert await read(backend, keys) == [make_page(keys[0]), None, make_page(keys[2])]


CRASHING_WRITER = """
import asyncio, json, sys
from aiohicache.storage import FileBackend, PageFormat
from tests.storage.conftest import make_keys, make_page

args = json.loads(sys.argv[1])
fmt = PageFormat(bytes.fromhex(args["ns"]), bytes.fromhex(args["spec"]), args["payload"])

async def main():
    async with FileBackend(args["root"], fmt, fsync=args["fsync"]) as backend:
        for seed in range(10_000):
            keys = make_keys(64, seed=seed)
            await backend.set_from(keys, [memoryview(make_page(k)) for k in keys])
            print(seed, flush=True)

asyncio.run(main())
"""


def _fmt_args(root: Path, **more: Any) -> str:
    return json.dumps({"root": str(root), "ns": FMT.namespace_id.hex(),
                       "spec": FMT.spec_id.hex(), "payload": FMT.payload_bytes, **more})


@pytest.mark.parametrize("fsync", [False, True])
def test_a_writer_killed_mid_run_leaves_whole_pages_or_misses(tmp_path: Path,
                                                              fsync: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER,
                             _fmt_args(tmp_path, fsync=fsync)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    for _ in range(3):  # a few batches stored, then SIGKILL mid-run
        assert proc.stdout.readline(), proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()

    async def check() -> None:
        async with FileBackend(tmp_path, FMT) as backend:
            keys = [k for s in range(200) for k in make_keys(64, seed=s)]
            got = await read(backend, keys)
            served = [page for page in got if page is not None]
            assert len(served) >= 3 * 64
            for key, page in zip(keys, got, strict=True):
                assert page in (None, make_page(key)), f"a torn page served for {key}"
            assert backend.stats().extra["orphans_removed"] == 0  # its files: a seg, a log
        # the dead writer's segment is lock-free: the next instance may compact it
        assert not seg.is_locked(str(with_suffix(tmp_path, ".seg")[0]))

    asyncio.run(check())


# ---------------------------------------------------------------------------- startup

async def test_startup_removes_orphans_but_not_a_live_writers_files(tmp_path: Path) -> None:
    keys = make_keys(2)
    async with FileBackend(tmp_path, FMT) as backend:
        await backend.set_from(keys, pages(keys))
    orphan = tmp_path / f"{1:016x}.seg"  # no journal, no lock: a compaction died mid-removal
    orphan.write_bytes(b"x" * OBJECT)
    temp = tmp_path / f"{2:016x}.seg.tmp"  # a writer died creating its segment
    temp.write_bytes(b"")
    live = tmp_path / f"{3:016x}.seg"  # another process creating its segment right now
    live.write_bytes(b"")
    (tmp_path / "README").write_text("not ours")  # foreign files are left alone
    held = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        async with FileBackend(tmp_path, FMT) as backend:
            assert backend.stats().extra["orphans_removed"] == 2
            assert await read(backend, keys) == [make_page(k) for k in keys]
    finally:
        os.close(held)
    assert not orphan.exists() and not temp.exists()
    assert live.exists() and (tmp_path / "README").exists()


async def test_a_new_instance_keeps_the_lru_order_and_applies_its_budget(
        tmp_path: Path) -> None:
    keys = make_keys(5)
    async with FileBackend(tmp_path, FMT) as first:
        for key in keys[:4]:  # oldest first
            await first.set_from([key], pages([key]))
        assert await read(first, keys[:1]) == [make_page(keys[0])]  # journaled at close
    async with FileBackend(tmp_path, FMT, capacity_bytes=3 * OBJECT) as second:
        # over budget at startup: the least recently used page goes
        assert second.stats().evicted_pages == 1
        assert await second.exists(keys[1:2]) == 0
        await second.set_from(keys[4:], pages(keys[4:]))  # evicts the next oldest: keys[2]
        assert [await second.exists([k]) for k in keys] == [1, 0, 0, 1, 1]
    async with FileBackend(tmp_path, FMT) as third:  # the evictions were journaled
        assert [await third.exists([k]) for k in keys] == [1, 0, 0, 1, 1]


async def test_concurrent_writes_within_the_budget_all_land(tmp_path: Path) -> None:
    # a run reserves its budget when it starts: runs of other batches waiting for a thread
    # must not hold reservations that make a page that fits look as if it never could
    keys = make_keys(4)
    async with FileBackend(tmp_path, FMT, capacity_bytes=3 * OBJECT,
                           max_concurrency=2) as backend:
        assert await backend.set_from(keys[3:], pages(keys[3:])) == [True]
        stored = await asyncio.gather(backend.set_from(keys[:2], pages(keys[:2])),
                                      backend.set_from(keys[2:], pages(keys[2:])))
        assert stored == [[True, True], [True, True]]
        assert await backend.exists(keys[3:]) == 1  # rewritten, not deleted
        assert await read(backend, keys[3:]) == [make_page(keys[3])]


async def test_the_index_is_built_on_first_use_on_an_io_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[str] = []
    real = file_module._scan_dir

    def scan(*args: Any) -> Any:
        scans.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(file_module, "_scan_dir", scan)
    backend = FileBackend(tmp_path, FMT)
    assert scans == []  # constructing does no I/O
    async with backend:
        await backend.exists(make_keys(1))
    assert len(scans) == 1 and scans[0].startswith("aiohicache-file")


# ---------------------------------------------------------------------------- compaction

async def test_compaction_reclaims_dead_records_and_keeps_live_ones(tmp_path: Path) -> None:
    budget = 16 * OBJECT
    async with FileBackend(tmp_path, FMT, capacity_bytes=budget, segment_bytes=8 * OBJECT,
                           max_concurrency=1) as backend:
        for seed in range(20):  # 160 pages through a budget of 16
            keys = make_keys(8, seed=seed)
            assert await backend.set_from(keys, pages(keys)) == [True] * 8
        stats = backend.stats()
        assert stats.extra["compactions"] >= 1
        assert stats.extra["used_bytes"] <= budget
        on_disk = segment_bytes_on_disk(tmp_path)
        assert on_disk <= 2 * budget + 8 * OBJECT  # dead at most half, plus the active one
        live = [k for s in range(20) for k in make_keys(8, seed=s)
                if await backend.exists([k])]
        assert len(live) == 16
        assert await read(backend, live) == [make_page(k) for k in live]
    async with FileBackend(tmp_path, FMT) as again:  # and a new instance sees the same
        assert await read(again, live) == [make_page(k) for k in live]
        assert again.stats().extra["objects"] == 16


async def test_a_dead_writers_segment_is_compacted_by_another_instance(
        tmp_path: Path) -> None:
    keys = make_keys(32)
    async with FileBackend(tmp_path, FMT) as first:
        await first.set_from(keys, pages(keys))
    async with FileBackend(tmp_path, FMT, capacity_bytes=8 * OBJECT) as second:
        assert second.stats().evicted_pages == 24
        more = make_keys(1, seed=9)
        await second.set_from(more, pages(more))  # the old segment is 3/4 dead: compacted
        assert second.stats().extra["compactions"] == 1
        kept = keys[:7]  # the first pages of the batch were its most recent
        assert await read(second, kept + more) == [make_page(k) for k in kept + more]


# ---------------------------------------------------------------------------- other processes

WRITER = """
import asyncio, json, sys
from aiohicache.storage import FileBackend, PageFormat
from tests.storage.conftest import make_page

args = json.loads(sys.argv[1])
fmt = PageFormat(bytes.fromhex(args["ns"]), bytes.fromhex(args["spec"]), args["payload"])

async def main():
    async with FileBackend(args["root"], fmt) as backend:
        keys = args["keys"]
        ok = await backend.set_from(keys, [memoryview(make_page(k)) for k in keys])
        assert all(ok), ok

asyncio.run(main())
"""


async def write_in_another_process(root: Path, keys: list[str]) -> None:
    result = await anyio.run_process([sys.executable, "-c", WRITER,
                                      _fmt_args(root, keys=keys)], check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr.decode()


def test_pages_written_by_other_processes_are_served(tmp_path: Path) -> None:
    # NOTE: sync, running its own loop once: a writer process takes a second to start.
    before = make_keys(4, seed=1)
    during = [make_keys(64, seed=s) for s in (2, 3)]

    async def scenario() -> None:
        await write_in_another_process(tmp_path, before)
        async with FileBackend(tmp_path, FMT, refresh_interval=0) as backend:
            assert await backend.exists(before) == 4  # found by the startup scan
            async with anyio.create_task_group() as tg:  # two writers at once
                for keys in during:
                    tg.start_soon(write_in_another_process, tmp_path, keys)
            every = before + during[0] + during[1]
            assert await backend.exists(every) == len(every)  # not indexed: journals read
            assert await read(backend, every) == [make_page(k) for k in every]

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- cancellation

async def test_cancelled_writes_leave_whole_objects_and_a_true_index(tmp_path: Path) -> None:
    keys = make_keys(2048)  # 32 runs of 64 pages, 2 at a time
    async with FileBackend(tmp_path, FMT, max_concurrency=2, fsync=True,
                           capacity_bytes=4000 * OBJECT) as backend:
        task = asyncio.ensure_future(backend.set_from(keys, pages(keys)))
        await until(lambda: backend.stats().pages_written > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        written = backend.stats().pages_written
        assert 0 < written < 2048
        assert backend.stats().extra["used_bytes"] == written * OBJECT
        assert backend._budget.reserved_bytes == 0
    entries = latest_entries(tmp_path)
    assert len(entries) == written
    for key, entry in entries.items():
        assert decode_page(FMT, key, record(tmp_path, entry)) == make_page(key)


async def test_a_cancelled_read_fills_whole_pages_or_none_and_nothing_after(
        tmp_path: Path) -> None:
    keys = make_keys(2048)  # 32 runs of 64 pages, 2 at a time
    buffers = [bytearray(PAYLOAD) for _ in keys]
    async with FileBackend(tmp_path, FMT, max_concurrency=2) as backend:
        await backend.set_from(keys, pages(keys))
        task = asyncio.ensure_future(backend.get_into(keys, [memoryview(b) for b in buffers]))
        await until(lambda: backend.stats().pages_read > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert 0 < backend.stats().pages_read < 2048
        after_cancel = [bytes(b) for b in buffers]
        filled = [b == make_page(k) for k, b in zip(keys, after_cancel, strict=True)]
        assert all(ok or b == bytes(PAYLOAD) for ok, b in zip(filled, after_cancel,
                                                                  strict=True))
        assert sum(filled) == backend.stats().pages_read  # only reads that completed
        await asyncio.sleep(0.01)  # an I/O thread still writing would show now
        assert [bytes(b) for b in buffers] == after_cancel


# ---------------------------------------------------------------------------- recovery

async def test_a_store_directory_removed_while_running_is_made_again(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    keys = make_keys(8)
    async with FileBackend(root, FMT) as backend:
        assert await backend.set_from(keys[:4], pages(keys[:4])) == [True] * 4
        await anyio.to_thread.run_sync(shutil.rmtree, root)
        assert await read(backend, keys[:1]) == [None]  # gone with it: a miss
        assert await backend.set_from(keys, pages(keys, version=1)) == [True] * 8
        assert await read(backend, keys) == [make_page(k, version=1) for k in keys]
        assert backend.stats().errors == 0
    async with FileBackend(root, FMT) as again:  # written to the new directory
        assert await read(again, keys) == [make_page(k, version=1) for k in keys]


@pytest.mark.usefixtures("file_reader")
async def test_a_segment_truncated_by_hand_is_a_counted_miss_never_a_crash(
        tmp_path: Path) -> None:
    keys = make_keys(4)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as backend:  # one run, in order
        await backend.set_from(keys, pages(keys))
        assert await read(backend, keys) == [make_page(k) for k in keys]
        [segment] = with_suffix(tmp_path, ".seg")
        os.truncate(segment, 3 * OBJECT + OBJECT // 2)  # the last record cut in half
        assert await read(backend, keys) == [*(make_page(k) for k in keys[:3]), None]
        assert backend.stats().corrupt == 1
        os.truncate(segment, 0)  # and everything
        assert await read(backend, keys[:3]) == [None] * 3
        assert backend.stats().corrupt == 4
        assert await backend.exists(keys) == 0  # deleted: the next backup rewrites them
        assert await backend.set_from(keys, pages(keys)) == [True] * 4
        assert await read(backend, keys) == [make_page(k) for k in keys]


# ---------------------------------------------------------------------------- errors

async def test_a_failed_write_raises_and_stores_nothing_of_its_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(4)
    async with FileBackend(tmp_path, FMT) as backend:
        await backend.exists(keys)

        def full(*args: Any) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(_appender.os, "pwritev", full)
        with pytest.raises(StorageWriteError, match="4 page.*No space"):
            await backend.set_from(keys, pages(keys))
        monkeypatch.undo()
        assert backend.stats().errors == 4
        assert await backend.exists(keys) == 0
        assert await backend.set_from(keys, pages(keys)) == [True] * 4


@pytest.mark.usefixtures("file_reader")
async def test_a_failed_read_raises_and_counts_its_pages_as_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(2)
    async with FileBackend(tmp_path / "l3", FMT) as backend:
        await backend.set_from(keys, pages(keys))
        directory = os.open(tmp_path, os.O_RDONLY)  # reading it fails: EISDIR
        monkeypatch.setattr(_reader.SegmentFiles, "open", lambda self, seg_id: os.dup(directory))
        buffers = [bytearray(PAYLOAD) for _ in keys]
        try:
            with pytest.raises(StorageReadError, match="Is a directory"):
                await backend.get_into(keys, [memoryview(b) for b in buffers])
        finally:
            os.close(directory)
        assert backend.stats().errors == 2
        assert backend.stats().pages_read == 0
        monkeypatch.undo()
        assert await read(backend, keys) == [make_page(k) for k in keys]  # nothing unbound


async def test_a_root_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "taken").write_bytes(b"")
    for root in (tmp_path / "taken", tmp_path / "taken" / "below"):
        backend = FileBackend(root, FMT)
        with pytest.raises(StorageError, match="cannot open"):
            await backend.exists(make_keys(1))
        await backend.aclose()


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"segment_bytes": 0}, "segment_bytes"), ({"segment_bytes": 1.5}, "segment_bytes"),
    ({"compact_dead_fraction": 1.5}, "compact_dead_fraction"),
    ({"refresh_interval": -1}, "refresh_interval"),
    ({"capacity_bytes": 0}, "capacity_bytes"), ({"capacity_bytes": 1.5}, "capacity_bytes"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"root_dir": 3}, "root_dir"),
])
def test_bad_settings_raise_config_error_naming_them(tmp_path: Path, kwargs: dict[str, object],
                                                     name: str) -> None:
    settings: dict[str, object] = {"root_dir": tmp_path, "fmt": FMT, **kwargs}
    with pytest.raises(ConfigError, match=name):
        FileBackend(**settings)  # type: ignore[arg-type]


async def test_an_unclosed_backend_warns(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, FMT)
    await backend.exists(make_keys(1))
    executor = backend._executor
    with pytest.warns(ResourceWarning, match="unclosed"):
        del backend
        gc.collect()
    assert executor is not None
    executor.shutdown()


@pytest.mark.parametrize("how", ["scope", "task"])
async def test_a_cancelled_close_still_stops_the_threads_and_closes_the_files(
        tmp_path: Path, how: str) -> None:
    """Cancelled between two of its steps, `aclose` skipped the rest: the I/O threads ran
    on and the segment files stayed open (a review)."""
    keys = make_keys(4)
    backend = FileBackend(tmp_path, FMT, max_concurrency=1)
    await backend.set_from(keys, pages(keys))
    assert await backend.get_into(keys, [memoryview(bytearray(PAYLOAD)) for _ in keys])
    executor, raised = backend._executor, False
    try:
        with anyio.CancelScope() as scope:
            if how == "task":
                asyncio.current_task().cancel()  # type: ignore[union-attr]
            else:
                scope.cancel()
            try:
                await backend.aclose()
            except anyio.get_cancelled_exc_class():
                raised = True
                raise
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
    assert raised  # the cancellation propagates, after the close
    assert backend._closed and executor is not None and executor._shutdown
    assert not backend._files._fds  # the segments it read are closed
    await backend.aclose()  # idempotent


async def test_repr_shows_objects_and_budget(tmp_path: Path) -> None:
    keys = make_keys(2)
    async with FileBackend(tmp_path, FMT, capacity_bytes=10 * OBJECT) as backend:
        await backend.set_from(keys, pages(keys))
        assert repr(backend) == (f"<FileBackend {str(tmp_path)!r} [2 objects, {2 * OBJECT} "
                                 f"bytes of {10 * OBJECT}]>")
        assert backend.stats().extra["max_bytes"] == 10 * OBJECT


def test_append_record_hook_is_a_foreign_writer(tmp_path: Path) -> None:
    [key] = make_keys(1)
    append_record(tmp_path, key, b"not a page", time.time_ns())
    assert latest_entries(tmp_path)[key].length == len(b"not a page")


@pytest.mark.parametrize("chunk", [
    HEADER_SIZE + 1, 100, PAYLOAD // 2, PAYLOAD - 1,  # a record read in pieces
    OBJECT, 3 * OBJECT + 7, 64 * OBJECT,  # one record per call, three, the whole span
])
@pytest.mark.usefixtures("file_reader")
async def test_spans_are_read_a_chunk_at_a_time_and_every_record_is_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(_reader, "_CHUNK_BYTES", chunk)
    keys = make_keys(10)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as backend:
        await backend.set_from(keys, pages(keys))
        [segment] = with_suffix(tmp_path, ".seg")
        damage_payload(segment, latest_entries(tmp_path)[keys[4]], at=-1)  # its last byte
        os.truncate(segment, 10 * OBJECT - 1)  # the last record one byte short
        expected: list[bytes | None] = [make_page(k) for k in keys]
        expected[4] = expected[9] = None
        assert await read(backend, keys) == expected
        assert backend.stats().corrupt == 2


@pytest.mark.usefixtures("file_reader")
async def test_a_span_of_more_records_than_one_call_takes_is_read_whole(
        tmp_path: Path) -> None:
    tiny = PageFormat.make(namespace="conformance", spec_fingerprint="tiny", page_size=1,
                           payload_bytes=8)
    keys = make_keys(1500)  # 3,000 buffers: more than IOV_MAX (1,024) in one span
    payloads = [hashlib.blake2b(k.encode(), digest_size=8).digest() for k in keys]
    async with FileBackend(tmp_path, tiny, max_concurrency=1) as backend:
        assert await backend.set_from(keys, [memoryview(p) for p in payloads]) == [True] * 1500
        buffers = [bytearray(8) for _ in keys]
        assert await backend.get_into(keys, [memoryview(b) for b in buffers]) == [True] * 1500
        assert buffers == payloads


async def test_a_start_cancelled_mid_scan_is_not_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call cancelled while the store started: the scan ran to its end, but the
    store was not marked started, so the next call scanned again (journaling the start's
    evictions twice, counting them twice) (a review)."""
    keys = make_keys(3)
    async with FileBackend(tmp_path, FMT) as first:
        await first.set_from(keys, pages(keys))
    scans, real = [], file_module._scan_dir

    def slow_scan(root: str, index: Any) -> Any:
        scans.append(root)
        time.sleep(0.2)
        return real(root, index)
    monkeypatch.setattr(file_module, "_scan_dir", slow_scan)
    backend = FileBackend(tmp_path, FMT, capacity_bytes=2 * OBJECT)
    try:
        with anyio.move_on_after(0.05):
            await backend.exists(keys)
        assert await backend.exists(keys) == 2  # the budget kept the first 2 (the newest)
        assert len(scans) == 1 and backend.stats().evicted_pages == 1
    finally:
        await backend.aclose()
