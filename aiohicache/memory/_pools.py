"""The two in-memory tiers: `DevicePool` (L1, what attention reads) and `HostPool` (L2).

Both hold KV for whole pages of `page_size` tokens and expose, for every layer and K/V tensor,
a ``(num_pages, page_size, *row_shape)`` view; transfers copy pages between such views.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import numpy as np
import torch

from .._validate import check_int
from ..config import KVSpec
from ..errors import ConfigError, PageError
from ._allocator import PageAllocator, PageIds
from ._pinned import register

__all__ = ("DevicePool", "HostPool")

_ID_BYTES = 9
"""Host bytes `PageAllocator` keeps per page: an int64 in its free stack, a bool in its bitmap."""


class _PagePool:
    __slots__ = ("allocator", "data", "num_pages", "page_size", "spec")

    def __init__(self, spec: KVSpec, *, num_pages: int, page_size: int, name: str,
                 field: str, device: torch.device) -> None:
        check_int(field, num_pages, low=0)
        check_int("page_size", page_size, low=1)
        _check_fits(field, num_pages, page_size, spec, device)
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages, name=name)
        self.data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer_view(self, kv: int, layer: int) -> torch.Tensor:
        """Pages of K (kv=0), V (kv=1) or the MLA latent (kv=0) of one layer."""
        raise NotImplementedError


class DevicePool(_PagePool):
    """L1: per-layer K/V buffers in the layout paged-attention kernels read.

    Token slot ``s`` of page ``p`` is ``p * page_size + s``; `k_buffer(layer)` is a
    ``(num_slots, num_kv_heads, head_dim)`` tensor (MLA: `kv_buffer(layer)`,
    ``(num_slots, kv_lora_rank + rope_dim)``).
    """

    __slots__ = ("device",)

    def __init__(self, spec: KVSpec, *, num_pages: int, page_size: int,
                 device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device} requested, but torch sees no CUDA device")
        super().__init__(spec, num_pages=num_pages, page_size=page_size, name="device pool",
                         field="device_pages", device=self.device)
        shape = (spec.num_kv, spec.num_layers, num_pages, page_size, *spec.row_shape)
        self.data = torch.zeros(shape, dtype=spec.dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def layer_view(self, kv: int, layer: int) -> torch.Tensor:
        return self.data[kv, layer]

    def _slots(self, kv: int, layer: int) -> torch.Tensor:
        return self.data[kv, layer].view(self.num_slots, *self.spec.row_shape)

    def k_buffer(self, layer: int) -> torch.Tensor:
        """MHA: the K cache of `layer`, indexed by token slot."""
        self._require("mha")
        return self._slots(0, layer)

    def v_buffer(self, layer: int) -> torch.Tensor:
        """MHA: the V cache of `layer`, indexed by token slot."""
        self._require("mha")
        return self._slots(1, layer)

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """MLA: the latent cache of `layer`, indexed by token slot."""
        self._require("mla")
        return self._slots(0, layer)

    def _require(self, kind: str) -> None:
        if self.spec.kind != kind:
            raise ConfigError(f"spec: this buffer exists for {kind.upper()} models only, "
                              f"the pool holds {self.spec.kind.upper()}")

    def page_slots(self, pages: PageIds) -> np.ndarray:
        """Token slots (int64 numpy) of the given pages, in order: slot arithmetic stays on
        the host, where it costs no GPU sync."""
        pages = np.asarray(pages, dtype=np.int64)
        slots: np.ndarray = (pages[:, None] * self.page_size + _offsets(self.page_size))
        return slots.reshape(-1)

    def index_tensor(self, values: np.ndarray) -> torch.Tensor:
        """`values` as an int64 tensor on the pool's device, without a host sync.

        On CUDA the values go through a pinned staging copy (torch's caching host allocator
        keeps it until the upload is done) and a ``non_blocking`` upload on the current
        stream, so the tensor is ready for work queued after this call on that stream; the
        host never waits for the GPU. (``tensor.to(device)`` from pageable memory instead
        waits for everything queued on the stream, possibly a whole forward pass.)
        """
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def pages_to_slots(self, pages: PageIds) -> torch.Tensor:
        """Token slots (int64, on the pool's device) of the given pages, in order; no host
        sync (see `index_tensor`)."""
        return self.index_tensor(self.page_slots(pages))

    def slots_to_pages(self, slots: torch.Tensor | np.ndarray) -> PageIds:
        """The pages that `slots` fill from their start, page by page.

        `slots` may be a tensor or its numpy twin (`page_slots`). NOTE: a CUDA tensor is
        copied to the host, which waits for the GPU; pass the numpy slots to avoid that.

        Raises:
            ConfigError: `slots` is not a 1-D integer tensor (or array) of whole,
                page-aligned pages (a trailing partial page is allowed).
        """
        if isinstance(slots, np.ndarray):
            if slots.ndim != 1 or slots.dtype not in (np.int64, np.int32):
                raise ConfigError("slots: must be a 1-D int64/int32 array of token slots")
            arr = slots
        elif not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (
                torch.int64, torch.int32):
            raise ConfigError("slots: must be a 1-D int64/int32 tensor of token slots")
        else:
            arr = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
        if len(arr) == 0:
            return np.empty(0, dtype=np.int64)
        arr = arr.astype(np.int64, copy=False)
        # NOTE: ufunc reduces and one comparison with the slots the pages would have, not
        # `min`/`max`/`all` (their Python wrappers cost more than the arithmetic: this runs
        # on every commit)
        heads = arr[::self.page_size]
        if np.minimum.reduce(heads) < 0 or np.maximum.reduce(arr) >= self.num_slots:
            raise ConfigError(f"slots: outside the device pool's {self.num_slots} slots")
        pages = heads // self.page_size
        if np.count_nonzero(self.page_slots(pages)[:len(arr)] != arr):
            raise ConfigError("slots: must cover whole pages in order, as allocate() returns them")
        return pages


class HostPool(_PagePool):
    """L2: host memory for KV pages in one of two layouts.

    - ``layer_first``: ``[num_kv, num_layers, num_pages, page_size, *row]`` mirrors the device
      pool, so per-layer transfers read one contiguous run per layer.
    - ``page_first``: ``[num_pages, num_kv, num_layers, page_size, *row]`` keeps every page in
      one contiguous block, so one page is one storage object without a gather.

    With ``pin_memory=True`` the pool is page-locked for DMA with ``cudaHostRegister`` of
    exactly its bytes (see `aiohicache.memory._pinned`); `close()` unlocks it.
    """

    __slots__ = ("_registration", "layout")

    def __init__(self, spec: KVSpec, *, num_pages: int, page_size: int,
                 layout: Literal["layer_first", "page_first"] = "page_first",
                 pin_memory: bool = False) -> None:
        super().__init__(spec, num_pages=num_pages, page_size=page_size, name="host pool",
                         field="host_pages", device=torch.device("cpu"))
        if layout not in ("layer_first", "page_first"):
            raise ConfigError(f"host_layout: unknown layout {layout!r}")
        self.layout = layout
        if layout == "layer_first":
            shape = (spec.num_kv, spec.num_layers, num_pages, page_size, *spec.row_shape)
        else:
            shape = (num_pages, spec.num_kv, spec.num_layers, page_size, *spec.row_shape)
        self.data = torch.zeros(shape, dtype=spec.dtype)
        self._registration = register(self.data) if pin_memory else None

    @property
    def pinned(self) -> bool:
        """Whether the pool is page-locked right now (registered here, or pinned by torch)."""
        if self._registration is not None and self._registration.active:
            return True
        return torch.cuda.is_available() and self.data.is_pinned()

    def close(self) -> None:
        """Unlock the pool's pages (idempotent). Copies that use them must have finished."""
        if self._registration is not None:
            self._registration.close()

    def layer_view(self, kv: int, layer: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.data[kv, layer]
        return self.data[:, kv, layer]

    def page_tensor(self, page: int) -> torch.Tensor:
        """All KV of one page as a ``[num_kv, num_layers, page_size, *row]`` tensor.

        A view for ``page_first``; a gathered copy for ``layer_first``.

        Raises:
            PageError: `page` is not an id in this pool (a negative one is not counted from
                the end).
        """
        check_int("page", page, low=0, high=self.num_pages - 1, numpy_ok=True, error=PageError)
        if self.layout == "page_first":
            return self.data[page]
        return self.data[:, :, page].clone()


def _check_fits(field: str, num_pages: int, page_size: int, spec: KVSpec,
                device: torch.device) -> None:
    """Refuse, naming `field`, a pool the machine certainly cannot hold, before allocating.

    Certainly: host RAM (KV of CPU pools plus the allocator's page ids) is compared with the
    machine's physical memory, or the process's cgroup memory limit where that is less; GPU
    memory with what is free on the device plus what torch's caching allocator holds
    unused. Sizes that pass may still fail (other pools, other
    processes); sizes that fail would otherwise be numpy's or torch's MemoryError.

    Raises:
        ConfigError: ``device_pages: ...`` or ``host_pages: ...`` with the bytes needed and
            those there are.
    """
    kv_bytes = num_pages * page_size * spec.bytes_per_token
    host_bytes = num_pages * _ID_BYTES + (kv_bytes if device.type == "cpu" else 0)
    ram = _physical_memory()
    if ram is not None and host_bytes > ram:
        raise ConfigError(f"{field}: {num_pages:,} pages need {host_bytes:,} bytes of host "
                          f"memory; this process may use {ram:,} bytes (RAM, or its "
                          f"cgroup's limit)")
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
        if kv_bytes > free:
            raise ConfigError(f"{field}: {num_pages:,} pages need {kv_bytes:,} bytes on "
                              f"{device}; {free:,} bytes are free there")


def _physical_memory() -> int | None:
    """Bytes of RAM this process may use: the machine's, or its cgroup's memory limit where
    that is less (a container); None where the platform says neither.

    NOTE: in a container the machine's RAM is not what the process gets: a pool under it
    but over the cgroup's limit passed the check and then had the process OOM-killed.
    """
    try:
        ram: int | None = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        ram = None
    limits = [n for n in (ram, _cgroup_limit()) if n is not None]
    return min(limits) if limits else None


_CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_limit(root: str = _CGROUP_ROOT, own: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``), None if it has none or the files are not there."""
    candidates = []
    for line in _read(own).splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":  # v2: "0::/path"
            candidates.append(os.path.join(root, path.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):  # v1: "4:memory:/path"
            candidates.append(os.path.join(root, "memory", path.lstrip("/"),
                                           "memory.limit_in_bytes"))
    candidates += [os.path.join(root, "memory.max"),
                   os.path.join(root, "memory", "memory.limit_in_bytes")]
    limits = [int(text) for text in map(str.strip, map(_read, candidates))
              if text.isascii() and text.isdigit() and int(text) < _NO_LIMIT]
    return min(limits) if limits else None


_NO_LIMIT = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; v2 as ``max``."""


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


@functools.cache
def _offsets(page_size: int) -> np.ndarray:
    """``0 .. page_size - 1`` (int64), made once per page size."""
    offsets = np.arange(page_size, dtype=np.int64)
    offsets.flags.writeable = False
    return offsets
