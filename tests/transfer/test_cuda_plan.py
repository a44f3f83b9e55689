"""The CUDA path without a GPU: launch arithmetic, kernel sources, waiter thread, pinning.

The kernel and copy-engine arguments the engine computes are executed on CPU memory by
`tests.cuda_reference` and must match the CPU engine byte for byte over the whole transfer
matrix; the kernels must compile with NVRTC exactly as the engine compiles them. The `gpu`
tests (tests/gpu) run the same matrix through CUDA.
"""

from __future__ import annotations

import asyncio
import gc
import mmap
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch

from aiohicache import ConfigError, KVSpec
from aiohicache.errors import PageError
from aiohicache.memory import DevicePool, HostPool
from aiohicache.memory._pinned import Registration
from aiohicache.transfer import _cuda_kernels as kernels
from aiohicache.transfer import _geometry as geometry
from aiohicache.transfer._geometry import (
    Geometry,
    Side,
    check_page_ids,
    coalesce,
    direct_copies,
    kernel_launches,
    layer_spans,
)
from aiohicache.transfer._waiter import EventWaiter
from tests import transfer_matrix as tm
from tests.conftest import until
from tests.cuda_reference import Memory, host_kernel, run_direct, run_kernel

HOST = host_kernel()
needs_gxx = pytest.mark.skipif(HOST is None, reason="g++ not installed")
KERNEL_RUNNERS = ["kernel-numpy", *(["kernel-host"] if HOST is not None else [])]
"""`kernel-host` runs kernels/page_copy.cu itself (as host C++), `kernel-numpy` its twin."""


def emulate(dev: DevicePool, host: HostPool, src: np.ndarray, dst: np.ndarray, *,
            to_device: bool, backend: str, max_pitch: int = 1 << 31, ctas: int = 4,
            threads: int = 512) -> None:
    """Run the engine's launch plan for one copy on CPU memory (what the GPU would do).

    `backend`: ``kernel-host`` (the real kernel source), ``kernel-numpy`` or ``kernel``
    (its numpy twin), or ``direct``.
    """
    g = Geometry.of(dev, host)
    if backend.startswith("kernel"):
        ids = np.concatenate([src, dst]).astype(np.int64)
        memory = Memory(dev.data, host.data, ids)
        table = kernels.LaunchTable(g, to_device=to_device, width=g.vector_width(), ctas=ctas,
                                    threads=threads)
        plan = table.plan(len(src), ids.ctypes.data, ids.ctypes.data + 8 * len(src))
        for span in plan.spans:
            for i in span:
                run_launch(memory, backend, plan.width, plan.grids[i], threads,
                           plan.params[i:i + 1])
        return
    memory = Memory(dev.data, host.data)
    for span in layer_spans(g.num_layers, to_device=to_device):
        run_direct(memory, list(direct_copies(g, coalesce(src, dst), to_device=to_device,
                                              layers=span, max_pitch=max_pitch)))


def run_launch(memory: Memory, backend: str, width: int, grid: int, threads: int,
               params: np.ndarray) -> None:
    if backend == "kernel-host":
        assert HOST is not None
        HOST.launch(width, grid, threads, params)
    else:
        run_kernel(memory, width, params)


@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize("page_size", tm.PAGE_SIZES)
@pytest.mark.parametrize("model", tm.MODELS)
@pytest.mark.parametrize("dtype", tm.DTYPES)
def test_launch_plans_copy_exactly_what_the_cpu_engine_copies(
        dtype: str, model: str, page_size: int, layout: str) -> None:
    dev, host = tm.cpu_pools(model, dtype, page_size, layout)  # type: ignore[arg-type]
    ref_dev, ref_host = tm.cpu_pools(model, dtype, page_size, layout)  # type: ignore[arg-type]
    fresh = dev.data.clone(), host.data.clone()
    for to_device in (True, False):
        for order in tm.ORDERS:
            src, dst = tm.page_pairs(order, to_device=to_device)
            ref_dev.data.copy_(fresh[0])
            ref_host.data.copy_(fresh[1])
            tm.reference_copy(ref_dev, ref_host, src, dst, to_device=to_device)
            for backend in (*KERNEL_RUNNERS, "direct"):
                dev.data.copy_(fresh[0])
                host.data.copy_(fresh[1])
                emulate(dev, host, src, dst, to_device=to_device, backend=backend)
                where = f"{backend} {'H2D' if to_device else 'D2H'} {order}"
                assert tm.same_bytes(dev.data, ref_dev.data), where
                assert tm.same_bytes(host.data, ref_host.data), where


def test_576_and_656_byte_rows_take_16_byte_vectors() -> None:
    for model, row in (("mla-576", 576), ("mla-656", 656)):
        dev, host = tm.cpu_pools(model, "fp8", 1, "page_first")
        g = Geometry.of(dev, host)
        assert g.chunk_bytes == row
        assert g.vector_width() == 16


@pytest.mark.parametrize(("heads", "head_dim", "dtype", "page_size", "width"), tm.ODD_ROWS)
def test_odd_rows_take_the_widest_vector_that_divides_every_address(
        heads: int, head_dim: int, dtype: str, page_size: int, width: int) -> None:
    dev, host = tm.odd_row_pools(heads, head_dim, dtype, page_size)
    ref_dev, ref_host = tm.odd_row_pools(heads, head_dim, dtype, page_size)
    assert Geometry.of(dev, host).vector_width() == width
    src, dst = tm.ODD_PAIRS
    tm.reference_copy(ref_dev, ref_host, src, dst, to_device=True)
    emulate(dev, host, src, dst, to_device=True, backend="kernel")
    assert tm.same_bytes(dev.data, ref_dev.data)


@pytest.mark.parametrize("backend", KERNEL_RUNNERS)
def test_a_negative_page_id_skips_the_pair(backend: str) -> None:
    dev, host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    before = dev.data.clone()
    src, dst = np.array([0, -1, 2, 3]), np.array([4, 5, -1, 6])
    emulate(dev, host, src, dst, to_device=True, backend=backend)
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    tm.reference_copy(ref_dev, ref_host, np.array([0, 3]), np.array([4, 6]), to_device=True)
    assert tm.same_bytes(dev.data, ref_dev.data)
    assert tm.same_bytes(dev.data[:, :, 5], before[:, :, 5])
    assert coalesce(src, dst) == [(0, 4, 1), (3, 6, 1)]


@pytest.mark.parametrize("backend", KERNEL_RUNNERS)
@pytest.mark.parametrize("to_device", [True, False], ids=["H2D", "D2H"])
def test_launches_split_to_keep_32_bit_chunk_counters(monkeypatch: pytest.MonkeyPatch,
                                                      backend: str, to_device: bool) -> None:
    monkeypatch.setattr(geometry, "MAX_CHUNKS", 8)  # a page here is 2 chunks per layer
    monkeypatch.setattr(kernels, "MAX_CHUNKS", 8)
    dev, host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    g = Geometry.of(dev, host)
    launches = kernel_launches(g, 5, to_device=True, width=16, layers=(0, 3))
    assert [(launch.start, launch.stop) for launch in launches] == [(i, i + 1)
                                                                    for i in range(5)]
    launches = kernel_launches(g, 5, to_device=True, width=16, layers=(0, 1))
    assert [(launch.start, launch.stop) for launch in launches] == [(0, 3), (3, 5)]
    assert all(launch.num_chunks < 8 for launch in launches)
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    src, dst = tm.page_pairs("random", to_device=to_device)
    tm.reference_copy(ref_dev, ref_host, src, dst, to_device=to_device)
    emulate(dev, host, src, dst, to_device=to_device, backend=backend)
    assert tm.same_bytes(dev.data, ref_dev.data)
    assert tm.same_bytes(host.data, ref_host.data)


def test_a_launch_table_packs_what_kernel_launches_computes() -> None:
    dev, host = tm.cpu_pools("mla-656", "fp8", 16, "page_first")
    g = Geometry.of(dev, host)
    for to_device in (True, False):
        table = kernels.LaunchTable(g, to_device=to_device, width=16, ctas=4, threads=512)
        plan = table.plan(37, 1000, 2000)
        for s, span in enumerate(layer_spans(g.num_layers, to_device=to_device)):
            (launch,) = kernel_launches(g, 37, to_device=to_device, width=16, layers=span)
            (i,) = plan.spans[s]
            assert plan.params[i:i + 1].tobytes() == \
                kernels.pack_params(launch, 1000, 2000).tobytes()
            assert plan.grids[i] == launch.grid(4, 512)
        empty = table.plan(0, 0, 0)
        assert all(len(span) == 0 for span in empty.spans)


@pytest.mark.parametrize(("chunk_bytes", "width", "lanes"), [
    (16, 16, 1), (128, 16, 8), (256, 16, 8), (576, 16, 16), (656, 16, 16), (2048, 16, 32),
    (288 << 10, 16, 32), (24, 8, 4), (6, 2, 4), (3, 1, 4), (4096, 4, 32)])
def test_a_group_spans_a_pcie_read_and_covers_small_chunks_in_one_pass(
        chunk_bytes: int, width: int, lanes: int) -> None:
    units = chunk_bytes // width
    assert 1 << geometry.group_shift(units, width) == lanes



def test_direct_copies_merge_runs_and_fall_back_per_page_above_the_pitch_limit() -> None:
    dev, host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    g = Geometry.of(dev, host)
    runs = coalesce(np.arange(3, 8), np.arange(1, 6))
    assert runs == [(3, 1, 5)]
    merged = list(direct_copies(g, runs, to_device=True, layers=(0, 1), max_pitch=1 << 31))
    assert [(c.height, c.width, c.spitch) for c in merged] == [(5, g.chunk_bytes,
                                                                 g.chunk_bytes)] * 2
    split = list(direct_copies(g, runs, to_device=True, layers=(0, 1), max_pitch=16))
    assert len(split) == 10 and all(c.height == 1 for c in split)
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    src, dst = np.arange(3, 8), np.arange(1, 6)
    tm.reference_copy(ref_dev, ref_host, src, dst, to_device=True)
    emulate(dev, host, src, dst, to_device=True, backend="direct", max_pitch=16)
    assert tm.same_bytes(dev.data, ref_dev.data)


def test_side_strides_are_read_off_each_layout() -> None:
    spec = tm.spec("mha", "bf16")
    dev = DevicePool(spec, num_pages=4, page_size=16)
    chunk = 16 * spec.row_bytes
    assert Side.of(dev) == Side(dev.data.data_ptr(), chunk, 3 * 4 * chunk, 4 * chunk)
    pf = HostPool(spec, num_pages=4, page_size=16, layout="page_first")
    assert Side.of(pf) == Side(pf.data.data_ptr(), 2 * 3 * chunk, 3 * chunk, chunk)


def test_mismatched_pools_are_a_config_error() -> None:
    dev = DevicePool(tm.spec("mha", "bf16"), num_pages=4, page_size=16)
    host = HostPool(tm.spec("mha", "fp16"), num_pages=4, page_size=16)
    with pytest.raises(ConfigError, match="spec"):
        Geometry.of(dev, host)


# --- kernel sources ---------------------------------------------------------------------


def test_kernels_ship_as_package_data() -> None:
    text = kernels.source()
    assert all(f'AIOHICACHE_COPY_PAGES({name},' in text for name in kernels.kernel_names())
    assert list(kernels.sources()) == ["page_copy.cu"]


def _nvrtc_available() -> bool:
    try:
        kernels.nvrtc_compile("extern \"C\" __global__ void k() {}", "probe.cu")
    except ConfigError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(),
                                 reason="CuPy or NVRTC not installed (pip install '.[cuda]')")


@needs_nvrtc
@pytest.mark.parametrize("name", sorted(kernels.sources()))
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_every_kernel_compiles_with_nvrtc_as_the_engine_compiles_it(name: str,
                                                                     arch: str) -> None:
    ptx = kernels.nvrtc_check(name, arch=arch).decode()
    for entry in kernels.kernel_names():
        assert f".entry {entry}(" in ptx
    assert "ld.global.cs.v4" in ptx  # the 16-byte variant streams


@needs_nvrtc
def test_a_kernel_that_does_not_compile_is_a_config_error_with_the_log() -> None:
    with pytest.raises(ConfigError, match="undefined"):
        kernels.nvrtc_compile("extern \"C\" __global__ void k() { undefined_fn(); }", "bad.cu")


def test_importing_aiohicache_does_not_import_cupy() -> None:
    code = ("import sys, aiohicache, aiohicache.transfer._cuda_kernels, aiohicache.transfer._cuda;"
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the waiter thread ------------------------------------------------------------------


class ThreadEvent:
    """Stands in for a CUDA event: `synchronize()` blocks until the test sets it."""

    def __init__(self, fail: bool = False) -> None:
        self._set = threading.Event()
        self.fail = fail
        self.waited_on: str | None = None

    def set(self) -> None:
        self._set.set()

    def synchronize(self) -> None:
        self.waited_on = threading.current_thread().name
        assert self._set.wait(10)
        if self.fail:
            raise RuntimeError("cudaErrorIllegalAddress")


async def test_the_waiter_reports_each_event_in_order_on_the_loop() -> None:
    waiter = EventWaiter("test-waiter")
    events = [ThreadEvent() for _ in range(3)]
    seen: list[object] = []
    done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    loop_thread = threading.current_thread()

    def on_event(i: int) -> None:
        assert threading.current_thread() is loop_thread
        seen.append(i)

    waiter.watch(events, on_event=on_event, on_done=done.set_result)
    await asyncio.sleep(0.01)
    assert seen == []  # nothing completed: the loop was free all along
    events[0].set()
    await until(lambda: seen == [0])
    events[2].set()  # out of order: still reported in stream order
    await asyncio.sleep(0.01)
    assert seen == [0]
    events[1].set()
    assert await asyncio.wait_for(done, 5) is None
    assert seen == [0, 1, 2]
    assert events[0].waited_on == "test-waiter"
    await waiter.aclose()


async def test_a_failed_event_fails_its_copy_and_the_next_copy_still_completes() -> None:
    waiter = EventWaiter("test-waiter")
    bad, good = ThreadEvent(fail=True), ThreadEvent()
    results: list[BaseException | None] = []
    waiter.watch([bad], on_event=lambda i: None, on_done=results.append)
    waiter.watch([good], on_event=lambda i: None, on_done=results.append)
    bad.set()
    good.set()
    await until(lambda: len(results) == 2)
    assert isinstance(results[0], RuntimeError) and results[1] is None
    await waiter.aclose()


async def test_cancelling_aclose_mid_flight_still_reports_and_stops_the_thread() -> None:
    waiter = EventWaiter("test-waiter")
    event = ThreadEvent()
    results: list[BaseException | None] = []
    waiter.watch([event], on_event=lambda i: None, on_done=results.append)
    closing = asyncio.ensure_future(waiter.aclose())
    await asyncio.sleep(0.01)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    with pytest.raises(RuntimeError, match="closed"):
        waiter.watch([ThreadEvent()], on_event=lambda i: None, on_done=results.append)
    event.set()
    await until(lambda: results == [None])  # the copy in flight was still reported
    await waiter.aclose()  # and the thread stopped
    assert not waiter._thread.is_alive()


# --- exact-size pinning -----------------------------------------------------------------


class RecordingCudart:
    """Stands in for ``torch.cuda.cudart()``: records calls, returns a CUDA status."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        return self.status

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0


def test_registration_locks_exactly_the_tensors_bytes_and_undoes_it_once() -> None:
    cudart = RecordingCudart()
    data = torch.zeros(3 * 1000 + 7, dtype=torch.uint8)
    reg = Registration(data, cudart=cudart)
    assert cudart.calls == [("register", data.data_ptr(), 3007)]  # not rounded up
    assert reg.active
    reg.close()
    reg.close()
    assert cudart.calls[1:] == [("unregister", data.data_ptr(), 0)]
    assert not reg.active


def test_a_dropped_registration_unregisters_before_its_memory_is_freed() -> None:
    cudart = RecordingCudart()
    data = torch.zeros(4096, dtype=torch.uint8)
    ptr = data.data_ptr()
    Registration(data, cudart=cudart)
    del data
    gc.collect()
    assert cudart.calls == [("register", ptr, 4096), ("unregister", ptr, 0)]


class StrictCudart(RecordingCudart):
    """As CUDA does: a null pointer or a size of 0 is ``cudaErrorInvalidValue`` (1)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        super().cudaHostRegister(ptr, size, flags)
        return 1 if ptr == 0 or size == 0 else 0

    def cudaHostUnregister(self, ptr: int) -> int:
        super().cudaHostUnregister(ptr)
        return 1 if ptr == 0 else 0


def test_an_empty_host_pool_is_pinned_without_asking_cuda() -> None:
    """host_pages=0 (no L2) on CUDA pins a pool of 0 bytes, which CUDA refuses to register:
    there is nothing to lock, so nothing is registered and the pool still counts as pinned."""
    cudart = StrictCudart()
    data = torch.zeros((0, 2, 3, 4, 8), dtype=torch.bfloat16)
    reg = Registration(data, cudart=cudart)
    assert reg.active and reg.nbytes == 0
    reg.close()
    assert not reg.active and cudart.calls == []


def test_a_failed_registration_is_a_config_error_saying_what_to_change() -> None:
    """A pool the memlock limit refuses (CUDA error 2 in a container) names the limit and
    the pool's size, the two things a user can change (the kernels need a locked pool)."""
    with pytest.raises(ConfigError, match="cudaHostRegister") as info:
        Registration(torch.zeros(16), cudart=RecordingCudart(status=2))
    assert "ulimit -l" in str(info.value) and "host_ratio" in str(info.value)


def test_pinning_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        HostPool(tm.spec("mha", "bf16"), num_pages=2, page_size=4, pin_memory=True)


# --- the real kernel source on the CPU ----------------------------------------------------


def _random_case(rng: np.random.Generator) -> tuple[DevicePool, HostPool, np.ndarray,
                                                      np.ndarray, bool]:
    """Random pools (any row width, layout, MHA/MLA, layers) and a copy with skips."""
    heads = int(rng.choice([1, 2, 3]))
    head_dim = int(rng.choice([1, 3, 8, 16, 72, 128]))
    dtype = str(rng.choice(["fp8", "bf16", "fp16"]))
    page_size = int(rng.choice([1, 2, 16, 64]))
    layers = int(rng.integers(1, 5))
    if rng.random() < 0.3:
        spec = KVSpec.mla(num_layers=layers, kv_lora_rank=512,
                          rope_dim=int(rng.choice([64, 144])), dtype=dtype)
    else:
        spec = KVSpec.mha(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    dev_pages, host_pages = int(rng.integers(3, 12)), int(rng.integers(3, 12))
    dev = DevicePool(spec, num_pages=dev_pages, page_size=page_size)
    host = HostPool(spec, num_pages=host_pages, page_size=page_size,
                    layout="page_first" if rng.random() < 0.5 else "layer_first")
    tm.random_fill(dev, int(rng.integers(1 << 30)))
    tm.random_fill(host, int(rng.integers(1 << 30)))
    to_device = bool(rng.random() < 0.5)
    n = int(rng.integers(1, min(dev_pages, host_pages) + 1))
    src = rng.choice(host_pages if to_device else dev_pages, n, replace=False)
    dst = rng.choice(dev_pages if to_device else host_pages, n, replace=False)
    src[rng.random(n) < 0.15] = -1
    dst[rng.random(n) < 0.15] = -1
    return dev, host, src.astype(np.int64), dst.astype(np.int64), to_device


@needs_gxx
@pytest.mark.parametrize("seed", range(40))
def test_the_real_kernel_source_matches_the_cpu_engine_on_random_cases(seed: int) -> None:
    rng = np.random.default_rng(seed)
    dev, host, src, dst, to_device = _random_case(rng)
    ref_dev, ref_host = dev.data.clone(), host.data.clone()
    ctas, threads = int(rng.choice([1, 2, 3, 4])), int(rng.choice([32, 64, 128, 512]))
    g = Geometry.of(dev, host)
    assert HOST is not None
    stored = HOST.stored_bytes
    emulate(dev, host, src, dst, to_device=to_device, backend="kernel-host", ctas=ctas,
            threads=threads)
    ref = DevicePool(dev.spec, num_pages=dev.num_pages, page_size=dev.page_size)
    refh = HostPool(host.spec, num_pages=host.num_pages, page_size=host.page_size,
                    layout=host.layout)
    ref.data.copy_(ref_dev)
    refh.data.copy_(ref_host)
    keep = (src >= 0) & (dst >= 0)
    tm.reference_copy(ref, refh, src[keep], dst[keep], to_device=to_device)
    assert tm.same_bytes(dev.data, ref.data)
    assert tm.same_bytes(host.data, refh.data)
    if g.vector_width() >= 4:  # __stcs counts: every copied byte stored exactly once
        layers = 1 if to_device else g.num_layers
        per_copy = int(keep.sum()) * g.num_kv * layers * g.chunk_bytes
        spans = g.num_layers if to_device else 1
        assert HOST.stored_bytes - stored == per_copy * spans


@needs_gxx
def test_the_real_kernel_addresses_offsets_past_4_gib() -> None:
    """Pages 4 GiB and more into a pool: the kernel's 64-bit address arithmetic."""
    size = 5 << 30
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                       | getattr(mmap, "MAP_NORESERVE", 0))
    try:
        data = np.frombuffer(region, dtype=np.uint8)
        base = data.ctypes.data
        chunk, page = 4096, (1 << 30) + 4096  # a page stride past 2^30: page 4 is past 4 GiB
        src_side = Side(base, page, chunk, 2 * chunk)  # 2 kv, 2 layers per page
        dst_side = Side(base + 2 * page + 8 * chunk, 8 * chunk, chunk, 2 * chunk)
        src_ids = np.array([4, 0, 3], dtype=np.int64)
        dst_ids = np.array([0, 1, 2], dtype=np.int64)
        rng = np.random.default_rng(0)
        for p in src_ids:
            at = int(p) * page
            data[at:at + 4 * chunk] = rng.integers(0, 256, 4 * chunk, dtype=np.uint8)
        launch = geometry.KernelLaunch(16, src_side, dst_side, 0, 3, 2, 0, 2, chunk // 16,
                                       geometry.group_shift(chunk // 16, 16))
        ids = np.concatenate([src_ids, dst_ids])
        params = kernels.pack_params(launch, ids.ctypes.data, ids.ctypes.data + 24)
        assert HOST is not None
        HOST.launch(16, 2, 64, params)
        for s, d in zip(src_ids, dst_ids, strict=True):
            at, to = int(s) * page, 2 * page + 8 * chunk + int(d) * 8 * chunk
            assert at + 4 * chunk <= size
            assert (data[to:to + 4 * chunk] == data[at:at + 4 * chunk]).all(), f"page {s}"
        assert 4 * page > 1 << 32
        del data, params, ids
    finally:
        region.close()


# --- checks before launch -----------------------------------------------------------------


def test_page_ids_past_a_pool_are_refused_before_any_copy() -> None:
    src, dst = check_page_ids([0, -1, 3], [1, 2, -5], src_pages=4, dst_pages=3,
                              src_name="host pool", dst_name="device pool")
    assert src.dtype == np.int64 and dst.tolist() == [1, 2, -5]
    with pytest.raises(PageError, match="7 is past the device pool's 3 pages"):
        check_page_ids([0, 1], [2, 7], src_pages=4, dst_pages=3, src_name="host pool",
                       dst_name="device pool")
    with pytest.raises(PageError, match="4 is past the host pool's 4 pages"):
        check_page_ids(np.array([4], dtype=np.int32), [0], src_pages=4, dst_pages=3,
                       src_name="host pool", dst_name="device pool")
    with pytest.raises(PageError, match="one length"):
        check_page_ids([0, 1], [2], src_pages=4, dst_pages=3, src_name="a", dst_name="b")


# --- versions and cubins ------------------------------------------------------------------


@pytest.mark.parametrize(("driver", "runtime", "nvrtc", "match"), [
    (12080, 13000, (13, 0), "cupy-cuda12x"),
    (12090, 12080, (13, 5), "NVRTC 13.5"),
    (0, 13000, (13, 0), "no CUDA driver"),
])
def test_a_driver_older_than_cupy_or_nvrtc_is_a_config_error(
        driver: int, runtime: int, nvrtc: tuple[int, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        kernels.check_versions(driver=driver, runtime=runtime, nvrtc=nvrtc)


@pytest.mark.parametrize(("driver", "runtime", "nvrtc"), [
    (13000, 13020, (13, 5)),  # a newer minor everywhere is fine: cubins, not PTX
    (12080, 12020, (12, 9)),
    (13000, 12080, (12, 8)),
])
def test_one_major_version_is_enough(driver: int, runtime: int,
                                     nvrtc: tuple[int, int]) -> None:
    kernels.check_versions(driver=driver, runtime=runtime, nvrtc=nvrtc)


def test_a_cuda_runtime_error_from_cupy_becomes_a_config_error() -> None:
    class Runtime:
        @staticmethod
        def driverGetVersion() -> int:
            raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                               "insufficient for CUDA runtime version")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=Runtime))
    with pytest.raises(ConfigError, match="insufficient"):
        kernels.check_cuda(fake)  # type: ignore[arg-type]


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_engine_compiles_a_cubin_for_the_device_arch(arch: str) -> None:
    cubin = kernels.nvrtc_check(arch=arch)
    assert cubin[:4] == b"\x7fELF"
    for entry in kernels.kernel_names():
        assert entry.encode() in cubin
