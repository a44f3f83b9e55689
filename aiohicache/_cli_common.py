"""Pieces the ``aiohicache`` subcommands share: the event loop option and option callbacks."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import click

from .errors import ConfigError
from .replay import Request, load_trace
from .replay.runner import eviction_tiers
from .storage import check_url

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

LOOPS = ("asyncio", "uvloop")


def loop_factory(name: str) -> LoopFactory:
    """The event loop constructor named by ``--loop``."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            raise click.BadParameter("uvloop is not installed (pip install uvloop)",
                                     param_hint="--loop") from exc
        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(fn: Callable[..., Awaitable[T]], *args: Any, loop: str) -> T:
    """``fn(*args)`` on a fresh event loop of the kind ``--loop`` named.

    NOTE: anyio's asyncio backend, with the loop factory of `loop_factory`, so ``--loop
    uvloop`` runs on uvloop. No trio choice: the commands use asyncio-only parts (the Redis
    store, aiohttp, the HF adapter's executor); docs/architecture.md, "Concurrency
    vocabulary", says what runs under trio.
    """
    return anyio.run(fn, *args, backend="asyncio",
                     backend_options={"loop_factory": loop_factory(loop)})


def loop_option(f: F) -> F:
    """``--loop asyncio|uvloop``, shared by every subcommand that runs a loop."""
    return click.option("--loop", "loop", type=click.Choice(LOOPS), default="asyncio",
                        show_default=True, help="Event loop to run on.")(f)


def comma_list(ctx: click.Context, param: click.Parameter, text: str | None) -> list[str] | None:
    """Callback of a comma-separated option: its items; an empty or blank item (``1,,2``,
    ``,``, ``""``) is a usage error naming the option."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise click.BadParameter(f"comma-separated values, none empty, got {text!r}")
    return items


def int_list(lo: int, hi: int) -> Callable[[click.Context, click.Parameter, str], list[int]]:
    """Callback of a comma-separated option of ints in ``lo..hi``."""
    def parse(ctx: click.Context, param: click.Parameter, text: str) -> list[int]:
        try:
            values = [int(x) for x in comma_list(ctx, param, text) or []]
        except ValueError:
            raise click.BadParameter(f"comma-separated ints, got {text!r}") from None
        if not all(lo <= v <= hi for v in values):
            raise click.BadParameter(f"ints in {lo}..{hi}, got {text!r}")
        return values
    return parse


class FiniteFloatRange(click.FloatRange):
    """`click.FloatRange` that also refuses ``nan`` and ``inf``.

    NOTE: FloatRange lets ``nan`` through (every comparison with it is false), and ``inf``
    passes any lower bound; an option that takes either would quietly do nothing.
    """

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def evictions(ctx: click.Context, param: click.Parameter, text: str) -> list[str]:
    """Callback of ``replay --eviction``: policies (or L1:L2 pairs), comma-separated, each
    once (``lru`` and ``lru:lru`` are one policy: a second replay would print the same
    numbers again)."""
    items = comma_list(ctx, param, text) or []
    seen: dict[tuple[str, str], str] = {}
    for item in items:
        try:
            tiers = eviction_tiers(item)
        except ConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix("eviction: ")) from None
        if tiers in seen:
            raise click.BadParameter(f"{item!r} is given twice" if item == seen[tiers] else
                                     f"{item!r} is {seen[tiers]!r} again")
        seen[tiers] = item
    return items


def load_requests(trace: str, *, limit: int | None) -> list[Request]:
    """`load_trace`, refusing a trace without requests (its report would be all zeros).

    Raises:
        ConfigError: as `load_trace`, or the trace has no requests (`no_requests`).
    """
    requests = load_trace(trace, limit=limit)
    if not requests:
        raise no_requests(trace)
    return requests


def no_requests(trace: str) -> ConfigError:
    return ConfigError(f"{trace}: no requests in this trace")


def l3_url(ctx: click.Context, param: click.Parameter, text: str) -> str:
    """Callback of ``--l3``: a malformed URL is a usage error before anything starts."""
    if text not in ("tmp", "none"):
        try:
            check_url(text)
        except ConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix("storage: ")) from None
    return text


def serve_tier_options(f: F) -> F:
    """``--l1``/``--l2`` (tokens) and ``--l3`` of a server's cache (serve, bench serve)."""
    f = click.option("--l3", "l3", default="none", show_default=True, callback=l3_url,
                     help="L3: a URL (file:///dir, redis://host:port/0, memory://), 'tmp' (a "
                          "temporary file store) or 'none'.")(f)
    f = click.option("--l2", "l2", type=click.IntRange(min=0), default=65536,
                     show_default=True, help="L2 (host pool) capacity in tokens; 0 for none.")(f)
    return click.option("--l1", "l1", type=click.IntRange(min=1), default=16384,
                        show_default=True, help="L1 (device pool) capacity in tokens.")(f)
