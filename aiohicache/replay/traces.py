"""Request traces for replays: the Mooncake and kv-cache-tester formats, and a synthetic chat load.

Every trace becomes a list of `Request` in arrival order. A request names its prompt as block
hash ids; `Request.tokens` turns them into token ids such that two prompts share a token
prefix exactly as far as their hash-id lists agree.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import IO, Any, Literal

import aiofiles
import numpy as np
import numpy.typing as npt

from ..errors import ConfigError

__all__ = (
    "BUNDLED_MOONCAKE",
    "Request",
    "load_agentic",
    "load_mooncake",
    "load_trace",
    "stream_mooncake",
    "synthetic",
)

BUNDLED_MOONCAKE = "mooncake_conversation_2k.jsonl"
"""The bundled slice: the first 2,000 of the 12,031 Mooncake conversation requests."""

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces."""

_MAX_TOKEN = 2**63 - 1
_Record = dict[str, Any]
_PathLike = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: a prompt named by block hash ids, and its timing.

    Block hash id ``h`` stands for the tokens ``h * block_size + arange(block_size)``, so
    equal ids mean equal content and prompts share a prefix exactly as far as their id lists
    agree. The last block may be partial: ``input_length`` is exact.

    Raises:
        ConfigError: a field is out of range, or ``input_length`` does not fit the blocks.
    """

    arrival: float
    """Seconds since the start of the trace."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Tokens the request decodes."""
    block_size: int
    """Tokens per hash id."""
    hash_ids: tuple[int, ...]
    """One id per block of the prompt, the last one possibly partial."""
    session: str | None = None
    """The conversation or agent session the request belongs to, where the trace says."""

    def __post_init__(self) -> None:
        _check(math.isfinite(self.arrival) and self.arrival >= 0,
               f"arrival must be a finite number >= 0, got {self.arrival!r}")
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.output_length >= 0, f"output_length must be >= 0, got {self.output_length}")
        _check(self.input_length >= 1, f"input_length must be >= 1, got {self.input_length}")
        self._check_blocks()

    def _check_blocks(self) -> None:
        num, size = len(self.hash_ids), self.block_size
        _check((num - 1) * size < self.input_length <= num * size,
               f"input_length={self.input_length} does not fit {num} hash_ids of {size} "
               f"tokens (expected {(num - 1) * size + 1}..{num * size})")
        _check(min(self.hash_ids) >= 0, "hash_ids must be >= 0")
        _check(max(self.hash_ids) <= (_MAX_TOKEN - size) // size,
               "hash_ids too large: token ids would overflow int64")

    @property
    def num_full_blocks(self) -> int:
        """Blocks of the prompt that are whole (a partial last block is not counted)."""
        return self.input_length // self.block_size

    def tokens(self) -> npt.NDArray[np.int64]:
        """The prompt's token ids, a new int64 array of ``input_length`` entries."""
        # Token i is hash_ids[b] * block_size + i % block_size with b = i // block_size,
        # that is (hash_ids[b] - b) * block_size + i: one repeat and one add, which beats a
        # broadcast (blocks x block_size) add by about a third.
        num_blocks, size = len(self.hash_ids), self.block_size
        shift = np.array(self.hash_ids, dtype=np.int64)
        shift -= _arange(num_blocks)
        shift *= size
        tokens = np.repeat(shift, size)[:self.input_length]
        tokens += _arange(self.input_length)
        return tokens


_ARANGE: npt.NDArray[np.int64] = np.arange(0, dtype=np.int64)


def _arange(n: int) -> npt.NDArray[np.int64]:
    """A read-only view of ``arange(n)``, from a shared array grown by doubling."""
    global _ARANGE
    if len(_ARANGE) < n:
        grown = np.arange(max(n, 2 * len(_ARANGE), 1 << 16), dtype=np.int64)
        grown.flags.writeable = False
        _ARANGE = grown
    return _ARANGE[:n]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# -- Mooncake --------------------------------------------------------------------------------


def load_mooncake(path: _PathLike, *, limit: int | None = None) -> list[Request]:
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
    for where, record in _records(path, limit=limit):
        with _at(where):
            start = _number(record, "timestamp") if start is None else start
            requests.append(_mooncake_request(record, start, requests[-1] if requests else None))
    return requests


async def stream_mooncake(path: _PathLike, *, limit: int | None = None
                          ) -> AsyncIterator[Request]:
    """`load_mooncake`, one request at a time, read with aiofiles: a large trace (plain
    ``.jsonl``) streams on an event loop without loading it whole or blocking the loop on
    reads (for a replay that honours timestamps while it reads).

    Raises:
        ConfigError: as `load_mooncake`, when the bad line is reached.
    """
    name = os.fspath(path)
    limit = _limit(limit)
    count, start, prev = 0, None, None
    try:
        async with aiofiles.open(name, encoding="utf-8") as lines:
            lineno = 0
            async for line in lines:
                lineno += 1
                if count == limit:
                    return
                parsed = _numbered_record(name, lineno, line)
                if parsed is None:
                    continue
                where, record = parsed
                with _at(where):
                    start = _number(record, "timestamp") if start is None else start
                    prev = _mooncake_request(record, start, prev)
                count += 1
                yield prev
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read trace: {exc}") from exc


def _mooncake_request(record: _Record, start: float, prev: Request | None) -> Request:
    arrival = (_number(record, "timestamp") - start) / 1000
    _check(prev is None or arrival >= prev.arrival, "timestamp goes backwards")
    return Request(arrival=arrival, input_length=_int(record, "input_length"),
                   output_length=_int(record, "output_length"), block_size=MOONCAKE_BLOCK_SIZE,
                   hash_ids=_ids(record))


# -- kv-cache-tester (agentic sessions) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Turn:
    """One agentic request as read, before sessions are interleaved."""

    where: str
    session: str
    t: float
    ids: tuple[int, ...]
    record: _Record


def load_agentic(path: _PathLike, *, limit: int | None = None,
                 interleave: Literal["arrival", "round_robin"] = "arrival",
                 session_gap: float = 30.0) -> list[Request]:
    """Load kv-cache-tester agentic sessions and interleave them into one multi-tenant stream.

    One JSON object a line (gzip): ``trace`` (session id), ``t`` (seconds since the session
    started), ``input_length``, ``output_length``, ``block_size``, ``hash_ids`` (one per
    WHOLE block: exactly ``input_length // block_size`` of them), ``think_time``, ``api_time``
    (the last two are not used). A session's lines must be in order of ``t``.

    Sessions are numbered k = 0, 1, ... in the order they first appear in the file, and:

    - ``"arrival"``: session k starts at ``k * session_gap`` seconds and each of its requests
      arrives at ``k * session_gap + t``. The stream is sorted by arrival; ties go to the
      lower session number, then to file order.
    - ``"round_robin"``: one request from each session that has any left, in session order,
      round after round (session 0's first, session 1's first, ..., session 0's second, ...;
      exhausted sessions drop out). Every arrival is 0.0: the order is the schedule.

    Block ids: a trailing partial block (``input_length % block_size`` tokens) has no id in
    the file; it gets a fresh id of its own, so it is never shared (the trace does not say
    what it holds). The file's ids are namespaced per session; if an id does turn up in two
    sessions, every session's ids are renumbered apart, so sessions never share blocks.

    Args:
        path: the ``.jsonl.gz`` file.
        limit: keep the first `limit` requests of the interleaved stream.
        interleave: ``"arrival"`` or ``"round_robin"``, as above.
        session_gap: seconds between the starts of consecutive sessions (``"arrival"``).
            On the shared 60-session kv-cache-tester file, 30 s spreads them over 8,301 s
            with 11 sessions live on average and 31 at the peak (10 s: 12 and 42).

    Raises:
        ConfigError: the file cannot be read, a line is bad (the message says ``file:line``
            and the field), or an argument is invalid.
    """
    _check(interleave in ("arrival", "round_robin"),
           f"interleave must be 'arrival' or 'round_robin', got {interleave!r}")
    _check(math.isfinite(session_gap) and session_gap >= 0,
           f"session_gap must be a finite number >= 0, got {session_gap!r}")
    limit = _limit(limit)
    sessions = _sessions(path)
    id_maps, next_id = _namespaces(sessions)
    order = (_by_arrival(sessions, session_gap) if interleave == "arrival"
             else _round_robin(sessions))
    requests: list[Request] = []
    for k, turn in order[:limit]:
        with _at(turn.where):
            arrival = k * session_gap + turn.t if interleave == "arrival" else 0.0
            request = _agentic_request(turn, arrival, id_maps[k], next_id)
        if request.input_length % request.block_size:
            next_id += 1  # the partial last block took it
        requests.append(request)
    return requests


def _sessions(path: _PathLike) -> list[list[_Turn]]:
    """The file's requests grouped by session, sessions in order of first appearance."""
    sessions: dict[str, list[_Turn]] = {}
    for where, record in _records(path, limit=None):
        with _at(where):
            name = _str(record, "trace")
            turn = _Turn(where=where, session=name, t=_number(record, "t"), ids=_ids(record),
                         record=record)
            turns = sessions.setdefault(name, [])
            _check(not turns or turn.t >= turns[-1].t, "t goes backwards within the session")
            turns.append(turn)
    return list(sessions.values())


def _all_ids(turns: list[_Turn]) -> set[int]:
    return set().union(*(turn.ids for turn in turns))


def _namespaces(sessions: list[list[_Turn]]) -> tuple[list[dict[int, int]], int]:
    """Per-session id renumbering (empty maps if the ids are disjoint across sessions), and
    the smallest id above every id in use.

    NOTE: when two sessions share an id, each session's ids are mapped one-to-one onto a
    dense range of their own, which keeps within-session prefix chains intact.
    """
    id_sets = [_all_ids(turns) for turns in sessions]
    all_ids = set().union(*id_sets)
    if sum(map(len, id_sets)) == len(all_ids):
        return [{} for _ in sessions], 1 + max(all_ids, default=-1)
    maps: list[dict[int, int]] = []
    base = 0
    for ids in id_sets:
        maps.append({h: base + i for i, h in enumerate(sorted(ids))})
        base += len(ids)
    return maps, base


def _by_arrival(sessions: list[list[_Turn]], gap: float) -> list[tuple[int, _Turn]]:
    keyed = [(k * gap + turn.t, k, i, turn)
             for k, turns in enumerate(sessions) for i, turn in enumerate(turns)]
    keyed.sort(key=lambda item: item[:3])
    return [(k, turn) for _, k, _, turn in keyed]


def _round_robin(sessions: list[list[_Turn]]) -> list[tuple[int, _Turn]]:
    rounds = max(map(len, sessions), default=0)
    return [(k, turns[i]) for i in range(rounds)
            for k, turns in enumerate(sessions) if i < len(turns)]


def _agentic_request(turn: _Turn, arrival: float, id_map: dict[int, int],
                     tail_id: int) -> Request:
    record, ids = turn.record, turn.ids
    size, length = _int(record, "block_size"), _int(record, "input_length")
    _check(size >= 1, f"block_size must be >= 1, got {size}")
    _check(len(ids) == length // size,
           f"expected input_length // block_size = {length // size} hash_ids, got {len(ids)}")
    if id_map:
        ids = tuple(id_map[h] for h in ids)
    if length % size:
        ids += (tail_id,)
    return Request(arrival=arrival, input_length=length,
                   output_length=_int(record, "output_length"), block_size=size,
                   hash_ids=ids, session=turn.session)


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
    _check_synthetic(locals())
    rng = np.random.default_rng(seed)
    prompts = rng.integers(num_system_prompts, size=num_sessions)
    sys_blocks = system_prompt_tokens // block_size
    longest = system_prompt_tokens + turns_per_session * (turn_tokens + output_tokens)
    stride = -(-longest // block_size)
    base = num_system_prompts * sys_blocks
    streams = [tuple(range(int(p) * sys_blocks, (int(p) + 1) * sys_blocks))
               + tuple(range(base + s * stride + sys_blocks, base + (s + 1) * stride))
               for s, p in enumerate(prompts)]
    lengths = [system_prompt_tokens + (k + 1) * turn_tokens + k * output_tokens
               for k in range(turns_per_session)]
    arrivals = (np.cumsum(rng.exponential(1 / arrival_rate, size=len(lengths) * num_sessions))
                if arrival_rate else np.zeros(len(lengths) * num_sessions))
    return [Request(arrival=float(arrivals[k * num_sessions + s]), input_length=length,
                    output_length=output_tokens, block_size=block_size,
                    hash_ids=stream[:-(-length // block_size)], session=f"s{s}")
            for k, length in enumerate(lengths) for s, stream in enumerate(streams)]


def _check_synthetic(args: dict[str, Any]) -> None:
    minimum = {"num_sessions": 1, "turns_per_session": 1, "num_system_prompts": 1,
               "system_prompt_tokens": 0, "turn_tokens": 1, "output_tokens": 0,
               "block_size": 1, "seed": 0}
    for name, least in minimum.items():
        _check(args[name] >= least, f"{name} must be >= {least}, got {args[name]}")
    rate = args["arrival_rate"]
    _check(rate is None or (math.isfinite(rate) and rate > 0),
           f"arrival_rate must be None or a finite number > 0, got {rate!r}")


# -- dispatch --------------------------------------------------------------------------------


def load_trace(name_or_path: str, *, limit: int | None = None) -> list[Request]:
    """Load a trace by name or path.

    - ``"mooncake"``: the bundled slice (`BUNDLED_MOONCAKE`) of the Mooncake conversation
      trace.
    - ``"synthetic"``: `synthetic` with its default load (64 sessions x 8 turns on 4 system
      prompts of 2,048 tokens; 256-token turns and replies; 64-token blocks).
    - a path ending ``.jsonl``: `load_mooncake`; ending ``.jsonl.gz``: `load_agentic`.

    Args:
        name_or_path: as above.
        limit: keep only the first `limit` requests.

    Raises:
        ConfigError: the name is unknown, the file is missing or a line is bad.
    """
    if name_or_path == "mooncake":
        source = resources.files("aiohicache.replay") / "data" / BUNDLED_MOONCAKE
        with resources.as_file(source) as path:
            return load_mooncake(path, limit=limit)
    if name_or_path == "synthetic":
        return synthetic(**_SYNTHETIC_DEFAULTS)[:_limit(limit)]
    if name_or_path.endswith(".jsonl.gz"):
        return load_agentic(name_or_path, limit=limit)
    if name_or_path.endswith(".jsonl"):
        return load_mooncake(name_or_path, limit=limit)
    raise ConfigError(f"unknown trace {name_or_path!r}: expected 'mooncake', 'synthetic', "
                      "or a path ending .jsonl (Mooncake) or .jsonl.gz (kv-cache-tester)")


# -- reading and fields ----------------------------------------------------------------------


def _records(path: _PathLike, *, limit: int | None) -> Iterator[tuple[str, _Record]]:
    """``("file:line", object)`` for each non-blank line, the first `limit` of them."""
    limit = _limit(limit)
    try:
        with _open(os.fspath(path)) as lines:
            yield from _parse_lines(os.fspath(path), lines, limit)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{os.fspath(path)}: cannot read trace: {exc}") from exc


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parse_lines(name: str, lines: IO[str], limit: int | None) -> Iterator[tuple[str, _Record]]:
    count = 0
    for lineno, line in enumerate(lines, start=1):
        if count == limit:
            return
        parsed = _numbered_record(name, lineno, line)
        if parsed is not None:
            count += 1
            yield parsed


def _numbered_record(name: str, lineno: int, line: str) -> tuple[str, _Record] | None:
    """A trace line's record and where it is (``path:line``); None for a blank line."""
    if not line.strip():
        return None
    where = f"{name}:{lineno}"
    return where, _parse_line(where, line)


def _parse_line(where: str, line: str) -> _Record:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    return record


@contextlib.contextmanager
def _at(where: str) -> Iterator[None]:
    """Prefix a `ConfigError` raised inside with ``file:line``."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _limit(limit: int | None) -> int | None:
    _check(limit is None or limit >= 0, f"limit must be None or >= 0, got {limit!r}")
    return limit


def _field(record: _Record, name: str) -> Any:
    if name not in record:
        raise ConfigError(f"missing field {name!r}")
    return record[name]


def _int(record: _Record, name: str) -> int:
    value = _field(record, name)
    _check(type(value) is int, f"field {name!r} must be an integer, got {value!r}")
    return int(value)


def _number(record: _Record, name: str) -> float:
    value = _field(record, name)
    _check(type(value) in (int, float) and math.isfinite(value),
           f"field {name!r} must be a finite number, got {value!r}")
    return float(value)


def _str(record: _Record, name: str) -> str:
    value = _field(record, name)
    _check(isinstance(value, str), f"field {name!r} must be a string, got {value!r}")
    return str(value)


def _ids(record: _Record) -> tuple[int, ...]:
    value: Sequence[Any] = _field(record, "hash_ids")
    _check(isinstance(value, list) and all(type(h) is int and h >= 0 for h in value),
           "field 'hash_ids' must be a list of integers >= 0")
    return tuple(value)
