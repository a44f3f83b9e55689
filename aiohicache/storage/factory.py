"""`backend_from_url`: a storage backend from a URL (or a backend object, passed through).

    backend_from_url("memory://", fmt, capacity_bytes=1 << 30)
    backend_from_url("file:///var/cache/kv", fmt, capacity_bytes=200 << 30, fsync=True)
    backend_from_url("file:relative/dir", fmt)          # relative to the working directory
    backend_from_url("redis://:pw@host:6379/0", fmt)     # also rediss:// (TLS)
    backend_from_url(my_backend, fmt)                    # any StorageBackend, as is

`check_url(url)` raises the ConfigError `backend_from_url` would for a malformed URL, building
nothing: a command line can check its options before it starts anything.
"""

from __future__ import annotations

import importlib
import re
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from ..errors import ConfigError
from .base import PageFormat, StorageBackend
from .file import FileBackend
from .memory import MemoryBackend

__all__ = ("backend_from_url", "check_url")

_SCHEMES = "memory://, file:///abs/dir, file:rel/dir, redis://..., rediss://..."


def backend_from_url(url: str | StorageBackend, fmt: PageFormat,
                     **opts: Any) -> StorageBackend:
    """The backend `url` names, built with `fmt` and `opts` (the backend's keyword arguments).

    Raises:
        ConfigError: the URL is malformed (see `check_url`), an option is invalid for the
            backend, or a backend object's format differs from `fmt`.
    """
    if isinstance(url, StorageBackend):
        return _passed_through(url, fmt, opts)
    scheme, target = _parse(url)
    if scheme == "memory":
        return _build(MemoryBackend, url, fmt, opts)
    if scheme == "file":
        return _build(FileBackend, url, target, fmt, opts)
    return _build(_redis_backend(), url, url, fmt, opts)


def check_url(url: str) -> None:
    """Check `url` as `backend_from_url` does, building nothing and connecting nowhere.

    Raises:
        ConfigError: ``storage: ...``, saying what is wrong: not a string, no or an unknown
            scheme, anything after ``memory://``, a file URL with a host, query or no
            directory, a redis URL without a host or with a bad port or database number.
    """
    _parse(url)


def _parse(url: object) -> tuple[str, str]:
    """``(scheme, target)``: ``("memory", "")``, ``("file", directory)`` or ``("redis", url)``
    (``rediss`` too). Only syntax is checked: nothing is built, nothing connects."""
    if not isinstance(url, str):
        raise ConfigError(f"storage: must be a URL or a StorageBackend, got {url!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise ConfigError(f"storage: URL {_shown(url)!r} contains a control character")
    scheme, colon, _ = url.partition(":")
    if not colon or not scheme:
        raise ConfigError(f"storage: {url!r} is not a URL (no scheme); expected one of "
                          f"{_SCHEMES}")
    scheme = scheme.lower()
    if scheme == "memory":
        _check_empty("memory", url, "memory://")
        return "memory", ""
    if scheme == "file":
        return "file", _file_path(url)
    if scheme in ("redis", "rediss"):
        _check_redis(url)
        return "redis", url
    raise ConfigError(f"storage: unknown URL scheme {scheme!r} in {_shown(url)!r}; expected "
                      f"one of {_SCHEMES}")


def _passed_through(backend: StorageBackend, fmt: PageFormat,
                    opts: dict[str, Any]) -> StorageBackend:
    if opts:
        raise ConfigError(f"storage: options {sorted(opts)} apply to URLs, not to a backend "
                          f"object")
    if backend.fmt != fmt:
        raise ConfigError(f"storage: the backend's page format {backend.fmt} differs from "
                          f"the cache's {fmt}")
    return backend


def _build(cls: Any, url: str, *args: Any) -> StorageBackend:
    *positional, opts = args
    try:
        backend: StorageBackend = cls(*positional, **opts)
    except TypeError as exc:  # an unknown keyword: name it, with the URL
        raise ConfigError(f"storage: bad options for {url!r}: {exc}") from None
    except ConfigError as exc:
        if str(exc).startswith("storage"):
            raise
        raise ConfigError(f"storage: {exc}") from exc
    return backend


def _check_empty(scheme: str, url: str, expected: str) -> None:
    if url.lower() != expected:
        raise ConfigError(f"storage: {scheme} URLs take nothing after the scheme; use "
                          f"{expected!r}, got {url!r}")


def _file_path(url: str) -> str:
    parts = _split(url)
    if parts.query or parts.fragment:
        raise ConfigError(f"storage: file URLs take no query or fragment (pass options as "
                          f"keyword arguments), got {url!r}")
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"storage: file URL {url!r} names host {parts.netloc!r}; use "
                          f"'file:///absolute/dir' or 'file:relative/dir'")
    path = unquote(parts.path)
    if not path:
        raise ConfigError(f"storage: file URL {url!r} names no directory")
    if "\x00" in path:
        raise ConfigError(f"storage: file URL {url!r} has a NUL byte in its path")
    return path


def _check_redis(url: str) -> None:
    parts = _split(url)
    shown = _shown(url)
    if not parts.hostname:
        raise ConfigError(f"storage: redis URL {shown!r} names no host; use "
                          f"'redis://host:port/db'")
    host_port = parts.netloc.rpartition("@")[2]
    port = host_port.rpartition("]")[2].partition(":")[2]  # after an IPv6 host's brackets
    if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"storage: redis URL {shown!r} has port {port!r}; a port is an "
                          f"int in 1..65535")
    db = parts.path.removeprefix("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ConfigError(f"storage: redis URL {shown!r} has path {parts.path!r}; the path "
                          f"is a database number (an int >= 0), as in 'redis://host:port/0'")
    if parts.fragment:
        raise ConfigError(f"storage: redis URL {shown!r} takes no fragment ('#...')")


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(f"storage: URL {_shown(url)!r} is malformed: {exc}") from None


def _shown(url: str) -> str:
    """`url` with any user and password replaced by ``***``."""
    return re.sub(r"//[^/?#]*@", "//***@", url, count=1)


def _redis_backend() -> Any:
    try:
        module = importlib.import_module("aiohicache.storage.redis")
    except ModuleNotFoundError as exc:
        if exc.name != "aiohicache.storage.redis":
            raise
        raise ConfigError("storage: redis URLs need aiohicache.storage.redis, which this "
                          "installation lacks") from None
    return module.RedisBackend
