"""The future of a trace, for Belady's offline optimum (``--eviction opt``): when each page is
next used.

A replay knows every request to come, so it can tell `radix.Belady` when the page a node ends
with is used again. Pages are named by their whole prefix: the requests are rewritten so that
a block's hash id becomes the id of its prefix (the chain of hash ids up to it), which keeps
prefix sharing exactly as it was and lets a token alone say which prefix and page it ends.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import replace

from ..errors import ConfigError
from ..radix import NEVER
from .traces import Request

__all__ = ("FutureUses",)


class FutureUses:
    """When each page of `requests` is next used, as seen from request `now`.

    Build it, replay `requests` (the rewritten ones, in order) and set `now` to the index of
    the request being served before serving it.

    Args:
        requests: the trace, in the order it is replayed.
        page_size: tokens per page of the cache (only whole pages of a prompt are used).

    Raises:
        ConfigError: the requests do not all have the same block size.
    """

    def __init__(self, requests: Sequence[Request], page_size: int) -> None:
        sizes = {r.block_size for r in requests}
        if len(sizes) > 1:
            raise ConfigError(f"eviction: 'opt' needs one block size, the trace has "
                              f"{sorted(sizes)}")
        self.block_size = sizes.pop() if sizes else 1
        self.now = -1
        """Index of the request being served: uses up to it are past."""
        self._prefix_ids: dict[tuple[int, int], int] = {}
        self._uses: list[list[int]] = []
        """Per prefix id: the requests (indices, ascending) that use some of its block."""
        self._covered: list[list[int]] = []
        """Per prefix id and use: how many tokens of the block the request's pages cover."""
        self.requests = [self._add(i, r, page_size) for i, r in enumerate(requests)]
        """`requests` with each hash id replaced by its prefix id."""

    def _add(self, index: int, request: Request, page_size: int) -> Request:
        size, parent = self.block_size, -1
        cached_tokens = request.input_length // page_size * page_size
        chain: list[int] = []
        for k, hash_id in enumerate(request.hash_ids):
            prefix = self._prefix_ids.get((parent, hash_id))
            if prefix is None:
                prefix = self._prefix_ids[parent, hash_id] = len(self._uses)
                self._uses.append([])
                self._covered.append([])
            covered = min(size, cached_tokens - k * size)
            if covered > 0:
                self._uses[prefix].append(index)
                self._covered[prefix].append(covered)
            chain.append(prefix)
            parent = prefix
        return replace(request, hash_ids=tuple(chain))

    def next_use(self, token: int) -> int:
        """The first request after `now` whose whole pages include the page that ends with
        `token` (a token of the rewritten requests), or `NEVER`.

        O(log uses) plus the uses in between that stop short of the page (only a request's
        last block can).
        """
        prefix, offset = divmod(token, self.block_size)
        uses, covered = self._uses[prefix], self._covered[prefix]
        i = bisect_right(uses, self.now)
        while i < len(uses) and covered[i] <= offset:
            i += 1
        return uses[i] if i < len(uses) else NEVER
