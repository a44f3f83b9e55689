"""A file store shared with an instance of the previous version (a rolling upgrade, or one
host not upgraded yet): each serves what the other wrote and moved.

The previous version's `Entry.pack` wrote 0 in the field the new `origin` took, so every
entry it journals, a compaction's moves included, reads as origin 0 here. This version
breaks ties of stamps by origin (0: unknown, breaks no tie); taken as the least origin, the
previous version's move of a page the new one wrote
(same stamp, origin 0 < the write's origin) lost the tie to the very record it moved: the
page was dropped with the moved-from segment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash

from aiohicache.storage import FileBackend
from aiohicache.storage import _journal as seg
from aiohicache.storage._journal import Entry

from .conftest import FMT, make_keys
from .test_file_binding import defer_binding_of, real_finish
from .test_file_sharing import pages, read, served_after_restart, written


def _previous_version_pack(self: Entry) -> bytes:
    """`Entry.pack` as of 127ef83: the field `origin` now uses was reserved and written 0."""
    fields = seg._ENTRY.pack(seg._MAGIC, self.kind, len(self.key), 0, self.seg_id,
                             self.offset, self.length, 0, self.stamp,
                             self.key.encode("ascii"))
    return fields + seg._CHECK.pack(xxhash.xxh3_64_intdigest(fields))


async def test_a_page_moved_by_a_previous_version_compaction_is_still_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer (new) has its page bound with (stamp s, origin o); an instance of the
    previous version compacts the sealed segment and journals the move as (s, origin 0).
    The writer's next look skips the move ((s, o) outranks (s, 0)) and then drops the
    moved-from segment, and with it the key: a page lost, for good in this instance."""
    k = make_keys(1, seed=91)
    async with FileBackend(tmp_path, FMT) as writer, \
            FileBackend(tmp_path, FMT, refresh_interval=0.0) as old:
        assert await writer.set_from(k, pages(k)) == [True]
        writer._appender.close()  # sealed: compactable by another instance
        victim = writer._index.entries[k[0]].seg_id
        await old._refresh(force=True)
        with monkeypatch.context() as m:
            m.setattr(seg.Entry, "pack", _previous_version_pack)
            assert await old._compact(victim)  # moved, journaled as the old version does
        await writer._refresh(force=True)
        assert await read(writer, k) == written(k), "the writer lost its page"
    assert await served_after_restart(tmp_path, k) == written(k)


async def test_a_write_moved_by_a_previous_version_before_it_was_bound_is_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As `test_a_write_moved_by_another_instance_before_it_was_bound_is_served`, with the
    compactor of the previous version: `bind_written` tells its own write moved by an equal
    origin, the move reads as origin 0, so the write was re-bound where it was written
    (removed) and the next look dropped the key."""
    k = make_keys(1, seed=92)
    async with FileBackend(tmp_path, FMT) as writer, \
            FileBackend(tmp_path, FMT, refresh_interval=0.0) as old:
        held = defer_binding_of(k[0], monkeypatch)
        await writer.set_from(k, pages(k))
        writer._appender.close()
        victim = held[0][1][0].seg_id
        await old._refresh(force=True)
        with monkeypatch.context() as m:
            m.setattr(seg.Entry, "pack", _previous_version_pack)
            assert await old._compact(victim)
        await writer._refresh(force=True)  # learns the move
        monkeypatch.undo()
        for run, entries in held:
            real_finish(run, entries)
        await writer._refresh(force=True)
        assert await read(writer, k) == written(k), "the writer lost its page"
    assert await served_after_restart(tmp_path, k) == written(k)
