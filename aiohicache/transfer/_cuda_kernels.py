"""The CUDA copy kernels: sources shipped in the wheel, compiled lazily with NVRTC via CuPy.

``kernels/*.cu`` is installed as the data package ``aiohicache._kernels`` and read with
`importlib.resources`, so an installed wheel needs neither the source tree nor CUDA headers.
CuPy is imported here, on first use, never by ``import aiohicache``: it is the ``[cuda]``
extra. `nvrtc_check` compiles without a GPU (CI runs it), `CopyKernels` compiles for the
current device and launches.

- **Cubin, not PTX.** The kernels are compiled straight to the device's SASS
  (``--gpu-architecture=sm_XY``): PTX from a newer NVRTC (13.5) cannot be JIT-compiled by an
  older driver (13.0), while a cubin of the same major version loads.
- **One argument.** A launch passes one `CopyParams` struct (`PARAMS_DTYPE`, packed with
  numpy) through ``cuLaunchKernel``: no per-argument marshalling, no CuPy launch objects.
- **Versions.** A CuPy built for a newer CUDA major than the driver (``cupy-cuda13x`` on a
  CUDA 12 driver) is a `ConfigError` naming both, not a raw ``CUDARuntimeError``.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from types import ModuleType

import numpy as np

from ..errors import ConfigError
from ._geometry import (
    MAX_CHUNKS,
    VECTOR_WIDTHS,
    Geometry,
    KernelLaunch,
    kernel_launches,
    layer_spans,
)

__all__ = ("MAX_THREADS", "NVRTC_OPTIONS", "PARAMS_DTYPE", "CopyKernels", "LaunchPlan",
           "LaunchTable", "check_cuda", "check_versions", "cupy",
           "kernel_names", "nvrtc_check", "nvrtc_compile", "pack_params", "source", "sources")

NVRTC_OPTIONS = ("--std=c++17",)
"""What the engine compiles with; `nvrtc_check` uses the same, so CI checks what runs."""
MAX_THREADS = 1024
"""The most threads per CTA an engine takes; `nvrtc_check` compiles for it by default."""
UNBOUNDED_THREADS = 512
"""CTAs up to this size launch every variant without launch bounds (see page_copy.cu)."""
PAGE_COPY = "page_copy.cu"

PARAMS_DTYPE = np.dtype([
    ("src", np.uint64), ("dst", np.uint64), ("src_pages", np.uint64), ("dst_pages", np.uint64),
    ("src_page", np.int64), ("src_kv", np.int64), ("src_layer", np.int64),
    ("dst_page", np.int64), ("dst_kv", np.int64), ("dst_layer", np.int64),
    ("num_chunks", np.uint32), ("num_kv", np.uint32), ("layers", np.uint32),
    ("layer_begin", np.int32), ("units_per_chunk", np.uint32), ("group_shift", np.uint32),
], align=True)
"""``struct CopyParams`` of kernels/page_copy.cu, field for field (104 bytes)."""


def _root() -> Traversable:
    try:
        return importlib.resources.files("aiohicache._kernels")
    except ModuleNotFoundError:  # a bare checkout on PYTHONPATH, not installed: the tree
        return importlib.resources.files("aiohicache").joinpath("..", "kernels")


def source(name: str = PAGE_COPY) -> str:
    """The CUDA C text of ``kernels/<name>`` as installed."""
    return _root().joinpath(name).read_text(encoding="utf-8")


def sources() -> dict[str, str]:
    """Every installed kernel source, by file name."""
    return {f.name: f.read_text(encoding="utf-8") for f in _root().iterdir()
            if f.name.endswith(".cu")}


def kernel_names() -> list[str]:
    """Entry points of the page copy, widest vector first."""
    return [f"copy_pages_v{w}" for w in VECTOR_WIDTHS]


def pack_params(launch: KernelLaunch, src_pages: int, dst_pages: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """`launch` as a one-element `PARAMS_DTYPE` array; `src_pages`/`dst_pages` are the
    addresses of the whole int64 id arrays (offset to ``launch.start`` here)."""
    p = np.zeros(1, dtype=PARAMS_DTYPE) if out is None else out
    offset = launch.start * 8
    s, d = launch.src, launch.dst
    p["src"], p["dst"] = s.base, d.base
    p["src_pages"], p["dst_pages"] = src_pages + offset, dst_pages + offset
    p["src_page"], p["src_kv"], p["src_layer"] = s.page, s.kv, s.layer
    p["dst_page"], p["dst_kv"], p["dst_layer"] = d.page, d.kv, d.layer
    p["num_chunks"], p["num_kv"] = launch.num_chunks, launch.num_kv
    p["layers"] = launch.layer_end - launch.layer_begin
    p["layer_begin"] = launch.layer_begin
    p["units_per_chunk"], p["group_shift"] = launch.units_per_chunk, launch.group_shift
    return p


def cupy() -> ModuleType:
    """The `cupy` module, or a `ConfigError` saying how to get it."""
    try:
        import cupy as cp  # the [cuda] extra is optional
    except ImportError as exc:
        raise ConfigError("the CUDA transfer engine needs CuPy: "
                          "pip install 'aiohicache[cuda]'") from exc
    return cp  # type: ignore[no-any-return]


def check_versions(*, driver: int, runtime: int, nvrtc: tuple[int, int]) -> None:
    """Refuse a CuPy or NVRTC built for a newer CUDA major than the driver runs.

    `driver` and `runtime` are CUDA's integers (12080 = 12.8). Within one major version the
    cubins compiled here load on any driver; across majors nothing does.

    Raises:
        ConfigError: naming the versions and what to install instead.
    """
    def text(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    if driver == 0:
        raise ConfigError("no CUDA driver is loaded (cudaDriverGetVersion says 0)")
    if runtime // 1000 > driver // 1000:
        raise ConfigError(f"CuPy was built for CUDA {text(runtime)} but the driver supports "
                          f"CUDA {text(driver)}: install cupy-cuda{driver // 1000}x, or "
                          f"upgrade the driver")
    if nvrtc[0] > driver // 1000:
        raise ConfigError(f"NVRTC {nvrtc[0]}.{nvrtc[1]} compiles for a newer CUDA than the "
                          f"driver's {text(driver)}: install the NVRTC of CUDA "
                          f"{driver // 1000}.x")


def check_cuda(cp: ModuleType) -> None:
    """`check_versions` with what CuPy reports; any CUDA error becomes a `ConfigError`."""
    runtime = cp.cuda.runtime
    try:
        versions = (runtime.driverGetVersion(), runtime.runtimeGetVersion())
    except Exception as exc:  # CUDARuntimeError: no driver, or one CuPy cannot use
        raise ConfigError(f"CUDA is not usable from CuPy: {exc}") from exc
    try:
        nvrtc = tuple(cp.cuda.nvrtc.getVersion())
    except Exception as exc:
        raise ConfigError(f"NVRTC is not available: {exc}") from exc
    check_versions(driver=versions[0], runtime=versions[1], nvrtc=(nvrtc[0], nvrtc[1]))


def nvrtc_check(name: str = PAGE_COPY, *, arch: str = "compute_90",
                threads: int = MAX_THREADS) -> bytes:
    """Compile the installed ``kernels/<name>`` as the engine does; see `nvrtc_compile`."""
    return nvrtc_compile(source(name), name, arch=arch, threads=threads)


def nvrtc_compile(text: str, name: str, *, arch: str = "compute_90",
                  threads: int = MAX_THREADS) -> bytes:
    """Compile CUDA C `text` with NVRTC and the engine's options; no GPU needed.

    ``arch="compute_XY"`` gives PTX, ``arch="sm_XY"`` a cubin (what the engine loads).
    `threads` is the CTA size launches use: over `UNBOUNDED_THREADS` it becomes the
    kernels' launch bounds (``AIOHICACHE_MAX_THREADS``), so registers fit a CTA that size.

    Raises:
        ConfigError: CuPy or NVRTC is missing, or compilation failed (with the NVRTC log).
    """
    nvrtc = cupy().cuda.nvrtc
    try:
        program = nvrtc.createProgram(text, name, [], [])
    except Exception as exc:  # NVRTC library missing: cupy raises at first use
        raise ConfigError(f"NVRTC is not available: {exc}") from exc
    try:
        bounds = [f"-DAIOHICACHE_MAX_THREADS={threads}"] if threads > UNBOUNDED_THREADS else []
        nvrtc.compileProgram(program, [*NVRTC_OPTIONS, *bounds, f"--gpu-architecture={arch}"])
        out = nvrtc.getCUBIN(program) if arch.startswith("sm_") else nvrtc.getPTX(program)
    except Exception as exc:
        log_text = nvrtc.getProgramLog(program)
        raise ConfigError(f"{name} does not compile with NVRTC:\n{log_text}") from exc
    finally:
        nvrtc.destroyProgram(program)
    return out if isinstance(out, bytes) else out.encode()


class CopyKernels:
    """The page-copy kernels compiled for one device to a cubin; every variant up front.

    Compiling at engine start (tens of milliseconds, once per engine) keeps NVRTC off the
    request path. Launches go straight to ``cuLaunchKernel`` with one packed struct.

    Raises:
        ConfigError: the driver is older than CuPy or NVRTC, or the kernels do not load.
    """

    def __init__(self, device_index: int, *, threads: int = 512) -> None:
        cp = cupy()
        self.threads = threads
        self._driver = cp.cuda.driver
        runtime = cp.cuda.runtime
        check_cuda(cp)
        try:
            with cp.cuda.Device(device_index) as device:
                arch = f"sm_{device.compute_capability}"
                self.cubin = nvrtc_compile(source(), PAGE_COPY, arch=arch, threads=threads)
                self._module = cp.cuda.function.Module()
                self._module.load(self.cubin)
                self._functions: dict[int, int] = {
                    w: self._module.get_function(f"copy_pages_v{w}").ptr
                    for w in VECTOR_WIDTHS}
        except (runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as exc:
            raise ConfigError(f"CUDA could not load the copy kernels on device "
                              f"{device_index}: {exc}") from exc

    def launch(self, plan: LaunchPlan, span: int, stream: int) -> None:
        """Enqueue the launches of layer span `span` of `plan` on the raw CUDA `stream`."""
        fn = self._functions[plan.width]
        for i in plan.spans[span]:
            # kernelParams is `void*[1]` pointing at record i; the driver copies it now
            self._driver.launchKernel(fn, plan.grids[i], 1, 1, self.threads, 1, 1, 0, stream,
                                      plan.argv + 8 * i, 0)


@dataclass(slots=True)
class LaunchPlan:
    """The packed launches of one copy: `params[i]` runs on `grids[i]` CTAs; layer span `s`
    (see `layer_spans`) is launches `spans[s]`."""

    width: int
    params: np.ndarray
    grids: list[int]
    spans: list[range]
    argv: int = 0
    """Address of ``void* argv[len(params)]``, argv[i] = &params[i] (`cuLaunchKernel`)."""
    _keep: np.ndarray | None = None

    def __post_init__(self) -> None:
        base = self.params.ctypes.data
        self._keep = base + self.params.itemsize * np.arange(len(self.params), dtype=np.uint64)
        self.argv = self._keep.ctypes.data


class LaunchTable:
    """The launches of one copy direction for one page, packed once; scaled per copy.

    A copy of n pages changes only the id addresses and the chunk counts, so building its
    `LaunchPlan` is a few vectorised numpy writes, whatever the number of layers.
    """

    def __init__(self, geometry: Geometry, *, to_device: bool, width: int, ctas: int,
                 threads: int, host_base: int | None = None) -> None:
        self.geometry = geometry
        self.to_device = to_device
        self.width = width
        self.ctas = ctas
        self.threads = threads
        self.host_base = host_base
        self.layer_spans = layer_spans(geometry.num_layers, to_device=to_device)
        self.template = np.zeros(len(self.layer_spans), dtype=PARAMS_DTYPE)
        for i, span in enumerate(self.layer_spans):
            (one,) = kernel_launches(geometry, 1, to_device=to_device, width=width,
                                     layers=span, host_base=host_base)
            pack_params(one, 0, 0, out=self.template[i:i + 1])
        self._per_page = self.template["num_chunks"].astype(np.int64)
        self._shift = self.template["group_shift"].astype(np.int64)

    def plan(self, num_pages: int, src_pages: int, dst_pages: int) -> LaunchPlan:
        """The launches copying `num_pages` pairs whose int64 ids are at those addresses."""
        n = len(self.layer_spans)
        if num_pages * int(self._per_page.max()) < MAX_CHUNKS:
            params = self.template.copy()
            chunks = self._per_page * num_pages
            params["num_chunks"] = chunks
            params["src_pages"], params["dst_pages"] = src_pages, dst_pages
            grid = np.clip(-(-(chunks << self._shift) // self.threads), 1, self.ctas)
            one = [range(i, i + 1) if num_pages else range(0) for i in range(n)]
            return LaunchPlan(self.width, params, grid.tolist(), one)
        packed: list[np.ndarray] = []  # more chunks than 32-bit counters: split
        grids: list[int] = []
        spans: list[range] = []
        for span in self.layer_spans:
            launches = kernel_launches(self.geometry, num_pages, to_device=self.to_device,
                                       width=self.width, layers=span,
                                       host_base=self.host_base)
            spans.append(range(len(packed), len(packed) + len(launches)))
            packed += [pack_params(launch, src_pages, dst_pages) for launch in launches]
            grids += [launch.grid(self.ctas, self.threads) for launch in launches]
        return LaunchPlan(self.width, np.concatenate(packed), grids, spans)
