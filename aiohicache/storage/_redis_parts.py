"""What the Redis backends share beside the class: page work (verify, copy, encode, on any
thread) and connecting (URLs, pools, redaction)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

import anyio.lowlevel
import numpy as np
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._validate import check_int, check_number
from ..errors import ConfigError
from .base import HEADER_SIZE, PageFormat, decode_page, encode_header

__all__ = ("CLUSTER_SCHEMES", "SCHEMES", "Blob", "FreshTlsConnection", "cancel_requests",
           "check_options", "check_query", "check_settings", "check_tls_files", "client",
           "copy_payloads", "encode_objects", "leading_true", "raise_lost_cancel", "redact",
           "verify")

SCHEMES: Final = ("redis", "rediss", "unix")
CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster", "valkey+cluster",
                          "valkeys+cluster")
Blob = bytes | None


# ---------------------------------------------------------------------- page work (any thread)


def verify(fmt: PageFormat, keys: Sequence[str],
           blobs: list[Blob]) -> list[memoryview | None]:
    """The checked payload of each key's blob, or None (absent or rejected)."""
    return [decode_page(fmt, key, blob) for key, blob in zip(keys, blobs, strict=True)]


def copy_payloads(payloads: list[memoryview | None], views: list[memoryview],
                  blobs: list[Blob]) -> list[bool]:
    """Copy each payload into its view; True where there was one. Then empty `payloads` and
    `blobs` (the objects fetched): the caller holds no reference left to them.

    NOTE: freeing them is the last reference dropped, on this thread: 10k objects of 64 KiB
    freed on the loop when the call returned held it 9-14 ms.
    """
    for payload, view in zip(payloads, views, strict=True):
        if payload is not None:
            np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(payload, np.uint8))
    filled = [payload is not None for payload in payloads]
    payloads.clear()
    blobs.clear()
    return filled


def encode_objects(fmt: PageFormat, keys: Sequence[str],
                   views: list[memoryview]) -> list[memoryview]:
    """Header + payload of each key's page, as one contiguous object each."""
    objects = []
    for key, view in zip(keys, views, strict=True):
        obj = np.empty(HEADER_SIZE + fmt.payload_bytes, np.uint8)
        obj[:HEADER_SIZE] = np.frombuffer(encode_header(fmt, key, view), np.uint8)
        np.copyto(obj[HEADER_SIZE:], np.frombuffer(view, np.uint8))
        objects.append(obj.data)
    return objects


def leading_true(replies: list[object]) -> int:
    """How many replies, from the first, are a true count (`exists` stops at the first
    absent key)."""
    for i, reply in enumerate(replies):
        if not isinstance(reply, int) or not reply:  # an error (a lost node) is absent
            return i
    return len(replies)


# ---------------------------------------------------------------------- cancellation


def cancel_requests() -> int:
    """The current task's pending cancellation requests (``Task.cancelling()``)."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


async def raise_lost_cancel(before: int) -> None:
    """Raise the cancellation of the current task if one was requested since
    `cancel_requests()` returned `before`: call it after a redis-py call that returned.

    NOTE: on Python 3.11 redis-py's send (``asyncio.wait_for``) swallows a cancellation that
    lands as its write finishes (CPython gh-86296): a third or more of the calls cancelled
    in flight returned normally, and the cancelled task ran on. A request still counted was never
    delivered (one delivered and handled is uncancelled); raised here it counts once, as
    if delivered. An anyio scope's is raised by the scope (it cancels again every loop turn),
    so the scope knows it as its own; any other as a plain `CancelledError`.
    """
    if cancel_requests() > before:
        await anyio.lowlevel.checkpoint_if_cancelled()
        raise asyncio.CancelledError


# ---------------------------------------------------------------------- connection set-up


def client(url: str, safe_url: str, *, socket_timeout: float, connect_timeout: float,
           max_connections: int, retries: int) -> Redis:
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"url {safe_url!r}: the scheme must be one of {SCHEMES}")
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():  # redis-py would ignore it
        raise ConfigError(f"url {safe_url!r}: the path must be a database number")
    check_query(parts.query, safe_url)
    pool = _pool(url, safe_url, max_connections=max_connections, timeout=None,
                 socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                 retry=Retry(NoBackoff(), retries))
    return Redis.from_pool(pool)


def check_options(url: str, safe_url: str) -> None:
    """Raise `ConfigError` for a query option of a one-server URL that redis-py (or the
    backend) refuses, connecting nowhere: what `client` would raise for it."""
    check_query(urlsplit(url).query, safe_url)
    _pool(url, safe_url)


def _pool(url: str, safe_url: str, **kwargs: object) -> BlockingConnectionPool:
    try:
        pool = BlockingConnectionPool.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"url {safe_url!r}: {safe_reason(url, exc)}") from None
    try:  # NOTE: a connection object connects only when used: this checks the options now
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as exc:  # an unknown query option: it failed at the first call
        raise ConfigError(f"url {safe_url!r}: an option redis-py does not take "
                          f"({safe_reason(url, exc)})") from None
    check_tls_files(pool.connection_kwargs, safe_url)
    if pool.connection_class is SSLConnection:
        pool.connection_class = FreshTlsConnection
    return pool


_TLS_FILES: Final = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def check_tls_files(options: Mapping[str, object], safe_url: str) -> None:
    """Raise `ConfigError` naming a CA, certificate or key file of `options` that cannot be
    read.

    NOTE: redis-py reads them only as each connection opens, and a missing one failed it as
    ``Error 2 connecting to host:port. No such file or directory``, naming no file (read as
    the server missing): the breaker opened and L3 was lost, the typo never shown.
    """
    for name in _TLS_FILES:
        path = options.get(name)
        if path is not None and not (os.path.isfile(str(path))
                                     and os.access(str(path), os.R_OK)):
            raise ConfigError(f"url {safe_url!r}: {name} {str(path)!r} is not a readable file")


class FreshTlsConnection(SSLConnection):
    """redis-py's `SSLConnection`, but a connection opened after its CA, certificate or key
    file changed reads them again: a certificate rotated on disk (a client's, for mTLS, or
    the CA file) is used from the next connection on, no restart.

    NOTE: redis-py builds each connection's TLS context once and keeps it: after a client
    certificate was rotated, every reconnect presented the old one, refused once the server
    stopped trusting it, until the process restarted.
    """

    _stamps: tuple[object, ...] = ()
    """The files' identity (inode, mtime, size) when the context was last built."""

    def _connection_arguments(self) -> Mapping[str, Any]:
        tls = self.ssl_context
        # NOTE: redis-py's private context holder (5.x-8.x); getattr: a release without
        # these names keeps its own behaviour (no re-read), not an AttributeError
        stamps = tuple(_stamp(getattr(tls, name, None))
                       for name in ("ca_certs", "certfile", "keyfile"))
        if stamps != self._stamps:
            tls.context = None  # built again from the files, for this connection on
            self._stamps = stamps
        return super()._connection_arguments()


def _stamp(path: str | None) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path) if path else None
    except OSError:  # gone: the connection's own load says so
        return None
    return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)


_REFUSED_OPTIONS: Final = {
    "decode_responses": "the backend reads bytes (replies decoded as text fail every read)",
}


def check_query(query: str, safe_url: str) -> None:
    """Raise `ConfigError` for a URL option the backend cannot work with."""
    for name, _ in parse_qsl(query, keep_blank_values=True):
        if name in _REFUSED_OPTIONS:
            raise ConfigError(f"url {safe_url!r}: option {name!r} is not allowed: "
                              f"{_REFUSED_OPTIONS[name]}")


def safe_reason(url: str, exc: Exception) -> str:
    """`exc`'s message, unless it quotes a piece of the URL's user or password (redis-py's
    port error quotes what it took for the port: a password with an unencoded '/' or '#')."""
    auth = url.partition("://")[2].rpartition("@")[0]
    pieces = re.split(r"[:/?#@]", auth)
    pieces += re.findall(r"(?i)\b\w*?(?:password|pass|passwd|pwd)=([^&#]*)", url)
    message = str(exc)
    if any(piece and piece in message for piece in pieces):
        return _UNPARSABLE
    return message


_UNPARSABLE = ("cannot be parsed (a port that is not a number? percent-encode any '/', '?', "
               "'#', '@' or ':' in a user or password)")


def redact(url: str) -> str:
    """`url` without user, password and query (``redis://***@host:port/db``)."""
    scheme, sep, rest = url.partition("://")
    auth_part, at, after = rest.rpartition("@")
    if at and any(c in auth_part for c in "/?#"):  # a password not percent-encoded: the URL
        return f"{scheme}://***@{after.split('?', 1)[0].split('#', 1)[0]}"  # splits in it
    if sep and scheme in CLUSTER_SCHEMES:
        netloc = rest.split("/", 1)[0].split("?", 1)[0]
        auth = "***@" if "@" in netloc else ""
        return f"{scheme}://{auth}{netloc.rpartition('@')[2]}"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<unparsable url>"
    auth = "***@" if "@" in parts.netloc else ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{auth}{host}{port}{parts.path}"


_MAX_TTL_S = 1e15
"""Seconds: about 31 million years, far inside what Redis accepts."""


def check_settings(*, max_batch: object, max_pipeline_bytes: object, max_connections: object,
                   retries: object, inline_bytes: object, ttl: object, socket_timeout: object,
                   connect_timeout: object) -> None:
    """Raise `ConfigError` naming the first bad setting of a Redis backend."""
    for name, value in (("max_batch", max_batch), ("max_pipeline_bytes", max_pipeline_bytes),
                        ("max_connections", max_connections)):
        check_int(name, value, low=1)
    check_int("retries", retries, low=0)
    check_int("inline_bytes", inline_bytes, low=0)
    if ttl is not None:  # NOTE: Redis refuses (every SET) an expiry past 2**63 ms from now
        check_number("ttl", ttl, low=0.0, low_open=True, high=_MAX_TTL_S)
    for name, seconds in (("socket_timeout", socket_timeout),
                          ("connect_timeout", connect_timeout)):
        check_number(name, seconds, low=0.0, low_open=True)
