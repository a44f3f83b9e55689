"""`backend_from_url`: a storage backend from a URL (or a backend object, passed through).

    backend_from_url("memory://", fmt, capacity_bytes=1 << 30)
    backend_from_url("file:///var/cache/kv", fmt, capacity_bytes=200 << 30, fsync=True)
    backend_from_url("file:relative/dir", fmt)          # relative to the working directory
    backend_from_url("redis://:pw@host:6379/0", fmt)     # also rediss:// (TLS)
    backend_from_url(my_backend, fmt)                    # any StorageBackend, as is
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError
from .base import PageFormat, StorageBackend
from .file import FileBackend
from .memory import MemoryBackend

__all__ = ("backend_from_url",)

_SCHEMES = "memory://, file:///abs/dir, file:rel/dir, redis://..., rediss://..."


def backend_from_url(url: str | StorageBackend, fmt: PageFormat,
                     **opts: Any) -> StorageBackend:
    """The backend `url` names, built with `fmt` and `opts` (the backend's keyword arguments).

    Raises:
        ConfigError: the URL is malformed, its scheme unknown, an option is invalid for the
            backend, or a backend object's format differs from `fmt`.
    """
    if isinstance(url, StorageBackend):
        return _passed_through(url, fmt, opts)
    if not isinstance(url, str):
        raise ConfigError(f"storage: must be a URL or a StorageBackend, got {url!r}")
    scheme, colon, _ = url.partition(":")
    scheme = scheme.lower() if colon else ""
    if scheme == "memory":
        _check_empty("memory", url, "memory://")
        return _build(MemoryBackend, url, fmt, opts)
    if scheme == "file":
        return _build(FileBackend, url, _file_path(url), fmt, opts)
    if scheme in ("redis", "rediss"):
        return _build(_redis_backend(), url, url, fmt, opts)
    raise ConfigError(f"storage: unknown URL scheme in {url!r}; expected one of {_SCHEMES}")


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
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError(f"storage: file URLs take no query or fragment (pass options as "
                          f"keyword arguments), got {url!r}")
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"storage: file URL {url!r} names host {parts.netloc!r}; use "
                          f"'file:///absolute/dir' or 'file:relative/dir'")
    if not parts.path:
        raise ConfigError(f"storage: file URL {url!r} names no directory")
    return unquote(parts.path)


def _redis_backend() -> Any:
    try:
        module = importlib.import_module("aiohicache.storage.redis")
    except ModuleNotFoundError as exc:
        if exc.name != "aiohicache.storage.redis":
            raise
        raise ConfigError("storage: redis URLs need aiohicache.storage.redis, which this "
                          "installation lacks") from None
    return module.RedisBackend
