"""kv-cache-tester agentic sessions, interleaved into one multi-tenant request stream."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ._fields import (
    PathLike,
    Record,
    at,
    check,
    check_limit,
    ids_field,
    int_field,
    number_field,
    records,
    str_field,
)
from ._request import Request

Interleave = Literal["arrival", "round_robin"]


@dataclass(frozen=True, slots=True)
class _Turn:
    """One agentic request as read, before sessions are interleaved."""

    where: str
    session: str
    t: float
    ids: tuple[int, ...]
    record: Record


def load_agentic(path: PathLike, *, limit: int | None = None,
                 interleave: Interleave = "arrival",
                 session_gap: float = 30.0) -> list[Request]:
    """Load kv-cache-tester agentic sessions and interleave them into one multi-tenant stream.

    One JSON object a line (gzip): ``trace`` (session id), ``t`` (seconds since the session
    started), ``input_length``, ``output_length``, ``block_size``, ``hash_ids`` (one per
    WHOLE block: exactly ``input_length // block_size`` of them), ``think_time``, ``api_time``
    (the last two are not used). A session's lines must be in order of ``t``; every line
    must have the same ``block_size``.

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
    _check_args(interleave, session_gap)
    limit = check_limit(limit)
    return _interleave(_sessions(path), limit, interleave, session_gap)


def _check_args(interleave: str, session_gap: float) -> None:
    check(interleave in ("arrival", "round_robin"),
          f"interleave must be 'arrival' or 'round_robin', got {interleave!r}")
    check(math.isfinite(session_gap) and session_gap >= 0,
          f"session_gap must be a finite number >= 0, got {session_gap!r}")


def _interleave(sessions: list[list[_Turn]], limit: int | None, interleave: Interleave,
                session_gap: float) -> list[Request]:
    """The sessions' turns as requests, in the order `interleave` says (`load_agentic`)."""
    id_maps, next_id = _namespaces(sessions)
    order = (_by_arrival(sessions, session_gap) if interleave == "arrival"
             else _round_robin(sessions))
    requests: list[Request] = []
    for k, turn in order[:limit]:
        with at(turn.where):
            arrival = k * session_gap + turn.t if interleave == "arrival" else 0.0
            request = _agentic_request(turn, arrival, id_maps[k], next_id)
        if request.input_length % request.block_size:
            next_id += 1  # the partial last block took it
        requests.append(request)
    return requests


def _sessions(path: PathLike) -> list[list[_Turn]]:
    """The file's requests grouped by session, sessions in order of first appearance.

    NOTE: one block size for the whole file: hash id h of B tokens is the tokens h*B ..
    h*B+B-1, so under two sizes disjoint ids can name the same tokens, and sessions that
    share nothing would be served each other's KV.
    """
    sessions: dict[str, list[_Turn]] = {}
    block_size: int | None = None
    for where, record in records(path, limit=None):
        with at(where):
            size = int_field(record, "block_size")
            block_size = size if block_size is None else block_size
            check(size == block_size, f"block_size {size} differs from the trace's "
                                      f"{block_size}: one trace has one block size")
            name = str_field(record, "trace")
            turn = _Turn(where=where, session=name, t=number_field(record, "t"),
                         ids=ids_field(record), record=record)
            turns = sessions.setdefault(name, [])
            check(not turns or turn.t >= turns[-1].t, "t goes backwards within the session")
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
    size, length = int_field(record, "block_size"), int_field(record, "input_length")
    check(size >= 1, f"block_size must be >= 1, got {size}")
    check(len(ids) == length // size,
          f"expected input_length // block_size = {length // size} hash_ids, got {len(ids)}")
    if id_map:
        ids = tuple(id_map[h] for h in ids)
    if length % size:
        ids += (tail_id,)
    return Request(arrival=arrival, input_length=length,
                   output_length=int_field(record, "output_length"), block_size=size,
                   hash_ids=ids, session=turn.session)
