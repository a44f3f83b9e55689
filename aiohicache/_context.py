"""`FetchContext`: one request's face, from match to commit (see `HiCache.fetch`)."""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Self

import anyio
import numpy as np
import torch

from ._core import Core
from ._request import Request, alloc_op, fetch_keys
from ._tokens import TokenInput, as_tokens
from ._validate import check_int
from .controller import LoadJob
from .errors import CapacityError, ClosedError, ConfigError
from .memory import PageIds

__all__ = ("FetchContext", "check_count", "lease")


async def lease(core: Core, num_tokens: int, owner: int, *,
                request: Request | None = None) -> PageIds:
    """Lease pages for `num_tokens` to `owner` (a fetch context's: pass its `request`)."""
    core.check_open()
    num_pages = -(-num_tokens // core.config.page_size)
    if num_pages > core.tree.device_alloc.capacity:
        raise CapacityError(f"asked for {num_pages} device pages; the pool has "
                            f"{core.tree.device_alloc.capacity}")
    last_used = num_tokens - (num_pages - 1) * core.config.page_size
    pages: PageIds = await core.run().call(
        lambda op: alloc_op(core, num_pages, owner, last_used=last_used) if request is None
        else request.lease_op(num_pages),
        undo=lambda got: core.leases.release_owned(got, owner))
    return pages


def check_count(num_tokens: int) -> None:
    check_int("num_tokens", num_tokens, low=1)


class FetchContext:
    """One request's view of the cache, from match to commit; also the async context manager.

    Attributes (valid inside the ``async with`` block):
        num_cached_tokens: prefix length whose KV is on the device or being loaded there.
        num_device_hit_tokens, num_host_hit_tokens, num_storage_hit_tokens: that prefix by
            the tier it came from.
        device_indices: device token slots (int64 tensor) of that prefix, for attention.
    """

    def __init__(self, request: Request) -> None:
        self._req = request
        self._device_indices: tuple[PageIds, torch.Tensor] | None = None

    def __del__(self, _warn: object = warnings.warn) -> None:
        # NOTE: entered and never exited (`__aenter__` called by hand, then dropped): its pin
        # and leases would be held for the cache's life. Released on the cache's loop: the GC
        # may run this on any thread, in the middle of any operation.
        # NOTE: not while a TP tick runs: the release would be an op queued whenever the GC
        # ran, a point of the op log that differs by rank, and the same later call had other
        # outcomes on the ranks. Its pin and leases stay, alike on every rank.
        req = getattr(self, "_req", None)
        if req is None or req.pin is None:
            return
        req.core.abandoned += 1  # NOTE: a race of two collecting threads may lose one: >0
        tp = req.core.tp is not None and not req.core.tp.finished.done()
        _warn(f"{self!r} was entered and never exited: "
              f"{'its pin and leases stay (TP)' if tp else 'released now'}; use 'async with'",
              ResourceWarning, stacklevel=1)  # type: ignore[operator]
        if tp:
            req.core.dropped.append(req)
        elif req.core.bridge is not None:
            req.core.bridge.call_soon(req.release)

    def __repr__(self) -> str:
        return (f"<FetchContext {len(self.tokens)} tokens, {self.num_cached_tokens} cached, "
                f"{len(self._req.jobs)} loads>")

    @property
    def tokens(self) -> np.ndarray:
        """The fetched tokens (extended by commits), read-only: commits are checked
        against them, so an edit would pass a commit of other tokens over the cached KV."""
        return self._req.tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._req.num_cached_tokens

    @property
    def num_device_hit_tokens(self) -> int:
        return self._req.num_device_hit_tokens

    @property
    def num_host_hit_tokens(self) -> int:
        return self._req.num_host_hit_tokens

    @property
    def num_storage_hit_tokens(self) -> int:
        return self._req.num_storage_hit_tokens

    @property
    def _jobs(self) -> list[LoadJob]:
        return self._req.jobs

    @property
    def device_indices(self) -> torch.Tensor:
        pages = self._req.pages
        if self._device_indices is None or self._device_indices[0] is not pages:
            # keyed by the array object itself (held here, so never mistaken for a new one)
            self._device_indices = (pages, self._req.core.device_pool.pages_to_slots(pages))
        return self._device_indices[1]

    async def __aenter__(self) -> Self:
        """Match, pin and plan loads (synchronously), then queue the loads.

        Cancellation: while hashing a long prompt's L3 keys or waiting for a prefetch, nothing
        is pinned yet; while queueing a load, the load is still launched and this context
        unpins before the cancellation propagates.
        """
        req = self._req
        if req.entered:
            raise ClosedError("a FetchContext can be entered once: call cache.fetch() again")
        req.core.check_open()
        if len(req.tokens) == 0:
            raise ConfigError("tokens: must not be empty")
        req.entered = True
        if (keys := fetch_keys(req.core, req.tokens)) is not None:
            try:
                req.hashed = await keys.hash_pages(req.tokens)
            except anyio.get_cancelled_exc_class():
                # NOTE: TP: a rank that got this cancellation later has queued the call:
                # queue it here too, cancelled (its keys are then hashed at the tick)
                await req.core.run().abandon(req.enter_op, undo=lambda _: req.release_op())
                raise
        await req.core.run().call(req.enter_op, undo=lambda _: req.release_op())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._req.release()

    async def layer_ready(self, layer: int, *, stream: torch.cuda.Stream | None = None) -> None:
        """Wait until `layer` of the cached prefix is on the device.

        With a CUDA `stream`, return as soon as `stream` is ordered after the layer's copies
        (``stream.wait_event`` on each load's layer event): the GPU waits, the host does not,
        so the forward pass can be enqueued while the copy runs. Loads whose engine records
        no CUDA events (the CPU engine) are waited for on the host.

        Raises:
            ConfigError: no such layer.
            ClosedError: the context's block has ended.
            TransferError: a load this request depends on failed (host waits only: a GPU-side
                wait cannot see a copy fail; the cache reports it in `health`).

        Cancellation: cancels only the wait; loads go on and stay shared with other requests.
        """
        num_layers = self._req.core.config.spec.num_layers
        check_int("layer", layer, low=0, high=num_layers - 1)
        self._req.check_active()
        for job in list(self._req.jobs):
            if stream is None:
                await job.wait_layer(layer)
                continue
            handle = await job.launched_handle()
            event = handle.layer_event(layer)
            if event is None or handle.done():
                await handle.wait_layer(layer)
            else:
                stream.wait_event(event)  # type: ignore[arg-type]

    async def ready(self) -> None:
        """Wait until every layer of the cached prefix is on the device (see `layer_ready`).

        Raises:
            ClosedError: the context's block has ended.
            TransferError: a load this request depends on failed.

        Cancellation: cancels only the wait.
        """
        self._req.check_active()
        for job in list(self._req.jobs):
            await job.wait()

    async def allocate(self, num_tokens: int) -> torch.Tensor:
        """`HiCache.allocate`, tied to this context: slots not committed are freed on exit.

        After a commit that ended mid-page, the first slots returned are the free rest of
        that page (while this context still leases it), so a sequence's KV stays contiguous
        page by page.

        Cancellation: nothing is leased.
        """
        req = self._req
        req.check_active()
        check_count(num_tokens)
        pool = req.core.device_pool
        tail = req.tail  # NOTE: given back if the await below fails or is cancelled
        head, rest = req.take_tail(num_tokens)
        if rest == 0:
            assert head is not None
            return head.to(pool.device)
        try:
            pages = await lease(req.core, rest, req.owner, request=req)
        except BaseException:
            if req.tail is None:  # unless another allocate started a page meanwhile
                req.tail = tail  # (`take_tail` checks it is still in the lease it names)
            raise
        req.check_active()  # TP: left meanwhile, by another task; its release frees them
        if head is not None and not req.holds(tail):
            # NOTE: the page `head` continues was freed while we waited (and may be leased
            # to anyone now): its rest is not ours to hand out; start afresh
            req.core.leases.release_owned(pages, req.owner)
            return await self.allocate(num_tokens)
        req.took_pages(pages, rest)
        slots = pool.pages_to_slots(pages)[:rest]
        return slots if head is None else torch.cat([head.to(slots.device), slots])

    async def commit(self, tokens: TokenInput, slots: torch.Tensor) -> None:
        """Insert `tokens` into the cache, with the KV of ``tokens[num_cached_tokens:]`` at `slots`.

        `tokens` must be a prefix of the fetched tokens (chunked prefill) or extend them
        (decode), and `slots` must be leased (from `allocate`)
        for exactly the tokens after `num_cached_tokens`. Whole pages join the tree (a page
        that another request inserted meanwhile is freed, and if that request's copy is
        still loading, `ready`/`layer_ready` wait for it); a trailing partial page stays
        leased to this context, so decoding can continue and a later `commit` can pass it
        again. `num_cached_tokens` then covers the committed pages, which stay pinned until
        the context exits. Write-through starts for nodes that reached the hit threshold.

        Raises:
            ConfigError: `tokens` or `slots` do not fit the rules above.
            PageError: `slots` are not leased by this context or by `HiCache.allocate`.
            ClosedError: the cache is closed, or the context's block has ended.

        Cancellation: the insert is atomic; if cancelled while queueing the write-through, the
        write is still launched and the cancellation propagates after.
        """
        req = self._req
        req.check_active()
        req.core.check_open()
        toks = as_tokens(tokens)  # always a copy: the caller may have edited its list
        pages = req.check_commit(toks, slots)
        if req.nothing_new(toks, slots):
            return
        await req.core.run().call(lambda op: req.commit_op(toks, pages))
