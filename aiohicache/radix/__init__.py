"""The radix tree: pure, synchronous bookkeeping of which prefixes live in which tier."""

from ._node import DeviceState, HostState, Node, PendingOp
from ._tree import Eviction, InsertResult, Match, RadixTree

__all__ = ("DeviceState", "Eviction", "HostState", "InsertResult", "Match", "Node",
           "PendingOp", "RadixTree")
