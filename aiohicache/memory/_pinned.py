"""Page-locking host memory of the exact size, with ``cudaHostRegister``.

torch's ``pin_memory=True`` and CuPy's pinned pool round an allocation up to a power of two
(a 20 GiB host pool would lock 32 GiB). Registering an ordinary allocation locks exactly its
bytes. Registration is slow (the kernel walks every page), so it happens once, at start-up,
and is undone when the pool is closed or collected.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from ..errors import ConfigError

__all__ = ("Registration", "register")

log = logging.getLogger(__name__)

_HOST_REGISTER_DEFAULT = 0  # with unified addressing: mapped and portable


class Registration:
    """An exact-size ``cudaHostRegister`` of one tensor's bytes; `close()` undoes it."""

    __slots__ = ("__weakref__", "_finalizer", "nbytes", "ptr")

    def __init__(self, tensor: torch.Tensor, *, cudart: object | None = None) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ConfigError("pinning: needs a contiguous CPU tensor")
        runtime = cudart if cudart is not None else _cudart()
        self.ptr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        if self.nbytes:  # 0 bytes (host_pages=0): nothing to lock, and CUDA refuses them
            _check(runtime.cudaHostRegister(self.ptr, self.nbytes, _HOST_REGISTER_DEFAULT),  # type: ignore[attr-defined]
                   f"cudaHostRegister of {self.nbytes} bytes", _REGISTER_HINT)
        # Unregister before the memory can go back to the allocator: the finalizer holds the
        # tensor, so the bytes outlive the registration even if the owner drops both at once.
        self._finalizer = weakref.finalize(self, _unregister, runtime, self.ptr, tensor)

    @property
    def active(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Unregister (idempotent). Copies that use the memory must have finished."""
        self._finalizer()


def register(tensor: torch.Tensor) -> Registration:
    """Page-lock `tensor`'s bytes for DMA. Raises `ConfigError` without a CUDA device."""
    return Registration(tensor)


def _cudart() -> object:
    if not torch.cuda.is_available():
        raise ConfigError("pinning the host pool needs a CUDA device; torch sees none")
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _unregister(runtime: object, ptr: int, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return  # nothing was registered
    unregister: Callable[[int], object] = runtime.cudaHostUnregister  # type: ignore[attr-defined]
    try:
        _check(unregister(ptr), "cudaHostUnregister")
    except ConfigError:
        log.exception("could not unpin the host pool")  # the process keeps the lock; no data risk
    del tensor


# NOTE: no unpinned fallback: the copy kernels read and write the host pool through its
# device mapping, which only a registered pool has; what the user can change is the limit
# or the pool's size, so the error says both
_REGISTER_HINT = ("; the host pool could not be page-locked: check the locked-memory limit "
                  "(`ulimit -l`, a container's memlock limit, RLIMIT_MEMLOCK) or make the "
                  "host pool smaller (host_ratio / host_pages)")


def _check(status: object, what: str, hint: str = "") -> None:
    code = int(getattr(status, "value", status))  # type: ignore[call-overload]
    if code != 0:
        raise ConfigError(f"{what} failed with CUDA error {code} ({status}){hint}")
