"""`aiohicache bench serve`: multi-turn sessions from a trace, over HTTP, cache vs recompute.

Each trace request becomes a prompt of token ids: block hash id ``h`` of the trace stands for
`block_tokens` ids derived from ``h`` (equal ids, equal tokens, so prompts share prefixes as
the trace says), scaled down from the trace's block size so a CPU model computes them.
Requests are grouped into sessions (the trace's own session ids, kv-cache-tester; or, for
Mooncake, the first two blocks: the first is a system prompt every request shares). A
session's turns are sent one after another, each after the previous answer; `concurrency`
sessions run at once, over real HTTP, against ``aiohicache serve`` started twice on this
machine: with the cache, then with ``--no-cache`` (every prompt recomputed).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

import aiohttp
import anyio
import numpy as np

from ..replay import Request

__all__ = ("ModeResult", "ServeBenchConfig", "bench_modes", "drive", "format_serve",
           "sessions_from_trace")

TIERS = ("L1", "L2", "L3")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeBenchConfig:
    concurrency: int = 4
    """Sessions in flight at once."""
    max_tokens: int = 4
    """Tokens generated per request."""
    block_tokens: int = 1
    """Token ids per trace block (the trace's blocks are 512 or 64 tokens)."""
    vocab_size: int = 32000
    server_args: tuple[str, ...] = ()
    """Extra ``aiohicache serve`` options of the cache run (``--l1 ...``)."""


def sessions_from_trace(requests: Sequence[Request], *, block_tokens: int,
                        vocab_size: int) -> list[list[list[int]]]:
    """The prompts of each session, sessions in order of their first request."""
    sessions: dict[object, list[list[int]]] = {}
    for req in sorted(requests, key=lambda r: r.arrival):
        key = req.session if req.session is not None else tuple(req.hash_ids[:2])
        sessions.setdefault(key, []).append(_prompt(req, block_tokens, vocab_size))
    return list(sessions.values())


def _prompt(req: Request, block_tokens: int, vocab_size: int) -> list[int]:
    n = max(1, -(-req.input_length * block_tokens // req.block_size))
    ids = np.repeat(np.asarray(req.hash_ids, dtype=np.int64), block_tokens)[:n]
    offsets = np.tile(np.arange(block_tokens, dtype=np.int64), len(req.hash_ids))[:n]
    mixed = (ids * block_tokens + offsets) * 2654435761 + 97
    return [int(t) for t in mixed % vocab_size]


@dataclass(slots=True)
class Sample:
    ttft: float
    latency: float
    prompt_tokens: int
    completion_tokens: int
    tiers: dict[str, int]


@dataclass(slots=True)
class ModeResult:
    """One run of the workload against one server."""

    name: str
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile([s.ttft for s in self.samples], q)) * 1e3

    @property
    def requests_per_s(self) -> float:
        return len(self.samples) / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        """Prompt and generated tokens served per second."""
        return sum(s.prompt_tokens + s.completion_tokens for s in self.samples) / self.wall_s

    def hit_ratio(self, tier: str | None = None) -> float:
        """Prompt tokens served from the cache (one tier, or all) over all prompt tokens."""
        total = sum(s.prompt_tokens for s in self.samples)
        hits = sum(sum(s.tiers.values()) if tier is None else s.tiers[tier]
                   for s in self.samples)
        return hits / total if total else 0.0

    def summary(self) -> dict[str, float | str | int]:
        return {"mode": self.name, "requests": len(self.samples), "wall_s": self.wall_s,
                "ttft_p50_ms": self.ttft_ms(50), "ttft_p99_ms": self.ttft_ms(99),
                "requests_per_s": self.requests_per_s, "tokens_per_s": self.tokens_per_s,
                "hit_ratio": self.hit_ratio(),
                **{f"hit_ratio_{t}": self.hit_ratio(t) for t in TIERS}}


async def drive(url: str, sessions: list[list[list[int]]], *, name: str, concurrency: int,
                max_tokens: int) -> ModeResult:
    """Send every session's turns in order, `concurrency` sessions at once; time each request
    (TTFT: to the first streamed token)."""
    result = ModeResult(name, 0.0)
    queue = list(reversed(sessions))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def worker() -> None:
            while queue:
                for prompt in queue.pop():
                    result.samples.append(await _request(http, url, prompt, max_tokens))

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, len(sessions))):
                tg.start_soon(worker)
        result.wall_s = time.perf_counter() - start
    return result


async def _request(http: aiohttp.ClientSession, url: str, prompt: list[int],
                   max_tokens: int) -> Sample:
    # every request generates max_tokens, end-of-sequence or not, so modes compare alike
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    ttft, final = 0.0, None
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and not ttft:
                ttft = time.perf_counter() - start
            if "usage" in event:
                final = event
    assert final is not None, "the server sent no usage event"
    tiers = final.get("aiohicache", {}).get("cached_tiers", dict.fromkeys(TIERS, 0))
    return Sample(ttft, time.perf_counter() - start, final["usage"]["prompt_tokens"],
                  final["usage"]["completion_tokens"], tiers)


@contextmanager
def server_process(args: Sequence[str]) -> Iterator[str]:
    """``aiohicache serve --port 0 ARGS`` in a subprocess while the block runs; yields its URL.

    Lines it prints before it is ready (a warning) are skipped; what it prints after is read
    and dropped by a thread: with nobody reading the pipe, 64 KiB of warnings would block the
    server mid-run.

    Raises:
        RuntimeError: the server exited before it was ready (its output says why).
    """
    proc = subprocess.Popen([sys.executable, "-m", "aiohicache", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    assert proc.stdout is not None
    drain = threading.Thread(target=deque, args=(proc.stdout, 0), daemon=True)
    try:
        url = _ready_url(proc.stdout)
        drain.start()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # stuck: never left behind
            proc.kill()
            proc.wait()
        if drain.ident is not None:
            drain.join(5)  # the pipe is at its end: the server has exited
        proc.stdout.close()


def _ready_url(out: IO[str]) -> str:
    """The URL of the server's ``aiohicache serve: ... on URL`` line, read up to it.

    Raises:
        RuntimeError: the output ended first (the last lines say why).
    """
    before: deque[str] = deque(maxlen=50)
    for line in out:
        _, on, rest = line.partition(" on http://")
        if line.startswith("aiohicache serve: ") and on:
            return "http://" + rest.split()[0]
        before.append(line)
    raise RuntimeError("aiohicache serve did not start:\n" + "".join(before))


def bench_modes(sessions: list[list[list[int]]], config: ServeBenchConfig) -> list[ModeResult]:
    """The workload against a server with the cache, then one without (fresh processes)."""
    results = []
    for name, args in (("cache", config.server_args), ("no cache", ("--no-cache",))):
        with server_process(args) as url:
            results.append(anyio.run(functools.partial(
                drive, url, sessions, name=name, concurrency=config.concurrency,
                max_tokens=config.max_tokens), backend="asyncio"))
    return results


def format_serve(results: list[ModeResult], *, title: str, as_json: bool = False) -> str:
    if as_json:
        return json.dumps({"title": title, "modes": [r.summary() for r in results]}, indent=2)
    head = (f"{'':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>7} {'tok/s':>9} "
            f"{'hit ratio':>9}  {'L1':>5} {'L2':>5} {'L3':>5}")
    rows = [f"{r.name:<10} {r.ttft_ms(50):>7.1f}ms {r.ttft_ms(99):>7.1f}ms "
            f"{r.requests_per_s:>7.2f} {r.tokens_per_s:>9.0f} {r.hit_ratio():>9.3f}  "
            + " ".join(f"{r.hit_ratio(t):>5.3f}" for t in TIERS) for r in results]
    lines = [title, "", head, *rows]
    if len(results) == 2:
        a, b = results
        lines += ["", f"TTFT p50 {b.ttft_ms(50) / a.ttft_ms(50):.1f}x lower with the cache, "
                      f"p99 {b.ttft_ms(99) / a.ttft_ms(99):.1f}x; throughput "
                      f"{a.tokens_per_s / b.tokens_per_s:.1f}x"]
    return "\n".join(lines)

