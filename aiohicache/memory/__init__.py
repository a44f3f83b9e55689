"""Memory tiers: the page allocator and the device (L1) and host (L2) pools."""

from ._allocator import PageAllocator, PageIds
from .pools import DevicePool, HostPool

__all__ = ("DevicePool", "HostPool", "PageAllocator", "PageIds")
