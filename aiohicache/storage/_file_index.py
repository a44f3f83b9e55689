"""The file store's in-memory index: the live record of every key, built from the journals.

Sync and I/O-free: the `FileBackend` changes it on the event loop, then does the I/O it
planned. The journals are the truth; this is what they say, merged (the latest stamp wins
for each key), plus the LRU byte budget and the live bytes of every segment.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Sequence
from operator import attrgetter
from typing import Final, TypeVar

from ._common import LruBudget
from ._journal import DELETE, PUT, TOUCH, Entry, JournalScan

__all__ = ("SegmentIndex",)

T = TypeVar("T")

_DELETED_MEMORY: Final = 1 << 16
"""Delete stamps remembered, so an older entry read later does not bring a key back."""
STEP: Final = 256
"""Records a compaction plans or re-points between two turns of the loop (about 0.3 ms)."""
_GONE_MEMORY: Final = 1 << 12
"""Segments this instance compacted away, remembered so a look at the directory that began
before their files went does not bring them back."""


class SegmentIndex:
    """Every key's live PUT entry, in least-recently-used order within the byte budget.

    `entries` maps key -> entry (O(1)); `keys_of` maps a segment to its keys, so dropping or
    compacting a segment costs its own keys, not the whole index; `budget` orders keys by
    last use; `live` and `sizes` give each segment's live and total bytes, which pick
    compaction victims.
    `on_drop(seg_id)` is called when a segment is found gone (its map is dropped).
    """

    def __init__(self, capacity_bytes: int | None, on_drop: Callable[[int], None]) -> None:
        self.budget = LruBudget(capacity_bytes)
        self.entries: dict[str, Entry] = {}
        """The live PUT entry of every key known."""
        self.keys_of: dict[int, set[str]] = {}
        """Segment id -> the keys bound into it. NOTE: a scan of `entries` for one segment
        held the loop 80 ms per million keys, at every compaction."""
        self.deleted: OrderedDict[str, int] = OrderedDict()
        self.live: dict[int, int] = {}
        """Segment id -> bytes of its records that are live."""
        self.sizes: dict[int, int] = {}
        """Segment id -> bytes in it (as scanned, or as appended by this instance)."""
        self.read_to: dict[int, int] = {}
        """Journal id -> bytes of it read so far."""
        self.last_stamp = 0
        self.may_compact = False
        """A record died since the last look for a compaction victim."""
        self.compacting: set[int] = set()
        """Segments this instance is compacting: a look at the journals that finds them gone
        leaves their keys bound (`repoint` moves them)."""
        self.gone: OrderedDict[int, None] = OrderedDict()
        self.emptied: set[int] = set()
        """Segments this instance sealed holding a journal and no record, and those found
        so at its start with no lock (their writer closed or died): garbage once compacted
        (another instance's size-0 segment may be its active lane: never tried)."""
        self._on_drop = on_drop

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def stamp(self) -> int:
        """Now, in ns since the epoch, later than any stamp this index gave before."""
        self.last_stamp = max(time.time_ns(), self.last_stamp + 1)
        return self.last_stamp

    def stamps(self, num: int) -> int:
        """The first of `num` consecutive stamps, each later than any this index gave
        before (one clock read for a batch)."""
        first = max(time.time_ns(), self.last_stamp + 1)
        self.last_stamp = first + max(num - 1, 0)
        return first

    def bind(self, entry: Entry) -> None:
        """Make `entry` the key's live record (the most recently used)."""
        self.unbind(entry.key)
        self.entries[entry.key] = entry
        self.keys_of.setdefault(entry.seg_id, set()).add(entry.key)
        self.live[entry.seg_id] = self.live.get(entry.seg_id, 0) + entry.length
        end = entry.offset + entry.length
        if self.sizes.get(entry.seg_id, 0) < end:
            self.sizes[entry.seg_id] = end
        self.budget.add(entry.key, entry.length)

    def bind_written(self, entry: Entry) -> bool:
        """Bind a record this instance just wrote, unless a later write or delete of its key
        (its stamp was taken when the write began) came first: then the record is dead on
        arrival, as the journals say too. True if bound.

        A key bound already with the entry's stamp is bound to this very write, moved by
        another instance's compaction (a look merged the move first): it stays there.
        NOTE: re-bound where it was written, the key pointed into the removed segment, and
        the next look dropped it (a stress found the writer missing its own last write).
        """
        current = self.entries.get(entry.key)
        # NOTE: the same stamp and origin: this very write, moved by another instance's
        # compaction, which removed the segment it was written into (not sized again)
        moved = current is not None and current.stamp == entry.stamp and \
            current.origin in (entry.origin, 0)  # 0: moved by an earlier version
        if moved or (current is not None and _outranks(current, entry)) or \
                self.deleted.get(entry.key, -1) > entry.stamp:
            if not moved and entry.seg_id not in self.gone:
                end = entry.offset + entry.length
                self.sizes[entry.seg_id] = max(self.sizes.get(entry.seg_id, 0), end)
            self.may_compact = True
            if current is not None and current.key not in self.budget:
                self.budget.add(current.key, current.length)  # the run took it out
            return False
        self.bind(entry)
        return True

    def unbind(self, key: str) -> Entry | None:
        """Forget `key`'s record (it becomes dead space); the entry it had, if any."""
        old = self.entries.pop(key, None)
        self.budget.pop(key)
        if old is not None:
            if (keys := self.keys_of.get(old.seg_id)) is not None:
                keys.discard(key)
            self.live[old.seg_id] -= old.length
            self.may_compact = True
        return old

    def tombstone(self, old: Entry, *, now: bool = True) -> Entry:
        """The delete entry that kills `old`'s record, and remember it was deleted. Stamped
        now, or (not `now`: a record evicted or found damaged) just after `old`, so a record
        of the key written meanwhile (begun here, or stored by another instance unseen
        here) still wins."""
        stamp = max(self.stamp(), old.stamp + 1) if now else old.stamp + 1
        self.last_stamp = max(self.last_stamp, stamp)
        self.deleted[old.key] = stamp
        self.deleted.move_to_end(old.key)
        while len(self.deleted) > _DELETED_MEMORY:
            self.deleted.popitem(last=False)
        return Entry(old.key, DELETE, old.seg_id, old.offset, old.length, stamp)

    def remove(self, keys: Iterable[str], *, evicted: bool = False) -> list[Entry]:
        """Unbind `keys`; the delete entries to journal for those that were bound. Deleted
        (stamped now), or `evicted` (stamped just after the record evicted: an eviction
        drops that record, not a write of the key already begun, here or elsewhere)."""
        now = not evicted
        return [self.tombstone(old, now=now) for key in keys
                if (old := self.unbind(key)) is not None]

    def apply(self, entry: Entry) -> bool:
        """Merge one entry read from a journal: the latest stamp wins (a touch only moves
        its key in the LRU order, if still bound to the record it read). True if it
        changed the binding."""
        current = self.entries.get(entry.key)
        if entry.kind == TOUCH:
            if current is not None and _same_record(current, entry):
                self.budget.touch(entry.key)
            return False
        # NOTE: stamps given here stay later than any merged (another instance's clock may
        # run ahead, or this machine's clock stepped back since the journals were written)
        self.last_stamp = max(self.last_stamp, entry.stamp)
        if current is not None and (current == entry or (_outranks(current, entry) if
                                                         entry.kind == PUT else
                                                         current.stamp > entry.stamp)):
            return False
        if entry.kind == PUT:
            if current is None and self.deleted.get(entry.key, -1) >= entry.stamp:
                return False
            if entry.seg_id not in self.sizes:  # its segment is gone
                # NOTE: compacted (its record moved, under the same stamp, into a journal
                # this look may not have read yet) or removed: either way the key's record
                # here is older than the journals say. Forgotten, it is a miss until a look
                # binds the move; kept, the older version was served (a stress found it,
                # where a look ran out of passes while compactions went on)
                if current is not None and _outranks(entry, current):
                    self.unbind(entry.key)
                    return True
                return False
            self.bind(entry)
            return True
        self.deleted[entry.key] = max(entry.stamp, self.deleted.get(entry.key, -1))
        return self.unbind(entry.key) is not None

    def load(self, scan: JournalScan) -> int:
        """Build the index from a full scan: entries in stamp order, so the last one wins
        and the budget's LRU order is the order of last use. Returns the torn entries
        (records past their segment's end) it dropped."""
        self.sizes = dict(scan.segments)
        self.read_to = dict(scan.read_to)
        torn = 0
        segments = scan.segments
        for entry in scan.in_stamp_order():
            if entry.kind == PUT and entry.seg_id in segments and \
                    entry.offset + entry.length > segments[entry.seg_id]:
                torn += 1
                continue  # the record never landed whole: the older one is the latest
            self.apply(entry)  # (its segment gone: the key's older record is forgotten)
        return torn

    def merge_segments(self, scan: JournalScan, before: set[int], newest: int) -> list[int]:
        """Begin merging what other processes journaled since the last look: the segments;
        the caller then `apply`s the scan's entries in stamp order, the latest `newest`,
        and last `drop_segment`s each of the segments returned: those of `before` (known
        when the look began) that are gone, compacted or removed.

        Entries naming a gone segment are not merged from now on, but the keys bound into
        one stay bound until it is dropped. NOTE: dropped first, a key moved out of it was
        unbound until the chunk holding its move came, and a read meanwhile missed it (the
        merge lets the loop run between chunks; found by a stress). Bound, a read finds the
        segment gone and looks again once the merge has ended.

        NOTE: stamps given from now on are later than any of the scan's, as if its entries
        were all merged already: the caller may apply them a chunk at a time, and a write or
        delete made meanwhile must outrank them, as it would after a merge made at once.
        """
        for seg_id, size in scan.segments.items():
            if seg_id not in self.gone:  # listed before this instance removed it
                self.sizes[seg_id] = max(size, self.sizes.get(seg_id, 0))
        gone = list(before - set(scan.segments) - self.compacting)
        for seg_id in gone:
            self.sizes.pop(seg_id, None)
        self.read_to = scan.read_to
        self.last_stamp = max(self.last_stamp, newest)
        return gone

    def drop_segment(self, seg_id: int) -> None:
        """Forget a segment that is gone, and every key bound into it."""
        self._on_drop(seg_id)
        for key in self.keys_of.pop(seg_id, ()):
            self.unbind(key)
        self.sizes.pop(seg_id, None)
        self.live.pop(seg_id, None)
        self.read_to.pop(seg_id, None)
        self.emptied.discard(seg_id)

    def add_emptied(self, seg_ids: Iterable[int]) -> bool:
        """Note segments this instance sealed holding only a journal; True if any."""
        added = False
        for seg_id in seg_ids:
            if seg_id not in self.gone:
                self.sizes.setdefault(seg_id, 0)
                self.emptied.add(seg_id)
                self.may_compact = added = True
        return added

    def pick_victim(self, skip: Callable[[int], bool], dead_fraction: float, *,
                    empty_only: bool = False) -> int | None:
        """The segment with the most dead bytes, if at least `dead_fraction` of it is dead
        and not `skip(seg_id)`; else one of `emptied` (least urgent: a few MiB of
        entries). `empty_only`: only one of those."""
        best, most = None, 0
        for seg_id, size in self.sizes.items():
            dead = size - self.live.get(seg_id, 0) if size else int(seg_id in self.emptied)
            if dead <= 0 or dead < dead_fraction * size or dead <= most or skip(seg_id) or \
                    (empty_only and size):
                continue
            best, most = seg_id, dead
        return best

    def compaction_plan(self, victim: int, log: Sequence[Entry], unseen: Sequence[Entry]
                        ) -> tuple[list[Entry], list[Entry]]:
        """`plan_steps` at once, its moves in file order (for tests and tools)."""
        moves, keep = _run(self.plan_steps(victim, log, unseen))
        return sorted(moves, key=attrgetter("offset")), keep

    def plan_steps(self, victim: int, log: Sequence[Entry], unseen: Sequence[Entry]
                   ) -> Generator[None, None, tuple[list[Entry], list[Entry]]]:
        """What compacting `victim` moves (its live records, in no order) and keeps (the
        entries of its journal `log` that must outlive it), `STEP` records a step.

        `unseen`, the entries of `log` this index has not read (its writer appended them
        since the last look), are merged first: their records are moved too, not lost with
        the segment. (Not the whole log: a key deleted long ago, its delete forgotten,
        would come back.)

        NOTE: in steps (32k records per segment held the loop 13 ms), so the index may
        change between them, by this instance's writes and deletes only (the caller holds
        `_merging`): a record planned and then unbound is moved dead (`repoint` leaves it),
        an entry kept and then outranked is kept harmlessly, as for any change made while
        the records are copied.
        """
        learned = [e.key for e in sorted(unseen, key=lambda e: e.stamp)
                   if self.apply(e) and e.kind == PUT]
        # NOTE: unread here, so least recently used: the next write evicts them before the
        # pages this instance reads (merged as most recent, they pushed those out)
        self.budget.make_oldest(learned)
        keys, get = list(self.keys_of.get(victim, ())), self.entries.get
        moves: list[Entry] = []
        for lo in range(0, len(keys), STEP):
            if lo:
                yield
            moves += [e for e in map(get, keys[lo:lo + STEP])
                      if e is not None and e.seg_id == victim]
        # NOTE: a segment with no record was rolled for its touches: carried, they would
        # fill the next journal as fast, so they go with it (its deletes are carried)
        touches = self.sizes.get(victim, 0) > 0
        keep: list[Entry] = []
        for lo in range(0, len(log), STEP):
            yield
            keep += [e for e in log[lo:lo + STEP]
                     if (touches or e.kind != TOUCH) and self._still_says(e, victim)]
        return moves, _last_touches(keep)

    def _still_says(self, entry: Entry, victim: int) -> bool:
        """Whether `entry`, of the victim's journal, must outlive it: a delete that still
        wins (even of a record in the victim: an older record of the key may live on in
        another segment), or a binding or touch of a live record elsewhere."""
        if entry.kind == DELETE:
            return self.deleted.get(entry.key) == entry.stamp
        if entry.seg_id == victim or entry.seg_id not in self.sizes:
            return False
        current = self.entries.get(entry.key)
        if entry.kind == PUT:
            return current == entry
        return current is not None and _same_record(current, entry)

    def repoint(self, victim: int, moves: Sequence[Entry], moved: Sequence[Entry]) -> None:
        """`repoint_steps` at once."""
        _run(self.repoint_steps(victim, moves, moved))

    def repoint_steps(self, victim: int, moves: Sequence[Entry], moved: Sequence[Entry]
                      ) -> Generator[None, None, None]:
        """Re-point the keys compaction moved (same LRU place and size), `STEP` a step, then
        drop `victim`. A key still bound to the record moved is re-pointed, matched by place
        (an older version's reader journals a read as a binding with a newer stamp).

        NOTE: between steps a key not re-pointed yet is bound into the removed victim: a
        read of it finds the segment gone and looks again, which waits for `_merging`
        (the caller holds it until the last step)."""
        for lo in range(0, len(moves), STEP):
            if lo:
                yield
            for old, new in zip(moves[lo:lo + STEP], moved[lo:lo + STEP], strict=True):
                now = self.entries.get(old.key)
                if now is not None and _same_record(now, old):
                    self.entries[old.key] = new._replace(stamp=max(now.stamp, new.stamp))
                    self.keys_of[victim].discard(old.key)
                    self.keys_of.setdefault(new.seg_id, set()).add(old.key)
                    self.live[victim] -= old.length
                    self.live[new.seg_id] = self.live.get(new.seg_id, 0) + new.length
                    self.sizes[new.seg_id] = max(self.sizes.get(new.seg_id, 0),
                                                 new.offset + new.length)
        self.drop_segment(victim)
        self.gone[victim] = None
        while len(self.gone) > _GONE_MEMORY:
            self.gone.popitem(last=False)


def _run(steps: Generator[None, None, T]) -> T:
    """All of `steps` at once; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def _outranks(a: Entry, b: Entry) -> bool:
    """Whether PUT `a` wins over PUT `b`: the later stamp, and on a tie (two instances
    that merged the same newest stamp stamp alike) the greater origin, as everywhere.

    Of two entries of one write (the same stamp and origin), the one moved more wins: the
    record's latest place.

    NOTE: origin 0 is unknown (an entry journaled by an earlier version, a compaction's
    move included): it neither wins nor loses a tie, so the entry applied later wins, as
    before origins. Taken as the least origin, an earlier version's move of a page lost
    the tie to the record it moved, and the page went with the moved-from segment."""
    if a.stamp != b.stamp:
        return a.stamp > b.stamp
    if a.origin != b.origin:
        return 0 < b.origin < a.origin
    return a.moves > b.moves  # one write, moved: the place it was moved to last


def _same_record(a: Entry, b: Entry) -> bool:
    return a.seg_id == b.seg_id and a.offset == b.offset


def _last_touches(entries: list[Entry]) -> list[Entry]:
    """`entries` less the touches of a key that a later touch of it outranks (only the last
    orders it: a key read 40 times was carried 40 times)."""
    last: dict[str, int] = {}
    for i, e in enumerate(entries):
        if e.kind == TOUCH and (e.key not in last or entries[last[e.key]].stamp <= e.stamp):
            last[e.key] = i
    return [e for i, e in enumerate(entries) if e.kind != TOUCH or last[e.key] == i]
