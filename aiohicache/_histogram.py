"""Fixed-bucket histograms of transfer sizes and durations, kept without any dependency.

`aiohicache.metrics` turns them into Prometheus histograms; the cache only counts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ("BYTES_BUCKETS", "SECONDS_BUCKETS", "Histogram", "TransferHistograms")

BYTES_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4 ** k) for k in range(11))
"""4 KiB .. 4 GiB, by fours."""
SECONDS_BUCKETS: tuple[float, ...] = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                                      0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts per bucket (not cumulative), their sum and count; `observe` is O(log buckets)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, as Prometheus wants them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


def _bytes() -> Histogram:
    return Histogram(BYTES_BUCKETS)


def _seconds() -> Histogram:
    return Histogram(SECONDS_BUCKETS)


@dataclass(slots=True)
class TransferHistograms:
    """Bytes and seconds of each finished copy, per direction: `load` brings KV towards the
    device (L2 -> L1, or L3 -> L2), `store` takes it away (L1 -> L2, or L2 -> L3)."""

    load_bytes: Histogram = field(default_factory=_bytes)
    load_seconds: Histogram = field(default_factory=_seconds)
    store_bytes: Histogram = field(default_factory=_bytes)
    store_seconds: Histogram = field(default_factory=_seconds)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        self.load_bytes.observe(nbytes)
        self.load_seconds.observe(seconds)

    def observe_store(self, nbytes: int, seconds: float) -> None:
        self.store_bytes.observe(nbytes)
        self.store_seconds.observe(seconds)
