"""Transfer engines: copy KV pages between the device and host pools, awaitably.

`CudaTransferEngine` is imported on first use (``aiohicache.transfer.CudaTransferEngine``):
it brings in CuPy, the ``[cuda]`` extra, which ``import aiohicache`` never needs.
"""

from typing import TYPE_CHECKING, Any

from ._base import TransferEngine, TransferHandle, record_fence, write_after
from ._cpu import CpuTransferEngine

if TYPE_CHECKING:
    from ._cuda import CudaTransferEngine

__all__ = ("CpuTransferEngine", "CudaTransferEngine", "TransferEngine", "TransferHandle",
           "record_fence", "write_after")


def __getattr__(name: str) -> Any:
    if name == "CudaTransferEngine":
        from ._cuda import CudaTransferEngine

        return CudaTransferEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
