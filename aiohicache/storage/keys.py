"""Page keys: a chained hash of token pages, rooted in the cache's identity.

``key(page i) = H(key(page i-1) || tokens of page i as little-endian int64)``, with
``key(page -1) = H(namespace identity)``; H is blake2b with a 16-byte digest (stdlib
`hashlib`; collision resistant, and about as fast as hashing gets in CPython per call). The
identity covers the model namespace, KV spec, page size, host layout and the TP shard, so two
caches share a page only if they would store identical bytes. Keys are 32 lowercase hex
characters: safe as file names and Redis keys.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

__all__ = ("chain_keys", "namespace_root")


def namespace_root(*, namespace: str, spec_fingerprint: str, page_size: int, layout: str,
                   tp_rank: int = 0, tp_size: int = 1) -> bytes:
    """The 16-byte root every page key chains from."""
    identity = (f"aiohicache-v1|ns={namespace}|spec={spec_fingerprint}|page={page_size}"
                f"|layout={layout}|tp={tp_rank}/{tp_size}")
    return hashlib.blake2b(identity.encode(), digest_size=16).digest()


def chain_keys(prev: bytes, tokens: npt.NDArray[np.int64], page_size: int) -> list[bytes]:
    """Digests of the whole pages of `tokens`, chained from `prev` (a root or a page digest)."""
    data = np.ascontiguousarray(tokens[:len(tokens) // page_size * page_size],
                                dtype="<i8").tobytes()
    step = page_size * 8
    out: list[bytes] = []
    view = memoryview(data)
    for start in range(0, len(data), step):
        h = hashlib.blake2b(prev, digest_size=16)
        # NOTE: hashlib releases the GIL for an update of 2 KiB or more; on the loop thread
        # each release lets a worker thread take the GIL for up to a switch interval (5 ms),
        # so a 256-token page (2 KiB) is hashed in halves: same digest, no hand-off.
        for chunk in range(start, start + step, _CHUNK):
            h.update(view[chunk:min(chunk + _CHUNK, start + step)])
        prev = h.digest()
        out.append(prev)
    return out


_CHUNK = 1024
"""Bytes per `update` in `chain_keys`: under hashlib's GIL-release size (2048)."""
