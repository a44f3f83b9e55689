"""Memory tiers: the page allocator and the device (L1) and host (L2) pools."""

from ._allocator import PageAllocator, PageIds
from ._pools import DevicePool, HostPool

__all__ = ("DevicePool", "HostPool", "PageAllocator", "PageIds")
