"""Trace replay: request traces (Mooncake, kv-cache-tester, synthetic) to drive the cache."""

from .traces import Request, load_agentic, load_mooncake, load_trace, stream_trace, synthetic

__all__ = (
    "Request",
    "load_agentic",
    "load_mooncake",
    "load_trace",
    "stream_trace",
    "synthetic",
)
