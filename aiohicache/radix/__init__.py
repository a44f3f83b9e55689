"""The radix tree: pure, synchronous bookkeeping of which prefixes live in which tier."""

from ._node import DeviceState, HostState, Node, PendingOp
from ._policy import ARC, LFU, LRU, NEVER, Belady, EvictionPolicy, PolicyName, make_policy
from ._tree import Eviction, InsertResult, Match, RadixTree

__all__ = ("ARC", "LFU", "LRU", "NEVER", "Belady", "DeviceState", "Eviction", "EvictionPolicy",
           "HostState", "InsertResult", "Match", "Node", "PendingOp", "PolicyName", "RadixTree",
           "make_policy")
