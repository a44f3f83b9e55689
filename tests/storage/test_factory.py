"""`backend_from_url`: each URL form, pass-through, and every bad URL naming ``storage``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aiohicache import ConfigError
from aiohicache.storage import (
    FileBackend,
    MemoryBackend,
    PageFormat,
    backend_from_url,
    check_url,
)

from .conftest import FMT


async def test_memory_url_makes_a_memory_backend_with_the_options() -> None:
    backend = backend_from_url("memory://", FMT, capacity_bytes=4096)
    assert isinstance(backend, MemoryBackend)
    assert backend.fmt == FMT
    assert "of 4096]" in repr(backend)
    await backend.aclose()


@pytest.mark.parametrize(("url", "path"), [
    ("file:///var/cache/kv", "/var/cache/kv"),
    ("file://localhost/var/cache/kv", "/var/cache/kv"),
    ("file:///var/cache/with%20space", "/var/cache/with space"),
])
async def test_file_url_names_an_absolute_directory(url: str, path: str) -> None:
    backend = backend_from_url(url, FMT, segment_bytes=1 << 20)
    assert isinstance(backend, FileBackend)
    assert (backend.root_dir, backend.segment_bytes) == (path, 1 << 20)
    await backend.aclose()


@pytest.mark.parametrize(("url", "max_bytes"), [
    ("memory://?max_bytes=4096", 4096), ("file:///var/kv?max_bytes=64K", 64 << 10),
    ("file:///var/kv?max_bytes=1.5GiB&fsync=1", 3 << 29), ("file:kv?max_bytes=2T", 2 << 40),
])
async def test_a_url_query_bounds_the_store(url: str, max_bytes: int) -> None:
    backend = backend_from_url(url, FMT)
    assert backend.stats().extra.get("max_bytes", max_bytes) == max_bytes
    assert f"of {max_bytes}]" in repr(backend)
    if isinstance(backend, FileBackend):
        assert backend.fsync == ("fsync=1" in url)
    await backend.aclose()


@pytest.mark.parametrize(("url", "match"), [
    ("file:///x?a=1", "take the options"), ("memory://?fsync=1", "take the options"),
    ("file:///x?max_bytes=0", "not a size"), ("file:///x?max_bytes=lots", "not a size"),
    ("file:///x?fsync=maybe", "fsync"), ("file:///x?max_bytes=1&max_bytes=2", "twice"),
])
def test_a_bad_url_option_is_a_config_error(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=f"^storage: .*{match}"):
        check_url(url)


def test_an_option_in_the_url_and_as_a_keyword_is_an_error() -> None:
    with pytest.raises(ConfigError, match="twice"):
        backend_from_url("memory://?max_bytes=1K", FMT, capacity_bytes=1024)


async def test_file_url_without_slashes_is_relative_to_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    backend = backend_from_url("file:kv/l3", FMT)
    assert isinstance(backend, FileBackend)
    assert backend.root_dir == str(tmp_path / "kv" / "l3")
    await backend.aclose()


async def test_a_backend_object_is_passed_through() -> None:
    async with MemoryBackend(FMT) as backend:
        assert backend_from_url(backend, FMT) is backend
        other = PageFormat.make(namespace="x", spec_fingerprint="y", page_size=1,
                                payload_bytes=8)
        with pytest.raises(ConfigError, match="storage: the backend's page format"):
            backend_from_url(backend, other)
        with pytest.raises(ConfigError, match="storage: options"):
            backend_from_url(backend, FMT, capacity_bytes=1)


@pytest.mark.parametrize("url", [
    "", "memory", "memory://x", "s3://bucket/kv", "file://host/dir", "file://", "file:///x?a=1",
    "/plain/path", "redis", "redis://host:notaport", "ftp://x", "redis+cluster://",
    "redis+cluster://h:1,h:x", "redis+cluster://h:1/2",
])
def test_a_bad_url_raises_config_error_naming_storage(url: str) -> None:
    with pytest.raises(ConfigError, match="^storage"):
        backend_from_url(url, FMT)


def test_a_bad_option_raises_config_error_naming_the_url() -> None:
    with pytest.raises(ConfigError, match="storage: bad options for 'memory://'"):
        backend_from_url("memory://", FMT, capacity_bytez=1)
    with pytest.raises(ConfigError, match="^storage: segment_bytes"):
        backend_from_url("file:///tmp/x", FMT, segment_bytes=0)


def test_not_a_url_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="storage: must be a URL or a StorageBackend"):
        backend_from_url(42, FMT)  # type: ignore[arg-type]


async def test_redis_urls_make_a_redis_backend() -> None:
    from aiohicache.storage.redis import RedisBackend

    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0"):
        backend = backend_from_url(url, FMT)
        assert isinstance(backend, RedisBackend)
        await backend.aclose()


def test_redis_urls_without_the_redis_module_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiohicache.storage.redis", None)
    with pytest.raises(ConfigError, match="storage: redis URLs need"):
        backend_from_url("redis://localhost", FMT)


@pytest.mark.parametrize("query, named", [
    ("socket_timeout=abc", "socket_timeout"), ("bogus=1", "bogus"),
    ("decode_responses=1", "decode_responses")])
def test_check_url_refuses_a_redis_option_redis_py_refuses(query: str, named: str) -> None:
    """`check_url` (what a command line runs before loading anything) refuses the query
    options building the backend would: they passed it, and `aiohicache serve --l3` failed
    only after its model had loaded."""
    from aiohicache.storage import check_url
    with pytest.raises(ConfigError, match=f"storage: .*{named}"):
        check_url(f"redis://127.0.0.1:1/0?{query}")
    check_url("redis://127.0.0.1:1/0?socket_timeout=2&health_check_interval=3")
