"""Adversarial review of the integrations and event surfaces: KV events, the SGLang storage
plug-in, the transformers adapter (and a cross-check of the event model under L3 traffic)."""

from __future__ import annotations

import contextlib
import random
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aiohicache import HiCache
from aiohicache.controller import page_format
from aiohicache.errors import CapacityError, ConfigError
from aiohicache.events import AllBlocksCleared
from aiohicache.storage.memory import MemoryBackend
from aiohicache.testing import KVOracle
from tests.conftest import make_cache, make_config, prefill
from tests.test_events import Model, apply, root_of, settle, tree_state

# ---------------------------------------------------------------------------- KV events


async def test_a_stream_of_a_cache_closed_without_being_opened_ends() -> None:
    """`events()` on a cache not opened yet (a publisher set up first), then `aclose()`
    without ever opening it: the hub was never closed, so the stream never ended and its
    reader (the publisher's task) hung for ever."""
    cache = make_cache()
    stream = cache.events()
    await cache.aclose()
    with anyio.fail_after(5):
        batches = [b async for b in stream]
    # as after any close: a last batch with `AllBlocksCleared`, then the end
    assert batches and isinstance(batches[-1].events[-1], AllBlocksCleared)


@pytest.mark.parametrize("seed", range(6))
async def test_snapshot_streams_joining_anytime_agree_with_the_tree_under_l3_traffic(
        seed: int) -> None:
    """Passes today; kept because no existing test drives the event model through L3
    prefetches landing in L2 (host `BlockStored` from `insert_host`), write-back staging,
    concurrent requests and snapshots taken at random points in that traffic."""
    rng = random.Random(seed)
    cfg0 = make_config()
    backend = MemoryBackend(page_format(cfg0),
                            capacity_bytes=rng.choice([None, 40 * (cfg0.page_bytes + 200)]))
    cfg = make_config(storage=backend, device_pages=rng.choice([12, 16]),
                      host_pages=rng.choice([8, 24]),
                      write_policy=rng.choice(["write_through", "write_back",
                                               "write_through_selective"]),
                      prefetch_threshold=4, prefetch_policy="wait_complete",
                      eviction=rng.choice(["lru", "lfu", "arc"]))
    streams: list[tuple[Any, Model]] = []
    async with HiCache(cfg) as cache:
        root = root_of(cache)
        convs: list[list[int]] = []

        async def one(conv: list[int]) -> None:
            with contextlib.suppress(CapacityError):  # three at once may not fit
                await prefill(cache, list(conv))

        for _ in range(50):
            if rng.random() < 0.12:
                streams.append((cache.events(snapshot=True), set()))
            if convs and rng.random() < 0.6:
                conv = rng.choice(convs)
                if len(conv) < 36:
                    conv += [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 12))]
            else:
                base = rng.choice(convs)[:rng.randrange(0, 16)] if convs else []
                conv = base + [rng.randrange(1 << 20) for _ in range(rng.randrange(4, 24))]
                convs.append(conv)
            if len(convs) > 2 and rng.random() < 0.3:
                async with anyio.create_task_group() as tg:
                    for c in rng.sample(convs, 3):
                        tg.start_soon(one, c)
            else:
                await prefill(cache, list(conv))
            if rng.random() < 0.3:
                await cache.drain()
            for stream, model in streams:
                if rng.random() < 0.5:
                    while (batch := stream.get_nowait()) is not None:
                        apply(model, batch, root)
        for _ in range(3):
            await settle(cache)
        want = tree_state(cache)
        for stream, model in streams:
            while (batch := stream.get_nowait()) is not None:
                apply(model, batch, root)
            assert stream.dropped == 0
            assert {(m, k) for m, k in model if m != "storage"} == want
            await stream.aclose()
        cache.check_invariants()
    await backend.aclose()


# ---------------------------------------------------------------------------- SGLang plug-in


def test_a_store_shared_with_another_kv_layout_or_dtype_neither_lies_nor_is_overwritten(
        tmp_path: Path) -> None:
    """Two deployments of one model (same name, same TP shard) over one store, whose host
    pools differ in layout (page_first / layer_first) or KV dtype (bf16 / fp16, as with
    ``--kv-cache-dtype``): the store key bound only the model and shard, not the page format,
    so each one's `batch_exists` counted the other's pages (its reads of them then all
    failed: a prefetch for nothing), and each one's backup replaced the other's objects
    (the first deployment then missed its own pages for good)."""
    from tests.test_sglang_plugin import PAGE, MHAHostPool, indices, make_backend, page_hashes

    class LayerFirst(MHAHostPool):
        layout = "layer_first"

    class Fp16(MHAHostPool):
        def __init__(self, num_pages: int) -> None:
            super().__init__(num_pages)
            self.kv_buffer = self.kv_buffer.to(torch.float16)

        def get_dummy_flat_data_page(self) -> torch.Tensor:
            return super().get_dummy_flat_data_page().to(torch.float16)

    keys = page_hashes(list(range(4 * PAGE)))
    for other_pool in (LayerFirst, Fp16):
        url = f"file://{tempfile.mkdtemp(dir=tmp_path)}"
        first = make_backend(url)
        src = MHAHostPool(4)
        src.kv_buffer.copy_(torch.randn_like(src.kv_buffer, dtype=torch.float32))
        first.register_mem_pool_host(src)
        other = make_backend(url)
        other.register_mem_pool_host(other_pool(4))
        try:
            assert all(first.batch_set_v1(keys, indices(range(4))))
            assert other.batch_exists(keys) == 0, other_pool.__name__
            assert all(other.batch_set_v1(keys, indices(range(4))))  # its own backup
        finally:
            first.close()
            other.close()
        again = make_backend(url)  # the first deployment, restarted
        dst = MHAHostPool(4)
        again.register_mem_pool_host(dst)
        try:
            assert again.batch_exists(keys) == 4, other_pool.__name__
            assert again.batch_get_v1(keys, indices(range(4))) == [True] * 4
            assert torch.equal(dst.kv_buffer, src.kv_buffer)
        finally:
            again.close()


def test_a_batch_get_with_fewer_targets_than_keys_is_a_config_error(tmp_path: Path) -> None:
    """Fewer `target_locations` than keys: the pages were read, then an IndexError ("list
    index out of range") came out of the loop that fills the targets."""
    from tests.test_sglang_plugin import MHAHostPool, a_page, make_backend

    backend = make_backend(f"file://{tmp_path}")
    backend.register_mem_pool_host(MHAHostPool(2))
    try:
        page = a_page()
        assert backend.batch_set(["ab" * 32, "cd" * 32], [page, page])
        with pytest.raises(ConfigError, match="target_locations"):
            backend.batch_get(["ab" * 32, "cd" * 32], [torch.empty_like(page)])
    finally:
        backend.close()


# ---------------------------------------------------------------------------- transformers


async def test_committing_decoded_tokens_twice_never_writes_into_pages_given_up() -> None:
    """`commit_decoded` called again as generation goes on (the sequence grown since): it
    wrote the KV of the prefill's partial page into that page's slots again, though the
    first call had committed that page and, as another request had inserted the same page
    meanwhile, freed it as a duplicate; the page now belonged to another prefix, whose
    cached KV was overwritten before the call failed (served later: wrong KV). Committing
    as generation goes on must work (or fail before writing anything)."""
    pytest.importorskip("transformers")
    from aiohicache import HiCacheConfig
    from aiohicache.hf import HFAdapter, kv_spec, tiny_llama

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama(seed=1, vocab_size=500, hidden_size=64, num_layers=3, num_heads=4,
                           num_kv_heads=2)
        cfg = HiCacheConfig(spec=kv_spec(model.config, model.dtype), page_size=4,
                            device_pages=12, host_pages=64)
        async with HiCache(cfg) as cache:
            adapter, oracle = HFAdapter(model, cache), KVOracle(cache)
            prompt = list(range(10, 20))  # 10 tokens: 2 pages and a partial one
            victim = [900 + i for i in range(4)]
            async with cache.fetch(prompt) as hit:
                out = await adapter.prefill(hit, prompt)
                seq = [*prompt, int(out.logits[0, -1].argmax())]
                for _ in range(4):
                    seq.append(int((await adapter.decode(out.past_key_values, seq[-1])).argmax()))
                # another request computes and inserts the same first 3 pages first
                async with cache.fetch(seq[:12]) as other:
                    await adapter.prefill(other, seq[:12])
                await adapter.commit_decoded(hit, out, seq[:14])  # our page 2: a duplicate
                await oracle.prefill(victim)  # another prefix takes the freed page
                for _ in range(4):
                    seq.append(int((await adapter.decode(out.past_key_values, seq[-1])).argmax()))
                with contextlib.suppress(ConfigError):  # refusing is fine, if nothing
                    await adapter.commit_decoded(hit, out, seq[:-1])  # was written
            async with cache.fetch(victim) as hit:
                assert await oracle.check_hit(hit, victim) == 4
            cache.check_invariants()
    finally:
        torch.set_num_threads(before)
