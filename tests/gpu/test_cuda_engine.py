"""The CUDA engine on a real GPU, against the CPU engine as reference (``make test-gpu``).

Every test here is marked `gpu` and skipped, with the reason, on a machine without CUDA.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import numpy as np
import pytest
import torch

from aiohicache import HiCache, KVSpec
from aiohicache.errors import PageError
from aiohicache.memory import DevicePool, HostPool
from aiohicache.transfer._cuda import CudaTransferEngine
from aiohicache.transfer._geometry import Geometry

from .. import transfer_matrix as tm
from ..conftest import make_config, make_tokens

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
        original = await prefill_u8(cache, tokens)
        await cache.drain()
        slots = await cache.allocate(cache.device_pool.num_slots)  # evict everything
        cache.free(slots)
        assert cache.stats().device_pages_used == 0
        async with cache.fetch(tokens) as hit:
            assert hit.num_host_hit_tokens == 5 * 16
            stream = torch.cuda.current_stream()
            for layer in range(spec.num_layers):
                await hit.layer_ready(layer, stream=stream)
            kv = read_kv_u8(cache, hit.device_indices)  # after the copies, on the GPU
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


# --- helpers that index fp8 CUDA tensors through uint8 views --------------------------------
# (torch has no Float8 index kernels on CUDA in some versions; bytes are what we compare)


def _rows_u8(pool: DevicePool, kv: int, layer: int) -> torch.Tensor:
    return pool.data[kv, layer].view(torch.uint8).view(pool.num_slots, -1)


def fill_kv_u8(cache: HiCache, slots: torch.Tensor, tokens: list[int]) -> None:
    """Write KV that encodes (token, layer, kv) into `slots`, byte-wise."""
    pool = cache.device_pool
    spec = cache.config.spec
    t = torch.tensor(tokens, dtype=torch.float64)
    for layer in range(spec.num_layers):
        for kv in range(spec.num_kv):
            rows = _rows_u8(pool, kv, layer)
            width = rows.shape[1] // pool.data.element_size()
            val = ((t * 0.5 + layer * 7 + kv * 3) % 251)[:, None].expand(-1, width)
            raw = val.to(pool.data.dtype).contiguous().view(torch.uint8)
            rows[slots] = raw.to(pool.device)


def read_kv_u8(cache: HiCache, slots: torch.Tensor) -> torch.Tensor:
    """All layers' KV bytes at `slots`."""
    pool = cache.device_pool
    return torch.stack([_rows_u8(pool, kv, layer)[slots]
                        for kv in range(pool.spec.num_kv)
                        for layer in range(pool.spec.num_layers)])


async def prefill_u8(cache: HiCache, tokens: list[int]) -> torch.Tensor:
    async with cache.fetch(tokens) as hit:
        await hit.ready()
        new = len(tokens) - hit.num_cached_tokens
        if new:
            slots = await hit.allocate(new)
            fill_kv_u8(cache, slots, tokens[hit.num_cached_tokens:])
            await hit.commit(tokens, slots)
        return read_kv_u8(cache, hit.device_indices[:hit.num_cached_tokens])


# --- server-sized cases, bit-exact against plain torch index copies ---------------------------


def torch_reference(dev: DevicePool, host: HostPool, src: np.ndarray, dst: np.ndarray, *,
                    to_device: bool) -> torch.Tensor:
    """The destination pool's bytes after the copy, computed with torch index copies on
    uint8 views (on the destination's device); negative ids skip."""
    keep = (src >= 0) & (dst >= 0)
    s = torch.from_numpy(src[keep].astype(np.int64))
    d = torch.from_numpy(dst[keep].astype(np.int64))
    out_pool = dev if to_device else host
    out = out_pool.data.view(torch.uint8).clone()
    view_of = (lambda t, kv, layer: t[kv, layer]) if to_device or host.layout == "layer_first" \
        else (lambda t, kv, layer: t[:, kv, layer])
    for layer in range(dev.spec.num_layers):
        for kv in range(dev.spec.num_kv):
            if to_device:
                src_rows = host.layer_view(kv, layer).view(torch.uint8)[s]
                out[kv, layer][d.to(out.device)] = src_rows.to(out.device)
            else:
                src_rows = dev.layer_view(kv, layer).view(torch.uint8)[s.to(dev.device)]
                view_of(out, kv, layer)[d] = src_rows.cpu()
    return out


def server_pools(row_bytes: int, page_size: int, tokens: int, *, layers: int = 2,
                 layout: Literal["layer_first", "page_first"] = "page_first",
                 mla: bool = False) -> tuple[DevicePool, HostPool]:
    if mla:
        spec = KVSpec.mla(num_layers=layers, kv_lora_rank=512, rope_dim=row_bytes - 512,
                          dtype="fp8")
    elif row_bytes >= 256:
        spec = KVSpec.mha(num_layers=layers, num_kv_heads=row_bytes // 256, head_dim=128,
                          dtype="bf16")
    else:
        spec = KVSpec.mha(num_layers=layers, num_kv_heads=1, head_dim=row_bytes, dtype="fp8")
    assert spec.row_bytes == row_bytes
    pages = -(-tokens // page_size)
    dev = DevicePool(spec, num_pages=pages, page_size=page_size, device="cuda")
    host = HostPool(spec, num_pages=pages + 7, page_size=page_size, layout=layout,
                    pin_memory=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    raw = dev.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=gen))
    hraw = host.data.view(torch.uint8)
    hraw.copy_(torch.randint(0, 256, hraw.shape, dtype=torch.uint8, device="cuda",
                             generator=gen))
    torch.cuda.synchronize()
    return dev, host


ROWS = [(128, False), (512, False), (2048, False), (576, True), (656, True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("row_bytes", "mla"), ROWS, ids=[f"{r}B" for r, _ in ROWS])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("copy_tokens", [1, 33, 131, 4104, 8192])
async def test_server_sized_copies_are_bit_exact_against_torch_index_copies(
        backend: Literal["kernel", "direct"], row_bytes: int, mla: bool, page_size: int,
        copy_tokens: int) -> None:
    """Pools of 16k tokens, 1..8192 tokens per copy; ids int32 or int64 by turns."""
    id_dtype = np.int32 if (copy_tokens + page_size) % 2 else np.int64
    dev, host = server_pools(row_bytes, page_size, 16384)
    n = -(-copy_tokens // page_size)
    rng = np.random.default_rng(copy_tokens + page_size)
    for to_device in (True, False):
        src_n, dst_n = (host.num_pages, dev.num_pages) if to_device \
            else (dev.num_pages, host.num_pages)
        src = rng.choice(src_n, n, replace=False).astype(id_dtype)
        dst = rng.choice(dst_n, n, replace=False).astype(id_dtype)
        expected = torch_reference(dev, host, src, dst, to_device=to_device)
        async with engine_on(dev, host, backend) as engine:  # unpins the host pool at exit
            await copy(engine, src, dst, to_device=to_device)
        got = (dev if to_device else host).data.view(torch.uint8)
        assert torch.equal(got, expected), f"{'H2D' if to_device else 'D2H'}"
        host = _repin(host)


def _repin(host: HostPool) -> HostPool:
    again = HostPool(host.spec, num_pages=host.num_pages, page_size=host.page_size,
                     layout=host.layout, pin_memory=True)
    again.data.copy_(host.data)
    return again


@pytest.mark.parametrize("backend", BACKENDS)
async def test_pools_over_4_gib_copy_pages_past_2_to_the_32(
        backend: Literal["kernel", "direct"]) -> None:
    # 16 layers x 2 kv x 2 KiB rows = 64 KiB per token: 80k tokens = 5 GiB per pool
    dev, host = server_pools(2048, 16, 80_000, layers=16)
    assert dev.nbytes > 1 << 32 and host.nbytes > 1 << 32
    last = dev.num_pages
    src = np.array([0, last - 1, last // 2, last - 5, 3], dtype=np.int64)  # ends of the pool
    dst = np.array([last - 1, 0, last - 2, 7, last // 3], dtype=np.int64)
    for to_device in (True, False):
        expected = torch_reference(dev, host, src, dst, to_device=to_device)
        async with engine_on(dev, host, backend) as engine:
            await copy(engine, src, dst, to_device=to_device)
        assert torch.equal((dev if to_device else host).data.view(torch.uint8), expected)
        host = _repin(host)


# --- ordering: fences, the current stream, many copies in flight ----------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_load_waits_for_work_queued_on_the_callers_current_stream(
        backend: Literal["kernel", "direct"]) -> None:
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    dev, host = cuda_twin(ref_dev, ref_host)
    tm.reference_copy(ref_dev, ref_host, np.array([1, 2]), np.array([3, 4]), to_device=True)
    side = torch.cuda.Stream()
    async with engine_on(dev, host, backend) as engine:
        with torch.cuda.stream(side):  # a non-default current stream
            torch.cuda._sleep(200_000_000)
            dev.data[:, :, 3:5].fill_(7.0)  # e.g. a zero-fill still queued
            handle = engine.load(np.array([1, 2]), np.array([3, 4]))
        await handle.wait()
    torch.cuda.synchronize()
    assert tm.same_bytes(dev.data, ref_dev.data), "the load ran before the queued fill"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_write_waits_for_the_fence_recorded_at_commit(
        backend: Literal["kernel", "direct"]) -> None:
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    dev, host = cuda_twin(ref_dev, ref_host)
    compute, other = torch.cuda.Stream(), torch.cuda.Stream()
    async with engine_on(dev, host, backend) as engine:
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)
            dev.data[:, :, 2].fill_(3.0)  # the forward pass writes the KV
            fence = engine.fence()  # commit
        with torch.cuda.stream(other):  # the write is launched elsewhere (a worker task)
            handle = engine.write(np.array([2]), np.array([7]), fences=[fence])
        await handle.wait()
        assert bool((host.data[7] == 3.0).all()), "the backup copied KV before it was written"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_many_loads_and_writes_in_flight_before_any_is_awaited(
        backend: Literal["kernel", "direct"]) -> None:
    dev, host = server_pools(512, 16, 8192, layers=4)
    rng = np.random.default_rng(0)
    host_pages = rng.permutation(host.num_pages)
    dev_pages = rng.permutation(dev.num_pages)
    loads = [(host_pages[i * 4:(i + 1) * 4], dev_pages[i * 4:(i + 1) * 4]) for i in range(64)]
    writes = [(dev_pages[256 + i * 4:256 + (i + 1) * 4], host_pages[256 + i * 4:260 + i * 4])
              for i in range(64)]
    want_dev = torch_reference(dev, host, np.concatenate([s for s, _ in loads]),
                               np.concatenate([d for _, d in loads]), to_device=True)
    want_host = torch_reference(dev, host, np.concatenate([s for s, _ in writes]),
                                np.concatenate([d for _, d in writes]), to_device=False)
    async with engine_on(dev, host, backend) as engine:
        handles = [engine.load(s, d) for s, d in loads] + [engine.write(s, d)
                                                           for s, d in writes]
        await asyncio.gather(*(h.wait() for h in handles))
        assert all(h.layer_event(0) is None for h in handles)  # settled: events reused
    assert torch.equal(dev.data.view(torch.uint8), want_dev)
    assert torch.equal(host.data.view(torch.uint8), want_host)


async def test_a_page_id_past_the_pool_is_refused_before_launch() -> None:
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    dev, host = cuda_twin(ref_dev, ref_host)
    async with engine_on(dev, host, "kernel") as engine:
        with pytest.raises(PageError, match="past the device pool"):
            engine.load(np.array([0]), np.array([dev.num_pages]))
    torch.cuda.synchronize()  # the context is alive: nothing ran out of bounds
    assert tm.same_bytes(dev.data, ref_dev.data)


async def test_index_tensors_do_not_wait_for_the_gpu() -> None:
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16")
    dev = DevicePool(spec, num_pages=64, page_size=16, device="cuda")
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s queued on the current stream
    start = time.perf_counter()
    slots = dev.pages_to_slots(np.array([3, 9]))
    other = dev.index_tensor(np.arange(5))
    elapsed = time.perf_counter() - start
    assert elapsed < 0.1, f"index tensors waited {elapsed:.3f} s for the GPU"
    torch.cuda.synchronize()
    assert slots.tolist() == dev.page_slots(np.array([3, 9])).tolist()
    assert other.tolist() == list(range(5))
