"""What the radix tree's queries return: matches, insert results, eviction reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..memory import PageIds
from ._node import Node

__all__ = ("Eviction", "InsertResult", "Match", "Tokens", "as_token_array", "compact",
           "held_bytes")

Tokens = npt.NDArray[np.int64]
"""Token ids as a 1-D int64 array: compared in bulk without copies (slices are views)."""


@dataclass(slots=True)
class Match:
    """What `RadixTree.match` found for a token sequence.

    `path` lists the matched nodes root-down. Because device residency is prefix-closed, the
    first `num_device_nodes` of them are on the device (settled or loading) and the rest are
    host-only.
    """

    path: list[Node]
    num_device_nodes: int
    page_size: int

    @property
    def device_nodes(self) -> list[Node]:
        return self.path[:self.num_device_nodes]

    @property
    def host_nodes(self) -> list[Node]:
        return self.path[self.num_device_nodes:]

    @property
    def last_device_node(self) -> Node | None:
        return self.path[self.num_device_nodes - 1] if self.num_device_nodes else None

    @property
    def last_node(self) -> Node | None:
        return self.path[-1] if self.path else None

    @property
    def num_device_pages(self) -> int:
        return sum([n.num_pages for n in self.device_nodes])

    @property
    def num_host_pages(self) -> int:
        return sum(n.num_pages for n in self.host_nodes)

    def device_pages(self) -> PageIds:
        parts = [n.device_pages for n in self.device_nodes if n.device_pages is not None]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class InsertResult:
    """What `RadixTree.insert` did: nodes now holding the caller's pages, and duplicates."""

    last_node: Node | None
    new_nodes: list[Node] = field(default_factory=list)
    duplicate_pages: list[PageIds] = field(default_factory=list)


@dataclass(slots=True)
class Eviction:
    """Pages a device eviction freed now, and nodes staged to the host (write-back)."""

    freed_pages: int = 0
    write_backs: list[Node] = field(default_factory=list)



def as_token_array(tokens: Tokens | Sequence[int]) -> Tokens:
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
        return tokens
    return np.asarray(tokens, dtype=np.int64)


def same_tokens(a: Tokens, b: Tokens) -> bool:
    # NOTE: count_nonzero, not .all(): the same pass without numpy's Python-level wrapper
    # (about a microsecond a call); `not` keeps the result a Python bool
    return len(a) == len(b) and not np.count_nonzero(a != b)


def common_tokens(key: Tokens, tokens: Tokens, pos: int, end: int | None = None) -> int:
    """How many leading tokens of `key` `tokens` repeats from `pos` (up to `end`)."""
    span = min(len(key), (len(tokens) if end is None else end) - pos)
    same = key[:span] == tokens[pos:pos + span]
    # NOTE: one compare pass, then a count: a full match (the usual case) needs no search,
    # and a mismatch is found in the bools already made (argmin: the first False)
    return span if np.count_nonzero(same) == span else int(same.argmin())


def compact(key: Tokens) -> Tokens:
    """`key`, or a copy of it if it is a view keeping alive a buffer over twice its size."""
    return key.copy() if held_bytes(key) > 2 * key.nbytes else key


def held_bytes(key: Tokens) -> int:
    """Bytes of the buffer `key` keeps alive (a foreign buffer: counted as unbounded)."""
    if key.base is None:
        return key.nbytes
    return key.base.nbytes if isinstance(key.base, np.ndarray) else 1 << 62
