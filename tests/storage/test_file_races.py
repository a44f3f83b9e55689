"""`FileBackend` calls racing each other, within one instance and across instances sharing a
directory: whichever order they end in, this instance, another instance and a restart agree
on what each key holds, a delete stays deleted, and a compaction loses nothing.

A second review (2026-11-24) found each of these; every test failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aiohicache.storage import FileBackend, _appender, _file_index
from aiohicache.storage import _journal as seg
from aiohicache.storage._file_upkeep import _TOUCH_FLUSH

from .conftest import FMT, make_keys
from .test_file_sharing import (
    OBJECT,
    pages,
    read,
    served_after_restart,
    slowed_compaction,
    written,
)

real_write_run = _appender.write_run


def slow_writes_of(key: str, seconds: float, times: int = 1 << 30) -> Callable[..., Any]:
    """`write_run`, held `seconds` on its I/O thread for its first `times` runs with `key`."""
    left = [times]

    def write_run(appender: Any, fmt: Any, keys: list[str], *args: Any) -> Any:
        if key in keys and left[0] > 0:
            left[0] -= 1
            time.sleep(seconds)
        return real_write_run(appender, fmt, keys, *args)
    return write_run


@contextlib.contextmanager
def compacting_before_the_listing(monkeypatch: pytest.MonkeyPatch, compactor: FileBackend,
                                  victim: int) -> Iterator[list[bool]]:
    """Within: the next look (of any instance) reads the journals, then `compactor`
    compacts `victim` (planned now, from its index), then the look lists the segments.
    Yields a list that is empty once the compaction ran."""
    known = 1 << 62 if victim in compactor._appender.created_ids() else \
        compactor._index.read_to.get(victim, 0)
    locked = _appender.lock_segment(compactor.root_dir, victim, known)
    assert locked is not None
    fd, (log, unseen) = locked
    moves, keep = compactor._index.compaction_plan(victim, log, unseen)
    real_list, armed = seg._list, [True]

    def list_after_a_compaction(root: str, segments: Any = None) -> list[int]:
        if segments is not None and armed.pop() if armed else False:
            _appender.compact(compactor._appender, fd, victim, moves, keep)
        return real_list(root, segments)
    monkeypatch.setattr(seg, "_list", list_after_a_compaction)
    try:
        yield armed
    finally:
        os.close(fd)
        monkeypatch.setattr(seg, "_list", real_list)


# ---------------------------------------------------------------------------- writes

async def test_a_delete_made_while_a_write_is_in_flight_wins_everywhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write's stamp is taken when it begins: the delete is later, so the journals say
    deleted. This instance once bound the write when it ended and served it, alone."""
    k = make_keys(1, seed=7)
    async with FileBackend(tmp_path, FMT) as store:
        await store.set_from(k, pages(k))
        monkeypatch.setattr(_appender, "write_run", slow_writes_of(k[0], 0.3))

        async def delete_later() -> int:
            await asyncio.sleep(0.1)
            return await store.delete(k)
        stored, deleted = await asyncio.gather(store.set_from(k, pages(k, version=1)),
                                               delete_later())
        monkeypatch.undo()
        assert stored == [True] and deleted == 1
        assert await store.exists(k) == 0 and await read(store, k) == [None]
        async with FileBackend(tmp_path, FMT) as other:
            assert await read(other, k) == [None]
    assert await served_after_restart(tmp_path, k) == [None]


async def test_two_writes_of_a_key_ending_out_of_order_agree_everywhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    k = make_keys(1, seed=7)
    async with FileBackend(tmp_path, FMT) as store:
        monkeypatch.setattr(_appender, "write_run", slow_writes_of(k[0], 0.3, times=1))

        async def second() -> list[bool]:
            await asyncio.sleep(0.1)
            return await store.set_from(k, pages(k, version=2))
        first, later = await asyncio.gather(store.set_from(k, pages(k, version=1)), second())
        monkeypatch.undo()
        assert first == later == [True]
        assert await read(store, k) == written(k, version=2)  # the later write, though the
        async with FileBackend(tmp_path, FMT) as other:  # first returned last
            assert await read(other, k) == written(k, version=2)
    assert await served_after_restart(tmp_path, k) == written(k, version=2)


# ---------------------------------------------------------------------------- reads (touches)

async def test_a_read_during_an_overwrite_does_not_bring_the_old_bytes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of the old record ending while the overwrite was in flight was journaled as a
    re-binding stamped after the overwrite began, and beat it on disk."""
    k, others = make_keys(1, seed=7), make_keys(4095, seed=8)
    async with FileBackend(tmp_path, FMT) as store:
        await store.set_from(k + others, pages(k + others))
        monkeypatch.setattr(_appender, "write_run", slow_writes_of(k[0], 0.4))

        async def read_meanwhile() -> bytes | None:
            await asyncio.sleep(0.1)
            return (await read(store, k + others))[0]  # 4,096 pages: their reads journaled
        stored, during = await asyncio.gather(store.set_from(k, pages(k, version=2)),
                                              read_meanwhile())
        monkeypatch.undo()
        assert stored == [True] and during == written(k)[0]  # the write was in flight
        async with FileBackend(tmp_path, FMT) as other:
            assert await read(other, k) == written(k, version=2)
    assert await served_after_restart(tmp_path, k) == written(k, version=2)


async def test_a_read_of_a_page_another_instance_deleted_does_not_bring_it_back(
        tmp_path: Path) -> None:
    """An instance that has not looked since still reads its record (right bytes, stale
    index); journaling that read once re-bound the key for every instance."""
    k = make_keys(1, seed=7)
    a = FileBackend(tmp_path, FMT)
    try:
        await a.set_from(k, pages(k))
        async with FileBackend(tmp_path, FMT) as b:
            assert await b.delete(k) == 1
            assert await read(a, k) == written(k)  # no look: a key it has
            await a.aclose()  # journals the read
            await asyncio.sleep(b.refresh_interval)
            assert await b.exists(make_keys(1, seed=5)) == 0  # B looks at A's journal
            assert await read(b, k) == [None]
    finally:
        await a.aclose()
    assert await served_after_restart(tmp_path, k) == [None]


async def test_a_read_of_a_page_another_instance_overwrote_keeps_the_new_bytes(
        tmp_path: Path) -> None:
    k = make_keys(1, seed=7)
    async with FileBackend(tmp_path, FMT) as a:
        await a.set_from(k, pages(k))
        async with FileBackend(tmp_path, FMT) as b:
            await b.set_from(k, pages(k, version=2))
        assert await read(a, k) == written(k)  # the old record, still whole
    assert await served_after_restart(tmp_path, k) == written(k, version=2)


# ---------------------------------------------------------------------------- compaction

async def test_a_read_during_this_instances_compaction_keeps_the_moved_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read found the victim gone, twice (the index not re-pointed yet), and unbound the
    keys as lost; the compaction then skipped them."""
    xs, others = make_keys(10, seed=1), make_keys(10, seed=2)
    async with FileBackend(tmp_path, FMT, segment_bytes=10 * OBJECT,
                           refresh_interval=0.0) as store:
        for key in xs + others:
            await store.set_from([key], pages([key]))
        slowed_compaction(monkeypatch, 0.3)

        async def read_meanwhile() -> list[bytes | None]:
            await asyncio.sleep(0.1)  # the victim's files are gone by now
            return await read(store, xs[6:])
        _, during = await asyncio.gather(store.delete(xs[:6]), read_meanwhile())
        monkeypatch.undo()
        assert store.stats().extra["compactions"] == 1
        assert all(page in (None, want) for page, want in zip(during, written(xs[6:]),
                                                               strict=True))
        assert await store.exists(xs[6:]) == 4
        assert await read(store, xs[6:]) == written(xs[6:])
    assert await served_after_restart(tmp_path, xs[6:]) == written(xs[6:])


async def test_another_instance_that_read_the_pages_keeps_what_a_compaction_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B's journaled reads had re-stamped the records, so B took A's moves (at the stamps A
    knew) for older, read past them, and dropped the keys when the victim went."""
    xs = make_keys(4200, seed=1)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as writer:
        await writer.set_from(xs, pages(xs))  # one sealed segment
    real = _appender._copy_records

    def copy_then_wait(*args: Any) -> Any:
        moved = real(*args)  # the moves are journaled, the victim not removed yet
        time.sleep(0.3)
        return moved
    async with FileBackend(tmp_path, FMT) as a:
        assert await a.exists(xs[:1]) == 1
        async with FileBackend(tmp_path, FMT, refresh_interval=0.0) as b:
            assert await read(b, xs) == written(xs)  # 4,200 reads: journaled
            monkeypatch.setattr(_appender, "_copy_records", copy_then_wait)

            async def b_looks() -> None:
                await asyncio.sleep(0.15)
                assert await b.exists(make_keys(1, seed=99)) == 0
            await asyncio.gather(a.delete(xs[:3000]), b_looks())
            monkeypatch.undo()
            assert a.stats().extra["compactions"] == 1
            assert await read(b, xs[3000:]) == written(xs[3000:])
            assert await b.exists(xs[3000:]) == 1200


async def test_a_delete_of_a_record_in_the_compacted_segment_outlives_it(
        tmp_path: Path) -> None:
    """The delete named the victim, so compaction dropped it with the victim's journal, and
    an older record of the key in another segment came back after a restart."""
    k = make_keys(1, seed=7)
    fill, gs, h = make_keys(9, seed=1), make_keys(9, seed=2), make_keys(1, seed=3)
    async with FileBackend(tmp_path, FMT, max_concurrency=1,
                           segment_bytes=10 * OBJECT) as store:
        for key in fill + k:  # S1: 9 pages and K v1
            await store.set_from([key], pages([key]))
        await store.set_from(k, pages(k, version=2))  # S2: K v2 (K v1 dead in S1)
        assert await store.delete(k) == 1  # names S2, journaled in S2's journal
        for key in gs:
            await store.set_from([key], pages([key]))
        await store.set_from(h, pages(h))  # S2 sealed
        assert await store.delete(gs[:5]) == 5  # S2 mostly dead: compacted
        assert store.stats().extra["compactions"] == 1
        assert await read(store, k) == [None]
    assert await served_after_restart(tmp_path, k) == [None]


async def test_a_compaction_does_not_bring_back_a_key_whose_delete_was_forgotten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compaction merged the victim's whole journal: the old binding of a key deleted
    long ago (its delete gone from the bounded memory) bound it again."""
    monkeypatch.setattr(_file_index, "_DELETED_MEMORY", 4)
    k = make_keys(1, seed=7)
    fill, h = make_keys(9, seed=1), make_keys(1, seed=3)
    async with FileBackend(tmp_path, FMT, max_concurrency=1,
                           segment_bytes=10 * OBJECT) as store:
        for key in k + fill:  # S1: K and 9 pages
            await store.set_from([key], pages([key]))
        await store.set_from(h, pages(h))  # S1 sealed
        assert await store.delete(k) == 1
        assert await store.delete(fill[:5]) == 5  # K's delete forgotten; S1 compacted
        assert store.stats().extra["compactions"] == 1
        assert await read(store, k) == [None]


async def test_pages_a_compaction_learned_of_are_evicted_before_the_pages_read_here(
        tmp_path: Path) -> None:
    """Merged from the victim's journal as the most recently used, they pushed out the
    pages this instance had just read."""
    xs, ys, z = make_keys(10, seed=1), make_keys(10, seed=2), make_keys(1, seed=3)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as writer:
        await writer.set_from(xs, pages(xs))
        async with FileBackend(tmp_path, FMT, capacity_bytes=12 * OBJECT) as store:
            assert await store.exists(xs) == 10
            await writer.set_from(ys, pages(ys))  # the same segment, unseen by `store`
            await writer.aclose()
            assert await read(store, xs[6:]) == written(xs[6:])
            assert await store.delete(xs[:6]) == 6  # compacted: ys learned of
            assert store.stats().extra["compactions"] == 1
            await store.set_from(z, pages(z))  # evicts down to the budget
            assert [await store.exists([x]) for x in xs[6:]] == [1, 1, 1, 1]
            # 4 + 10 + 1 pages in a budget of 12: three of ys go, the tail of their chain
            assert [await store.exists([y]) for y in ys] == [1] * 7 + [0] * 3


async def test_a_segment_removed_between_open_and_lock_is_not_compacted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another instance compacted and removed it in that window: locking the removed inode
    succeeded, its journal read empty, and this instance moved what its stale index bound,
    at the old stamps (bringing back what the other had deleted since)."""
    xs = make_keys(10, seed=1)
    async with FileBackend(tmp_path, FMT, max_concurrency=1) as writer:
        await writer.set_from(xs, pages(xs))
        victim = writer._index.entries[xs[0]].seg_id
    async with FileBackend(tmp_path, FMT) as store:
        assert await store.exists(xs) == 10
        path = seg.segment_path(str(tmp_path), victim)
        monkeypatch.setattr(_appender, "os", removed_after_open(path))
        assert await store._compact(victim) is None
        monkeypatch.undo()
        assert segments(tmp_path) == []  # it is gone, and nothing was moved


def segments(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.suffix == ".seg"]


def removed_after_open(path: str) -> SimpleNamespace:
    """`os`, but the segment at `path` and its journal are removed (another instance's
    compaction ends) right after the segment is opened."""
    def open_(name: str, flags: int, *args: Any) -> int:
        fd = os.open(name, flags, *args)
        if name == path:
            os.unlink(path)
            os.unlink(path[:-len("seg")] + "log")
        return fd
    return SimpleNamespace(**{**vars(os), "open": open_})


# ---------------------------------------------------------------------------- segments

async def test_a_segment_whose_temp_file_a_starting_instance_removed_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A starting instance took the temp file of a segment being made for a dead writer's
    and removed it before the maker locked it: the write failed."""
    k = make_keys(4, seed=1)
    removed: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not removed:  # the first segment's lock: a start removes orphans first
            removed.append(seg.remove_orphans(str(tmp_path), [], []))
        fcntl.flock(fd, op)
    monkeypatch.setattr(_appender, "fcntl", SimpleNamespace(**{**vars(fcntl), "flock": flock}))
    async with FileBackend(tmp_path, FMT) as store:
        assert await store.set_from(k, pages(k)) == [True] * 4
        assert removed == [1]
        assert await read(store, k) == written(k)


# ---------------------------------------------------------------------------- stamps

async def test_an_overwrite_after_a_restart_whose_clock_stepped_back_is_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stamps given here did not catch up with the stamps read from the journals: a write
    stamped below the record bound was refused, though reported stored (a third review)."""
    k = make_keys(1, seed=3)
    async with FileBackend(tmp_path, FMT) as store:
        await store.set_from(k, pages(k))
    real = time.time_ns
    monkeypatch.setattr(_file_index.time, "time_ns", lambda: real() - 5_000_000_000)
    async with FileBackend(tmp_path, FMT) as store:
        assert await store.set_from(k, pages(k, version=1)) == [True]
        assert await read(store, k) == written(k, version=1)
        assert await store.delete(k) == 1
        assert await store.set_from(k, pages(k, version=2)) == [True]  # after the delete
        assert await read(store, k) == written(k, version=2)
    assert await served_after_restart(tmp_path, k) == written(k, version=2)


async def test_an_overwrite_of_a_page_stamped_by_a_clock_ahead_is_served(
        tmp_path: Path) -> None:
    k = make_keys(1, seed=4)
    async with FileBackend(tmp_path, FMT) as ahead, FileBackend(tmp_path, FMT) as behind:
        ahead._index.last_stamp = time.time_ns() + 5_000_000_000  # its clock runs ahead
        await ahead.set_from(k, pages(k))
        assert await read(behind, k) == written(k)  # learned here, with its stamp
        assert await behind.set_from(k, pages(k, version=1)) == [True]
        assert await read(behind, k) == written(k, version=1)
    assert await served_after_restart(tmp_path, k) == written(k, version=1)


async def test_a_write_overtaken_by_a_later_one_keeps_the_key_in_the_budget(
        tmp_path: Path) -> None:
    """The late record, dead on arrival, left the key's live record out of the LRU budget:
    never evicted, never counted."""
    ks = make_keys(129, seed=11)  # the last in the third run of the first call
    async with FileBackend(tmp_path, FMT, max_concurrency=1,
                           capacity_bytes=300 * OBJECT) as store:
        first = asyncio.ensure_future(store.set_from(ks, pages(ks)))
        await asyncio.sleep(0)  # its stamps are taken: the next write of the key is later
        second = asyncio.ensure_future(store.set_from(ks[-1:], pages(ks[-1:], version=1)))
        assert await first == [True] * 129 and await second == [True]
        assert await read(store, ks[-1:]) == written(ks[-1:], version=1)
        assert ks[-1] in store._budget
        more = make_keys(600, seed=12)
        for lo in range(0, 600, 50):
            await store.set_from(more[lo:lo + 50], pages(more[lo:lo + 50]))
        assert len(store._index.entries) == 300  # the budget holds


# ---------------------------------------------------------------------------- journals

def journal_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.glob("*.log"))


async def test_a_read_mostly_store_keeps_its_journals_bounded(tmp_path: Path) -> None:
    """Every read is journaled as a touch; with no writes the active segment never filled,
    so its journal grew 176 bytes a page read, without end (29 MB after 40 reads of 4,096
    pages). A lane is rolled once its touches pass a limit, and a segment that holds only a
    journal is compacted away: after as many reads the journals hold the records' entries
    and at most three lanes' worth of touches (the data segment's, the active lane's, one
    sealed), and every page is still served, here and after a restart."""
    keys = make_keys(4096, seed=31)
    async with FileBackend(tmp_path, FMT, segment_bytes=4 << 20, max_concurrency=1) as store:
        await store.set_from(keys, pages(keys))
        records = journal_bytes(tmp_path)
        for _ in range(40):
            assert await read(store, keys) == written(keys)
        lane = (1 << 20) + seg.ENTRY_SIZE * _TOUCH_FLUSH  # the limit (1 MiB at least), a flush
        assert journal_bytes(tmp_path) <= records + 3 * lane
        assert len(segments(tmp_path)) <= 3
    assert await served_after_restart(tmp_path, keys) == written(keys)


async def test_another_instances_journal_only_lane_is_not_tried_for_compaction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every segment of size 0 was taken for garbage: a reader's active lane (touches, no
    record) was tried for compaction by the other instances at every chance, each try a
    thread hop and a failed lock (a review). Only a lane this instance sealed is tried."""
    keys = make_keys(_TOUCH_FLUSH, seed=33)
    tried: list[int] = []
    real = _appender.lock_segment

    def lock_segment(root: str, seg_id: int, known: int) -> Any:
        tried.append(seg_id)
        return real(root, seg_id, known)
    async with FileBackend(tmp_path, FMT, refresh_interval=0.0) as writer, \
            FileBackend(tmp_path, FMT, refresh_interval=0.0) as reader:
        await writer.set_from(keys, pages(keys))
        assert await read(reader, keys) == written(keys)  # journals its touches: a lane
        lanes = reader._appender.active_ids()
        assert lanes and all(reader._index.sizes.get(s, 0) == 0 for s in lanes)
        monkeypatch.setattr(_appender, "lock_segment", lock_segment)
        assert await writer.exists(make_keys(1, seed=34)) == 0  # a look: learns the lane
        assert await writer.delete(keys[:1]) == 1  # a chance to compact
        assert not set(tried) & lanes


async def test_a_compaction_between_reading_the_journals_and_listing_the_segments_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A look reads the journals, then lists the segments. Another instance compacting in
    between journaled its moves where the look had read already, then removed the victim:
    the look dropped the victim's keys, and their moves came only with a later look (a
    stress found pages lost, and older versions served at a start)."""
    xs = make_keys(8, seed=35)
    async with FileBackend(tmp_path, FMT) as a, \
            FileBackend(tmp_path, FMT, refresh_interval=0.0) as b:
        await a.set_from(xs, pages(xs))
        a._appender.close()  # sealed: compactable
        assert await b.exists(xs) == 8
        victim = a._index.entries[xs[0]].seg_id
        with compacting_before_the_listing(monkeypatch, a, victim) as armed:
            assert await b.exists(make_keys(1, seed=36)) == 0  # a look, A compacting
        assert not armed and not (tmp_path / f"{victim:016x}.seg").exists()
        assert all(x in b._index for x in xs)  # moved, not dropped until another look
        assert await read(b, xs) == written(xs)


async def test_a_segment_sealed_while_a_starting_instance_scans_is_not_taken_for_an_orphan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A starting instance lists the journals, then the segments: a segment made, written
    and sealed in between had no journal in its listing and no lock, and was removed as a
    dead writer's orphan, with the pages journaled in it (a stress found them lost)."""
    k = make_keys(1, seed=43)
    real_list, armed = seg._list, [True]

    def list_then_seal_a_segment(root: str, segments: Any = None) -> list[int]:
        logs = real_list(root, segments)
        if segments is None and armed and armed.pop():
            appender = _appender.Appender(root, segment_bytes=1 << 20, fsync=False)
            _appender.write_run(appender, FMT, k, pages(k), [time.time_ns()], [])
            appender.close()
        return logs
    monkeypatch.setattr(seg, "_list", list_then_seal_a_segment)
    async with FileBackend(tmp_path, FMT) as starter:
        monkeypatch.undo()
        assert not armed and starter.stats().extra["orphans_removed"] == 0
        assert await read(starter, k) == written(k)
    assert await served_after_restart(tmp_path, k) == written(k)


async def test_a_newer_write_whose_segment_a_look_found_gone_is_not_served_older(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A look that ran out of passes while compactions went on read a newer write of a key
    whose segment was gone by the listing, and not yet the journal its move went to: it
    skipped the write and kept serving the older version it had bound (a stress found it).
    The older record is forgotten now: a miss until a look binds the move."""
    k, others = make_keys(1, seed=46), make_keys(2, seed=48)
    monkeypatch.setattr(seg, "_PASSES", 1)
    async with FileBackend(tmp_path, FMT) as w, \
            FileBackend(tmp_path, FMT, refresh_interval=0.0) as r, FileBackend(tmp_path, FMT) as x:
        await w.set_from(k + others, pages(k + others, version=1))  # not compacted later
        w._appender.close()  # the newer write goes to another segment
        assert await read(r, k) == written(k, version=1)
        await w.set_from(k, pages(k, version=2))
        w._appender.close()
        victim = w._index.entries[k[0]].seg_id
        await x._refresh(force=True)
        with compacting_before_the_listing(monkeypatch, x, victim) as armed:
            assert await r.exists(make_keys(1, seed=47)) == 0  # a look, X compacting
        assert not armed
        monkeypatch.undo()
        assert await read(r, k) == written(k, version=2)  # looks again: the move
    assert await served_after_restart(tmp_path, k) == written(k, version=2)
