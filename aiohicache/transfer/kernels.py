"""The CUDA copy kernels: sources shipped in the wheel, compiled lazily with NVRTC via CuPy.

``kernels/*.cu`` is installed as the data package ``aiohicache._kernels`` and read with
`importlib.resources`, so an installed wheel needs neither the source tree nor CUDA headers.
CuPy is imported here, on first use, never by ``import aiohicache``: it is the ``[cuda]``
extra. `nvrtc_check` compiles without a GPU (CI runs it), `CopyKernels` compiles for the
current device and launches.
"""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ConfigError
from .geometry import VECTOR_WIDTHS, KernelLaunch

__all__ = ("NVRTC_OPTIONS", "CopyKernels", "cupy", "kernel_names", "nvrtc_check",
           "nvrtc_compile", "source", "sources")

NVRTC_OPTIONS = ("--std=c++17",)
"""What the engine compiles with; `nvrtc_check` uses the same, so CI checks what runs."""
PAGE_COPY = "page_copy.cu"


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


def cupy() -> ModuleType:
    """The `cupy` module, or a `ConfigError` saying how to get it."""
    try:
        import cupy as cp  # the [cuda] extra is optional
    except ImportError as exc:
        raise ConfigError("the CUDA transfer engine needs CuPy: "
                          "pip install 'aiohicache[cuda]'") from exc
    return cp  # type: ignore[no-any-return]


def nvrtc_check(name: str = PAGE_COPY, *, arch: str = "compute_90") -> bytes:
    """Compile the installed ``kernels/<name>`` as the engine does; see `nvrtc_compile`."""
    return nvrtc_compile(source(name), name, arch=arch)


def nvrtc_compile(text: str, name: str, *, arch: str = "compute_90") -> bytes:
    """Compile CUDA C `text` to PTX with NVRTC and the engine's options; no GPU needed.

    Raises:
        ConfigError: CuPy or NVRTC is missing, or compilation failed (with the NVRTC log).
    """
    nvrtc = cupy().cuda.nvrtc
    try:
        program = nvrtc.createProgram(text, name, [], [])
    except Exception as exc:  # NVRTC library missing: cupy raises at first use
        raise ConfigError(f"NVRTC is not available: {exc}") from exc
    try:
        nvrtc.compileProgram(program, [*NVRTC_OPTIONS, f"--gpu-architecture={arch}"])
        ptx = nvrtc.getPTX(program)
    except Exception as exc:
        log_text = nvrtc.getProgramLog(program)
        raise ConfigError(f"{name} does not compile with NVRTC:\n{log_text}") from exc
    finally:
        nvrtc.destroyProgram(program)
    return ptx if isinstance(ptx, bytes) else ptx.encode()


class CopyKernels:
    """The page-copy kernels compiled for one device; every variant is built up front.

    Compiling at engine start keeps NVRTC (tens of milliseconds per variant, once per machine
    thanks to CuPy's on-disk cache) off the request path.
    """

    def __init__(self, device_index: int, *, threads: int = 512) -> None:
        cp = cupy()
        self.threads = threads
        self._cp = cp
        self._device = cp.cuda.Device(device_index)
        with self._device:
            module = cp.RawModule(code=source(), options=NVRTC_OPTIONS)
            self._functions: dict[int, Any] = {
                w: module.get_function(f"copy_pages_v{w}") for w in VECTOR_WIDTHS}
            for fn in self._functions.values():
                _ = fn.attributes  # forces compilation and loading now

    def launch(self, launch: KernelLaunch, src_pages: int, dst_pages: int, *, ctas: int,
               stream: Any) -> None:
        """Enqueue `launch` on the CuPy `stream`; page ids are int64 device arrays at the
        given addresses (offset to `launch.start` here)."""
        if launch.units == 0:
            return
        offset = launch.start * 8
        src, dst = launch.src, launch.dst
        args = (src.base, dst.base, src_pages + offset, dst_pages + offset,
                np.uint32(launch.num_pages), np.uint32(launch.num_kv),
                np.int32(launch.layer_begin), np.int32(launch.layer_end),
                src.page, src.kv, src.layer, dst.page, dst.kv, dst.layer,
                np.uint32(launch.units_per_chunk))
        grid = min(ctas, -(-launch.units // self.threads))
        with self._device, stream:
            self._functions[launch.width]((grid,), (self.threads,), args)
