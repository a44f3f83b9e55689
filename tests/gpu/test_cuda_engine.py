"""The CUDA engine on a real GPU, against the CPU engine as reference (``make test-gpu``).

Every test here is marked `gpu` and skipped, with the reason, on a machine without CUDA.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import numpy as np
import pytest
import torch

from aiohicache import HiCache, KVSpec
from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer.cuda import CudaTransferEngine
from aiohicache.transfer.geometry import Geometry

from .. import transfer_matrix as tm
from ..conftest import make_config, make_tokens, prefill, read_kv

pytestmark = pytest.mark.gpu

BACKENDS: list[Literal["kernel", "direct"]] = ["kernel", "direct"]
GUARD = 0xA5


def cuda_twin(dev: DevicePool, host: HostPool) -> tuple[DevicePool, HostPool]:
    """CUDA device pool and pinned host pool holding the same bytes as the CPU pools."""
    spec, ps = dev.spec, dev.page_size
    cdev = DevicePool(spec, num_pages=dev.num_pages, page_size=ps, device="cuda")
    chost = HostPool(spec, num_pages=host.num_pages, page_size=ps, layout=host.layout,
                     pin_memory=True)
    cdev.data.view(torch.uint8).copy_(dev.data.view(torch.uint8))
    chost.data.view(torch.uint8).copy_(host.data.view(torch.uint8))
    return cdev, chost


@asynccontextmanager
async def engine_on(dev: DevicePool, host: HostPool, backend: Literal["kernel", "direct"],
                    **kwargs: object) -> AsyncIterator[CudaTransferEngine]:
    engine = CudaTransferEngine(dev, host, backend=backend, **kwargs)  # type: ignore[arg-type]
    try:
        yield engine
    finally:
        await engine.aclose()
        host.close()


async def copy(engine: CudaTransferEngine, src: np.ndarray, dst: np.ndarray, *,
               to_device: bool) -> None:
    handle = engine.load(src, dst) if to_device else engine.write(src, dst)
    await handle.wait()


@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize("page_size", tm.PAGE_SIZES)
@pytest.mark.parametrize("model", tm.MODELS)
@pytest.mark.parametrize("dtype", tm.DTYPES)
async def test_cuda_copies_are_bit_exact_against_the_cpu_engine(
        dtype: str, model: str, page_size: int, layout: Literal["layer_first",
                                                                "page_first"]) -> None:
    for backend in BACKENDS:
        for to_device in (True, False):
            for order in tm.ORDERS:
                ref_dev, ref_host = tm.cpu_pools(model, dtype, page_size, layout)
                dev, host = cuda_twin(ref_dev, ref_host)
                src, dst = tm.page_pairs(order, to_device=to_device)
                tm.reference_copy(ref_dev, ref_host, src, dst, to_device=to_device)
                async with engine_on(dev, host, backend) as engine:
                    await copy(engine, src, dst, to_device=to_device)
                    where = f"{engine!r} {'H2D' if to_device else 'D2H'} {order}"
                    assert tm.same_bytes(dev.data, ref_dev.data), where
                    assert tm.same_bytes(host.data, ref_host.data), where


@pytest.mark.parametrize(("heads", "head_dim", "dtype", "page_size", "width"), tm.ODD_ROWS)
async def test_odd_rows_copy_exactly_with_narrower_vectors(
        heads: int, head_dim: int, dtype: str, page_size: int, width: int) -> None:
    ref_dev, ref_host = tm.odd_row_pools(heads, head_dim, dtype, page_size)
    dev, host = cuda_twin(ref_dev, ref_host)
    src, dst = tm.ODD_PAIRS
    tm.reference_copy(ref_dev, ref_host, src, dst, to_device=True)
    async with engine_on(dev, host, "kernel") as engine:
        assert engine.width == width
        await copy(engine, src, dst, to_device=True)
        assert tm.same_bytes(dev.data, ref_dev.data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", tm.LAYOUTS)
async def test_copies_never_touch_bytes_outside_the_pools(
        backend: Literal["kernel", "direct"], layout: Literal["layer_first",
                                                              "page_first"]) -> None:
    ref_dev, ref_host = tm.cpu_pools("mla-656", "fp8", 16, layout)
    dev, host = cuda_twin(ref_dev, ref_host)
    guard = 1 << 16
    dev_buf = _guarded(dev.data, guard, device="cuda")
    host_buf = _guarded(host.data, guard, device="cpu")
    dev.data, host.data = _inner(dev_buf, dev.data, guard), _inner(host_buf, host.data, guard)
    host.close()  # the original allocation is no longer used; the guarded one is torch-pinned
    assert host.pinned
    async with engine_on(dev, host, backend) as engine:
        for to_device in (True, False):
            src, dst = tm.page_pairs("random", to_device=to_device)
            tm.reference_copy(ref_dev, ref_host, src, dst, to_device=to_device)
            await copy(engine, src, dst, to_device=to_device)
        assert tm.same_bytes(dev.data, ref_dev.data) and tm.same_bytes(host.data, ref_host.data)
        for buf in (dev_buf.cpu(), host_buf):
            assert bool((buf[:guard] == GUARD).all()) and bool((buf[-guard:] == GUARD).all())


def _guarded(data: torch.Tensor, guard: int, *, device: str) -> torch.Tensor:
    nbytes = data.numel() * data.element_size()
    buf = torch.full((nbytes + 2 * guard,), GUARD, dtype=torch.uint8,
                     pin_memory=device == "cpu", device=device)
    buf[guard:guard + nbytes].copy_(data.view(torch.uint8).reshape(-1))
    return buf


def _inner(buf: torch.Tensor, like: torch.Tensor, guard: int) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return buf[guard:guard + nbytes].view(like.dtype).view(like.shape)


async def test_a_negative_page_id_skips_the_pair_on_the_gpu() -> None:
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    dev, host = cuda_twin(ref_dev, ref_host)
    async with engine_on(dev, host, "kernel") as engine:
        await copy(engine, np.array([0, -1, 2, 3]), np.array([4, 5, -1, 6]), to_device=True)
    tm.reference_copy(ref_dev, ref_host, np.array([0, 3]), np.array([4, 6]), to_device=True)
    assert tm.same_bytes(dev.data, ref_dev.data)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_each_layer_has_an_event_a_compute_stream_can_wait_on(
        backend: Literal["kernel", "direct"]) -> None:
    spec = KVSpec.mha(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bf16")
    ref_dev = DevicePool(spec, num_pages=64, page_size=64)
    ref_host = HostPool(spec, num_pages=64, page_size=64, layout="page_first")
    tm.random_fill(ref_dev, 1)
    tm.random_fill(ref_host, 2)
    dev, host = cuda_twin(ref_dev, ref_host)
    pages = np.random.default_rng(0).permutation(64)
    tm.reference_copy(ref_dev, ref_host, pages, pages, to_device=True)
    compute = torch.cuda.Stream()
    async with engine_on(dev, host, backend) as engine:
        handle = engine.load(pages, pages)
        seen = []
        with torch.cuda.stream(compute):
            for layer in range(spec.num_layers):
                compute.wait_event(handle.layer_event(layer))  # type: ignore[arg-type]
                seen.append(dev.data[:, layer].clone())  # runs after the layer's copy, on GPU
        await handle.wait()
        compute.synchronize()
        for layer in range(spec.num_layers):
            assert tm.same_bytes(seen[layer], ref_dev.data[:, layer]), f"layer {layer}"
            assert handle.layer_done(layer)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_write_waits_for_the_producer_stream(backend: Literal["kernel",
                                                                      "direct"]) -> None:
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    dev, host = cuda_twin(ref_dev, ref_host)
    producer = torch.cuda.Stream()
    async with engine_on(dev, host, backend, producer_stream=producer) as engine:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the forward "writes"
            dev.data[:, :, 2].fill_(3.0)
        await copy(engine, np.array([2]), np.array([7]), to_device=False)
        assert bool((host.data[7] == 3.0).all()), "the backup copied KV before it was written"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancelling_a_wait_mid_copy_leaves_the_copy_to_finish(
        backend: Literal["kernel", "direct"]) -> None:
    spec = KVSpec.mha(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bf16")
    ref_dev = DevicePool(spec, num_pages=256, page_size=64)  # 1 GiB per pool
    ref_host = HostPool(spec, num_pages=256, page_size=64, layout="page_first")
    tm.random_fill(ref_dev, 1)
    tm.random_fill(ref_host, 2)
    dev, host = cuda_twin(ref_dev, ref_host)
    pages = np.arange(256)
    tm.reference_copy(ref_dev, ref_host, pages, pages, to_device=True)
    async with engine_on(dev, host, backend) as engine:
        handle = engine.load(pages, pages)
        waiter = asyncio.ensure_future(handle.wait_layer(15))
        await asyncio.sleep(0)
        assert not handle.done(), "the copy finished before it could be cancelled"
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await handle.wait()  # the copy itself was not cancelled
        assert handle.exception() is None
        assert tm.same_bytes(dev.data, ref_dev.data)
    assert not host.pinned


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
async def test_hicache_on_cuda_serves_identical_kv_after_a_host_round_trip(
        backend: str, mla: bool) -> None:
    spec = tm.spec("mla-656", "fp8") if mla else tm.spec("mha", "bf16")
    cfg = make_config(spec=spec, device="cuda", io_backend=backend, page_size=16,
                      device_pages=16, host_pages=64)
    async with HiCache(cfg) as cache:
        assert cache.host_pool.pinned
        tokens = make_tokens(5 * 16)
        original = await prefill(cache, tokens)
        await cache.drain()
        slots = await cache.allocate(cache.device_pool.num_slots)  # evict everything
        cache.free(slots)
        assert cache.stats().device_pages_used == 0
        async with cache.fetch(tokens) as hit:
            assert hit.num_host_hit_tokens == 5 * 16
            stream = torch.cuda.current_stream()
            for layer in range(spec.num_layers):
                await hit.layer_ready(layer, stream=stream)
            kv = read_kv(cache, hit.device_indices)  # ordered after the copies on the GPU
            assert tm.same_bytes(kv, original)
        await cache.drain()
        cache.check_invariants()
    assert not cache.host_pool.pinned


async def test_the_kernel_path_uses_16_byte_vectors_for_the_documented_rows() -> None:
    for model in ("mla-576", "mla-656"):
        ref_dev, ref_host = tm.cpu_pools(model, "fp8", 1, "page_first")
        dev, host = cuda_twin(ref_dev, ref_host)
        async with engine_on(dev, host, "kernel") as engine:
            assert engine.width == 16
            assert Geometry.of(dev, host).chunk_bytes in (576, 656)
