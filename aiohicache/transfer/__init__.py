"""Transfer engines: copy KV pages between the device and host pools, awaitably."""

from .base import TransferEngine, TransferHandle
from .cpu import CpuTransferEngine

__all__ = ("CpuTransferEngine", "TransferEngine", "TransferHandle")
