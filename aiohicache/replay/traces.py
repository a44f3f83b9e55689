"""Request traces for replays: the Mooncake and kv-cache-tester formats, and a synthetic chat load.

Every trace becomes a list of `Request` in arrival order. A request names its prompt as block
hash ids; `Request.tokens` turns them into token ids such that two prompts share a token
prefix exactly as far as their hash-id lists agree. A Mooncake trace can also be streamed
(`stream_mooncake`, `stream_trace`): read as a replay proceeds, never loaded whole.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import aiofiles
import anyio.to_thread
import numpy as np

from ..errors import ConfigError
from ._agentic import load_agentic
from ._fields import (
    PathLike,
    Record,
    at,
    check,
    check_limit,
    ids_field,
    int_field,
    number_field,
    numbered_record,
    records,
)
from ._request import Request

__all__ = (
    "BUNDLED_MOONCAKE",
    "Request",
    "load_agentic",
    "load_mooncake",
    "load_trace",
    "stream_mooncake",
    "stream_trace",
    "synthetic",
)

BUNDLED_MOONCAKE = "mooncake_conversation_2k.jsonl"
"""The bundled slice: the first 2,000 of the 12,031 Mooncake conversation requests."""

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces."""

_CHUNK = 1 << 16
"""Bytes `stream_mooncake` reads per thread hop: one hop per line (aiofiles' ``async for``)
costs more than parsing the line."""


# -- Mooncake --------------------------------------------------------------------------------


def load_mooncake(path: PathLike, *, limit: int | None = None) -> list[Request]:
    """Load a Mooncake trace (FAST'25 release, ``traces/*.jsonl``).

    One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens)
    and ``hash_ids`` (one per 512-token block, prefix-chained). Arrivals are seconds since
    the first line's timestamp; timestamps must not go backwards.

    Args:
        path: the ``.jsonl`` file.
        limit: read only the first `limit` requests.

    Raises:
        ConfigError: the file cannot be read, or a line is bad (the message says
            ``file:line`` and the field).
    """
    requests: list[Request] = []
    start: float | None = None
    for where, record in records(path, limit=limit):
        with at(where):
            start = number_field(record, "timestamp") if start is None else start
            requests.append(_mooncake_request(record, start, requests[-1] if requests else None))
    return requests


async def stream_mooncake(path: PathLike, *, limit: int | None = None
                          ) -> AsyncIterator[Request]:
    """`load_mooncake`, one request at a time, read with aiofiles: a large trace (plain
    ``.jsonl``) streams on an event loop without loading it whole or blocking the loop on
    reads (`replay --time timestamps` reads its trace this way while it replays).

    The file is read in chunks of up to 64 KiB on aiofiles' thread, each as soon as some
    data is there, so a request is yielded once its line is in, before later lines exist
    (the trace may be a pipe).

    Raises:
        ConfigError: as `load_mooncake`, when the bad line is reached.

    Cancellation: the file is closed; nothing else is held.
    """
    name = os.fspath(path)
    limit = check_limit(limit)
    if limit == 0:
        return
    count, start, prev = 0, None, None
    # NOTE: aclosing: leaving early (the limit) must close the file now, not when the
    # abandoned generator is collected (after the loop has closed, under uvloop)
    async with contextlib.aclosing(_stream_records(name)) as records:
        async for where, record in records:
            with at(where):
                start = number_field(record, "timestamp") if start is None else start
                prev = _mooncake_request(record, start, prev)
            yield prev
            count += 1
            if count == limit:
                return


async def _stream_records(name: str) -> AsyncGenerator[tuple[str, Record], None]:
    """``("file:line", object)`` per non-blank line of `name`, read a chunk at a time.

    NOTE: ``read1`` on the binary file, not ``read``: ``read(n)`` waits for n bytes or the
    end of the file, so on a pipe or a file still being written it would wait for data the
    replay has no need of yet. A newline byte never occurs inside a UTF-8 character, so lines
    are split as bytes and decoded one by one.
    """
    try:
        async with aiofiles.open(name, "rb") as f:
            lineno, rest = 0, b""
            while chunk := await f.read1(_CHUNK):
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    lineno += 1
                    if (parsed := numbered_record(name, lineno, line.decode())) is not None:
                        yield parsed
            if (parsed := numbered_record(name, lineno + 1, rest.decode())) is not None:
                yield parsed
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read trace: {exc}") from exc


def _mooncake_request(record: Record, start: float, prev: Request | None) -> Request:
    arrival = (number_field(record, "timestamp") - start) / 1000
    check(prev is None or arrival >= prev.arrival, "timestamp goes backwards")
    return Request(arrival=arrival, input_length=int_field(record, "input_length"),
                   output_length=int_field(record, "output_length"),
                   block_size=MOONCAKE_BLOCK_SIZE, hash_ids=ids_field(record))


# -- synthetic multi-turn chat ---------------------------------------------------------------


_SYNTHETIC_DEFAULTS: dict[str, int] = {
    "num_sessions": 64, "turns_per_session": 8, "num_system_prompts": 4,
    "system_prompt_tokens": 2048, "turn_tokens": 256, "output_tokens": 256,
}


def synthetic(*, num_sessions: int, turns_per_session: int, num_system_prompts: int,
              system_prompt_tokens: int, turn_tokens: int, output_tokens: int,
              block_size: int = 64, seed: int = 0,
              arrival_rate: float | None = None) -> list[Request]:
    """A multi-turn chat load: growing per-session histories on a few shared system prompts.

    Session s uses system prompt ``rng.integers(num_system_prompts)``. Its turn k prompt is
    the system prompt, then k times (user turn + reply), then the new user turn:
    ``system_prompt_tokens + (k + 1) * turn_tokens + k * output_tokens`` tokens, so each
    prompt extends the previous one by the previous reply and a new user turn.

    Block ids: the whole blocks of a system prompt are shared by every session that uses
    it; every other block (including one that holds the end of the system prompt and the
    start of the history) belongs to its session alone. Sharing is thus exact at block
    granularity.

    Order: turn 0 of every session (in session order), then turn 1 of every session, and so
    on. Arrivals are 0.0, or a Poisson process of `arrival_rate` requests per second laid on
    that order. The output is a function of the arguments (and `seed`) only.

    Raises:
        ConfigError: an argument is out of range.
    """
    args = locals()
    _check_synthetic(args)
    rng = np.random.default_rng(seed)
    streams = _session_blocks(rng, args)
    lengths = [system_prompt_tokens + (k + 1) * turn_tokens + k * output_tokens
               for k in range(turns_per_session)]
    arrivals = (np.cumsum(rng.exponential(1 / arrival_rate, size=len(lengths) * num_sessions))
                if arrival_rate else np.zeros(len(lengths) * num_sessions))
    return [Request(arrival=float(arrivals[k * num_sessions + s]), input_length=length,
                    output_length=output_tokens, block_size=block_size,
                    hash_ids=stream[:-(-length // block_size)], session=f"s{s}")
            for k, length in enumerate(lengths) for s, stream in enumerate(streams)]


def _session_blocks(rng: np.random.Generator, args: dict[str, Any]) -> list[tuple[int, ...]]:
    """Each session's block ids for its longest prompt: its system prompt's shared blocks,
    then ids of its own (`synthetic`)."""
    block_size, sys_tokens = args["block_size"], args["system_prompt_tokens"]
    prompts = rng.integers(args["num_system_prompts"], size=args["num_sessions"])
    sys_blocks = sys_tokens // block_size
    longest = sys_tokens + args["turns_per_session"] * (args["turn_tokens"]
                                                         + args["output_tokens"])
    stride = -(-longest // block_size)
    base = args["num_system_prompts"] * sys_blocks
    return [tuple(range(int(p) * sys_blocks, (int(p) + 1) * sys_blocks))
            + tuple(range(base + s * stride + sys_blocks, base + (s + 1) * stride))
            for s, p in enumerate(prompts)]


def _check_synthetic(args: dict[str, Any]) -> None:
    minimum = {"num_sessions": 1, "turns_per_session": 1, "num_system_prompts": 1,
               "system_prompt_tokens": 0, "turn_tokens": 1, "output_tokens": 0,
               "block_size": 1, "seed": 0}
    for name, least in minimum.items():
        check(args[name] >= least, f"{name} must be >= {least}, got {args[name]}")
    rate = args["arrival_rate"]
    check(rate is None or (math.isfinite(rate) and rate > 0),
          f"arrival_rate must be None or a finite number > 0, got {rate!r}")


# -- dispatch --------------------------------------------------------------------------------


def _is_mooncake(path: str) -> bool:
    """Whether a ``.jsonl.gz`` file's first record is Mooncake's (a gzipped Mooncake trace
    was read as kv-cache-tester sessions: "missing field 'trace'")."""
    first = next((record for _, record in records(path, limit=1)), None)
    return isinstance(first, dict) and "timestamp" in first and "trace" not in first


def load_trace(name_or_path: str, *, limit: int | None = None) -> list[Request]:
    """Load a trace by name or path.

    - ``"mooncake"``: the bundled slice (`BUNDLED_MOONCAKE`) of the Mooncake conversation
      trace.
    - ``"synthetic"``: `synthetic` with its default load (64 sessions x 8 turns on 4 system
      prompts of 2,048 tokens; 256-token turns and replies; 64-token blocks).
    - a path ending ``.jsonl``: `load_mooncake`; ending ``.jsonl.gz``: `load_agentic`, or
      `load_mooncake` when its first line is a Mooncake record (``timestamp``, no ``trace``).

    Args:
        name_or_path: as above.
        limit: keep only the first `limit` requests.

    Raises:
        ConfigError: the name is unknown, the file is missing or a line is bad.
    """
    if name_or_path == "mooncake":
        with _bundled() as path:
            return load_mooncake(path, limit=limit)
    if name_or_path == "synthetic":
        return synthetic(**_SYNTHETIC_DEFAULTS)[:check_limit(limit)]
    if name_or_path.endswith(".jsonl.gz"):
        if _is_mooncake(name_or_path):
            return load_mooncake(name_or_path, limit=limit)
        return load_agentic(name_or_path, limit=limit)
    if name_or_path.endswith(".jsonl"):
        return load_mooncake(name_or_path, limit=limit)
    raise ConfigError(f"unknown trace {name_or_path!r}: expected 'mooncake', 'synthetic', "
                      "or a path ending .jsonl (Mooncake) or .jsonl.gz (kv-cache-tester)")


async def stream_trace(name_or_path: str, *, limit: int | None = None
                       ) -> AsyncIterator[Request]:
    """`load_trace`'s requests, one at a time: Mooncake traces (the bundled one and
    ``.jsonl`` files) are streamed (`stream_mooncake`); the others are made whole first, on
    a worker thread (sessions interleave across the whole file, and `synthetic` is computed).

    Raises:
        ConfigError: as `load_trace`, when the problem is reached.

    Cancellation: an open trace file is closed; a trace being made whole is finished on its
    thread first.
    """
    if name_or_path == "mooncake" or name_or_path.endswith(".jsonl"):
        with _bundled() if name_or_path == "mooncake" else _as_path(name_or_path) as path:
            async for request in stream_mooncake(path, limit=limit):
                yield request
        return
    # NOTE: not on the loop: it is the replay's, its cache already open (`replay` reads the
    # stream inside it), and the shared kv-cache-tester file held it 250-340 ms there
    load = functools.partial(load_trace, name_or_path, limit=limit)
    for request in await anyio.to_thread.run_sync(load):
        yield request


@contextlib.contextmanager
def _bundled() -> Iterator[Path]:
    """The bundled trace as a file path, for as long as the block runs."""
    source = resources.files("aiohicache.replay") / "data" / BUNDLED_MOONCAKE
    with resources.as_file(source) as path:
        yield path


@contextlib.contextmanager
def _as_path(name: str) -> Iterator[Path]:
    yield Path(name)
