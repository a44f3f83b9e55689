"""The CUDA path without a GPU: launch arithmetic, kernel sources, waiter thread, pinning.

The kernel and copy-engine arguments the engine computes are executed on CPU memory by
`tests.cuda_reference` and must match the CPU engine byte for byte over the whole transfer
matrix; the kernels must compile with NVRTC exactly as the engine compiles them. The `gpu`
tests (tests/gpu) run the same matrix through CUDA.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from aiohicache import ConfigError
from aiohicache.memory import DevicePool, HostPool
from aiohicache.memory.pinned import Registration
from aiohicache.transfer import geometry, kernels
from aiohicache.transfer._waiter import EventWaiter
from aiohicache.transfer.geometry import (
    Geometry,
    Side,
    coalesce,
    direct_copies,
    kernel_launches,
    layer_spans,
)

from . import transfer_matrix as tm
from .conftest import until
from .cuda_reference import Memory, run_direct, run_kernel


def emulate(dev: DevicePool, host: HostPool, src: np.ndarray, dst: np.ndarray, *,
            to_device: bool, backend: str, max_pitch: int = 1 << 31) -> None:
    """Run the engine's launch plan for one copy on CPU memory (what the GPU would do)."""
    g = Geometry.of(dev, host)
    memory = Memory(dev.data, host.data)
    for span in layer_spans(g.num_layers, to_device=to_device):
        if backend == "kernel":
            for launch in kernel_launches(g, len(src), to_device=to_device,
                                          width=g.vector_width(), layers=span):
                run_kernel(memory, launch, src, dst)
        else:
            run_direct(memory, list(direct_copies(g, coalesce(src, dst), to_device=to_device,
                                                  layers=span, max_pitch=max_pitch)))


@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize("page_size", tm.PAGE_SIZES)
@pytest.mark.parametrize("model", tm.MODELS)
@pytest.mark.parametrize("dtype", tm.DTYPES)
def test_launch_plans_copy_exactly_what_the_cpu_engine_copies(
        dtype: str, model: str, page_size: int, layout: str) -> None:
    for to_device in (True, False):
        for order in tm.ORDERS:
            for backend in ("kernel", "direct"):
                dev, host = tm.cpu_pools(model, dtype, page_size, layout)  # type: ignore[arg-type]
                ref_dev, ref_host = tm.cpu_pools(model, dtype, page_size, layout)  # type: ignore[arg-type]
                src, dst = tm.page_pairs(order, to_device=to_device)
                tm.reference_copy(ref_dev, ref_host, src, dst, to_device=to_device)
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


def test_a_negative_page_id_skips_the_pair() -> None:
    dev, host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    before = dev.data.clone()
    src, dst = np.array([0, -1, 2, 3]), np.array([4, 5, -1, 6])
    emulate(dev, host, src, dst, to_device=True, backend="kernel")
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "layer_first")
    tm.reference_copy(ref_dev, ref_host, np.array([0, 3]), np.array([4, 6]), to_device=True)
    assert tm.same_bytes(dev.data, ref_dev.data)
    assert tm.same_bytes(dev.data[:, :, 5], before[:, :, 5])
    assert coalesce(src, dst) == [(0, 4, 1), (3, 6, 1)]


def test_launches_split_to_keep_32_bit_unit_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(geometry, "MAX_UNITS", 1000)  # a page here is 384 units
    dev, host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    g = Geometry.of(dev, host)
    launches = kernel_launches(g, 5, to_device=True, width=16, layers=(0, 3))
    assert [(launch.start, launch.stop) for launch in launches] == [(0, 2), (2, 4), (4, 5)]
    assert all(launch.units < 1000 for launch in launches)
    ref_dev, ref_host = tm.cpu_pools("mha", "bf16", 16, "page_first")
    src, dst = tm.page_pairs("random", to_device=True)
    tm.reference_copy(ref_dev, ref_host, src, dst, to_device=True)
    emulate(dev, host, src, dst, to_device=True, backend="kernel")
    assert tm.same_bytes(dev.data, ref_dev.data)


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
    code = ("import sys, aiohicache, aiohicache.transfer.kernels, aiohicache.transfer.cuda;"
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


def test_a_failed_registration_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cudaHostRegister"):
        Registration(torch.zeros(16), cudart=RecordingCudart(status=2))


def test_pinning_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        HostPool(tm.spec("mha", "bf16"), num_pages=2, page_size=4, pin_memory=True)
