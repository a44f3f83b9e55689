"""`FileBackend` instances sharing one directory, and the races inside one instance: what one
does (compact, start, read, find a damaged record, fail a journal write) never loses a page
another stored and did not delete, nor brings back one that was deleted.

Every page read is checked against what was written for its key; a lost page shows as a
miss where a hit is due, in the instance itself, in another one or after a restart.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aiohicache.storage import FileBackend, _appender
from aiohicache.storage import _journal as seg
from aiohicache.storage.base import HEADER_SIZE
from aiohicache.storage.errors import StorageWriteError

from .conftest import FMT, PAYLOAD, make_keys, make_page
from .segment_hooks import corrupt_record

OBJECT = HEADER_SIZE + PAYLOAD


def pages(keys: list[str], *, version: int = 0) -> list[memoryview]:
    return [memoryview(make_page(key, version=version)) for key in keys]


async def read(backend: FileBackend, keys: list[str]) -> list[bytes | None]:
    buffers = [bytearray(PAYLOAD) for _ in keys]
    hits = await backend.get_into(keys, [memoryview(b) for b in buffers])
    return [bytes(b) if hit else None for hit, b in zip(hits, buffers, strict=True)]


def written(keys: list[str], *, version: int = 0) -> list[bytes | None]:
    return [make_page(key, version=version) for key in keys]


async def served_after_restart(root: Path, keys: list[str]) -> list[bytes | None]:
    async with FileBackend(root, FMT) as fresh:
        return await read(fresh, keys)


def slowed_compaction(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Hold each compaction's I/O thread `seconds` after it removed the victim's files (the
    window where the loop may run other calls of the same instance)."""
    real = _appender.compact

    def slow(*args: Any) -> tuple[list[seg.Entry], list[int]]:
        done = real(*args)
        time.sleep(seconds)
        return done
    monkeypatch.setattr(_appender, "compact", slow)


# ---------------------------------------------------------------------------- compaction

async def test_compaction_moves_records_another_instance_wrote_since_the_last_look(
        tmp_path: Path) -> None:
    """A compacted the segment from what its index knew: B's later pages in it were removed
    for every instance."""
    xs, ys = make_keys(10, seed=1), make_keys(4, seed=2)
    async with FileBackend(tmp_path, FMT, refresh_interval=0.0) as a:
        async with FileBackend(tmp_path, FMT, max_concurrency=1) as b:
            await b.set_from(xs, pages(xs))
            assert await a.exists(xs) == 10  # A looks: it knows xs, in B's segment
            await b.set_from(ys, pages(ys))  # the same segment, after A's last look
        assert await a.delete(xs[:6]) == 6  # keys A knows: no look; B's segment compacted
        assert a.stats().extra["compactions"] == 1
        assert await read(a, ys + xs[6:]) == written(ys + xs[6:])
    assert await served_after_restart(tmp_path, ys + xs[6:]) == written(ys + xs[6:])


async def test_a_look_at_the_journals_during_a_compaction_keeps_the_moved_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look found the victim gone and dropped its keys before the compaction re-pointed
    them: this instance missed them until a restart."""
    xs, others = make_keys(10, seed=1), make_keys(10, seed=2)
    async with FileBackend(tmp_path, FMT, segment_bytes=10 * OBJECT,
                           refresh_interval=0.0) as store:
        for key in xs + others:  # one page a call: xs fill one segment
            await store.set_from([key], pages([key]))
        slowed_compaction(monkeypatch, 0.3)

        async def look() -> None:
            await asyncio.sleep(0.1)  # the victim's files are gone by now
            assert await store.exists(make_keys(1, seed=3)) == 0  # a key it lacks: a look
        await asyncio.gather(store.delete(xs[:6]), look())
        assert store.stats().extra["compactions"] == 1
        assert await store.exists(xs[6:]) == 4
        assert await read(store, xs[6:]) == written(xs[6:])
        assert store.stats().extra["segments"] == len(seg_ids(tmp_path))  # no ghost
    assert await served_after_restart(tmp_path, xs[6:]) == written(xs[6:])


async def test_reads_journaled_during_a_compaction_keep_the_moved_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their recency, journaled while the compaction ran, re-stamped the keys, and the
    compaction then dropped every key it did not find as it had left it."""
    xs, others = make_keys(10, seed=1), make_keys(10, seed=2)
    async with FileBackend(tmp_path, FMT, segment_bytes=10 * OBJECT) as store:
        for key in xs + others:
            await store.set_from([key], pages([key]))
        assert await read(store, xs[6:]) == written(xs[6:])  # to be journaled as touches
        slowed_compaction(monkeypatch, 0.3)

        async def journal_the_reads() -> None:
            await asyncio.sleep(0.1)
            await store._flush_touches(force=True)
        await asyncio.gather(store.delete(xs[:6]), journal_the_reads())
        assert await store.exists(xs[6:]) == 4
        assert await read(store, xs[6:]) == written(xs[6:])
    assert await served_after_restart(tmp_path, xs[6:]) == written(xs[6:])


def seg_ids(root: Path) -> list[str]:
    return sorted(p.stem for p in root.iterdir() if p.suffix == ".seg")


# ---------------------------------------------------------------------------- starting up

async def test_an_instance_starting_while_another_writes_sees_every_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments were sized before the journals were read: a record landing in between looked
    torn, and its entry, already read past, was never read again."""
    early, late = make_keys(4, seed=1), make_keys(1, seed=2)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as writer:
        await writer.set_from(early, pages(early))
        real = seg._read_from
        landed: list[str] = []

        def read_from(path: str, start: int) -> bytes | None:
            if not landed:  # the writer's next page lands while the starter scans
                landed.append(late[0])
                _appender.write_run(writer._appender, FMT, late, pages(late),
                                    [time.time_ns()], [])
            return real(path, start)
        monkeypatch.setattr(seg, "_read_from", read_from)
        async with FileBackend(tmp_path, FMT) as starter:
            monkeypatch.setattr(seg, "_read_from", real)
            assert landed and starter.stats().extra["torn_entries"] == 0
            assert await starter.exists(early + late) == 5
            assert await read(starter, early + late) == written(early + late)


# ---------------------------------------------------------------------------- reads

async def test_a_damaged_record_is_deleted_but_not_a_newer_good_one(tmp_path: Path) -> None:
    """A's delete of its damaged record was stamped when A read it, after B had stored a
    good one unseen by A: B's page was deleted for every instance."""
    key = make_keys(1)
    async with FileBackend(tmp_path, FMT) as a, FileBackend(tmp_path, FMT) as b:
        await a.set_from(key, pages(key))
        corrupt_record(tmp_path, a._index.entries[key[0]])
        await b.set_from(key, pages(key, version=1))
        assert await read(a, key) == [None]  # damaged: a counted miss, deleted
        assert a.stats().corrupt == 1
        await a.aclose()
        await asyncio.sleep(b.refresh_interval)
        assert await b.exists(make_keys(1, seed=5)) == 0  # B looks at A's journal
        assert await read(b, key) == written(key, version=1)
    assert await served_after_restart(tmp_path, key) == written(key, version=1)


async def test_a_read_before_another_instance_deletes_does_not_bring_the_page_back(
        tmp_path: Path) -> None:
    """The read's recency was journaled stamped when journaled, later than the delete."""
    key = make_keys(1)
    reader = FileBackend(tmp_path, FMT)
    try:
        await reader.set_from(key, pages(key))
        assert await read(reader, key) == written(key)
        async with FileBackend(tmp_path, FMT) as other:
            assert await other.delete(key) == 1
    finally:
        await reader.aclose()  # journals the read
    assert await served_after_restart(tmp_path, key) == [None]


# ---------------------------------------------------------------------------- journal errors

async def test_a_journal_write_cut_short_leaves_the_journal_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that filled up mid-entry left part of one, and every later entry of that
    journal off the entry grid: pages stored after it were lost to other instances and to
    a restart."""
    olds, news = make_keys(5, seed=1), make_keys(10, seed=2)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as store:
        await store.set_from(olds, pages(olds))
        monkeypatch.setattr(_appender, "os", short_write_once(100))
        with pytest.raises(StorageWriteError, match="journal write was short"):
            await store.delete(olds[:3])
        monkeypatch.undo()
        assert all(size % seg.ENTRY_SIZE == 0 for size in journal_sizes(tmp_path))
        assert await store.set_from(news, pages(news)) == [True] * 10
        async with FileBackend(tmp_path, FMT) as other:
            assert await read(other, news + olds[3:]) == written(news + olds[3:])
    assert await served_after_restart(tmp_path, news + olds[3:]) == written(news + olds[3:])


def short_write_once(limit: int) -> SimpleNamespace:
    """`os`, but whose next `write` lands only `limit` bytes (a disk filling up)."""
    calls: list[int] = []

    def write(fd: int, data: bytes) -> int:
        calls.append(fd)
        return os.write(fd, data[:limit] if len(calls) == 1 else data)
    shim: dict[str, Callable[..., Any] | Any] = {**vars(os), "write": write}
    return SimpleNamespace(**shim)


def journal_sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in root.iterdir() if p.suffix == ".log"]
