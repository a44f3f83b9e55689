"""A review of the KV events: what a router rebuilds from them is what the cache holds.

A router (SGLang's / vLLM's KV-event-aware routing) keeps, per instance, the blocks each tier
holds, from a snapshot and the batches after it, and trusts `seq` to tell it when it missed
some. Each test states a rule the docs promise and that the code broke."""

from __future__ import annotations

import asyncio

from aiohicache import HiCache
from aiohicache.controller import page_format
from aiohicache.events import ZmqEventPublisher
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import make_cache, make_config, make_tokens, prefill
from tests.test_events import Subscriber, apply, h, replay, root_of, settle, tree_state

LOCAL = "tcp://127.0.0.1:*"


async def test_changes_nobody_saw_leave_a_gap_in_seq() -> None:
    """"A gap [in `seq`] means this subscriber dropped batches": a subscriber that follows
    `seq` from one stream to the next (a router across a publisher's restart) must see a gap
    where the tiers changed with nobody subscribed. The hub numbered only the batches it
    made, and it made none while unhooked: the next stream went on from the last number as
    if nothing had happened, and the router kept evicted pages for ever."""
    async with make_cache(device_pages=16, host_pages=24) as cache:
        async with cache.events() as first:
            await prefill(cache, make_tokens(40, seed=1))
            await settle(cache)
        last = [b.seq for b in iter(first.get_nowait, None)][-1]
        evicted = cache.stats().device_evicted_pages
        for seed in range(2, 8):  # nobody listens: these evict the first prompt's pages
            await prefill(cache, make_tokens(40, seed=seed))
        await settle(cache)
        assert cache.stats().device_evicted_pages > evicted
        async with cache.events() as second:
            await prefill(cache, make_tokens(40, seed=9))
            await settle(cache)
        seqs = [b.seq for b in iter(second.get_nowait, None)]
        assert seqs and seqs[0] > last + 1, f"no gap in seq after {last}: {seqs}"


async def test_a_restarted_publisher_shows_its_subscribers_the_changes_they_missed() -> None:
    """A router subscribed to an endpoint across a restart of its publisher (the cache
    running on meanwhile) must be able to tell that its view went stale: by a gap in `seq`.
    The new publisher went on from the old one's last number, and the router's model of the
    instance kept the pages evicted while no publisher ran, with nothing to say so."""
    async with make_cache(device_pages=16, host_pages=24) as cache:
        pub = ZmqEventPublisher(cache, LOCAL, replay_endpoint=LOCAL)
        async with pub:
            sub = await asyncio.to_thread(Subscriber, pub.endpoint, str(pub.replay_endpoint))
            await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
            await prefill(cache, make_tokens(40, seed=1))
            await settle(cache)
            await asyncio.to_thread(sub.receive)
        try:
            assert sub.batches
            for seed in range(2, 8):  # no publisher: evicts the first prompt's pages
                await prefill(cache, make_tokens(40, seed=seed))
            await settle(cache)
            async with ZmqEventPublisher(cache, pub.endpoint,
                                         replay_endpoint=str(pub.replay_endpoint)):
                for seed in range(100, 200):  # until the SUB has reconnected
                    await prefill(cache, make_tokens(8, seed=seed))
                    await settle(cache)
                    await asyncio.to_thread(sub.receive, 50)
                    if max(sub.batches) > 0:
                        break
                await asyncio.to_thread(sub.fill_gaps)  # what it lost while reconnecting
            seqs = sorted(sub.batches)
            medium = {"device": "GPU", "host": "CPU"}
            stale = sub.model() != {(medium[m], h(k)) for m, k in tree_state(cache)}
            gap = seqs != list(range(len(seqs)))
            assert stale and gap, f"a stale view and no gap in seq {seqs}"
        finally:
            sub.close()


async def test_a_snapshot_lists_the_pages_l3_holds_as_a_subscriber_from_the_start_knew() -> None:
    """`snapshot=True` starts with "what the tiers hold now", and L3 is a tier (`storage`,
    reported when a backup succeeds). The snapshot listed L1 and L2 only: a router that
    joined late (or restarted) never learnt which prefixes an instance could read back from
    its L3, though one subscribed from the start knew, and though the tree knows (its nodes'
    `stored` pages). Every storage page the snapshot lists must really be in L3."""
    backend = MemoryBackend(page_format(make_config()))
    cfg = make_config(storage=backend, device_pages=16, host_pages=24)
    async with HiCache(cfg) as cache:
        root, early, late = root_of(cache), set[tuple[str, bytes]](), set[tuple[str, bytes]]()
        async with cache.events() as first:
            await replay(cache, turns=20, seed=4)
            await settle(cache)
            await settle(cache)
            async with cache.events(snapshot=True) as second:
                pass
        for batch in iter(first.get_nowait, None):
            apply(early, batch, root)
        apply(late, await anext(second), root)
        held = {k for _, k in tree_state(cache)}
        known = {k for m, k in early if m == "storage" and k in held}
        assert known, "nothing was backed up: the test shows nothing"
        in_l3 = {k for m, k in late if m == "storage"}
        assert known <= in_l3, f"{len(known - in_l3)} of {len(known)} L3 pages not listed"
        assert in_l3 <= {bytes.fromhex(k) for k in backend._objects}
        assert {(m, k) for m, k in late if m != "storage"} == tree_state(cache)
    await backend.aclose()
