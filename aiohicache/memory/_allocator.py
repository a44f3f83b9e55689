"""Page allocator: a free stack of page ids plus a per-page state (allocated or free).

Only the event loop calls it (design rule 1), so it takes no lock. `alloc` and `free` cost
O(k) in the number of pages moved, never O(capacity): double frees and foreign ids are caught
through the page states, not by scanning the free list.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._validate import check_int
from ..errors import PageError

__all__ = ("PageAllocator", "PageIds")

PageIds = npt.NDArray[np.int64]


class PageAllocator:
    """Hands out page ids ``0..capacity-1``.

    NOTE: the free list is a LIFO stack. Freed pages are pushed so that the next `alloc` of
    the same size returns them in the same order: runs that were contiguous stay contiguous,
    which lets transfers coalesce them into one copy. Its top lies first in memory, so a
    push and a pop copy a run forwards (a reversed run was copied element by element).
    """

    __slots__ = ("_free", "_name", "_stamps", "_state", "_top")

    def __init__(self, capacity: int, *, name: str = "pool") -> None:
        check_int("capacity", capacity, low=0)
        self._name = name
        # The stack is the last `_top` ids, its top first: the first alloc returns 0, 1, 2, ...
        self._free: PageIds = np.arange(capacity, dtype=np.int64)
        self._top = capacity
        # Per page: 0 while allocated, else (free) not 0. A long `free` stamps its ids with
        # their positions (from 1) and reads them back: a repeated id kept one stamp only.
        # NOTE: one array for both: a used bitmap and a scratch array of stamps read two
        # arrays for every long free, and wrote the bitmap once more
        self._state = np.ones(capacity, dtype=np.int32)
        self._stamps = np.arange(1, 1, dtype=np.int32)  # 1, 2, 3, ...: grown on demand

    def __repr__(self) -> str:
        return f"<PageAllocator {self._name}: {self.num_used} used, {self.num_free} free>"

    @property
    def capacity(self) -> int:
        return len(self._state)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    def alloc(self, n: int) -> PageIds | None:
        """Take `n` free pages, or return None (and take nothing) if fewer are free."""
        if type(n) is not int or n < 0:  # (the check's call costs more than the test)
            check_int("n", n, low=0, numpy_ok=True)
        if n > self._top:
            return None
        start = len(self._free) - self._top
        pages = self._free[start:start + n].copy()
        self._top -= n
        self._state[pages] = 0
        return pages

    def free(self, pages: npt.ArrayLike) -> None:
        """Give `pages` back. Nothing is freed if any id is foreign, free or repeated.

        Raises:
            PageError: an id is not an integer, outside the pool, not allocated, or listed
                twice.
        """
        arr = np.asarray(pages)
        if arr.size == 0:
            return
        if arr.dtype.kind not in "iu":  # a cast would turn 0.9 or True into another page
            raise PageError(f"{self._name}: page ids must be integers, got {arr.dtype}")
        ids = arr.astype(np.int64, copy=False).reshape(-1)
        if len(ids) <= _SCALAR_CHECK:
            self._check_few(ids.tolist())
            self._state[ids] = 1
        else:
            self._release(ids)
        start = len(self._free) - self._top
        self._free[start - len(ids):start] = ids
        self._top += len(ids)

    def _check_few(self, ids: list[int]) -> None:
        """`check_allocated` and the repeat check for a handful of ids, in plain Python:
        each numpy reduction costs about a microsecond however few ids it sees."""
        state, cap = self._state, self.capacity
        for page in ids:
            if not 0 <= page < cap:
                raise PageError(f"{self._name}: page {page} is foreign to a pool of "
                                f"{cap} pages")
            if state[page]:
                raise PageError(f"{self._name}: page {page} is not allocated (double free?)")
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise PageError(f"{self._name}: page ids listed twice in one free")

    def check_allocated(self, ids: PageIds) -> None:
        """Raise `PageError` unless every id in `ids` is a currently allocated page."""
        # NOTE: one gather checks the upper bound (IndexError), a ufunc reduce the lower
        # (numpy would wrap a negative index); no `min`/`max`/`all`, whose Python wrappers
        # cost more than the work here (7 % of a two-tier replay's loop time in all)
        try:
            if np.minimum.reduce(ids) < 0:
                raise IndexError
            state = self._state[ids]
        except IndexError:
            bad = next(int(i) for i in ids if not 0 <= i < self.capacity)
            raise PageError(f"{self._name}: page {bad} is foreign to a pool of "
                            f"{self.capacity} pages") from None
        if np.count_nonzero(state):
            bad = int(ids[np.flatnonzero(state)[0]])
            raise PageError(f"{self._name}: page {bad} is not allocated (double free?)")

    def _release(self, ids: PageIds) -> None:
        """Mark `ids` (more than a handful) free, once checked: allocated, none repeated."""
        self.check_allocated(ids)
        if len(ids) <= _STAMP_CHECK:
            if has_repeats(ids):
                raise PageError(f"{self._name}: page ids listed twice in one free")
            self._state[ids] = 1
            return
        if len(self._stamps) < len(ids):  # kept: a new range each call cost more
            size = max(len(ids), 2 * len(self._stamps))
            self._stamps = np.arange(1, size + 1, dtype=np.int32)
        stamps = self._stamps[:len(ids)]
        self._state[ids] = stamps
        # (count_nonzero, not .any(): the same pass without numpy's Python-level wrapper)
        if np.count_nonzero(self._state[ids] != stamps):
            self._state[ids] = 0  # all were allocated (checked): as they were
            raise PageError(f"{self._name}: page ids listed twice in one free")

    def is_used(self, ids: PageIds) -> npt.NDArray[np.bool_]:
        used: npt.NDArray[np.bool_] = self._state[ids] == 0
        return used

    def used_pages(self) -> PageIds:
        """All allocated page ids (O(capacity); for invariant checks only)."""
        return np.flatnonzero(self._state == 0).astype(np.int64)

    def free_pages(self) -> PageIds:
        """The free stack, top last (for invariant checks only)."""
        return self._free[len(self._free) - self._top:][::-1].copy()


def has_repeats(ids: PageIds) -> bool:
    if len(ids) <= _SET_CHECK:
        # NOTE: a set, not np.sort: sorting releases the GIL, and on a loaded machine getting
        # it back from the copy threads cost the loop up to 11 ms (bench core, 2 cores).
        return len(set(ids.tolist())) != len(ids)
    ordered = np.sort(ids)  # cheap: ids usually arrive sorted
    return bool((ordered[1:] == ordered[:-1]).any())


_SCALAR_CHECK = 8
"""Up to this many ids, `PageAllocator.free` checks them one by one (2-3x faster)."""

_SET_CHECK = 4096
"""Up to this many ids, `has_repeats` checks with a set (microseconds, GIL held)."""

_STAMP_CHECK = 64
"""Above this many ids, `PageAllocator.free` checks repeats with stamps in the page states:
6 us for 256 ids and 12 us for 2,048, against 10 and 58 us with a set."""
