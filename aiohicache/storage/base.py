"""The `StorageBackend` protocol (L3) and the page format every backend stores.

A backend stores opaque, self-describing page objects under hex keys. What makes an object
*correct* is checked here, once, for every backend: `encode_header` heads a page's payload
with its namespace, KV spec, page size and key, plus a checksum of the payload, and
`decode_page` returns the payload only if all of them match what the reader expects.
Anything else is a miss (correct-or-miss: never wrong KV). Nothing is ever unpickled.

NOTE: the key is bound into the object because storage does not bind it: a file copied or
renamed over another, a Redis ``RENAME``/``COPY``, would otherwise serve one prefix's KV
for another's tokens. An object read under any key but its own is rejected (a corrupt miss).

On-disk / on-wire layout of one page object (little-endian)::

    offset  size  field
    0       4     magic            b"AHKV"
    4       2     format version   2 (1: no key id; such objects are now rejected)
    6       2     header length    (64)
    8       16    namespace id     blake2b-128 of the namespace identity (see keys.py)
    24      16    spec id          blake2b-128 of KVSpec.fingerprint(), page size and layout
    40      8     payload length   bytes
    48      8     checksum         xxh3-64 of the payload, seeded with the key id
    56      8     key id           blake2b-64 of the page key (its ASCII hex)
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
    "checksum",
    "checksum_stream",
    "decode_page",
    "encode_header",
    "expected_checksum",
    "fixed_header",
    "key_id",
    "pack_header",
)

MAGIC = b"AHKV"
VERSION = 2
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHH16s16sQQ8s")
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


def key_id(key: str) -> bytes:
    """The 8-byte id of `key` in its objects' headers (also the seed of their checksum)."""
    return hashlib.blake2b(key.encode("ascii"), digest_size=8).digest()


def fixed_header(fmt: PageFormat) -> bytes:
    """The first 48 bytes of every header of `fmt` (magic .. payload length): the bytes
    that do not depend on the key or the payload."""
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, fmt.namespace_id, fmt.spec_id,
                        fmt.payload_bytes, 0, b"\0" * 8)[:_FIXED_BYTES]


_FIXED_BYTES = 48


def _seed(kid: bytes) -> int:
    # Seeded with the key id: the payload's checksum, too, holds only under its own key.
    return int.from_bytes(kid, "little")


def encode_header(fmt: PageFormat, key: str, payload: memoryview | bytes) -> bytes:
    """The 64-byte header for `payload` stored under `key` (store header + payload as one
    object, under that key only)."""
    view = memoryview(payload).cast("B")
    if len(view) != fmt.payload_bytes:
        raise ValueError(f"payload is {len(view)} bytes, the format says {fmt.payload_bytes}")
    kid = key_id(key)
    return pack_header(fmt, checksum(view, _seed(kid)), kid)


def pack_header(fmt: PageFormat, value: int, kid: bytes) -> bytes:
    """The header of a payload of `fmt` whose `checksum` is `value`, under key id `kid`
    (`encode_header` for writers that hash a batch of payloads at once)."""
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, fmt.namespace_id, fmt.spec_id,
                        fmt.payload_bytes, value, kid)


def decode_page(fmt: PageFormat, key: str,
                blob: bytes | memoryview | None) -> memoryview | None:
    """The payload of `blob`, read under `key`, if its header and checksum match `fmt` and
    `key`, else None (a miss: absent, damaged, of another format, or another key's object)."""
    if blob is None:
        return None
    view = memoryview(blob).cast("B")
    if len(view) != HEADER_SIZE + fmt.payload_bytes:
        return None
    payload = view[HEADER_SIZE:]
    expected = expected_checksum(fmt, key, view)
    if expected is None or checksum(payload, expected[1]) != expected[0]:
        return None
    return payload


def expected_checksum(fmt: PageFormat, key: str, header: memoryview) -> tuple[int, int] | None:
    """``(value, seed)``: the `checksum` with `seed` that the payload stored after `header`
    must have, if the header is one of `fmt`'s objects stored under `key`; else None (a miss).

    For readers that land a payload apart from its header (straight into the caller's
    buffer): check the payload with `checksum`, or a `checksum_stream` fed piece by piece.
    """
    # NOTE: unpacked and compared as one tuple: of the ways tried, the least CPU per page
    # (slices compared as bytes cost 0.3-0.5 µs more)
    magic, version, hlen, ns, spec, length, value, stored_id = _HEADER.unpack_from(header)
    expected_id = key_id(key)
    if (magic, version, hlen, ns, spec, length, stored_id) != (
            MAGIC, VERSION, HEADER_SIZE, fmt.namespace_id, fmt.spec_id, fmt.payload_bytes,
            expected_id):
        return None
    return value, _seed(expected_id)


def checksum(payload: memoryview | bytes, seed: int) -> int:
    """The payload checksum of the format (xxh3-64 with the key's seed)."""
    return xxhash.xxh3_64_intdigest(payload, seed=seed)


def checksum_stream(seed: int) -> xxhash.xxh3_64:
    """`checksum` fed piece by piece (``update``, then ``intdigest``): the same value."""
    return xxhash.xxh3_64(seed=seed)


@dataclass(slots=True)
class BackendStats:
    """Counters every backend keeps (pages, not bytes, unless named), and its budget."""

    exists_calls: int = 0
    pages_read: int = 0
    pages_written: int = 0
    pages_deleted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    misses: int = 0
    """Keys asked for that were absent."""
    corrupt: int = 0
    """Objects found but rejected by `decode_page` (bad header, size or checksum, or the
    object of another key)."""
    errors: int = 0
    """Operations that raised (I/O or connection errors)."""
    evicted_pages: int = 0
    """Objects the store evicted for its byte budget (see `counts_evictions`)."""
    extra: dict[str, int] = field(default_factory=dict)
    capacity_bytes: int | None = field(default=None, compare=False)
    """The store's byte budget (header + payload of live objects; Redis: ``maxmemory``), or
    None: unbounded, or not known."""
    used_bytes: int | None = field(default=None, compare=False)
    """Bytes the store holds now (Redis: ``used_memory``), or None: not known.

    NOTE: these two are levels, not counters: they are left out of ``==``. `extra` is not,
    and some backends repeat the levels there (``used_bytes``, ``max_bytes``, ``objects``).
    """
    counts_evictions: bool = field(default=True, compare=False)
    """False: the store evicts on its own, unseen (Redis's ``maxmemory-policy``), so
    `evicted_pages` is not known (its 0 means nothing) and the cache reports none."""
    server_evicted_keys: int | None = field(default=None, compare=False)
    """Redis: the server's ``evicted_keys`` (INFO stats, summed over a cluster's primaries)
    as last seen; server-wide (every database and client, not only these pages) and reset
    when a server restarts. None: not Redis, or not seen."""


@runtime_checkable
class StorageBackend(Protocol):
    """An async, batched page store: the L3 tier.

    Keys are lowercase hex strings (page hashes, see `keys.py`). Buffers are writable
    (`get_into`) or readable (`set_from`) byte views of exactly `fmt.payload_bytes` each:
    host pages in page_first layout, or staging buffers. The buffers of one `get_into` must
    not overlap (`ConfigError`: two keys filling one buffer would both be reported filled).
    Backends write each object with `encode_header` for its key and verify every object
    they read under the key it was read by (`decode_page`, or `expected_checksum` and
    `checksum` where the payload lands apart from its header); a failed check (an object
    moved or copied from another key included) is a miss and counts in `stats().corrupt`.
    Batches may partly succeed: results are per key. Only buffers reported filled hold a
    page: one whose object was rejected may hold its bytes (a backend may read straight into
    the buffer, then check), and an absent key's buffer is left as it was.

    Cancellation: a cancelled call leaves every object either fully written or absent (no
    torn objects: writes are atomic per object). A cancelled read may still have written some
    buffers before the cancellation surfaces (which were verified is not reported); nothing is
    written into a buffer after the call ends. (Holding a whole batch back to copy it on the
    event loop instead costs far more loop time than it buys.)
    """

    fmt: PageFormat

    async def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present (stops at the first absent)."""
        ...

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each key's verified payload into its buffer; True where it was filled.

        Raises:
            ConfigError: a bad key, a buffer of the wrong size, or two buffers overlapping.
        """
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
