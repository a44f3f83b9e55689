"""Page allocator: a free stack of page ids plus a used bitmap.

Only the event loop calls it (design rule 1), so it takes no lock. `alloc` and `free` cost
O(k) in the number of pages moved, never O(capacity): double frees and foreign ids are caught
through the bitmap, not by scanning the free list.
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
    which lets transfers coalesce them into one copy.
    """

    __slots__ = ("_free", "_mark", "_name", "_top", "_used")

    def __init__(self, capacity: int, *, name: str = "pool") -> None:
        check_int("capacity", capacity, low=0)
        self._name = name
        # Stack with its top at the end; reversed so the first alloc returns 0, 1, 2, ...
        self._free: PageIds = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._top = capacity
        self._used = np.zeros(capacity, dtype=np.bool_)
        self._mark: npt.NDArray[np.int32] | None = None  # scratch for `_repeats`, on demand

    def __repr__(self) -> str:
        return f"<PageAllocator {self._name}: {self.num_used} used, {self.num_free} free>"

    @property
    def capacity(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    def alloc(self, n: int) -> PageIds | None:
        """Take `n` free pages, or return None (and take nothing) if fewer are free."""
        check_int("n", n, low=0, numpy_ok=True)
        if n > self._top:
            return None
        pages = self._free[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._used[pages] = True
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
        else:
            self.check_allocated(ids)
            if self._repeats(ids):
                raise PageError(f"{self._name}: page ids listed twice in one free")
        self._used[ids] = False
        self._free[self._top:self._top + len(ids)] = ids[::-1]
        self._top += len(ids)

    def _check_few(self, ids: list[int]) -> None:
        """`check_allocated` and the repeat check for a handful of ids, in plain Python:
        each numpy reduction costs about a microsecond however few ids it sees."""
        used, cap = self._used, self.capacity
        for page in ids:
            if not 0 <= page < cap:
                raise PageError(f"{self._name}: page {page} is foreign to a pool of "
                                f"{cap} pages")
            if not used[page]:
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
            used = self._used[ids]
        except IndexError:
            bad = next(int(i) for i in ids if not 0 <= i < self.capacity)
            raise PageError(f"{self._name}: page {bad} is foreign to a pool of "
                            f"{self.capacity} pages") from None
        if np.count_nonzero(used) != len(ids):
            bad = int(ids[np.argmin(used)])
            raise PageError(f"{self._name}: page {bad} is not allocated (double free?)")

    def _repeats(self, ids: PageIds) -> bool:
        """`has_repeats`, in O(k) vectorized steps for long lists: write each id's position
        into a scratch array at the id; a repeated id keeps only its last position."""
        if len(ids) <= _MARK_CHECK:
            return has_repeats(ids)
        if self._mark is None:
            self._mark = np.zeros(self.capacity, dtype=np.int32)
        pos = np.arange(len(ids), dtype=np.int32)
        self._mark[ids] = pos
        return bool((self._mark[ids] != pos).any())

    def is_used(self, ids: PageIds) -> npt.NDArray[np.bool_]:
        return self._used[ids]

    def used_pages(self) -> PageIds:
        """All allocated page ids (O(capacity); for invariant checks only)."""
        return np.flatnonzero(self._used).astype(np.int64)

    def free_pages(self) -> PageIds:
        """The free stack, top last (for invariant checks only)."""
        return self._free[:self._top].copy()


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

_MARK_CHECK = 64
"""Above this many ids, `PageAllocator.free` checks repeats with its scratch array: 6 us
for 256 ids and 12 us for 2,048, against 10 and 58 us with a set."""
