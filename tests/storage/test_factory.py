"""`backend_from_url`: each URL form, pass-through, and every bad URL naming ``storage``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aiohicache import ConfigError
from aiohicache.storage import FileBackend, MemoryBackend, PageFormat, backend_from_url

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
    backend = backend_from_url(url, FMT, fanout=1)
    assert isinstance(backend, FileBackend)
    assert (backend.root_dir, backend.fanout) == (path, 1)
    await backend.aclose()


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
    "/plain/path", "redis", "redis://host:notaport", "ftp://x",
])
def test_a_bad_url_raises_config_error_naming_storage(url: str) -> None:
    with pytest.raises(ConfigError, match="^storage"):
        backend_from_url(url, FMT)


def test_a_bad_option_raises_config_error_naming_the_url() -> None:
    with pytest.raises(ConfigError, match="storage: bad options for 'memory://'"):
        backend_from_url("memory://", FMT, capacity_bytez=1)
    with pytest.raises(ConfigError, match="^storage: fanout"):
        backend_from_url("file:///tmp/x", FMT, fanout=9)


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
