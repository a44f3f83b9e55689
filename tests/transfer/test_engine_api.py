"""Choosing and driving the transfer engine through `HiCache`, on any machine.

- `engine=` takes an engine or a factory of one, called with the cache's pools;
- ``layer_ready(layer, stream=s)`` orders a compute stream after the layer's copies through
  the copies' CUDA events, without a host wait; loads without events are waited on the host;
- a CUDA device or backend that this machine cannot provide is a `ConfigError`.
"""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
import torch

from aiohicache import ConfigError, CpuTransferEngine, HiCache, TransferHandle
from aiohicache.memory import DevicePool, HostPool, PageIds
from tests.conftest import make_config, make_tokens, prefill, read_kv
from tests.test_api import evict_all


class MarkedEngine(CpuTransferEngine):
    """The CPU engine with a gate on loads, whose handles carry stand-in layer events."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool, inline_bytes=0)
        self.gate = threading.Event()
        self.gate.set()
        self.handles: list[TransferHandle] = []

    def load(self, host_pages: PageIds, device_pages: PageIds) -> TransferHandle:
        handle = super().load(host_pages, device_pages)
        handle._events = [("event", len(self.handles), layer)
                          for layer in range(handle.num_layers)]
        self.handles.append(handle)
        return handle

    def _run(self, src: PageIds, dst: PageIds, handle: TransferHandle,
             to_device: bool) -> None:
        if to_device:
            self.gate.wait()
        super()._run(src, dst, handle, to_device)


def marked_cache(**fields: object) -> tuple[HiCache, list[MarkedEngine]]:
    """A cache whose engine factory builds a `MarkedEngine` (listed once the cache opens)."""
    engines: list[MarkedEngine] = []

    def factory(device_pool: DevicePool, host_pool: HostPool) -> MarkedEngine:
        engines.append(MarkedEngine(device_pool, host_pool))
        return engines[-1]

    return HiCache(make_config(**fields), engine=factory), engines


class RecordingStream:
    """Stands in for a `torch.cuda.Stream`: records what it was told to wait for."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


async def test_an_engine_factory_is_called_with_the_caches_pools() -> None:
    made: list[tuple[DevicePool, HostPool]] = []

    def factory(device_pool: DevicePool, host_pool: HostPool) -> CpuTransferEngine:
        made.append((device_pool, host_pool))
        return CpuTransferEngine(device_pool, host_pool)

    async with HiCache(make_config(), engine=factory) as cache:
        assert made == [(cache.device_pool, cache.host_pool)]
        assert cache.controller.engine.device_pool is cache.device_pool
        await prefill(cache, make_tokens(12))


async def test_layer_ready_on_a_stream_makes_the_stream_wait_instead_of_the_host() -> None:
    cache, engines = marked_cache()
    async with cache:
        engine = engines[0]
        tokens = make_tokens(16)
        original = await prefill(cache, tokens)
        await evict_all(cache)
        engine.gate.clear()  # the load below stays in flight
        async with cache.fetch(tokens) as hit:
            stream = RecordingStream()
            await asyncio.wait_for(hit.layer_ready(1, stream=stream), 5)  # type: ignore[arg-type]
            assert stream.waited == [("event", 0, 1)]  # the layer's event, nothing else
            assert not engine.handles[0].layer_done(1)  # and the host did not wait
            host_wait = asyncio.ensure_future(hit.layer_ready(1))
            await anyio.wait_all_tasks_blocked()
            assert not host_wait.done()
            engine.gate.set()
            await asyncio.wait_for(host_wait, 5)
            await hit.ready()
            kv = read_kv(cache, hit.device_indices)
            assert torch.equal(kv.view(torch.uint8), original.view(torch.uint8))
        await cache.drain()
        cache.check_invariants()


async def test_cancelling_layer_ready_on_a_stream_before_launch_leaves_the_load_to_run() -> None:
    cache, engines = marked_cache(max_inflight_loads=1)
    async with cache:
        engine = engines[0]
        seqs = [make_tokens(16, seed=s) for s in (1, 2, 3)]
        kv = [await prefill(cache, tokens) for tokens in seqs]
        await evict_all(cache)
        engine.gate.clear()  # two loads in flight fill the worker; the third stays queued
        try:
            async with cache.fetch(seqs[0]), cache.fetch(seqs[1]), \
                    cache.fetch(seqs[2]) as hit:
                assert hit._jobs[0].handle is None, "the third load should wait for launch"
                stream = RecordingStream()
                waiting = asyncio.ensure_future(
                    hit.layer_ready(0, stream=stream))  # type: ignore[arg-type]
                await anyio.wait_all_tasks_blocked()
                assert not waiting.done()
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                assert stream.waited == []
                engine.gate.set()
                await asyncio.wait_for(hit.ready(), 5)  # the load itself was not cancelled
                assert torch.equal(read_kv(cache, hit.device_indices).view(torch.uint8),
                                   kv[2].view(torch.uint8))
        finally:
            engine.gate.set()
        await cache.drain()
        cache.check_invariants()


async def test_layer_ready_on_a_stream_waits_on_the_host_for_loads_without_events() -> None:
    async with HiCache(make_config()) as cache:
        tokens = make_tokens(16)
        await prefill(cache, tokens)
        await evict_all(cache)
        async with cache.fetch(tokens) as hit:
            stream = RecordingStream()
            await hit.layer_ready(2, stream=stream)  # type: ignore[arg-type]
            assert stream.waited == []
            handle = await hit._jobs[0].launched_handle()
            assert handle.layer_done(2) and handle.layer_event(2) is None


async def test_layer_ready_rejects_a_layer_the_model_does_not_have() -> None:
    async with HiCache(make_config()) as cache, cache.fetch(make_tokens(8)) as hit:
        for bad in (-1, 3, True, 1.0):
            with pytest.raises(ConfigError, match="layer"):
                await hit.layer_ready(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_device_this_machine_lacks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        HiCache(make_config(device="cuda"))


@pytest.mark.parametrize(("fields", "match"), [
    ({"device": "cpu", "io_backend": "kernel"}, "needs a CUDA device"),
    ({"device": "cpu", "io_backend": "direct"}, "needs a CUDA device"),
    ({"device": "cuda", "io_backend": "cpu"}, "CPU pools only"),
    ({"transfer_ctas": 0}, "transfer_ctas"),
    ({"transfer_ctas": 2000}, "transfer_ctas"),
])
def test_backend_choices_that_cannot_work_are_config_errors(fields: dict[str, object],
                                                            match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_config(**fields)


def test_the_cuda_engine_refuses_pools_it_cannot_copy() -> None:
    from aiohicache.transfer._cuda import CudaTransferEngine

    cfg = make_config()
    dev = DevicePool(cfg.spec, num_pages=4, page_size=4)
    host = HostPool(cfg.spec, num_pages=4, page_size=4)
    with pytest.raises(ConfigError, match="CUDA pool"):
        CudaTransferEngine(dev, host)
    assert not host.pinned


def test_the_cpu_engine_refuses_a_device_pool_not_in_cpu_memory() -> None:
    """With a GPU pool (`engine=CpuTransferEngine` on a CUDA cache) the first copy failed
    inside numpy; the engine now says so when it is made. "meta" stands in for a GPU here."""
    cfg = make_config()
    dev = DevicePool(cfg.spec, num_pages=4, page_size=4, device="meta")
    host = HostPool(cfg.spec, num_pages=4, page_size=4)
    with pytest.raises(ConfigError, match="CpuTransferEngine: the device pool is on meta"):
        CpuTransferEngine(dev, host)
