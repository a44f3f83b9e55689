"""Eviction policies: the order in which one tier's unpinned leaves leave it.

Each tier of a `RadixTree` owns one policy. The tree offers every node that becomes a
candidate (an unpinned leaf of that tier) and pops victims; the policy decides the order.
Policies are synchronous and I/O-free like the tree, and no operation scans the tree.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from ._node import Node
from ._results import Keys, common_tokens, compact, page_bytes

__all__ = ("ARC", "LFU", "LRU", "NEVER", "Belady", "EvictionPolicy", "PolicyName",
           "make_policy")

PolicyName = Literal["lru", "lfu", "arc"]
"""Online policies a tree builds by name (Belady's needs the future: `Belady`)."""

NEVER = 1 << 62
"""`Belady`'s next use of a page no later request uses."""

_Entry = tuple[tuple[int, ...], int, Node]

_MIGRATE_STEP = 16
"""Entries `compact` moves per push or pop: it ends long before the next one is due (that
takes 3 entries per node pushed)."""


class EvictionPolicy:
    """Orders one tier's candidates in lazy min-heaps, one per class: smallest key first.

    Subclasses define `key` (the order within a class), and may split candidates into
    classes (`cls`) and choose the class the next victim comes from (`order`). An entry goes
    stale when its node's key or class changes or the node stops being a candidate; `pop`
    discards those, so push and pop are O(log n) and nothing is ever removed from the middle.
    The tree calls the ``on_*`` hooks; the base class ignores them.
    """

    name: ClassVar[str] = ""
    num_classes: ClassVar[int] = 1
    counts_pages: ClassVar[bool] = False
    """Whether the tree must report pages joining and leaving the tier (`on_resident`)."""
    learns_from_misses: ClassVar[bool] = False
    """Whether the tree must report what a request wanted and the tier lacked (`on_miss`)."""

    def __init__(self) -> None:
        self._heaps: list[list[_Entry]] = [[] for _ in range(self.num_classes)]
        self._old: list[list[_Entry]] | None = None
        """Heaps being drained into `_heaps` by `compact`, a few entries per push and pop."""
        self._keep: Callable[[Node], bool] | None = None
        """While `_old` is set: whether a node's entries are kept."""

    def key(self, node: Node) -> tuple[int, ...]:
        raise NotImplementedError

    def cls(self, node: Node) -> int:
        return 0

    def order(self) -> Sequence[int]:
        """Classes in the order the next victim is looked for."""
        return range(self.num_classes)

    def tail_run(self, node: Node) -> int:
        """Pages that may leave together from the tail of victim `node` (the tree splits off
        the rest, which becomes a candidate of its own)."""
        return node.num_pages

    # -- the heaps ---------------------------------------------------------------------------

    def push(self, node: Node) -> None:
        # (one class: its heap, without asking `cls`)
        heap = self._heaps[0] if self.num_classes == 1 else self._heaps[self.cls(node)]
        heapq.heappush(heap, (self.key(node), node.id, node))
        if self._old is not None:
            self._migrate()

    def pop(self, is_candidate: Callable[[Node], bool]) -> Node | None:
        """The next victim among candidates, or None; stale entries on the way are dropped."""
        if self._old is not None:
            self._migrate()
        for c in self.order():
            # (not compacting: the class's heap, without asking `_smaller_top`)
            while heap := (self._heaps[c] if self._old is None else self._smaller_top(c)):
                key, _, node = heapq.heappop(heap)
                if is_candidate(node) and self._current(node, c, key):
                    return node
        return None

    def _smaller_top(self, c: int) -> list[_Entry] | None:
        """Class `c`'s heap whose first entry comes first (old or new), None if both empty."""
        new = self._heaps[c]
        old = self._old[c] if self._old is not None else None
        if not old:
            return new or None
        return old if not new or old[0][:2] < new[0][:2] else new

    def _current(self, node: Node, c: int, key: tuple[int, ...]) -> bool:
        return (self.num_classes == 1 or self.cls(node) == c) and key == self.key(node)

    def compact(self, keep: Callable[[Node], bool]) -> None:
        """Drop the stale entries (and those of nodes not `keep`), a few per push and pop.

        NOTE: at once, walking every node held the loop 193 ms at 100k nodes, recurring
        under steady traffic. The heaps are set aside as they are and drained from their
        ends (what stays is still a heap), the current entries pushed into fresh ones;
        meanwhile `pop` takes the smaller of the two tops, so the order is unchanged.
        """
        if self._old is None:
            self._old, self._keep = self._heaps, keep
            self._heaps = [[] for _ in range(self.num_classes)]

    def _migrate(self) -> None:
        assert self._old is not None and self._keep is not None
        keep, budget = self._keep, _MIGRATE_STEP
        for c, old in enumerate(self._old):
            while old and budget:
                budget -= 1
                key, _, node = entry = old.pop()
                if keep(node) and self._current(node, c, key):
                    heapq.heappush(self._heaps[c], entry)
            if not budget:
                return
        self._old = None

    def rebuild(self, candidates: Iterable[Node]) -> None:
        """Drop every entry and queue exactly `candidates` (O(n): a new policy, once)."""
        self._heaps = [[] for _ in range(self.num_classes)]
        self._old = None
        for node in candidates:
            self._heaps[self.cls(node)].append((self.key(node), node.id, node))
        for heap in self._heaps:
            heapq.heapify(heap)

    @property
    def num_entries(self) -> int:
        return sum(map(len, self._heaps)) + sum(map(len, self._old or ()))

    @property
    def compacting(self) -> bool:
        """Stale entries are being dropped (`compact`)."""
        return self._old is not None

    def queued(self) -> set[int]:
        """Ids of nodes with a current entry (for checks: O(entries))."""
        return {node.id for heaps in (self._heaps, self._old or []) for c, heap in
                enumerate(heaps) for key, _, node in heap if self._current(node, c, key)}

    # -- hooks -------------------------------------------------------------------------------

    def on_resident(self, node: Node, pages: int) -> None:
        """`pages` pages of `node` joined (> 0) or left (< 0) the tier, or changed class
        (the tree reports them leaving and joining again around a hit)."""

    def on_evict(self, node: Node) -> None:
        """Victim `node` (all of its pages) leaves the tier; `node.parent` stays."""

    def on_miss(self, after: Node, tokens: Keys, pos: int) -> None:
        """A request wanted the whole pages of `tokens` from `pos` on, right after `after`
        (a node or the root), and the tier had none of them."""

    def widen(self) -> None:
        """The tree's keys became int64 (`TreeState.keys`): tokens kept from them, and
        dict keys made of their bytes, must be widened too."""

    def problem(self, resident: Iterable[Node]) -> str:
        """What is wrong with the policy's own bookkeeping given the tier's nodes, or ""."""
        return ""


class LRU(EvictionPolicy):
    """Least recently used first; equal recency: the older node first."""

    name = "lru"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.last_access,)


class LFU(EvictionPolicy):
    """Least frequently used first (hits since insert), then least recently used."""

    name = "lfu"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.hit_count, node.last_access)


@dataclass(slots=True)
class _Ghost:
    """Pages a victim took with it: how many, its class then, its id (the parent of the
    ghost that continues the prefix) and its tokens (which of its pages a request wants)."""

    num_pages: int
    cls: int
    node_id: int
    key: Keys


class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03) on a prefix tree.

    Class 0 (ARC's T1) holds nodes hit at most once, i.e. inserted and not matched since;
    class 1 (T2) nodes matched again. Each class is LRU. Victims come from class 0 while it
    holds more than `target` pages, else from class 1 (either way the other when the first
    has no candidate). Victims leave ghosts, keyed by (parent id, first page): a later
    request that misses exactly those pages after that parent is evidence that their class
    deserved more room, and moves `target` towards it by ``STEP * max(1, other ghosts /
    these ghosts)`` pages per page missed. Ghosts hold at most ``GHOSTS * capacity`` pages,
    oldest dropped first.

    NOTE: ARC's constants are a target starting at 0, STEP = 1 and GHOSTS = 1. In a prefix
    cache one request can miss a whole conversation's ghost pages at once, and each such
    event swings the target across the cache; a target started low also takes most of a
    long trace to rise. With ARC's step and ghosts `arc` fell up to 0.007 below LRU on the
    traces of docs/eviction.md; with a target starting at 3/4 of the capacity, STEP = 1/4
    and GHOSTS = 1/2 (evidence from recent evictions only), no more than 0.001. The values
    were chosen on those traces.

    Cost: push/pop O(log n); a miss looks up one ghost per evicted run it walks down (O(1)
    each, dict, then a compare of the run's tokens); `on_resident` O(1). Ghosts keep their
    victims' tokens (4 bytes a token, 8 in a widened tree; at most ``GHOSTS * capacity``
    pages of them).
    """

    name = "arc"
    num_classes = 2
    counts_pages = True
    learns_from_misses = True
    START: ClassVar[float] = 0.75
    STEP: ClassVar[float] = 0.25
    GHOSTS: ClassVar[float] = 0.5

    def __init__(self, capacity: int, page_size: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.page_size = page_size
        self.target = self.START * capacity
        """Pages class 0 may hold before it gives up victims first (ARC's p)."""
        self.recent_pages = 0
        """Pages of class-0 nodes on the tier (ARC's |T1|), pinned ones included."""
        self._ghosts: OrderedDict[tuple[int, bytes], _Ghost] = OrderedDict()
        self.ghost_pages = [0, 0]

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.last_access,)

    def cls(self, node: Node) -> int:
        return 0 if node.hit_count < 2 else 1

    def order(self) -> Sequence[int]:
        return (0, 1) if self.recent_pages > self.target else (1, 0)

    def on_resident(self, node: Node, pages: int) -> None:
        if node.hit_count < 2:
            self.recent_pages += pages

    def on_evict(self, node: Node) -> None:
        assert node.parent is not None
        where = (node.parent.id, node.key[:self.page_size].tobytes())
        old = self._ghosts.pop(where, None)
        if old is not None:
            self.ghost_pages[old.cls] -= old.num_pages
        # (compact: a trimmed victim's key is a view of its whole key before the trim)
        ghost = self._ghosts[where] = _Ghost(node.num_pages, self.cls(node), node.id,
                                             compact(node.key))
        self.ghost_pages[ghost.cls] += ghost.num_pages
        while self.ghost_pages[0] + self.ghost_pages[1] > self.GHOSTS * self.capacity:
            _, gone = self._ghosts.popitem(last=False)
            self.ghost_pages[gone.cls] -= gone.num_pages

    def on_miss(self, after: Node, tokens: Keys, pos: int) -> None:
        ps, parent_id, dtype = self.page_size, after.id, after.key.dtype
        end = len(tokens) - len(tokens) % ps
        while pos < end:
            where = (parent_id, page_bytes(tokens[pos:pos + ps], dtype))
            ghost = self._ghosts.get(where)
            if ghost is None:
                return
            # NOTE: only the pages the request wants: one that shares a ghost's first page
            # and then goes elsewhere missed one page of it, not the ghost's length
            wanted = common_tokens(ghost.key, tokens, pos, end) // ps
            if not wanted:  # ids beyond int32 keys, wrapped to its first page: not it
                return
            del self._ghosts[where]
            self.ghost_pages[ghost.cls] -= ghost.num_pages
            self._adapt(ghost.cls, wanted)
            if wanted < ghost.num_pages:
                return
            pos += ghost.num_pages * ps
            parent_id = ghost.node_id

    def widen(self) -> None:
        ghosts = [(parent_id, ghost) for (parent_id, _), ghost in self._ghosts.items()]
        self._ghosts = OrderedDict()
        for parent_id, ghost in ghosts:  # (oldest first, as they were)
            ghost.key = ghost.key.astype(np.int64)
            self._ghosts[parent_id, ghost.key[:self.page_size].tobytes()] = ghost

    def _adapt(self, cls: int, num_pages: int) -> None:
        these, other = self.ghost_pages[cls] + num_pages, self.ghost_pages[1 - cls]
        step = self.STEP * num_pages * max(1.0, other / these)
        if cls == 0:
            self.target = min(float(self.capacity), self.target + step)
        else:
            self.target = max(0.0, self.target - step)

    def problem(self, resident: Iterable[Node]) -> str:
        counted = sum(n.num_pages for n in resident if n.hit_count < 2)
        if counted != self.recent_pages:
            return f"arc: {self.recent_pages} class-0 pages counted, {counted} resident"
        return ""


class Belady(EvictionPolicy):
    """Belady's MIN: the leaf whose next use lies furthest in the future first.

    Offline: `next_use(token)` must say when the page that ends with `token` is next used
    (a request index, `NEVER` if not again), which only a replay of a known trace can. A
    node's key is its last page's next use. Pages of a node are used as prefixes, so their
    next uses never decrease towards the tail; `tail_run` lets only the tail pages that share
    the last page's next use leave in one step, so victims leave page by page in exact MIN
    order.
    """

    name = "opt"

    def __init__(self, next_use: Callable[[int], int], page_size: int) -> None:
        super().__init__()
        self.next_use = next_use
        self.page_size = page_size

    def key(self, node: Node) -> tuple[int, ...]:
        return (-self.next_use(int(node.key[-1])),)

    def tail_run(self, node: Node) -> int:
        ps, keys = self.page_size, node.key
        last = self.next_use(int(keys[-1]))
        lo, hi = 0, node.num_pages - 1  # the first page that is next used with the last one
        while lo < hi:
            mid = (lo + hi) // 2
            if self.next_use(int(keys[(mid + 1) * ps - 1])) == last:
                hi = mid
            else:
                lo = mid + 1
        return node.num_pages - lo


def make_policy(name: str, *, capacity: int, page_size: int) -> EvictionPolicy:
    """The online policy called `name` for a tier of `capacity` pages.

    Raises:
        ValueError: no online policy has that name.
    """
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "arc":
        return ARC(capacity, page_size)
    raise ValueError(f"unknown eviction policy {name!r}")
