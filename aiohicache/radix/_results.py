"""What the radix tree's queries return: matches, insert results, eviction reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..memory import PageIds
from ._node import Node

__all__ = ("Eviction", "InsertResult", "Keys", "Match", "Tokens", "as_ids", "as_token_array",
           "compact", "held_bytes", "narrow", "page_bytes")

Tokens = npt.NDArray[np.int64]
"""Token ids as a 1-D int64 array: compared in bulk without copies (slices are views)."""

Keys = npt.NDArray[np.signedinteger[Any]]
"""Token ids as a tree keeps them (`RadixTree.keys`): a 1-D int32 array while every id the
tree has seen fits, else int64."""


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



def as_token_array(tokens: Keys | Sequence[int]) -> Tokens:
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
        return tokens
    return np.asarray(tokens, dtype=np.int64)


def as_ids(tokens: Keys | Sequence[int]) -> Keys:
    """`tokens` to read (no copy): an int32 or int64 array as it is, anything else as int64."""
    if isinstance(tokens, np.ndarray) and (tokens.dtype == np.int32 or tokens.dtype == np.int64):
        return tokens
    return np.asarray(tokens, dtype=np.int64)


def page_bytes(page: Keys, dtype: np.dtype[Any]) -> bytes:
    """The bytes of `page` as ids of `dtype`: a children's or ghosts' dict key.

    An int64 id beyond an int32 `dtype` wraps: whatever the bytes find must then be checked
    against the ids themselves (`common_tokens` compares across dtypes exactly).
    """
    return (page if page.dtype is dtype else page.astype(dtype)).tobytes()


def narrow(tokens: Tokens) -> Keys | None:
    """`tokens` as a new int32 array, or None if an id does not fit in int32 (never
    wrapped: a wrapped id would match the KV of another token)."""
    # NOTE: one reduction for the usual ids (0 <= id < 2**31: as unsigned, below 2**31);
    # negative ids take the second look
    if len(tokens) and (int(np.maximum.reduce(tokens.view(np.uint64))) > _INT32_MAX and (
            int(tokens.min()) < -_INT32_MAX - 1 or int(tokens.max()) > _INT32_MAX)):
        return None
    return tokens.astype(np.int32)


_INT32_MAX = int(np.iinfo(np.int32).max)


def same_tokens(a: Keys, b: Keys) -> bool:
    # NOTE: count_nonzero, not .all(): the same pass without numpy's Python-level wrapper
    # (about a microsecond a call); `not` keeps the result a Python bool
    return len(a) == len(b) and not np.count_nonzero(a != b)


def common_tokens(key: Keys, tokens: Keys, pos: int, end: int | None = None) -> int:
    """How many leading tokens of `key` `tokens` repeats from `pos` (up to `end`)."""
    span = min(len(key), (len(tokens) if end is None else end) - pos)
    same = key[:span] == tokens[pos:pos + span]
    # NOTE: one compare pass, then a count: a full match (the usual case) needs no search,
    # and a mismatch is found in the bools already made (argmin: the first False)
    return span if np.count_nonzero(same) == span else int(same.argmin())


def compact(key: Keys) -> Keys:
    """`key`, or a copy of it if it is a view keeping alive a buffer over twice its size."""
    return key.copy() if held_bytes(key) > 2 * key.nbytes else key


def held_bytes(key: Keys) -> int:
    """Bytes of the buffer `key` keeps alive (a foreign buffer: counted as unbounded)."""
    if key.base is None:
        return key.nbytes
    return key.base.nbytes if isinstance(key.base, np.ndarray) else 1 << 62
