"""KV events: the async stream and the ZMQ wire match what the tree actually holds."""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest
import zmq

from aiohicache import ConfigError, HiCache
from aiohicache.controller import page_format
from aiohicache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventStream,
    ZmqEventPublisher,
)
from aiohicache.storage.keys import chain_keys, namespace_root
from aiohicache.storage.memory import MemoryBackend
from tests.conftest import make_cache, make_config, make_tokens, prefill

Model = set[tuple[str, bytes]]


def root_of(cache: HiCache) -> bytes:
    cfg = cache.config
    return namespace_root(namespace=cfg.namespace, spec_fingerprint=cfg.spec.fingerprint(),
                          page_size=cfg.page_size, layout=cfg.host_layout)


def tree_state(cache: HiCache, *, storage: bool = False) -> Model:
    """(medium, page key) of every page L1 and L2 hold, keys derived from the tokens alone;
    with `storage`, also the pages the tree knows to be in L3 (`Node.stored`)."""
    root, ps, out = root_of(cache), cache.config.page_size, set()
    for node in cache.tree.iter_nodes():
        tokens = np.concatenate([n.key for n in node.path_to_root()[::-1]])
        keys = chain_keys(root, tokens, ps)[-node.num_pages:]
        for medium, present in (("device", node.on_device), ("host", node.on_host)):
            if present:
                out |= {(medium, k) for k in keys}
        if storage and node.stored:
            out |= {("storage", k) for k, s in zip(keys, node.stored, strict=True) if s}
    return out


def apply(model: Model, batch: EventBatch, root: bytes) -> None:
    """Apply a batch to the subscriber's model, checking each event on the way."""
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            assert chain_keys(ev.parent_block_hash or root, np.array(ev.token_ids),
                              ev.block_size) == ev.block_hashes  # keys, parent, tokens agree
            for k in ev.block_hashes:
                assert (ev.medium, k) not in model or ev.medium == "storage"
                model.add((ev.medium, k))
        elif isinstance(ev, BlockRemoved):
            for k in ev.block_hashes:
                model.remove((ev.medium, k))
        else:
            assert isinstance(ev, AllBlocksCleared)
            model -= {(m, k) for m, k in model if m != "storage"}


async def replay(cache: HiCache, *, turns: int = 60, seed: int = 0) -> None:
    """Multi-turn conversations (each turn extends its conversation), small tiers: inserts,
    hits, load-backs, evictions from L1 and L2, splits."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    for _ in range(turns):
        if convs and rng.random() < 0.6 and len(conv := rng.choice(convs)) < 40:
            conv += [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 12))]
        else:
            base = rng.choice(convs)[:rng.randrange(0, 16)] if convs else []
            conv = base + [rng.randrange(1 << 20) for _ in range(rng.randrange(4, 24))]
            convs.append(conv)
        await prefill(cache, list(conv))
        if rng.random() < 0.3:
            await cache.drain()


async def settle(cache: HiCache) -> None:
    await cache.drain()
    await asyncio.sleep(0)  # batches are sealed one loop turn after the change
    await asyncio.sleep(0)


async def test_stream_matches_the_tree_over_a_replay() -> None:
    async with make_cache(device_pages=16, host_pages=24) as cache:
        root = root_of(cache)
        model: Model = set()
        async with cache.events() as stream:
            await replay(cache)
            await settle(cache)
            seqs = []
            while (batch := stream.get_nowait()) is not None:
                seqs.append(batch.seq)
                apply(model, batch, root)
            assert stream.dropped == 0 and seqs == list(range(len(seqs)))
            assert model == tree_state(cache) and model
            assert cache.stats().device_evicted_pages and cache.stats().host_evicted_pages
            cache.check_invariants()


async def test_a_late_subscriber_starts_from_a_snapshot_and_the_stream_ends_on_close() -> None:
    cache = make_cache(device_pages=16, host_pages=24)
    async with cache:
        root = root_of(cache)
        await replay(cache, turns=20, seed=1)
        await settle(cache)
        stream = cache.events(snapshot=True)
        model: Model = set()
        apply(model, await anext(stream), root)
        assert model == tree_state(cache)
        await replay(cache, turns=20, seed=2)
        await settle(cache)
        while (batch := stream.get_nowait()) is not None:
            apply(model, batch, root)
        assert model == tree_state(cache)
    batches = [b async for b in stream]  # ends after the close
    assert batches and isinstance(batches[-1].events[-1], AllBlocksCleared)


async def test_a_snapshot_does_not_repeat_the_changes_it_already_holds() -> None:
    """The open batch (changes of this loop turn, not sealed yet) went to a stream that
    subscribed during the turn too, after a snapshot that already held them: pages were
    stored twice in its model."""
    async with make_cache(device_pages=16, host_pages=24) as cache:
        root, first = root_of(cache), cache.events()
        await prefill(cache, list(range(40)))  # its changes are still the open batch
        late = cache.events(snapshot=True)
        await settle(cache)
        model: Model = set()
        while (batch := late.get_nowait()) is not None:
            apply(model, batch, root)  # asserts no page is stored twice
        assert model == tree_state(cache)
        await first.aclose()
        await late.aclose()


async def big_tree(cache: HiCache, *, prompts: int, length: int = 400) -> None:
    """`prompts` sequences sharing no prefix, on the device and (after settling) the host."""
    for seed in range(prompts):
        await prefill(cache, make_tokens(length, seed=seed))
    await settle(cache)


async def test_a_snapshot_is_hashed_while_it_is_read_yielding_to_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`events(snapshot=True)` hashed every page the tiers held at once, on the loop, inside
    the (sync) call: 835 ms for a 5M-token tree, 167 ms for 1M."""
    async with make_cache(device_pages=3000, host_pages=3000) as cache:
        await big_tree(cache, prompts=28)  # 2,800 pages: a few steps of the snapshot
        first = cache.events()  # the hub exists: its namespace root is hashed already
        calls = 0
        blake2b = hashlib.blake2b

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return blake2b(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(hashlib, "blake2b", counting)
            stream = cache.events(snapshot=True)
        assert calls == 0  # O(nodes) at subscribe time
        turns = 0

        async def tick() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await asyncio.sleep(0)
            turns = 0
            snapshot = await anext(stream)
            tg.cancel_scope.cancel()
        assert turns >= 2 and snapshot.seq == -1
        model: Model = set()
        apply(model, snapshot, root_of(cache))
        assert model == tree_state(cache)
        await first.aclose()
        await stream.aclose()


async def test_a_snapshot_read_during_churn_agrees_with_the_batches_after_it() -> None:
    """The snapshot is what the tiers held at subscribe time, though it is hashed later,
    while the tree splits, evicts and grows: with the batches after it, it is the tree."""
    async with make_cache(device_pages=2400, host_pages=2600) as cache:
        await big_tree(cache, prompts=23)
        stream, model = cache.events(snapshot=True), set[tuple[str, bytes]]()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _apply_next(model, stream, root_of(cache)))
            for seed in range(40):  # evicts from both tiers, splits shared prefixes
                await prefill(cache, make_tokens(200, seed=seed % 23)[:120] +
                              make_tokens(200, seed=100 + seed))
        await settle(cache)
        while (batch := stream.get_nowait()) is not None:
            apply(model, batch, root_of(cache))
        assert model == tree_state(cache)
        assert cache.stats().device_evicted_pages and cache.stats().host_evicted_pages
        await stream.aclose()


async def _apply_next(model: Model, stream: EventStream, root: bytes) -> None:
    batch = await anext(stream)
    assert batch.seq == -1
    apply(model, batch, root)


async def test_leaving_a_stream_keeps_the_changes_made_before() -> None:
    """Closing a stream unsubscribed before the loop sealed the open batch, so the
    changes of that last turn never reached it."""
    async with make_cache(device_pages=16, host_pages=24) as cache:
        async with cache.events() as stream:
            await prefill(cache, list(range(40)))
        model: Model = set()
        async for batch in stream:
            apply(model, batch, root_of(cache))
        assert model == tree_state(cache) and model


async def test_a_stream_of_a_closed_cache_ends_at_once() -> None:
    """Asking a closed cache for events made a hub nobody would close: the stream never
    ended and its reader hung."""
    cache = make_cache(device_pages=16, host_pages=24)
    async with cache:
        await prefill(cache, list(range(40)))
    with anyio.fail_after(5):
        assert [b async for b in cache.events()] == []
        assert [b async for b in cache.events(snapshot=True)] == []


async def test_two_readers_of_one_stream_both_get_batches() -> None:
    """Each waiting reader replaced the stream's one wake-up: the first reader was never
    woken again, by a batch or by the end."""
    async with make_cache(device_pages=16, host_pages=24) as cache:
        stream = cache.events()
        got: list[int] = []

        async def read() -> None:
            async for batch in stream:
                got.append(batch.seq)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            tg.start_soon(read)
            await anyio.sleep(0.01)  # both readers wait
            await prefill(cache, list(range(40)))
            await settle(cache)
            await prefill(cache, list(range(100, 140)))
            await settle(cache)
            with anyio.fail_after(5):
                await stream.aclose()  # both readers end
        assert got and got == sorted(set(got))


async def test_a_slow_subscriber_drops_batches_and_never_blocks_the_cache() -> None:
    async with make_cache(device_pages=16, host_pages=24) as cache:
        slow, fast = cache.events(max_batches=2), cache.events()
        await replay(cache, turns=30, seed=3)
        await settle(cache)
        got = []
        while (batch := fast.get_nowait()) is not None:
            got.append(batch)
        assert slow.dropped == len(got) - 2 > 0 and fast.dropped == 0
        await slow.aclose()
        await fast.aclose()
        assert not cache.tree.on_residency  # nobody subscribes: the tree calls no hook


async def test_storage_events_list_what_was_backed_up() -> None:
    cfg0 = make_config()
    backend = MemoryBackend(page_format(cfg0))
    cfg = make_config(storage=backend, device_pages=16, host_pages=24)
    async with HiCache(cfg) as cache, cache.events() as stream:
        await replay(cache, turns=20, seed=4)
        await settle(cache)
        await settle(cache)
        model: Model = set()
        while (batch := stream.get_nowait()) is not None:
            apply(model, batch, root_of(cache))
        stored = {k for m, k in model if m == "storage"}
        # NOTE: not every page backed up: those whose nodes left the tree are forgotten
        # (removed), though L3 still holds them
        assert stored and stored <= {bytes.fromhex(k) for k in backend._objects}
        assert model == tree_state(cache, storage=True)
    await backend.aclose()


# ---------------------------------------------------------------------------- ZMQ


def h(key: bytes) -> int:
    return int.from_bytes(key[:8], "big", signed=True)


class Subscriber:
    """A router's side: SUB for live batches, DEALER for replay; blocking (run in a thread)."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_sock = self.ctx.socket(zmq.DEALER)
        self.replay_sock.connect(replay_endpoint)
        self.batches: dict[int, list[Any]] = {}

    def replay(self, start: int) -> None:
        self.replay_sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.replay_sock.poll(5000), "no replay reply"
            _, seq, payload = self.replay_sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return
            self.batches[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)

    def receive(self, timeout_ms: int = 200) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b""
            self.batches[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)

    def fill_gaps(self) -> None:
        top = max(self.batches, default=-1)
        missing = [s for s in range(top + 1) if s not in self.batches]
        if missing:
            self.replay(missing[0])

    def model(self) -> set[tuple[str, int]]:
        model: set[tuple[str, int]] = set()
        for seq in sorted(self.batches):
            ts, events = self.batches[seq][:2]
            assert isinstance(ts, float)
            for ev in events:
                if ev[0] == "BlockStored":
                    _, hashes, _parent, tokens, size, lora, medium, lora_name = ev
                    assert len(tokens) == len(hashes) * size and lora is lora_name is None
                    model |= {(medium, x) for x in hashes}
                elif ev[0] == "BlockRemoved":
                    _, hashes, medium = ev
                    model -= {(medium, x) for x in hashes}
                else:
                    assert ev == ["AllBlocksCleared"]
                    model = {(m, x) for m, x in model if m == "DISK"}
        return model

    def close(self) -> None:
        self.ctx.destroy(linger=0)


async def test_zmq_subscriber_decodes_the_vllm_wire_format_and_replays_gaps() -> None:
    cache = make_cache(device_pages=16, host_pages=24)
    async with cache, ZmqEventPublisher(cache, "tcp://127.0.0.1:*",
                                        replay_endpoint="tcp://127.0.0.1:*") as pub:
        await replay(cache, turns=25, seed=5)  # before anyone listens: only replay has it
        await settle(cache)
        sub = await asyncio.to_thread(Subscriber, pub.endpoint, str(pub.replay_endpoint))
        try:
            await asyncio.to_thread(sub.replay, 0)
            first = len(sub.batches)
            assert first and sorted(sub.batches) == list(range(first))
            await asyncio.sleep(0.2)  # let the subscription reach the PUB socket
            await replay(cache, turns=25, seed=6)
            await settle(cache)
            await asyncio.to_thread(sub.receive)
            await asyncio.to_thread(sub.fill_gaps)
            assert sorted(sub.batches) == list(range(len(sub.batches)))
            assert len(sub.batches) > first and pub.dropped == 0
            medium = {"device": "GPU", "host": "CPU"}
            assert sub.model() == {(medium[m], h(k)) for m, k in tree_state(cache)}
        finally:
            sub.close()


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_encoding_is_msgspec_array_like(hash_format: str) -> None:
    from aiohicache.events import encode_batch

    key, parent = bytes(range(16)), bytes(range(16, 32))
    batch = EventBatch(seq=3, ts=1.5, events=[
        BlockStored([key], parent, [1, 2, 3, 4], 4, "host"),
        BlockRemoved([key], "device"), AllBlocksCleared()])
    decoded = msgpack.unpackb(encode_batch(batch, hash_format=hash_format,  # type: ignore[arg-type]
                                           data_parallel_rank=0))
    want = h(key) if hash_format == "int" else key
    want_parent = h(parent) if hash_format == "int" else parent
    assert decoded == [1.5, [["BlockStored", [want], want_parent, [1, 2, 3, 4], 4, None, "CPU",
                              None], ["BlockRemoved", [want], "GPU"], ["AllBlocksCleared"]], 0]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_hub_flushes_on_the_next_loop_turn_under_either_backend(backend: str) -> None:
    import anyio.lowlevel

    from aiohicache._events_hub import _soon_caller

    async def main() -> list[str]:
        order: list[str] = []
        _soon_caller()(lambda: order.append("flushed"))
        order.append("now")  # the callback waits for the loop's next turn
        await anyio.lowlevel.checkpoint()
        return order

    assert anyio.run(main, backend=backend) == ["now", "flushed"]


@pytest.mark.parametrize("bad", [0, -1, None, "8"])
async def test_a_bad_max_batches_is_a_config_error(bad: Any) -> None:
    """It was taken, and broke the flush of every other subscriber (a review)."""
    async with HiCache(make_config()) as cache:
        with pytest.raises(ConfigError, match="max_batches"):
            cache.events(max_batches=bad)
