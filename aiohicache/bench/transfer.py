"""GPU page copies, side by side in one run: ours against the link's practical ceiling.

For each page size and direction the same bytes move five ways, each timed with CUDA events
on the stream that runs it (median of `repeat` runs after a warm-up):

- ceiling: one contiguous ``cudaMemcpyAsync`` of the whole payload between the pinned host
  pool and the device pool, the most the link gives;
- direct per page: one ``cudaMemcpyAsync`` per page and (kv, layer), what a naive copy-engine
  path issues (SGLang's per-page direct path);
- direct coalesced: our ``io_backend="direct"``, one 2-D copy per run and (kv, layer);
- kernel: our ``io_backend="kernel"`` at each CTA budget.

Loads are issued as the cache issues them (one launch and one event per layer); writes as
one all-layer copy. Page ids are a random permutation (scattered pages, the common case after
some churn). Last, the event loop's lag is sampled while loads run back to back and are
awaited through the waiter thread. Needs a CUDA device, CuPy and NVRTC.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import numpy as np
import torch

from .._lagprobe import LagSummary, LoopLagProbe
from ..config import KVSpec
from ..errors import ConfigError
from ..memory import DevicePool, HostPool
from ..transfer._cuda import CudaTransferEngine
from ..transfer._geometry import Geometry

__all__ = ("TransferRow", "bench_transfer", "format_transfer")


@dataclass(slots=True)
class TransferRow:
    page_size: int
    direction: Literal["H2D", "D2H"]
    nbytes: int
    ceiling_gbps: float
    per_page_gbps: float
    direct_gbps: float
    kernel_gbps: dict[int, float] = field(default_factory=dict)

    def ratio(self, ctas: int) -> float:
        return self.kernel_gbps[ctas] / self.ceiling_gbps


@dataclass(slots=True)
class TransferReport:
    device: str
    versions: str
    spec: str
    layout: str
    rows: list[TransferRow]
    lag: LagSummary
    lag_gbps: float


def bench_transfer(*, page_sizes: list[int], ctas: list[int], total_mb: int = 64,
                   repeat: int = 20, layout: Literal["layer_first", "page_first"] = "page_first",
                   spec: KVSpec | None = None,
                   echo: Callable[[str], None] = lambda _: None) -> TransferReport:
    """Run the sweep (see the module docstring); `echo` gets progress lines."""
    if not torch.cuda.is_available():
        raise ConfigError("bench transfer: needs a CUDA device; torch sees none")
    spec = spec or KVSpec.mha(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bf16")
    rows = []
    for page_size in page_sizes:
        pools = _pools(spec, page_size, total_mb << 20, layout)
        for to_device in (True, False):
            rows.append(_measure(pools, to_device, ctas, repeat))
            echo(f"measured page {page_size} {rows[-1].direction}")
        pools[1].close()
    lag, lag_gbps = anyio.run(_loop_lag, spec, layout, total_mb << 20, backend="asyncio")
    props = torch.cuda.get_device_properties(0)
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, " \
               f"driver {_driver_version()}, CuPy {_cupy_version()}"
    return TransferReport(f"{props.name} ({props.multi_processor_count} SMs)", versions,
                          spec.fingerprint(), layout, rows, lag, lag_gbps)


def _pools(spec: KVSpec, page_size: int, nbytes: int,
           layout: Literal["layer_first", "page_first"]) -> tuple[DevicePool, HostPool]:
    pages = max(1, nbytes // (page_size * spec.bytes_per_token))
    dev = DevicePool(spec, num_pages=pages, page_size=page_size, device="cuda")
    host = HostPool(spec, num_pages=pages, page_size=page_size, layout=layout, pin_memory=True)
    host.data.view(torch.uint8).random_(0, 256)
    return dev, host


def _measure(pools: tuple[DevicePool, HostPool], to_device: bool, ctas: list[int],
             repeat: int) -> TransferRow:
    dev, host = pools
    n = dev.num_pages
    perm = np.random.default_rng(0).permutation(n).astype(np.int64)
    src, dst = (perm, np.arange(n, dtype=np.int64)) if to_device \
        else (np.arange(n, dtype=np.int64), perm)
    nbytes = n * dev.page_size * dev.spec.bytes_per_token
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    row = TransferRow(dev.page_size, "H2D" if to_device else "D2H", nbytes,
                      ceiling_gbps=_gbps(nbytes, _time(stream, lambda: _contiguous(
                          dev, host, nbytes, to_device), repeat)),
                      per_page_gbps=_gbps(nbytes, _time(stream, lambda: _per_page(
                          dev, host, src, dst, to_device, stream), min(repeat, 3))),
                      direct_gbps=_gbps(nbytes, _engine_time(
                          dev, host, "direct", 1, src, dst, to_device, repeat)))
    for c in ctas:
        row.kernel_gbps[c] = _gbps(nbytes, _engine_time(dev, host, "kernel", c, src, dst,
                                                        to_device, repeat))
    return row


def _contiguous(dev: DevicePool, host: HostPool, nbytes: int, to_device: bool) -> None:
    d = dev.data.view(torch.uint8).reshape(-1)[:nbytes]
    h = host.data.view(torch.uint8).reshape(-1)[:nbytes]
    if to_device:
        d.copy_(h, non_blocking=True)
    else:
        h.copy_(d, non_blocking=True)


def _per_page(dev: DevicePool, host: HostPool, src: np.ndarray, dst: np.ndarray,
              to_device: bool, stream: torch.cuda.Stream) -> None:
    from ..transfer._cuda_kernels import cupy

    runtime = cupy().cuda.runtime
    g = Geometry.of(dev, host)
    a, b = (g.host, g.device) if to_device else (g.device, g.host)
    for layer in range(g.num_layers):
        for kv in range(g.num_kv):
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                runtime.memcpyAsync(b.chunk(d, kv, layer), a.chunk(s, kv, layer),
                                    g.chunk_bytes, runtime.memcpyDefault, stream.cuda_stream)


def _time(stream: torch.cuda.Stream, issue: Callable[[], None], repeat: int) -> float:
    """Median seconds of `issue()` on `stream`, by CUDA events (submission included)."""
    times = []
    with torch.cuda.stream(stream):
        issue()  # warm-up
        for _ in range(repeat):
            start, end = _timing_event(), _timing_event()
            start.record(stream)
            issue()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(times))


def _engine_time(dev: DevicePool, host: HostPool, backend: Literal["kernel", "direct"],
                 ctas: int, src: np.ndarray, dst: np.ndarray, to_device: bool,
                 repeat: int) -> float:
    async def run() -> float:
        engine = CudaTransferEngine(dev, host, backend=backend, ctas=ctas)
        stream = engine.load_stream if to_device else engine.write_stream
        times = []
        try:
            for i in range(repeat + 1):
                start, end = _timing_event(), _timing_event()
                start.record(stream)
                handle = engine.load(src, dst) if to_device else engine.write(src, dst)
                end.record(stream)
                await handle.wait()
                end.synchronize()
                if i:  # the first run is the warm-up
                    times.append(start.elapsed_time(end) / 1e3)
        finally:
            await engine.aclose()
        return float(statistics.median(times))
    return anyio.run(run, backend="asyncio")


async def _loop_lag(spec: KVSpec, layout: Literal["layer_first", "page_first"],
                    nbytes: int) -> tuple[LagSummary, float]:
    dev, host = _pools(spec, 16, nbytes, layout)
    pages = np.random.default_rng(1).permutation(dev.num_pages).astype(np.int64)
    engine = CudaTransferEngine(dev, host)
    moved, began = 0, time.perf_counter()
    try:
        async with LoopLagProbe() as probe:
            while time.perf_counter() - began < 2.0:
                handles = [engine.load(pages, pages) for _ in range(4)]
                for h in handles:
                    await h.wait()
                moved += 4 * h.nbytes
    finally:
        await engine.aclose()
        host.close()
    return probe.summary(), moved / (time.perf_counter() - began) / 1e9


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _driver_version() -> str:
    from ..transfer._cuda_kernels import cupy

    v = int(cupy().cuda.runtime.driverGetVersion())
    return f"{v // 1000}.{v % 1000 // 10}"


def _cupy_version() -> str:
    from ..transfer._cuda_kernels import cupy

    return str(cupy().__version__)


def _reference_ctas(ctas: list[int]) -> int:
    """The budget the ratios are reported at: 4 CTAs (the target's), else the largest run."""
    return 4 if 4 in ctas else max(ctas)


def format_row(row: TransferRow, ctas: list[int]) -> str:
    kernel = "  ".join(f"{row.kernel_gbps[c]:6.1f}" for c in ctas)
    ref = _reference_ctas(ctas)
    return (f"page {row.page_size:>3} {row.direction}  {row.nbytes >> 20:>4} MiB  "
            f"ceiling {row.ceiling_gbps:6.1f}  per-page {row.per_page_gbps:6.1f}  "
            f"direct {row.direct_gbps:6.1f}  kernel[{','.join(map(str, ctas))}] {kernel}  "
            f"kernel/ceiling {row.ratio(ref):.2f}  "
            f"kernel/per-page {row.kernel_gbps[ref] / row.per_page_gbps:.1f}x")


def format_transfer(report: TransferReport, ctas: list[int]) -> str:
    lines = [f"device: {report.device}; {report.versions}",
             f"spec {report.spec}, host {report.layout}; GB/s (1e9 B/s), median by CUDA "
             f"events; ratios at {_reference_ctas(ctas)} CTAs",
             *(format_row(row, ctas) for row in report.rows),
             f"event-loop lag while loads run back to back ({report.lag_gbps:.1f} GB/s "
             f"awaited): p50 {report.lag.p50_ms:.3f} ms, p99 {report.lag.p99_ms:.3f} ms, "
             f"max {report.lag.max_ms:.3f} ms over {report.lag.samples} samples"]
    return "\n".join(lines)
