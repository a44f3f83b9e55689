"""The `StorageBackend` protocol (L3) and the page format every backend stores.

A backend stores opaque, self-describing page objects under hex keys. What makes an object
*correct* is checked here, once, for every backend: `encode_page` wraps a page's payload in a
header naming its namespace, KV spec and page size plus a checksum of the payload, and
`decode_page` returns the payload only if all of them match what the reader expects.
Anything else is a miss (correct-or-miss: never wrong KV). Nothing is ever unpickled.

On-disk / on-wire layout of one page object (little-endian)::

    offset  size  field
    0       4     magic            b"AHKV"
    4       2     format version   1
    6       2     header length    (64)
    8       16    namespace id     blake2b-128 of the namespace identity (see keys.py)
    24      16    spec id          blake2b-128 of KVSpec.fingerprint(), page size and layout
    40      8     payload length   bytes
    48      8     checksum         xxh3-64 of the payload
    56      8     reserved         0
    64      ...   payload          the page's KV bytes, page_first order
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import xxhash

__all__ = (
    "HEADER_SIZE",
    "BackendStats",
    "PageFormat",
    "StorageBackend",
    "decode_page",
    "encode_header",
)

MAGIC = b"AHKV"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHH16s16sQQQ")
assert _HEADER.size == HEADER_SIZE


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What a reader expects of every page object: identity and size."""

    namespace_id: bytes
    """16 bytes: blake2b-128 of the namespace identity (model, TP shard ...)."""
    spec_id: bytes
    """16 bytes: blake2b-128 of the KV spec fingerprint, page size and layout."""
    payload_bytes: int
    """Exact payload size of one page."""

    @classmethod
    def make(cls, *, namespace: str, spec_fingerprint: str, page_size: int,
             payload_bytes: int) -> PageFormat:
        return cls(_digest16(namespace.encode()),
                   _digest16(f"{spec_fingerprint}|page={page_size}".encode()), payload_bytes)


def _digest16(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def encode_header(fmt: PageFormat, payload: memoryview | bytes) -> bytes:
    """The 64-byte header for `payload` (store header + payload as one object)."""
    view = memoryview(payload).cast("B")
    if len(view) != fmt.payload_bytes:
        raise ValueError(f"payload is {len(view)} bytes, the format says {fmt.payload_bytes}")
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, fmt.namespace_id, fmt.spec_id,
                        len(view), xxhash.xxh3_64_intdigest(view), 0)


def decode_page(fmt: PageFormat, blob: bytes | memoryview | None) -> memoryview | None:
    """The payload of `blob` if its header and checksum match `fmt`, else None (a miss)."""
    if blob is None:
        return None
    view = memoryview(blob).cast("B")
    if len(view) != HEADER_SIZE + fmt.payload_bytes:
        return None
    magic, version, hlen, ns, spec, length, checksum, _ = _HEADER.unpack_from(view)
    if (magic, version, hlen, ns, spec, length) != (
            MAGIC, VERSION, HEADER_SIZE, fmt.namespace_id, fmt.spec_id, fmt.payload_bytes):
        return None
    payload = view[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    return payload


@dataclass(slots=True)
class BackendStats:
    """Counters every backend keeps (pages, not bytes, unless named)."""

    exists_calls: int = 0
    pages_read: int = 0
    pages_written: int = 0
    pages_deleted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    misses: int = 0
    """Keys asked for that were absent."""
    corrupt: int = 0
    """Objects found but rejected by `decode_page` (bad header, size or checksum)."""
    errors: int = 0
    """Operations that raised (I/O or connection errors)."""
    evicted_pages: int = 0
    extra: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class StorageBackend(Protocol):
    """An async, batched page store: the L3 tier.

    Keys are lowercase hex strings (page hashes, see `keys.py`). Buffers are writable
    (`get_into`) or readable (`set_from`) byte views of exactly `fmt.payload_bytes` each:
    host pages in page_first layout, or staging buffers. Backends verify every object they
    read with `decode_page`; a failed check is a miss and counts in `stats().corrupt`.
    Batches may partly succeed: results are per key.

    Cancellation: a cancelled call leaves every object either fully written or absent (no
    torn objects: writes are atomic per object). A cancelled read may still have filled some
    buffers, each with a whole verified page, before the cancellation surfaces; nothing is
    written into a buffer after the call ends. (Holding a whole batch back to copy it on the
    event loop instead costs far more loop time than it buys.)
    """

    fmt: PageFormat

    async def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present (stops at the first absent)."""
        ...

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's verified payload into its buffer; True where it was filled."""
        ...

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store each buffer under its key (header + payload); True where it was stored."""
        ...

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys`; return how many existed."""
        ...

    def stats(self) -> BackendStats:
        ...

    async def aclose(self) -> None:
        ...
