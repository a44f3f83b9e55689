"""The native page copier (`_pagecopy`, built from ``_pagecopy.c``), where it can be used.

`native_copier` is None where the extension was not built or ``AIOHICACHE_NATIVE=0``
turns it off (`aiohicache._native`); the CPU engine then copies with numpy (`_copy.py`), the
same bytes, the GIL held for more of each copy.
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

import torch

from .._native import load_extension
from ..memory import DevicePool, HostPool, PageIds
from ._geometry import Geometry, Side

__all__ = ("PageCopier", "native_copier")

log = logging.getLogger("aiohicache.transfer")


class PageCopier(Protocol):
    """`_pagecopy.PageCopier`: both pools' bytes held, every chunk checked to lie inside."""

    def copy(self, src: PageIds, dst: PageIds, to_device: bool, layer_lo: int, layer_hi: int,
             release_gil: bool, /) -> None:
        """Copy pages ``src[i] -> dst[i]`` (int64; a negative id skips its pair) of layers
        ``[layer_lo, layer_hi)``, K and V; blocking. Nothing is copied if an id is past its
        pool (IndexError)."""


_MODULE: Final = load_extension("aiohicache.transfer._pagecopy", logger=log,
                                fallback="the CPU engine copies pages with numpy")


def native_copier(device_pool: DevicePool, host_pool: HostPool) -> PageCopier | None:
    """A copier between the two CPU pools, or None where the extension cannot be used.

    Raises:
        ConfigError: the pools differ in spec or page size (`Geometry.of`).
    """
    if _MODULE is None or device_pool.device.type != "cpu":
        return None
    geometry = Geometry.of(device_pool, host_pool)
    copier: PageCopier = _MODULE.PageCopier(
        _bytes(device_pool), _strides(geometry.device, device_pool), _bytes(host_pool),
        _strides(geometry.host, host_pool), geometry.chunk_bytes, geometry.num_kv,
        geometry.num_layers)
    return copier


def _bytes(pool: DevicePool | HostPool) -> object:
    return pool.data.reshape(-1).view(torch.uint8).numpy()


def _strides(side: Side, pool: DevicePool | HostPool) -> tuple[int, int, int, int, int]:
    """`side` with its base as an offset into the pool's bytes, and the pool's pages."""
    return side.base - pool.data.data_ptr(), side.page, side.kv, side.layer, pool.num_pages
