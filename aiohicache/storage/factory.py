"""`backend_from_url`: a storage backend from a URL (or a backend object, passed through).

    backend_from_url("memory://", fmt, capacity_bytes=1 << 30)
    backend_from_url("memory://?max_bytes=1G", fmt)      # the same budget, in the URL
    backend_from_url("file:///var/cache/kv", fmt, capacity_bytes=200 << 30, fsync=True)
    backend_from_url("file:///var/cache/kv?max_bytes=200G&fsync=1", fmt)   # the same
    backend_from_url("file:///var/cache/kv?compact_dead_fraction=0.8", fmt)  # less copying
    backend_from_url("file:relative/dir", fmt)          # relative to the working directory
    backend_from_url("redis://:pw@host:6379/0", fmt)     # also rediss:// (TLS)
    backend_from_url("unix:///run/redis/redis.sock?db=0&password=pw", fmt)  # a local socket
    backend_from_url("redis+cluster://host1:7000,host2:7001", fmt)   # Redis/Valkey Cluster
    backend_from_url("redis+cluster://host1:7000?node_cooldown=5", fmt)  # skip a hung node 5 s
    backend_from_url(my_backend, fmt)                    # any StorageBackend, as is

A memory or file URL's query sets its options (`URL_OPTIONS`; sizes take a K/M/G/T suffix,
powers of 1024), so a store configured by URL alone (``HiCacheConfig(storage=...)``, the
``--l3`` option) can be bounded. An option given both in the URL and as a keyword argument
is an error.

`check_url(url)` raises the ConfigError `backend_from_url` would for a malformed URL, building
nothing: a command line can check its options before it starts anything.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ..errors import ConfigError
from .base import PageFormat, StorageBackend
from .file import FileBackend
from .memory import MemoryBackend

__all__ = ("URL_OPTIONS", "backend_from_url", "check_url", "parse_size", "shown_url")

_SCHEMES = ("memory://, file:///abs/dir, file:rel/dir, redis://..., rediss://..., "
            "unix:///path/to/redis.sock, redis+cluster://host:port,..., rediss+cluster://...")
_CLUSTER = ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")

URL_OPTIONS: dict[str, dict[str, str]] = {
    "memory": {"max_bytes": "capacity_bytes"},
    "file": {"max_bytes": "capacity_bytes", "fsync": "fsync", "segment_bytes": "segment_bytes",
             "max_concurrency": "max_concurrency",
             "compact_dead_fraction": "compact_dead_fraction"},
}
"""Query options of memory and file URLs: URL name -> backend keyword."""
_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


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
    opts = {**opts, **_url_options(url, scheme, opts)}
    if scheme == "memory":
        return _build(MemoryBackend, url, fmt, opts)
    if scheme == "file":
        return _build(FileBackend, url, target, fmt, opts)
    if scheme == "cluster":
        return _build(_redis_backend("RedisClusterBackend"), url, url, fmt, opts)
    return _build(_redis_backend("RedisBackend"), url, url, fmt, opts)


def check_url(url: str) -> None:
    """Check `url` as `backend_from_url` does, building nothing and connecting nowhere.

    Raises:
        ConfigError: ``storage: ...``, saying what is wrong: not a string, no or an unknown
            scheme, anything after ``memory://`` but its query, a file URL with a host or no
            directory, a query option a memory or file URL does not take or a bad value of
            one, a redis or cluster URL without a host, with a bad port or database number, or
            with a query option redis-py (or the backend) refuses, a unix URL with a host or
            no absolute socket path.
    """
    _parse(url)


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"64K"``, ``"1.5G"`` (suffixes K/M/G/T are powers of 1024).

    Raises:
        ConfigError: not a size > 0.
    """
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = body[-1:] if body[-1:] in _SIZE_SUFFIX else ""
    try:
        value = float(body[:len(body) - len(suffix)]) * _SIZE_SUFFIX[suffix]
    except ValueError:
        value = -1.0
    if not (value >= 1 and value == value and value < 2**63):
        raise ConfigError(f"storage: {text!r} is not a size in bytes (e.g. 4096, 64K, 200G)")
    return int(value)


def _url_options(url: str, scheme: str, given: dict[str, Any]) -> dict[str, Any]:
    """The backend keywords a memory or file URL's query sets."""
    if scheme not in URL_OPTIONS:
        return {}
    allowed = URL_OPTIONS[scheme]
    out: dict[str, Any] = {}
    for name, value in parse_qsl(_split(url).query, keep_blank_values=True,
                                 strict_parsing=False):
        if name not in allowed:
            raise ConfigError(f"storage: {scheme} URLs take the options {sorted(allowed)}, "
                              f"got {name!r} in {shown_url(url)!r}")
        keyword = allowed[name]
        if keyword in out or keyword in given:
            raise ConfigError(f"storage: option {name!r} is given twice for {shown_url(url)!r}")
        out[keyword] = _option_value(name, value)
    return out


def _option_value(name: str, value: str) -> Any:
    if name == "fsync":
        if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ConfigError(f"storage: fsync must be 0/1/true/false, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if name == "max_concurrency":
        # NOTE: ASCII digits: str.isdigit() takes '²', which int() refuses (a ValueError);
        # and >= 1 as the backend wants, so the URL check refuses what the backend would
        if not (value.isascii() and value.isdigit() and int(value) >= 1):
            raise ConfigError(f"storage: max_concurrency must be a positive int, got {value!r}")
        return int(value)
    if name == "compact_dead_fraction":
        # NOTE: docs/storage.md's sizing advice turns this knob; a store configured by URL
        # alone (`--l3`, `HiCacheConfig(storage=...)`) had no way to
        return _fraction(name, value)
    return parse_size(value)


def _fraction(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0.0 <= number <= 1.0:  # NaN fails too
        raise ConfigError(f"storage: {name} must be a number in [0, 1], got {value!r}")
    return number


def _parse(url: object) -> tuple[str, str]:
    """``(scheme, target)``: ``("memory", "")``, ``("file", directory)``, ``("redis", url)``
    (``rediss`` too) or ``("cluster", url)``. Only syntax is checked: nothing is built,
    nothing connects."""
    if not isinstance(url, str):
        raise ConfigError(f"storage: must be a URL or a StorageBackend, got {url!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise ConfigError(f"storage: URL {shown_url(url)!r} contains a control character")
    scheme, colon, _ = url.partition(":")
    if not colon or not scheme:
        raise ConfigError(f"storage: {shown_url(url)!r} is not a URL (no scheme); expected one of "
                          f"{_SCHEMES}")
    scheme = scheme.lower()
    if scheme == "memory":
        _check_empty("memory", url.partition("?")[0], "memory://")
        _url_options(url, "memory", {})
        return "memory", ""
    if scheme == "file":
        path = _file_path(url)
        _url_options(url, "file", {})
        return "file", path
    if scheme in ("redis", "rediss"):
        _check_redis(url)
        return "redis", url
    if scheme == "unix":
        _check_unix(url)
        return "redis", url
    if scheme in _CLUSTER:
        _check_cluster(url)
        return "cluster", url
    raise ConfigError(f"storage: unknown URL scheme {scheme!r} in {shown_url(url)!r}; expected "
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
        raise ConfigError(f"storage: bad options for {shown_url(url)!r}: {exc}") from None
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
    if parts.fragment:
        raise ConfigError(f"storage: file URLs take no fragment, got {url!r}")
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
    shown = shown_url(url)
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
    if parts.query:
        _check_redis_options(url, shown)


def _check_unix(url: str) -> None:
    """``unix://[[user]:password@]/abs/redis.sock[?db=N&password=...]``: a Redis server's
    local socket, as redis-py takes it (the database and options in the query)."""
    parts = _split(url)
    shown = shown_url(url)
    if parts.netloc.rpartition("@")[2] or not parts.path.startswith("/"):
        # NOTE: redis-py ignores a host here, and reads a relative path from the working
        # directory of whichever process opens the store
        raise ConfigError(f"storage: unix URL {shown!r} must name no host and an absolute "
                          f"socket path, as in 'unix:///run/redis/redis.sock?db=0'")
    if parts.fragment:
        raise ConfigError(f"storage: unix URL {shown!r} takes no fragment ('#...')")
    _check_redis_options(url, shown)


def _check_redis_options(url: str, shown: str, module: str = "_redis_parts") -> None:
    """The query options as redis-py reads them (else a bad one failed only when the store
    was built: after a server had loaded its model); `module`'s ``check_options`` reads them
    as its client does."""
    try:
        parts = importlib.import_module(f"aiohicache.storage.{module}")
    except ModuleNotFoundError:  # no redis-py: building the backend says so
        return
    try:
        parts.check_options(url, shown)
    except ConfigError as exc:
        raise ConfigError(f"storage: {exc}") from None


def _check_cluster(url: str) -> None:
    """``redis+cluster://[user:pass@]host:port[,host:port...]``: each seed checked as a
    redis URL's host and port (no database: a cluster has only database 0)."""
    parts = _split(url)
    shown = shown_url(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise ConfigError(f"storage: cluster URL {shown!r} names no node; use "
                          f"'redis+cluster://host:port,host:port'")
    for seed in hosts.split(","):
        _check_redis(f"redis://{auth + '@' if auth else ''}{seed.strip()}")
    if parts.path not in ("", "/", "/0"):
        raise ConfigError(f"storage: cluster URL {shown!r} has path {parts.path!r}; a "
                          f"cluster has only database 0")
    if parts.fragment:
        raise ConfigError(f"storage: cluster URL {shown!r} takes no fragment ('#...')")
    if parts.query:
        _check_redis_options(url, shown, "_redis_cluster")


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(f"storage: URL {shown_url(url)!r} is malformed: {exc}") from None


def shown_url(url: str) -> str:
    """`url` with any user and password replaced by ``***``: everything up to the last
    ``@`` (a password may hold ``/``, ``?`` or ``#`` unencoded), and password options of
    the query, ``ssl_password`` (a client key's passphrase) included."""
    shown = re.sub(r"//.*@", "//***@", url, count=1, flags=re.S)
    return re.sub(r"(?i)\b(\w*?(?:password|pass|passwd|pwd))=[^&#]*", r"\1=***", shown)


def _redis_backend(name: str) -> Any:
    try:
        module = importlib.import_module("aiohicache.storage.redis")
    except ModuleNotFoundError as exc:
        if exc.name != "aiohicache.storage.redis":
            raise
        raise ConfigError("storage: redis URLs need aiohicache.storage.redis, which this "
                          "installation lacks") from None
    return getattr(module, name)
