"""The SGLang storage plugin, driven as SGLang's cache controller drives a dynamic backend.

SGLang itself needs CUDA-only packages to import (its package pulls in triton and the
serving stack), so these tests stand in for its two collaborators, faithfully to SGLang
0.5.23: ``HiCacheStorageConfig`` (the fields the factory fills) and the MHA host pool's page
interface (``page_size``, ``layout``, ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page`` over a ``(2, size, layers, heads, head_dim)`` page_first buffer).
The controller's calls are replayed as its threads make them: the factory's
``cls(storage_config, kwargs)``, ``register_mem_pool_host``, backup batches of 128 pages
through ``batch_set_v1``, prefetch as ``batch_exists`` then ``batch_get_v1``, from threads.
Where SGLang is importable, the last test checks the class against its real base and factory.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from aiohicache import ConfigError
from aiohicache.sglang_plugin import AiohicacheStorage, StorageStats
from tests.storage.redis_server import redis_server, redis_url  # noqa: F401  (fixtures)

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


@dataclass
class HiCacheStorageConfig:
    """The fields of SGLang's config that the factory fills (0.5.23)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = "meta-llama/Llama-3.1-8B"
    extra_config: dict[str, Any] | None = field(default_factory=dict)


class MHAHostPool:
    """SGLang's ``MHATokenToKVPoolHost`` page interface, page_first layout."""

    layout = "page_first"
    page_size = PAGE

    def __init__(self, num_pages: int) -> None:
        self.kv_buffer = torch.zeros((2, num_pages * PAGE, LAYERS, HEADS, DIM),
                                     dtype=torch.bfloat16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE, HEADS, DIM), dtype=torch.bfloat16).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, LAYERS, HEADS, DIM)


def page_hashes(tokens: list[int]) -> list[str]:
    """SGLang's page keys: a SHA-256 chain over each page's token ids (4-byte LE)."""
    keys, prior = [], b""
    for start in range(0, len(tokens) - PAGE + 1, PAGE):
        h = hashlib.sha256(prior)
        for t in tokens[start:start + PAGE]:
            h.update(struct.pack("<I", t))
        prior = h.digest()
        keys.append(h.hexdigest())
    return keys


def make_backend(url: str, **config: Any) -> AiohicacheStorage:
    """As SGLang's factory does for ``dynamic``: ``cls(storage_config, kwargs)``, then the
    controller registers its host pool."""
    extra = {"backend_name": "aiohicache", "module_path": "aiohicache.sglang_plugin",
             "class_name": "AiohicacheStorage", "interface_v1": 1, "storage_url": url,
             **config.pop("extra", {})}
    cfg = HiCacheStorageConfig(extra_config=extra, **config)
    module = importlib.import_module(extra["module_path"])
    backend: AiohicacheStorage = getattr(module, extra["class_name"])(cfg, {})
    return backend


def indices(pages: range) -> torch.Tensor:
    """Host token indices of whole pages, as the controller passes them."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.fixture(params=["file", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    url: str = request.getfixturevalue("redis_url")
    return url


def test_backup_then_prefetch_round_trips_pages_bit_exactly(store_url: str) -> None:
    num = 2 * BATCH + 10
    src, dst = MHAHostPool(num), MHAHostPool(num)
    src.kv_buffer.copy_(torch.randn_like(src.kv_buffer, dtype=torch.float32))
    keys = page_hashes(list(range(num * PAGE)))
    writer = make_backend(store_url, enable_storage_metrics=True)
    reader = make_backend(store_url)
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    try:
        with ThreadPoolExecutor(3) as backup:  # SGLang's backup thread, batch by batch
            done = list(backup.map(lambda b: writer.batch_set_v1(
                keys[b:b + BATCH], indices(range(b, min(b + BATCH, num)))),
                range(0, num, BATCH)))
        assert all(all(ok) for ok in done)
        assert reader.batch_exists(keys) == num
        # the prefetch thread reads into other host pages than the writer's
        got = reader.batch_get_v1(keys[:BATCH], indices(range(10, 10 + BATCH)))
        assert got == [True] * BATCH
        assert torch.equal(dst.kv_buffer[:, 10 * PAGE:(10 + BATCH) * PAGE],
                           src.kv_buffer[:, :BATCH * PAGE])
        stats = writer.get_stats()
        assert isinstance(stats, StorageStats) and sum(stats.backup_pgs) == num
        assert writer.get_stats().backup_pgs == []  # drained on read, as SGLang expects
    finally:
        writer.close()
        reader.close()


def test_batches_are_recorded_only_for_storage_metrics(tmp_path: Path) -> None:
    """SGLang drains `get_stats` only with ``enable_storage_metrics`` (off by default): a
    record of every batch kept without it would grow for the life of the server."""
    keys = page_hashes(list(range(4 * PAGE)))
    quiet, counted = (make_backend(f"file://{tmp_path}", enable_storage_metrics=on)
                      for on in (False, True))
    try:
        for backend in (quiet, counted):
            backend.register_mem_pool_host(MHAHostPool(4))
            for _ in range(3):
                assert all(backend.batch_set_v1(keys, indices(range(4))))
                assert all(backend.batch_get_v1(keys, indices(range(4))))
        stats = quiet.get_stats()
        assert (stats.prefetch_pgs, stats.backup_pgs, stats.prefetch_bandwidth,
                stats.backup_bandwidth) == ([], [], [], [])
        assert stats.backend is not None  # the store's own counters are always there
        stats = counted.get_stats()
        assert stats.prefetch_pgs == stats.backup_pgs == [4, 4, 4]
    finally:
        quiet.close()
        counted.close()


def test_exists_counts_the_leading_pages_present(tmp_path: Path) -> None:
    pool = MHAHostPool(8)
    backend = make_backend(f"file://{tmp_path}")
    backend.register_mem_pool_host(pool)
    keys = page_hashes(list(range(8 * PAGE)))
    try:
        assert backend.batch_set_v1([keys[0], keys[1], keys[3]], indices(range(3))) == [True] * 3
        assert backend.batch_exists(keys) == 2
        assert backend.exists(keys[3]) and not backend.exists(keys[2])
        assert backend.batch_exists([]) == 0
        got = backend.batch_get_v1(keys[:4], indices(range(4, 8)))
        assert got == [True, True, False, True]
    finally:
        backend.close()


@pytest.fixture
def small(tmp_path: Path) -> Iterator[AiohicacheStorage]:
    """A file-store backend over a two-page host pool; closed after the test."""
    backend = make_backend(f"file://{tmp_path}")
    backend.register_mem_pool_host(MHAHostPool(2))
    yield backend
    backend.close()


def a_page() -> torch.Tensor:
    """One flat page of random KV, as the host pool holds it."""
    return torch.randn(2 * LAYERS * PAGE * HEADS * DIM).to(torch.bfloat16)


def test_per_key_get_and_set(small: AiohicacheStorage) -> None:
    backend, page = small, a_page()
    assert backend.set("ab" * 32, page) and backend.batch_set(["cd" * 32], [page * 2])
    target = torch.empty_like(page)
    assert backend.get("ab" * 32, target) is target and torch.equal(target, page)
    fresh = backend.get("cd" * 32)
    assert fresh is not None and torch.equal(fresh, page * 2)
    assert backend.get("ef" * 32) is None
    assert backend.batch_get(["ab" * 32, "ef" * 32]) [1] is None
    backend.clear()
    assert backend.batch_exists(["ab" * 32, "cd" * 32]) == 0


def test_clear_remembers_only_the_latest_keys_it_stored(tmp_path: Path) -> None:
    """The keys kept for `clear` were a set of every page ever stored: it grew for the life
    of the server. Now the latest `clear_memory`; a key stored again counts as latest."""
    backend = make_backend(f"file://{tmp_path}", extra={"clear_memory": 3})
    backend.register_mem_pool_host(MHAHostPool(2))
    try:
        keys, page = [f"{i:02x}" * 32 for i in range(5)], a_page()
        for key in keys:
            assert backend.set(key, page)
        assert backend.set(keys[0], page)  # again: the latest now
        assert len(backend._stored) == 3
        backend.clear()
        assert [backend.exists(key) for key in keys] == [False, True, True, False, False]
        assert not backend._stored
    finally:
        backend.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "many"])
def test_a_bad_clear_memory_is_a_config_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^clear_memory: must be"):
        make_backend(f"file://{tmp_path}", extra={"clear_memory": bad})


def test_a_value_not_one_page_long_is_refused_and_nothing_is_stored(
        small: AiohicacheStorage) -> None:
    backend, page = small, a_page()
    for bad in (torch.tensor([7], dtype=torch.uint8),  # would broadcast over the page
                page[:-1], page.float()):
        with pytest.raises(ConfigError, match=r"^values\[1\]: .* bytes"):
            backend.batch_set(["ab" * 32, "cd" * 32], [page, bad])
    assert backend.batch_exists(["ab" * 32]) == 0 and backend.get("cd" * 32) is None


def test_a_target_not_one_page_long_is_refused_before_reading(small: AiohicacheStorage) -> None:
    """A wrong-size target got torch's RuntimeError, after the read."""
    backend, page = small, a_page()
    assert backend.set("ab" * 32, page)
    for bad in (page[:-1].clone(), page.float(), page.half()):
        with pytest.raises(ConfigError, match=r"^target_locations\[0\]: .* bytes"):
            backend.batch_get(["ab" * 32], [bad])


def test_reads_do_not_allocate_a_page_to_learn_the_dtype(tmp_path: Path) -> None:
    """Every page read asked the host pool for a new dummy page (8 MiB for Llama-8B with
    64-token pages), only to read its dtype."""
    backend = make_backend(f"file://{tmp_path}")
    pool = MHAHostPool(BATCH)
    backend.register_mem_pool_host(pool)
    made = 0
    real = pool.get_dummy_flat_data_page

    def counted() -> torch.Tensor:
        nonlocal made
        made += 1
        return real()
    pool.get_dummy_flat_data_page = counted  # type: ignore[method-assign]
    keys = page_hashes(list(range(BATCH * PAGE)))
    try:
        assert all(backend.batch_set_v1(keys, indices(range(BATCH))))
        assert all(backend.batch_get_v1(keys, indices(range(BATCH))))
        assert all(page is not None for page in backend.batch_get(keys))
        assert made == 0
    finally:
        backend.close()


def test_other_models_and_tp_ranks_miss_each_others_pages(tmp_path: Path) -> None:
    url, keys = f"file://{tmp_path}", page_hashes(list(range(4 * PAGE)))
    writer = make_backend(url, tp_rank=0, tp_size=2)
    writer.register_mem_pool_host(MHAHostPool(4))
    others = [make_backend(url, tp_rank=1, tp_size=2),
              make_backend(url, tp_rank=0, tp_size=2, model_name="Qwen/Qwen3-8B")]
    try:
        assert all(writer.batch_set_v1(keys, indices(range(4))))
        for other in others:
            other.register_mem_pool_host(MHAHostPool(4))
            assert other.batch_exists(keys) == 0
            assert other.batch_get_v1(keys, indices(range(4))) == [False] * 4
        mla = [make_backend(url, tp_rank=r, tp_size=2, is_mla_model=True) for r in (0, 1)]
        for b in mla:
            b.register_mem_pool_host(MHAHostPool(4))
        assert all(mla[0].batch_set_v1(keys, indices(range(4))))  # MLA: rank 0 writes
        assert mla[1].batch_exists(keys) == 4  # ... and every rank reads
    finally:
        for b in [writer, *others, *mla]:
            b.close()


def test_a_deployment_without_model_name_is_warned_and_can_name_its_namespace(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's page hashes cover tokens only: two unnamed models with one page format over
    one store would read each other's KV. The plug-in says so, and `namespace` separates them."""
    url, keys = f"file://{tmp_path}", page_hashes(list(range(4 * PAGE)))
    with caplog.at_level(logging.WARNING, logger="aiohicache.sglang_plugin"):
        unnamed = make_backend(url, model_name=None)
    assert "no model_name" in caplog.text
    named = [make_backend(url, model_name=None, extra={"namespace": name}) for name in "ab"]
    try:
        for b in [unnamed, *named]:
            b.register_mem_pool_host(MHAHostPool(4))
        assert all(named[0].batch_set_v1(keys, indices(range(4))))
        assert named[1].batch_exists(keys) == 0 and unnamed.batch_exists(keys) == 0
        assert named[0].batch_exists(keys) == 4
    finally:
        for b in [unnamed, *named]:
            b.close()


@pytest.mark.parametrize("is_mla_model", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("rank", ["pp", "attn_cp"])
def test_pipeline_and_context_parallel_ranks_miss_each_others_pages(
        tmp_path: Path, rank: str, is_mla_model: bool) -> None:
    """A PP stage holds other layers (same page shape when the layers split evenly), an
    attention-CP rank another slice of every page: each reads only its own pages."""
    url, keys = f"file://{tmp_path}", page_hashes(list(range(4 * PAGE)))
    first, second = (make_backend(url, is_mla_model=is_mla_model,
                                  **{f"{rank}_rank": r, f"{rank}_size": 2}) for r in (0, 1))
    try:
        for b in (first, second):
            b.register_mem_pool_host(MHAHostPool(4))
        assert all(first.batch_set_v1(keys, indices(range(4))))
        assert first.batch_exists(keys) == 4
        assert second.batch_exists(keys) == 0
        assert second.batch_get_v1(keys, indices(range(4))) == [False] * 4
    finally:
        first.close()
        second.close()


def test_close_ends_a_call_another_thread_is_waiting_on_as_a_miss(
        small: AiohicacheStorage) -> None:
    """SGLang detaches the store while its prefetch thread may be mid-call: that call must
    end as a miss at once, not hold the thread until `timeout_s` (30 s by default)."""
    async def never(*_: Any) -> list[bool]:
        await asyncio.sleep(3600)  # a store that stopped answering
        return []

    small._require().get_into = never  # type: ignore[method-assign]
    keys = page_hashes(list(range(PAGE)))
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(small.batch_get_v1, keys, indices(range(1)))
        time.sleep(0.2)  # the call is on the loop, waiting
        small.close()
        assert got.result(timeout=5) == [False]


def test_close_is_idempotent(tmp_path: Path) -> None:
    backend = make_backend(f"file://{tmp_path}")
    backend.register_mem_pool_host(MHAHostPool(2))
    backend.close()
    backend.close()
    make_backend(f"file://{tmp_path}").close()  # never registered: nothing opened to close
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        backend.batch_exists(page_hashes(list(range(PAGE))))


def test_a_failing_store_is_a_miss_never_none() -> None:
    backend = make_backend("redis://127.0.0.1:1/0")  # nothing listens on port 1
    backend.options["connect_timeout"] = 0.2
    backend.timeout_s = 5.0
    backend.register_mem_pool_host(MHAHostPool(4))
    keys = page_hashes(list(range(4 * PAGE)))
    try:
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices(range(4))) == [False] * 4
        assert backend.batch_set_v1(keys, indices(range(4))) == [False] * 4
    finally:
        backend.close()


def test_against_sglangs_own_base_class_and_factory(tmp_path: Path) -> None:
    storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                                  reason="SGLang is not installed (see docs/serving.md)")
    factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    assert issubclass(AiohicacheStorage, storage.HiCacheStorage)
    cfg = storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config={
            "backend_name": "aiohicache", "module_path": "aiohicache.sglang_plugin",
            "class_name": "AiohicacheStorage", "interface_v1": 1,
            "storage_url": f"file://{tmp_path}"})
    backend = factory.StorageBackendFactory.create_backend("dynamic", cfg, None)
    backend.register_mem_pool_host(MHAHostPool(2))
    try:
        keys = page_hashes(list(range(2 * PAGE)))
        assert backend.batch_set_v1(keys, indices(range(2))) == [True, True]
        assert backend.batch_exists(keys) == 2
    finally:
        backend.close()
