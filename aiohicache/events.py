"""KV events: what entered and left each tier, as an async stream and over ZMQ.

    async with cache.events() as stream:
        async for batch in stream:                 # EventBatch(seq, ts, events)
            for event in batch.events:             # BlockStored / BlockRemoved / AllBlocksCleared
                ...

`ZmqEventPublisher` sends the same batches in the wire format vLLM and SGLang use (topic,
8-byte big-endian sequence number, msgpack payload; optional replay socket), so routers built
for those engines can subscribe. Buffers are bounded everywhere: a subscriber that falls
behind loses whole batches (counted, and visible as a gap in `seq`); the cache never waits.
docs/observability.md describes every field.

The records and the stream live in `_events_stream`, the hub that feeds streams from the tree
in `_events_hub`, the wire format and publisher in `_events_zmq`; this module is the face.
"""

from ._events_hub import hub_of
from ._events_stream import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventStream,
    KVEvent,
    Medium,
)
from ._events_zmq import DEFAULT_MEDIUM_NAMES, END_SEQ, ZmqEventPublisher, encode_batch

__all__ = ("DEFAULT_MEDIUM_NAMES", "END_SEQ", "AllBlocksCleared", "BlockRemoved", "BlockStored",
           "EventBatch", "EventStream", "KVEvent", "Medium", "ZmqEventPublisher", "encode_batch",
           "hub_of")
