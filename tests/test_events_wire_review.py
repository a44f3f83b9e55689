"""A review of the KV-event wire format against the routers that decode it.

The payload must decode the way the real subscribers decode it: SGLang's router
(`experimental/sgl-router/src/policies/kv_events/wire.rs`: `block_hashes` as i64, events as
tagged arrays), vLLM's own msgspec structs before and after its switch to map encoding
(`vllm/distributed/kv_events.py`, PRs #27577 and #42892), Dynamo's `zmq_wire` and llm-d's
`engineadapter` (either sign, either shape). The decoders below restate those layouts with
plain msgpack, field by field; each test states a rule the code broke."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import zmq

from aiohicache import ConfigError
from aiohicache.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ZmqEventPublisher,
    encode_batch,
)
from tests.conftest import make_cache, make_tokens, prefill
from tests.test_events import settle
from tests.test_events_zmq import LOCAL

I64 = range(-(1 << 63), 1 << 63)
HIGH = bytes([0xFF]) + bytes(range(1, 16))  # a key whose first bit is set: half of them
PARENT = bytes([0x80]) + bytes(15)

# vLLM >= 0.11.1 (#27577): fields of BlockStored without a default, in declaration order;
# msgspec rejects an array_like struct shorter than these, and a map missing one of them.
VLLM_BLOCK_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                     "lora_id", "medium", "lora_name")
VLLM_BLOCK_REMOVED = ("block_hashes", "medium")


def batch() -> EventBatch:
    return EventBatch(seq=0, ts=1.5, events=[
        BlockStored([HIGH], PARENT, [1, 2, 3, 4], 4, "device"),
        BlockRemoved([HIGH], "host"), AllBlocksCleared()])


def decode_like_sglang_router(payload: bytes) -> list[list[Any]]:
    """`[ts, [event...], rank?]`, events tagged arrays, hashes read as i64 (rmp-serde fails
    the whole batch on a u64 past i64::MAX)."""
    ts, events = msgpack.unpackb(payload)[:2]
    assert isinstance(ts, float)
    for ev in events:
        assert isinstance(ev, list) and ev[0] in ("BlockStored", "BlockRemoved",
                                                  "AllBlocksCleared")
        if ev[0] != "AllBlocksCleared":
            hashes = ev[1] + ([ev[2]] if ev[0] == "BlockStored" and ev[2] is not None else [])
            bad = [x for x in hashes if not (isinstance(x, int) and x in I64)]
            assert not bad, f"not an i64: {bad} (the router drops the batch)"
    return events  # type: ignore[no-any-return]


def decode_like_vllm_array_like(payload: bytes) -> list[dict[str, Any]]:
    """vLLM 0.11.1 .. #42892: msgspec `array_like`, `tag=True`: every field without a default
    must be present by position; trailing extra ones are ignored."""
    out = []
    for ev in msgpack.unpackb(payload)[1]:
        names = {"BlockStored": VLLM_BLOCK_STORED, "BlockRemoved": VLLM_BLOCK_REMOVED,
                 "AllBlocksCleared": ()}[ev[0]]
        assert len(ev) >= 1 + len(names), (
            f"{ev[0]}: Expected `array` of at least length {1 + len(names)}, got {len(ev)}")
        out.append({"type": ev[0], **dict(zip(names, ev[1:], strict=False))})
    return out


def decode_like_vllm_main(payload: bytes) -> list[dict[str, Any]]:
    """vLLM since #42892: the batch an array, each event a map with its tag under "type";
    msgspec requires every field without a default by name, and rejects an array."""
    body = msgpack.unpackb(payload)
    assert isinstance(body, list) and isinstance(body[0], float)
    for ev in body[1]:
        assert isinstance(ev, dict), f"Expected `object`, got `{type(ev).__name__}`"
        names = {"BlockStored": VLLM_BLOCK_STORED, "BlockRemoved": VLLM_BLOCK_REMOVED,
                 "AllBlocksCleared": ()}[ev["type"]]
        missing = [n for n in names if n not in ev]
        assert not missing, f"{ev['type']}: missing required fields {missing}"
    return body[1]  # type: ignore[no-any-return]


def test_int_hashes_are_signed_64_bit_as_sglang_sends_them_and_its_router_reads_them() -> None:
    """The docs say keys go out "as SGLang's 64-bit hashes", but SGLang sends the first 8
    bytes as a *signed* int64 (`hash_str_to_int64`), and its router decodes `block_hashes`
    as i64. An unsigned value >= 2**63 (every key whose first bit is set) went out as a
    msgpack uint64: the router rejected the whole batch, half the batches in practice."""
    events = decode_like_sglang_router(encode_batch(batch()))
    want = int.from_bytes(HIGH[:8], "big", signed=True)
    assert events[0][1:3] == [[want], int.from_bytes(PARENT[:8], "big", signed=True)]
    assert events[1][1] == [want]


def test_uint_hashes_keep_vllms_unsigned_range_for_routers_that_want_it() -> None:
    """vLLM's own int hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) are unsigned 64-bit;
    a router that reads only u64 gets that with `hash_format="uint"` (it went out as bytes)."""
    stored = msgpack.unpackb(encode_batch(batch(), hash_format="uint"))[1][0]
    assert stored[1] == [int.from_bytes(HIGH[:8], "big")] and stored[1][0] >= 1 << 63


def test_block_stored_carries_every_field_vllm_0_11_requires() -> None:
    """vLLM 0.11.1 (#27577) added `lora_name` to `BlockStored` without a default; its
    array_like decoder (`KVEventBatch`, used by vLLM-based subscribers) rejected our
    7-element `BlockStored` ("Expected `array` of at least length 8"). Older decoders ignore
    the trailing field."""
    stored, removed, cleared = decode_like_vllm_array_like(encode_batch(batch()))
    assert stored["lora_name"] is None and stored["medium"] == "GPU"
    assert stored["lora_id"] is None and stored["block_size"] == 4
    assert removed["medium"] == "CPU" and cleared == {"type": "AllBlocksCleared"}


def test_map_events_decode_by_name_as_vllm_since_42892_reads_them() -> None:
    """vLLM #42892 (and SGLang #37482) dropped `array_like` from the event structs: their
    decoders read each event as a map and reject an array. Routers disagree (older llm-d,
    kthena, aibrix read arrays only; Dynamo, llm-d >= #661, sgl-router >= #40684 read both),
    so the shape is a switch; nothing could produce the map shape."""
    stored, removed, cleared = decode_like_vllm_main(
        encode_batch(batch(), event_format="map", data_parallel_rank=0))
    assert stored == {"type": "BlockStored",
                      "block_hashes": [int.from_bytes(HIGH[:8], "big", signed=True)],
                      "parent_block_hash": int.from_bytes(PARENT[:8], "big", signed=True),
                      "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None,
                      "medium": "GPU", "lora_name": None}
    assert removed == {"type": "BlockRemoved", "block_hashes": stored["block_hashes"],
                       "medium": "CPU"}
    assert cleared == {"type": "AllBlocksCleared"}


def replayed_payloads(endpoint: str) -> list[bytes]:
    """Every buffered payload, asked of the replay socket as a router does (blocking)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads: list[bytes] = []
        while sock.poll(5000):
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return payloads
            payloads.append(payload)
        raise AssertionError("no end marker")
    finally:
        ctx.destroy(linger=0)


async def test_a_publisher_sends_what_a_vllm_main_subscriber_decodes() -> None:
    """A real cache's events through a publisher set to the map shape decode as vLLM main
    reads them, every hash an i64 (the publisher had no such option)."""
    cache = make_cache(device_pages=16, host_pages=24)
    async with ZmqEventPublisher(cache, LOCAL, replay_endpoint=LOCAL,
                                 event_format="map") as pub, cache:
        for seed in range(4):
            await prefill(cache, make_tokens(64, seed=seed))
        await settle(cache)
        await asyncio.sleep(0.05)  # the publisher's task sends what the stream sealed
        payloads = await asyncio.to_thread(replayed_payloads, str(pub.replay_endpoint))
    events = [ev for p in payloads for ev in decode_like_vllm_main(p)]
    stored = [ev for ev in events if ev["type"] == "BlockStored"]
    assert stored and all(x in I64 for ev in stored for x in ev["block_hashes"])
    assert all(len(ev["token_ids"]) == len(ev["block_hashes"]) * ev["block_size"]
               for ev in stored)


async def test_an_unknown_event_format_is_a_config_error() -> None:
    """A shape no router decodes is refused at construction, naming the option."""
    with pytest.raises(ConfigError, match="event_format"):
        ZmqEventPublisher(make_cache(), LOCAL, event_format="json")  # type: ignore[arg-type]
