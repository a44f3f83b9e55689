"""`FileBackend` beyond the shared contract: layout on disk, atomic writes, startup, processes.

The conformance suite covers what every backend does; these tests pin what only a directory
of files can get wrong: where objects live, that half-written temp files are never served
and are cleaned up, that a new instance (or another process) sees what an old one wrote, in
the same least-recently-used order, and that I/O errors become `StorageError`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiohicache import ConfigError
from aiohicache.storage import FileBackend, StorageError, decode_page
from aiohicache.storage import file as file_module
from aiohicache.storage.base import HEADER_SIZE
from aiohicache.storage.errors import StorageReadError, StorageWriteError
from aiohicache.storage.file import STALE_TEMP_S
from aiohicache.storage.file import _scan_dir as scan_dir
from tests.conftest import until

from .conftest import FMT, PAYLOAD, make_keys, make_page

OBJECT = HEADER_SIZE + PAYLOAD


def pages(keys: list[str], *, version: int = 0) -> list[memoryview]:
    return [memoryview(make_page(key, version=version)) for key in keys]


def files_under(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def on_disk(backend: FileBackend, keys: list[str]) -> list[bool]:
    return [os.path.exists(backend._path(key)) for key in keys]


async def read(backend: FileBackend, keys: list[str]) -> list[bytes | None]:
    buffers = [bytearray(PAYLOAD) for _ in keys]
    hits = await backend.get_into(keys, [memoryview(b) for b in buffers])
    return [bytes(b) if hit else None for hit, b in zip(hits, buffers, strict=True)]


# ---------------------------------------------------------------------------- layout

@pytest.mark.parametrize("fanout", [0, 1, 2, 4])
async def test_an_object_lives_under_fanout_directories_named_by_its_key(
        tmp_path: Path, fanout: int) -> None:
    key = make_keys(1)[0]
    async with FileBackend(tmp_path, FMT, fanout=fanout) as backend:
        await backend.set_from([key], pages([key]))
    parts = [key[2 * i:2 * i + 2] for i in range(fanout)]
    assert files_under(tmp_path) == [Path(*parts, key)]
    blob = (tmp_path / Path(*parts, key)).read_bytes()
    assert len(blob) == OBJECT
    assert decode_page(FMT, key, blob) == memoryview(make_page(key))  # header + payload


async def test_a_write_leaves_no_temp_file(tmp_path: Path) -> None:
    keys = make_keys(20)
    async with FileBackend(tmp_path, FMT, fsync=True) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * 20
    assert sorted(p.name for p in files_under(tmp_path)) == sorted(keys)


async def test_a_temp_file_is_never_served(tmp_path: Path) -> None:
    key = make_keys(1)[0]
    async with FileBackend(tmp_path, FMT) as backend:
        await backend.set_from([key], pages([key]))
        path = backend._path(key)
        os.rename(path, f"{path}.0123456789ab.tmp")  # as a crashed writer leaves it
        assert await read(backend, [key]) == [None]
        assert await backend.exists([key]) == 0  # the failed read dropped it from the index
    async with FileBackend(tmp_path, FMT) as backend:
        assert await backend.exists([key]) == 0


# ---------------------------------------------------------------------------- startup

async def test_startup_rebuilds_the_index_and_removes_stale_temp_files(tmp_path: Path) -> None:
    keys = make_keys(5)
    async with FileBackend(tmp_path, FMT) as first:
        await first.set_from(keys, pages(keys))
        leaf = Path(first._path(keys[0])).parent
    stale = leaf / f"{keys[0]}.aaaaaaaaaaaa.tmp"
    fresh = leaf / f"{keys[0]}.bbbbbbbbbbbb.tmp"  # maybe another process's write in flight
    for temp in (stale, fresh):
        temp.write_bytes(b"half a page")
    old = time.time() - STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    (tmp_path / "README").write_text("not ours")  # foreign files are left alone
    (leaf / ("f" * 32)).write_bytes(b"x")  # a key name in the wrong directory: not indexed

    async with FileBackend(tmp_path, FMT) as second:
        assert await second.exists(keys) == 5
        stats = second.stats()
        assert stats.extra["objects"] == 5
        assert stats.extra["used_bytes"] == 5 * OBJECT
        assert stats.extra["temps_removed"] == 1
        assert await read(second, keys) == [make_page(k) for k in keys]
    assert not stale.exists() and fresh.exists()
    assert (tmp_path / "README").exists()


async def test_a_new_instance_keeps_the_lru_order_and_applies_its_budget(
        tmp_path: Path) -> None:
    keys = make_keys(5)
    async with FileBackend(tmp_path, FMT) as first:
        await first.set_from(keys[:4], pages(keys[:4]))
        now = time.time()
        for age, key in enumerate(keys[:4]):  # written long ago, oldest first
            os.utime(first._path(key), (now - 100 + age, now - 100 + age))
        assert await read(first, keys[:1]) == [make_page(keys[0])]  # a read marks it recent
    async with FileBackend(tmp_path, FMT, capacity_bytes=3 * OBJECT) as second:
        # over budget at startup: the least recently used object goes
        assert second.stats().evicted_pages == 1
        assert on_disk(second, keys) == [True, False, True, True, False]
        await second.set_from(keys[4:], pages(keys[4:]))  # evicts the next oldest: keys[2]
        assert on_disk(second, keys) == [True, False, False, True, True]


async def test_the_index_is_built_on_first_use_on_an_io_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[str] = []

    def scan(*args: Any) -> Any:
        scans.append(threading.current_thread().name)
        return scan_dir(*args)

    monkeypatch.setattr(file_module, "_scan_dir", scan)
    backend = FileBackend(tmp_path, FMT)
    assert scans == []  # constructing does no I/O
    async with backend:
        await backend.exists(make_keys(1))
    assert len(scans) == 1 and scans[0].startswith("aiohicache-file")


# ---------------------------------------------------------------------------- other processes

WRITER = """
import asyncio, json, sys
from aiohicache.storage import FileBackend, PageFormat
from tests.storage.conftest import make_page

args = json.loads(sys.argv[1])
fmt = PageFormat(bytes.fromhex(args["ns"]), bytes.fromhex(args["spec"]), args["payload"])

async def main():
    async with FileBackend(args["root"], fmt) as backend:
        keys = args["keys"]
        ok = await backend.set_from(keys, [memoryview(make_page(k)) for k in keys])
        assert all(ok), ok

asyncio.run(main())
"""


async def write_in_another_process(root: Path, keys: list[str]) -> None:
    args = json.dumps({"root": str(root), "keys": keys, "ns": FMT.namespace_id.hex(),
                       "spec": FMT.spec_id.hex(), "payload": FMT.payload_bytes})
    result = await anyio.run_process([sys.executable, "-c", WRITER, args], check=False,
                                     cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr.decode()


def test_pages_written_by_another_process_are_served(tmp_path: Path) -> None:
    # NOTE: sync, running its own loop once: a writer process takes a second to start.
    before, after = make_keys(4, seed=1), make_keys(4, seed=2)

    async def scenario() -> None:
        await write_in_another_process(tmp_path, before)
        async with FileBackend(tmp_path, FMT) as backend:
            assert await backend.exists(before) == 4  # found by the startup scan
            await write_in_another_process(tmp_path, after)
            assert await backend.exists(after) == 4  # not in the index: found on disk
            assert await read(backend, before + after) == [make_page(k)
                                                           for k in before + after]

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- cancellation

async def test_cancelled_writes_leave_whole_objects_no_temps_and_a_true_index(
        tmp_path: Path) -> None:
    keys = make_keys(256)  # 8 runs of 32 pages, 2 at a time
    async with FileBackend(tmp_path, FMT, max_concurrency=2, fsync=True,
                           capacity_bytes=1000 * OBJECT) as backend:
        task = asyncio.ensure_future(backend.set_from(keys, pages(keys)))
        await until(lambda: backend.stats().pages_written > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        written = backend.stats().pages_written
        assert 0 < written < 256
        on_disk = files_under(tmp_path)
        assert all(p.name in keys for p in on_disk), "a temp file outlived the cancel"
        assert len(on_disk) == written
        assert backend.stats().extra["used_bytes"] == written * OBJECT
        assert backend._budget.reserved_bytes == 0
        for path in on_disk:
            page = decode_page(FMT, path.name, (tmp_path / path).read_bytes())
            assert page == memoryview(make_page(path.name))


async def test_a_cancelled_read_fills_whole_pages_or_none_and_nothing_after(
        tmp_path: Path) -> None:
    keys = make_keys(256)  # 8 runs of 32 pages, 2 at a time
    buffers = [bytearray(PAYLOAD) for _ in keys]
    async with FileBackend(tmp_path, FMT, max_concurrency=2) as backend:
        await backend.set_from(keys, pages(keys))
        task = asyncio.ensure_future(backend.get_into(keys, [memoryview(b) for b in buffers]))
        await until(lambda: backend.stats().pages_read > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert 0 < backend.stats().pages_read < 256
        after_cancel = [bytes(b) for b in buffers]
        filled = [b == make_page(k) for k, b in zip(keys, after_cancel, strict=True)]
        assert all(ok or b == bytes(PAYLOAD) for ok, b in zip(filled, after_cancel,
                                                                  strict=True))
        assert sum(filled) == backend.stats().pages_read  # only reads that completed
        await asyncio.sleep(0.01)  # an I/O thread still writing would show now
        assert [bytes(b) for b in buffers] == after_cancel


# ---------------------------------------------------------------------------- recovery

@pytest.mark.parametrize("fanout", [0, 2])
async def test_a_store_directory_removed_while_running_is_made_again(
        tmp_path: Path, fanout: int) -> None:
    root = tmp_path / "l3"
    keys = make_keys(8)
    async with FileBackend(root, FMT, fanout=fanout) as backend:
        assert await backend.set_from(keys[:4], pages(keys[:4])) == [True] * 4
        await anyio.to_thread.run_sync(shutil.rmtree, root)
        assert await read(backend, keys[:1]) == [None]  # gone with it: a miss
        # keys[:4] go where directories were made before, keys[4:] where none were
        assert await backend.set_from(keys, pages(keys, version=1)) == [True] * 8
        assert await read(backend, keys) == [make_page(k, version=1) for k in keys]
        await anyio.to_thread.run_sync(shutil.rmtree, root)
        assert await backend.set_from(keys[4:], pages(keys[4:])) == [True] * 4
        assert await read(backend, keys[4:]) == [make_page(k) for k in keys[4:]]
        assert backend.stats().errors == 0


# ---------------------------------------------------------------------------- errors

async def test_a_failed_write_raises_after_the_others_are_stored(tmp_path: Path) -> None:
    keys = make_keys(4)
    async with FileBackend(tmp_path, FMT, fanout=1) as backend:
        (tmp_path / keys[0][:2]).write_bytes(b"")  # a file where keys[0]'s directory goes
        with pytest.raises(StorageWriteError, match="1 page"):
            await backend.set_from(keys, pages(keys))
        assert backend.stats().errors == 1
        assert await read(backend, keys[1:]) == [make_page(k) for k in keys[1:]]


async def test_a_failed_read_raises_and_leaves_its_buffer_alone(tmp_path: Path) -> None:
    keys = make_keys(2)
    async with FileBackend(tmp_path, FMT) as backend:
        await backend.set_from(keys[1:], pages(keys[1:]))
        os.makedirs(backend._path(keys[0]))  # reading it fails: it is a directory
        buffers = [bytearray(PAYLOAD) for _ in keys]
        with pytest.raises(StorageReadError):
            await backend.get_into(keys, [memoryview(b) for b in buffers])
        assert buffers[0] == bytearray(PAYLOAD)
        assert backend.stats().errors == 1


async def test_a_root_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "taken").write_bytes(b"")
    for root in (tmp_path / "taken", tmp_path / "taken" / "below"):
        backend = FileBackend(root, FMT)
        with pytest.raises(StorageError, match="cannot open"):
            await backend.exists(make_keys(1))
        await backend.aclose()


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"fanout": 5}, "fanout"), ({"fanout": -1}, "fanout"), ({"fanout": True}, "fanout"),
    ({"capacity_bytes": 0}, "capacity_bytes"), ({"capacity_bytes": 1.5}, "capacity_bytes"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"root_dir": 3}, "root_dir"),
])
def test_bad_settings_raise_config_error_naming_them(tmp_path: Path, kwargs: dict[str, object],
                                                     name: str) -> None:
    settings: dict[str, object] = {"root_dir": tmp_path, "fmt": FMT, **kwargs}
    with pytest.raises(ConfigError, match=name):
        FileBackend(**settings)  # type: ignore[arg-type]


async def test_an_unclosed_backend_warns(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, FMT)
    await backend.exists(make_keys(1))
    executor = backend._executor
    with pytest.warns(ResourceWarning, match="unclosed"):
        del backend
        gc.collect()
    assert executor is not None
    executor.shutdown()


async def test_repr_shows_objects_and_budget(tmp_path: Path) -> None:
    keys = make_keys(2)
    async with FileBackend(tmp_path, FMT, capacity_bytes=10 * OBJECT) as backend:
        await backend.set_from(keys, pages(keys))
        assert repr(backend) == (f"<FileBackend {str(tmp_path)!r} [2 objects, {2 * OBJECT} "
                                 f"bytes of {10 * OBJECT}]>")
