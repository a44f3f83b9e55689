"""Device pages leased to requests: from `allocate` until `commit` takes them or `free`."""

from __future__ import annotations

import numpy as np

from .errors import PageError
from .memory import PageAllocator, PageIds
from .memory._allocator import has_repeats

__all__ = ("ANONYMOUS", "FREEING", "Leases")

ANONYMOUS = -1
"""The owner of pages leased by `HiCache.allocate` (no fetch context)."""

FREEING = -2
"""The owner of pages `HiCache.free` gave back whose release waits for the next TP tick: no
longer the caller's to commit, continue or free again, not yet the pool's to hand out."""


class Leases:
    """Which owner (a fetch context's id, or `ANONYMOUS`) holds each device page; 0 = none.

    A numpy array indexed by page id: checks of a whole batch of pages are vectorised.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.owner = np.zeros(allocator.capacity, dtype=np.int64)
        self.count = 0
        """Pages leased, all owners."""
        self.handed = np.zeros(allocator.capacity, dtype=np.int32)
        """Slots of each page `HiCache.allocate` leased that it handed out (the last page of
        a lease for a number of tokens that is not whole pages has fewer). Read only when a
        commit adopts such a page; a context's own partial page is tracked by its
        `Request.tail`, which later allocates move on, so for its pages this stays ``ps``."""
        self.serial = np.zeros(allocator.capacity, dtype=np.int64)
        """The lease each page is in, numbered: a page freed and leased again (to anyone,
        its old owner too) is in another lease, so a note about the old one is stale."""
        self._leases_made = 0

    def lease(self, pages: PageIds, owner: int, *, last_used: int | None = None) -> None:
        """Lease `pages` to `owner`, every slot handed out but the last page's past
        `last_used` (None: all of them)."""
        self.owner[pages] = owner
        self.count += len(pages)
        self._leases_made += 1
        self.serial[pages] = self._leases_made
        self.handed[pages] = self.page_size
        if last_used is not None and len(pages):
            self.handed[pages[-1]] = last_used

    def holds(self, page: int, owner: int, serial: int) -> bool:
        """Whether `owner` still holds `page` in the lease numbered `serial`."""
        return bool(self.owner[page] == owner and self.serial[page] == serial)

    def check(self, pages: PageIds, *, freeing: bool = False) -> None:
        """Raise `PageError` unless every page is leased, once (with `freeing`: by a free
        waiting for its tick; else to a user, not freed)."""
        owners = self.owner[pages]
        leased = owners == FREEING if freeing else (owners != 0) & (owners != FREEING)
        if not leased.all() or (len(pages) > 1 and has_repeats(pages)):
            raise PageError("slots: pages not leased by allocate() (double free or foreign)")

    def check_owner(self, pages: PageIds, owner: int) -> None:
        """Raise `PageError` unless every page is leased to `owner` or anonymously, once."""
        owners = self.owner[pages]
        if len(pages) and not ((owners == owner) | (owners == ANONYMOUS)).all():
            raise PageError("slots: not leased by allocate() of this context or of the cache "
                            "(already committed, freed, or another request's?)")
        if len(pages) > 1 and has_repeats(pages):
            raise PageError("slots: name a page twice (each page of a commit once, in order)")

    def mark_freeing(self, pages: PageIds) -> None:
        """`pages` (checked) are being freed at the next tick: nobody may use them until then."""
        self.check(pages)
        self.owner[pages] = FREEING

    def release(self, pages: PageIds, *, free: bool, freeing: bool = False) -> None:
        """End the leases of `pages` (with `freeing`: those `mark_freeing` took); with
        `free`, give the pages back to the pool."""
        if len(pages) == 0:
            return
        self.check(pages, freeing=freeing)
        self.owner[pages] = 0
        self.count -= len(pages)
        if free:
            self.allocator.free(pages)

    def release_owned(self, pages: PageIds, owner: int) -> None:
        """Free those of `pages` still leased to `owner` (the user may have freed some)."""
        self.release(pages[self.owner[pages] == owner], free=True)

    def owned(self, pages: PageIds, owner: int) -> PageIds:
        owned: PageIds = pages[self.owner[pages] == owner]
        return owned

    def num_held(self, pages: PageIds, owner: int) -> int:
        """How many distinct `pages` are still leased to `owner` or being freed (TP: a free
        takes effect at its tick, so every rank counts them alike until then)."""
        owners = self.owner[np.unique(pages)]
        return int(np.count_nonzero((owners == owner) | (owners == FREEING)))

    def leased_pages(self) -> PageIds:
        return np.flatnonzero(self.owner != 0)
