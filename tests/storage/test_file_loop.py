"""The file store's index work never holds the event loop for a time that grows with the
whole store: dropping or compacting a segment costs its own keys, a start builds the index on
an I/O thread, and a look at other processes' journals merges a chunk at a time.

Each failed before its fix (at 1M keys: 80 ms per dropped segment, 33 ms per compaction
plan, 3.3 s per start; 270 ms per 100k entries merged).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aiohicache.storage import FileBackend, _file_index, _file_upkeep
from aiohicache.storage._file_index import SegmentIndex
from aiohicache.storage._journal import DELETE, PUT, TOUCH, Entry

from .conftest import FMT, make_keys
from .test_file_sharing import pages, read, written


class _NoScan(dict[str, Entry]):
    """An index's `entries` that refuses to be walked: only per-key lookups are allowed."""

    def _refuse(self, *args: Any) -> Any:
        raise AssertionError("walked every entry of the index")

    items = values = keys = __iter__ = _refuse  # type: ignore[assignment]


def _index_of(segments: int, per: int) -> SegmentIndex:
    index = SegmentIndex(None, on_drop=lambda seg_id: None)
    for i in range(segments * per):
        index.bind(Entry(f"key-{i:012d}", PUT, i // per, (per - 1 - i % per) * 100, 100, i + 1))
    index.entries = _NoScan(index.entries)
    return index


def test_compacting_or_dropping_a_segment_touches_its_own_keys_only() -> None:
    index = _index_of(segments=4, per=50)
    moves, keep = index.compaction_plan(2, [], [])
    assert [e.key for e in moves] == [f"key-{i:012d}" for i in range(149, 99, -1)]  # by offset
    assert [e.offset for e in moves] == sorted(e.offset for e in moves) and keep == []
    moved = [e._replace(seg_id=9, offset=i * 100) for i, e in enumerate(moves)]
    index.repoint(2, moves, moved)
    assert all(index.entries.get(e.key) == m for e, m in zip(moves, moved, strict=True))
    index.drop_segment(1)
    assert index.entries.get("key-000000000050") is None
    assert index.live == {0: 5000, 3: 5000, 9: 5000}
    assert len(dict.keys(index.entries)) == 150 and not index.keys_of.get(2)
    index.apply(Entry("key-000000000000", DELETE, 0, 4900, 100, 10_000))
    index.drop_segment(9)
    assert sorted(map(len, index.keys_of.values())) == [49, 50]


async def test_a_start_builds_the_index_off_the_loop(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(20)
    async with FileBackend(tmp_path, FMT) as store:
        await store.set_from(keys, pages(keys))
    loaded_on: list[threading.Thread] = []
    real_load = SegmentIndex.load

    def load(self: SegmentIndex, scan: Any) -> int:
        loaded_on.append(threading.current_thread())
        return real_load(self, scan)
    monkeypatch.setattr(SegmentIndex, "load", load)
    async with FileBackend(tmp_path, FMT) as store:
        assert await read(store, keys) == written(keys)
        assert store.stats().extra["objects"] == 20
    assert loaded_on and threading.main_thread() not in loaded_on


async def test_a_look_at_other_journals_merges_a_chunk_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process journaled far more than a chunk since the last look: the loop runs
    between chunks, and every key is served after."""
    monkeypatch.setattr(_file_upkeep, "_MERGE_CHUNK", 64, raising=False)
    keys = make_keys(1000, seed=3)
    turns, applied_since_turn, longest = [0], [0], [0]
    real_apply = _file_index.SegmentIndex.apply

    def apply(self: SegmentIndex, entry: Entry) -> bool:
        applied_since_turn[0] += 1
        longest[0] = max(longest[0], applied_since_turn[0])
        return real_apply(self, entry)

    async def ticker() -> None:
        while True:
            await anyio.lowlevel.checkpoint()
            turns[0] += 1
            applied_since_turn[0] = 0

    async with FileBackend(tmp_path, FMT) as reader, FileBackend(tmp_path, FMT) as writer:
        assert await reader.exists(keys[:1]) == 0
        await writer.set_from(keys, pages(keys))
        monkeypatch.setattr(_file_index.SegmentIndex, "apply", apply)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0.06)  # past the refresh interval
            assert await reader.exists(keys) == 1000
            tg.cancel_scope.cancel()
        assert longest[0] <= 64
        assert await read(reader, keys[:50]) == written(keys[:50])


async def test_a_delete_made_during_a_merge_is_not_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete arriving while another task's look was mid-merge skipped the look: the key
    was not indexed yet, so nothing was deleted (it returned 0), and the merge then bound
    the other process's record, served here and after a restart (a review)."""
    monkeypatch.setattr(_file_upkeep, "_MERGE_CHUNK", 8, raising=False)
    keys = make_keys(400, seed=4)
    async with FileBackend(tmp_path, FMT) as reader, FileBackend(tmp_path, FMT) as writer:
        assert await reader.exists(keys[:1]) == 0
        await writer.set_from(keys, pages(keys))
        await anyio.sleep(0.06)  # past the refresh interval
        real_apply = SegmentIndex.apply

        def slow_apply(self: SegmentIndex, entry: Entry) -> bool:
            time.sleep(0.0005)  # 400 entries: a merge of 0.2 s, 8 entries a loop turn
            return real_apply(self, entry)
        monkeypatch.setattr(SegmentIndex, "apply", slow_apply)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.exists, keys)  # a look
            while not reader._merging.locked():
                await anyio.lowlevel.checkpoint()
            await anyio.sleep(0.06)  # mid-merge, past the refresh interval again
            assert reader._merging.locked()
            assert await reader.delete(keys[:1]) == 1  # the newest: merged last
        assert await reader.exists(keys[:1]) == 0
    async with FileBackend(tmp_path, FMT) as fresh:
        assert await fresh.exists(keys[:1]) == 0


def test_a_compaction_carries_one_touch_per_key() -> None:
    """Every touch of a live key in the victim's journal was carried: a key read 40 times
    was journaled again 40 times (a review). Only its latest touch orders it."""
    index = _index_of(segments=2, per=4)
    key = "key-000000000000"  # in segment 0; the victim is segment 1
    live = index.entries[key]
    touches = [Entry(key, TOUCH, live.seg_id, live.offset, live.length, stamp)
               for stamp in (50, 70, 60)]
    moves, keep = index.compaction_plan(1, touches, [])
    assert len(moves) == 4 and keep == [touches[1]]
