"""The serving engine: one HF model, one `HiCache`, requests generated through `aiohicache.hf`.

Forward passes run on a compute executor (one thread by default: one accelerator runs one
pass at a time); everything a request waits for on the cache — the match, L3 prefetch,
load-back layer by layer, commit — is awaited on the event loop, so a request waiting for its
KV never holds up another's compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self

import anyio
import anyio.to_thread
import torch
import xxhash
from transformers import DynamicCache, PreTrainedModel

from .. import (
    CapacityError,
    ClosedError,
    ConfigError,
    FetchContext,
    HiCache,
    HiCacheConfig,
    KVSpec,
    TransferError,
    WorkerError,
)
from .._concurrency import finish_then_cancel, run_in_thread
from .._validate import check_int, check_number
from ..hf import HFAdapter, Prefill, forward, kv_spec
from ..metrics import render as render_cache_metrics

__all__ = ("ByteTokenizer", "Engine", "EngineBusy", "EngineConfig", "Metrics", "PromptError",
           "SamplingParams", "Tokenizer", "Usage", "cache_config")

log = logging.getLogger(__name__)

TIERS = ("L1", "L2", "L3")


class Tokenizer(Protocol):
    """What the server needs of a tokenizer (a transformers tokenizer fits)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


_ID_TEXT = re.compile(r"<([1-9][0-9]{2,9})>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; ids past 255 (a random model emits them) decode as
    ``<id>``, and, given the model's `vocab_size`, encode back to it (as a transformers
    tokenizer reads a special token in text). For the tiny random model, which has no
    tokenizer of its own."""

    vocab_size = 256
    """Ids below it read back from ``<id>``; 256: none (a subclass made before it was
    asked for has it too)."""

    def __init__(self, vocab_size: int = 256) -> None:
        self.vocab_size = check_int("vocab_size", vocab_size, low=256)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, but ``<id>`` (as `decode` writes it: no leading zero)
        for an id of 256..`vocab_size` - 1.

        NOTE: ``<id>`` was its bytes: a chat's next turn, quoting the tiny model's answer,
        was other tokens than the answer, and missed its cached KV."""
        if self.vocab_size == 256 or "<" not in text:
            return list(text.encode())
        ids: list[int] = []
        at = 0
        for found in _ID_TEXT.finditer(text):
            if 256 <= int(found[1]) < self.vocab_size:
                ids += text[at:found.start()].encode()
                ids.append(int(found[1]))
                at = found.end()
        ids += text[at:].encode()
        return ids

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """A plain chat template: each message as ``<|role|>`` and its text on lines of their
        own, then ``<|assistant|>``, where the answer begins."""
        turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return f"{turns}<|assistant|>\n"

    def decode(self, ids: Sequence[int]) -> str:
        """Each run of byte ids as UTF-8, each id past 255 as ``<id>``.

        NOTE: one id past 255 rendered every byte of the sequence but printable ASCII as
        ``<byte>`` too: a sequence's text was not its parts' texts, and the streaming
        detokenizer, which decodes a window with and without the newest token, sent pieces
        such as ``"\n10><300>"``."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode(errors="replace") + f"<{i}>")
            run.clear()
        out.append(run.decode(errors="replace"))
        return "".join(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine caches: tier sizes in tokens, L3, and the recompute-only baseline."""

    page_size: int = 16
    device_tokens: int = 16384
    """L1 capacity (tokens)."""
    host_tokens: int = 65536
    """L2 capacity (tokens); 0 for none (then no `storage`: L3 is read into L2 and written
    from it)."""
    storage: object = None
    """L3: a URL (``file:///dir``, ``redis://host:port/0``, ``memory://``), a
    `StorageBackend` built for `cache_config`'s page format, or None."""
    use_cache: bool = True
    """False: no cache at all; every prompt is computed whole (the baseline)."""
    commit_output: bool = True
    """Also cache the KV of generated tokens (a next turn that quotes them hits)."""
    compute_threads: int = 1
    max_running: int = 8
    """Requests generating at once (a batch): past it, requests wait their turn before they
    touch the cache, so waiting requests pin no device pages."""
    max_waiting: int | None = 1024
    """Requests that may wait for a turn; one more is refused at once (`EngineBusy`, HTTP
    503 with ``Retry-After``) rather than queued for ever. None: no bound. The server counts
    a request as waiting from when it arrives (its body read, its prompt tokenized)."""
    namespace: str | None = None
    """The cache's namespace (part of every L3 key); None: `weights_namespace` of the
    model, so servers of one model share L3 pages and other models (or other weights of
    one architecture, a fine-tune) never do."""
    cache_options: Mapping[str, Any] = field(default_factory=dict)
    """Further `HiCacheConfig` fields for the cache: ``eviction``, ``write_policy``,
    ``prefetch_threshold`` (the L3 read of prompts shorter than it, 256 tokens by default,
    is skipped), ... The fields above (tiers, page size, storage, namespace), the model's
    (``spec``, ``device``) and ``tp_rank``/``tp_size`` (one process, one rank) are the
    engine's own. Checked, values too, when the config is made."""
    torch_threads: int | None = 1
    """torch's intra-op threads (process-wide), set when the engine opens; None leaves it.
    NOTE: 1 by default because the CPU transfer engine's copy thread sets the process-wide
    count to 1 when it starts: a cache run and a no-cache run then compute alike."""

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, low=1, high=256)
        if check_int("device_tokens", self.device_tokens, low=0) < self.page_size:
            # NOTE: it was rounded up to one page, unsaid
            raise ConfigError(f"device_tokens: {self.device_tokens} is less than one page "
                              f"({self.page_size} tokens)")
        if 0 < check_int("host_tokens", self.host_tokens, low=0) < self.page_size:
            # NOTE: it was rounded down to no page: no L2 tier at all, unsaid
            raise ConfigError(f"host_tokens: {self.host_tokens} is less than one page "
                              f"({self.page_size} tokens); 0 for no L2")
        check_int("compute_threads", self.compute_threads, low=1)
        check_int("max_running", self.max_running, low=1)
        if self.max_waiting is not None:
            check_int("max_waiting", self.max_waiting, low=0)
        if self.torch_threads is not None:  # else torch's RuntimeError when the engine opens
            check_int("torch_threads", self.torch_threads, low=1)
        _check_cache_options(self.cache_options)
        if self.use_cache and self.storage is not None and self.host_tokens == 0:
            # NOTE: the cache refuses it, but only once the engine is made: after
            # `aiohicache serve` had loaded the model
            raise ConfigError("storage: L3 pages are read into L2 and written from it, and "
                              "host_tokens 0 leaves no L2; give L2 tokens or no storage")


class PromptError(ConfigError):
    """A prompt the model cannot take (the client's fault: HTTP 400)."""


class EngineBusy(Exception):
    """`EngineConfig.max_waiting` requests already wait for a turn: try again later."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0: greedy."""
    seed: int | None = None
    top_p: float = 1.0
    """Nucleus sampling: draw from the fewest most likely tokens whose probabilities sum to
    at least this (1: all of them). No effect when greedy."""
    ignore_eos: bool = False
    """Generate `max_tokens` tokens even past an end-of-sequence token (benchmarks)."""

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, low=1)
        check_number("temperature", self.temperature, low=0)
        check_number("top_p", self.top_p, low=0, low_open=True, high=1)


@dataclass(slots=True)
class Usage:
    """One request's token counts and where its cached prefix came from."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV was not computed."""
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """`cached_tokens` by the tier they were found in (L1 device, L2 host, L3 storage): they
    sum to `cached_tokens`."""
    ttft: float = 0.0
    """Seconds from the request to its first token."""
    finish_reason: str = "length"
    """``"stop"`` once the model generated an end-of-sequence token (`Engine.eos_token_ids`;
    it is the last token yielded), else ``"length"``. The consumer sets ``"stop"`` itself to
    end the generation at the token just yielded (a stop string it found): the next step ends
    it with no further forward pass, and caches its output as at any other end."""


_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class Metrics:
    """Counters for ``/metrics``: per tier, never a single hit-rate gauge (a ratio with no
    requests reads as anything)."""

    requests: int = 0
    running: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    uncached_fallbacks: int = 0
    """Requests computed without the cache: the device pool had no room for them."""
    busy_rejections: int = 0
    """Requests refused because `EngineConfig.max_waiting` others waited (`EngineBusy`)."""
    waiting: int = 0
    """Requests waiting for a turn now."""
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(_TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0

    def observe(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        for tier, n in usage.tiers.items():
            self.hit_tokens[tier] += n
        self.ttft_sum += usage.ttft
        self.ttft_count += 1
        for i, bound in enumerate(_TTFT_BUCKETS):
            if usage.ttft <= bound:
                self.ttft_buckets[i] += 1

    def render(self, cache: HiCache | None) -> str:
        """Prometheus text exposition: the server's metrics (``aiohicache_server_*`` where the
        cache has one of the same name), then the cache's (`aiohicache.metrics`)."""
        lines = [
            "# TYPE aiohicache_server_requests_total counter",
            f"aiohicache_server_requests_total {self.requests}",
            "# TYPE aiohicache_requests_running gauge",
            f"aiohicache_requests_running {self.running}",
            "# TYPE aiohicache_server_prompt_tokens_total counter",
            f"aiohicache_server_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE aiohicache_generated_tokens_total counter",
            f"aiohicache_generated_tokens_total {self.generated_tokens}",
            "# TYPE aiohicache_uncached_fallbacks_total counter",
            f"aiohicache_uncached_fallbacks_total {self.uncached_fallbacks}",
            "# TYPE aiohicache_requests_waiting gauge",
            f"aiohicache_requests_waiting {self.waiting}",
            "# TYPE aiohicache_busy_rejections_total counter",
            f"aiohicache_busy_rejections_total {self.busy_rejections}",
            "# TYPE aiohicache_server_hit_tokens_total counter",
            *(f'aiohicache_server_hit_tokens_total{{tier="{t}"}} {n}'
              for t, n in self.hit_tokens.items()),
            "# TYPE aiohicache_ttft_seconds histogram",
            *(f'aiohicache_ttft_seconds_bucket{{le="{b}"}} {n}'
              for b, n in zip(_TTFT_BUCKETS, self.ttft_buckets, strict=True)),
            f'aiohicache_ttft_seconds_bucket{{le="+Inf"}} {self.ttft_count}',
            f"aiohicache_ttft_seconds_sum {self.ttft_sum:.6f}",
            f"aiohicache_ttft_seconds_count {self.ttft_count}",
        ]
        text = "\n".join(lines) + "\n"
        if cache is not None:
            text += render_cache_metrics(cache).decode()
        return text


class Engine:
    """Generates for many concurrent requests with one model and (unless disabled) one cache.

    An async context manager: the cache is open and the compute thread runs inside it.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: Tokenizer, config: EngineConfig,
                 *, name: str = "tiny-llama") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.metrics = Metrics()
        if config.use_cache:  # NOTE: checked now (a bad config raises here); made when opened
            cache_config(model, dataclasses.replace(config, namespace=config.namespace or "-"))
        self.cache: HiCache | None = None
        """The cache (None: `use_cache` off, or not opened yet)."""
        # NOTE: an executor of its own, not anyio.to_thread with a limiter: cached passes run
        # through `HFAdapter(executor=...)` (a public argument: callers pick the thread a
        # model runs on) and uncached ones through `_run`, and one executor bounds both
        # together to `compute_threads` (1 by default: one accelerator, one pass at a time).
        self._executor = ThreadPoolExecutor(config.compute_threads,
                                            thread_name_prefix="aiohicache-compute")
        self._adapter: HFAdapter | None = None
        self._admission = anyio.Semaphore(config.max_running)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        """Tokens that end a generation (unless `SamplingParams.ignore_eos`). NOTE: there
        were none: a checkpoint's completion ran on past its end-of-sequence token, into
        text the model never meant, until `max_tokens`."""

    async def __aenter__(self) -> Self:
        if self.config.torch_threads is not None:
            torch.set_num_threads(self.config.torch_threads)
        if self.config.use_cache:
            # NOTE: on a thread: the digest reads every byte of the weights (about 0.1 s a
            # GB), which held the loop of whoever built an engine in a coroutine
            namespace = self.config.namespace or await anyio.to_thread.run_sync(
                weights_namespace, self.model)
            self.cache = HiCache(cache_config(
                self.model, dataclasses.replace(self.config, namespace=namespace)))
            await self.cache.__aenter__()
            self._adapter = HFAdapter(self.model, self.cache, executor=self._executor)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the cache, then stop the compute thread (no request may be generating).

        Cancellation: the cache's close runs to the end first, the thread is stopped all the
        same, then the cancellation propagates.
        """
        try:
            if self.cache is not None:
                await self.cache.aclose()
        finally:
            self._executor.shutdown(wait=False)

    @property
    def health(self) -> str:
        return self.cache.stats().health if self.cache is not None else "ok"

    async def generate(self, prompt: list[int], params: SamplingParams,
                       usage: Usage) -> AsyncGenerator[int, None]:
        """Yield the generated token ids of one request; fill `usage` on the way.

        Raises:
            PromptError: the prompt is empty, too long for the model or holds ids outside
                its vocabulary (the request's fault; any other `ConfigError` is the server's,
                e.g. a model whose KV does not fit its spec).
            EngineBusy: `EngineConfig.max_waiting` requests already wait for a turn.

        Cancellation (or the consumer closing the generator): the forward pass in flight
        finishes on its thread, the cache context exits; nothing leaks.
        """
        self._check(prompt, params)
        self._check_room()
        start = time.perf_counter()
        self.metrics.requests += 1
        # NOTE: every generator nested here is closed by `aclosing`: `async for` does not close
        # the one it iterates, so closing this one between tokens would leave the inner ones
        # (and the cache context) to the loop's finalizer, in a task nobody awaits.
        tokens = self._admitted(prompt, params, usage, start)
        waits = self._admission.value == 0  # NOTE: acquire yields even when it need not wait
        self.metrics.waiting += waits
        try:
            await self._admission.acquire()
        finally:
            self.metrics.waiting -= waits
        try:
            async with contextlib.aclosing(tokens):
                async for token in tokens:
                    yield token
        finally:
            self._admission.release()

    def _check_room(self) -> None:
        """Refuse a request that would wait behind `max_waiting` others (`EngineBusy`)."""
        bound = self.config.max_waiting
        if bound is not None and self._admission.value == 0 and self.metrics.waiting >= bound:
            self.metrics.busy_rejections += 1
            raise EngineBusy(f"{self.metrics.waiting} requests already wait for one of "
                             f"{self.config.max_running} turns (max_waiting {bound})")

    async def _admitted(self, prompt: list[int], params: SamplingParams, usage: Usage,
                        start: float) -> AsyncGenerator[int, None]:
        self.metrics.running += 1
        steps = self._cached(prompt, params, usage) if self._adapter is not None \
            else self._uncached(prompt, params, usage)
        try:
            async with contextlib.aclosing(steps):
                async for token in steps:
                    if usage.completion_tokens == 0:
                        usage.ttft = time.perf_counter() - start
                        self.metrics.observe(usage)
                    usage.completion_tokens += 1
                    self.metrics.generated_tokens += 1
                    yield token
        finally:
            self.metrics.running -= 1

    def _check(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise PromptError("prompt: must not be empty")
        if len(prompt) + params.max_tokens > self.max_positions:
            raise PromptError(f"prompt: {len(prompt)} tokens + max_tokens {params.max_tokens} "
                              f"exceed the model's {self.max_positions} positions")
        vocab = int(self.model.config.vocab_size)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise PromptError(f"prompt: token ids must be in 0..{vocab - 1}")

    async def _cached(self, prompt: list[int], params: SamplingParams,
                      usage: Usage) -> AsyncGenerator[int, None]:
        """Generate over the cache; a prompt the device pool has no room for right now (too
        long, or the pool pinned by other requests) is computed without it instead."""
        adapter, cache = self._adapter, self.cache
        assert adapter is not None and cache is not None
        if len(prompt) <= cache.config.device_pages * cache.config.page_size:
            async with cache.fetch(prompt) as hit:
                try:
                    out = await adapter.prefill(hit, prompt)
                except CapacityError as exc:
                    self._fall_back(len(prompt), str(exc))
                else:
                    async with contextlib.aclosing(self._over(adapter, hit, out, prompt,
                                                              params, usage)) as tokens:
                        async for token in tokens:
                            yield token
                    return
        else:
            # NOTE: fetched first, its hits were counted by the cache, and loaded back from
            # L2 or L3 into the pool, for a prompt whose KV the pool can never hold
            self._fall_back(len(prompt), "longer than the device pool")
        async with contextlib.aclosing(self._uncached(prompt, params, usage)) as tokens:
            async for token in tokens:
                yield token

    def _fall_back(self, length: int, why: str) -> None:
        log.info("no device room for a %d-token prompt, computed uncached: %s", length, why)
        self.metrics.uncached_fallbacks += 1

    async def _over(self, adapter: HFAdapter, hit: FetchContext, out: Prefill,
                    prompt: list[int], params: SamplingParams,
                    usage: Usage) -> AsyncGenerator[int, None]:
        """Generate from `out` (`prompt` prefilled over the cache), then cache the output."""
        usage.cached_tokens = out.num_reused_tokens
        usage.tiers = _by_tier(out.num_reused_tokens, hit.num_device_hit_tokens,
                               hit.num_host_hit_tokens, hit.num_storage_hit_tokens)
        fed = list(prompt)
        tokens = self._decode(out.logits[0, -1], out.past_key_values, params, fed, usage)
        async with contextlib.aclosing(tokens):
            async for token in tokens:
                yield token
        if self.config.commit_output:
            await self._commit_output(adapter, hit, out, fed)

    async def _commit_output(self, adapter: HFAdapter, hit: FetchContext, out: Prefill,
                             fed: list[int]) -> None:
        """Cache the generated tokens' KV, if the cache can: every token has been yielded.

        NOTE: only a `CapacityError` was kept from the client: a cache that failed meanwhile
        (another request's copy failed: `WorkerError`) turned a finished generation into a
        500, or a stream cut before its finish and ``[DONE]``. The output's KV is an extra;
        the next request learns of the failure (503).

        Cancellation: as `HFAdapter.commit_decoded`.
        """
        try:
            await adapter.commit_decoded(hit, out, fed)
        except CapacityError:
            pass  # no room: the output is not cached
        except (WorkerError, TransferError, ClosedError) as exc:
            log.warning("the generated tokens were not cached: %s", exc)

    async def _uncached(self, prompt: list[int], params: SamplingParams,
                        usage: Usage) -> AsyncGenerator[int, None]:
        past = DynamicCache(config=self.model.config)
        logits = await self._run(prompt, past)
        tokens = self._decode(logits, past, params, list(prompt), usage)
        async with contextlib.aclosing(tokens):
            async for token in tokens:
                yield token

    async def _decode(self, logits: torch.Tensor, past: DynamicCache, params: SamplingParams,
                      fed: list[int], usage: Usage) -> AsyncGenerator[int, None]:
        """Sample from `logits`, then decode on `past`; `fed` grows by each token fed back.
        An end-of-sequence token is yielded last (it counts as generated, as in vLLM); a
        consumer that set `Usage.finish_reason` to ``"stop"`` got the last one."""
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        ends = frozenset() if params.ignore_eos else self.eos_token_ids
        for step in range(params.max_tokens):
            token = _sample(logits, params, gen)
            if token in ends:
                usage.finish_reason = "stop"
                yield token
                return
            yield token
            # NOTE: a stop string ended the text: ending here (not closing the generator)
            # lets the output be cached; it was not, so a next turn quoting it missed
            if usage.finish_reason == "stop":
                return
            if step + 1 < params.max_tokens:
                fed.append(token)
                logits = await self._run([token], past)

    async def _run(self, tokens: list[int], past: DynamicCache) -> torch.Tensor:
        """A forward pass on the compute thread; the last position's logits ``[vocab]``.

        Cancellation: the pass finishes (it mutates `past`), then the cancellation propagates.
        """
        logits = await finish_then_cancel(
            run_in_thread(self._executor, forward, self.model, tokens, past))
        return logits[0, -1]


def eos_token_ids(model: PreTrainedModel, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end a generation: the model's generation config's end-of-sequence ids
    (one or a list: Llama-3 instruct ends turns with two) and the tokenizer's."""
    found: set[int] = set()
    config = getattr(model, "generation_config", None)
    for ids in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(ids, int):
            found.add(ids)
        elif isinstance(ids, list | tuple):
            found.update(i for i in ids if isinstance(i, int))
    return frozenset(found)


def _by_tier(reused: int, *found: int) -> dict[str, int]:
    """The `reused` prompt tokens by the tier they came from, given the tokens `found` in
    L1, L2, L3 (in prefix order).

    NOTE: what was found, cut to what was reused: a prompt found whole still computes its
    last token (the logits come from it), and the tiers summed to one more than
    `cached_tokens` (the last token's tier was counted as a hit it was not).
    """
    out = {}
    for tier, n in zip(TIERS, found, strict=True):
        out[tier] = min(n, reused)
        reused -= out[tier]
    return out


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    if params.temperature <= 0:
        return int(logits.argmax())
    # NOTE: float64 and the max subtracted first: a small temperature made logits /
    # temperature inf (or 0 / 0 in float32) and the probabilities NaN, and multinomial
    # raised; now the max stays 0, the rest go to -inf: greedy in the limit, as it should
    scaled = logits.double()
    probs = torch.softmax((scaled - scaled.max()) / params.temperature, dim=-1)
    if params.top_p < 1:
        probs = _nucleus(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=gen))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` with all but the fewest most likely tokens whose mass reaches `top_p` zeroed
    (the most likely token always stays; multinomial renormalises)."""
    ordered, order = torch.sort(probs, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # the mass ahead of each token
    ordered[before >= top_p] = 0
    return torch.zeros_like(probs).scatter_(-1, order, ordered)


def cache_config(model: PreTrainedModel, config: EngineConfig) -> HiCacheConfig:
    """The `HiCacheConfig` an engine for `model` opens with `config`."""
    ps = config.page_size
    return HiCacheConfig(spec=kv_spec(model.config, model.dtype), page_size=ps,
                         device_pages=config.device_tokens // ps,
                         host_pages=config.host_tokens // ps, storage=config.storage,
                         device=str(model.device),
                         namespace=config.namespace or weights_namespace(model),
                         **config.cache_options)


_ENGINE_OWNS = frozenset({"spec", "page_size", "device", "device_pages", "host_pages",
                          "host_bytes", "host_ratio", "storage", "namespace", "tp_rank",
                          "tp_size"})
"""`HiCacheConfig` fields the engine sets from its own fields and the model. NOTE: the
``tp_*`` ranks too: an engine is one process, one rank (``tp_size`` 2 passed every check
and failed only when the engine opened, after the model had loaded)."""
_PROBE_SPEC = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1, dtype="fp16")


def _check_cache_options(options: Mapping[str, Any]) -> None:
    if not isinstance(options, Mapping):
        raise ConfigError(f"cache_options: a mapping of HiCacheConfig fields, got "
                          f"{type(options).__name__}")
    known = {f.name for f in dataclasses.fields(HiCacheConfig) if f.init}
    for name in options:
        if name in _ENGINE_OWNS:
            raise ConfigError(f"cache_options: {name!r} is set by the engine (its tiers, "
                              f"page size, storage and namespace, and the model)")
        if name not in known:
            raise ConfigError(f"cache_options: {name!r} is not a HiCacheConfig field")
    # NOTE: their values too, now, on a stand-in model: a bad one (eviction=bogus) failed
    # only in `Engine`, after `aiohicache serve` had loaded the model, and named no option
    # (the device is the model's: a CUDA backend is checked against it then)
    device = "cuda" if options.get("io_backend") in ("kernel", "direct") else "cpu"
    try:
        HiCacheConfig(spec=_PROBE_SPEC, device_pages=1, device=device, **options)
    except ConfigError as exc:
        raise ConfigError(f"cache_options: {exc}") from None


def weights_namespace(model: PreTrainedModel) -> str:
    """``weights-`` and the xxh3-128 of every parameter and buffer (names, shapes, dtypes,
    bytes): one model's servers agree on it, and nothing else does.

    NOTE: the namespace was left "default", so two servers of models whose KV has one
    shape (a model and its fine-tune, two seeds of the tiny model) sharing an L3 served
    each other's KV (a review found it). About 0.1 s a GB of weights, once per engine.
    """
    digest = xxhash.xxh3_128()
    # NOTE: the config too (RoPE theta and scaling, norms' eps: KV differs under one set of
    # weights), less where it was loaded from; and every buffer: `state_dict` leaves out the
    # non-persistent ones (a Llama's rotary `inv_freq`)
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    tensors = dict(model.state_dict())
    for name, buffer in model.named_buffers():
        tensors.setdefault(name, buffer)
    for name, tensor in tensors.items():
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return f"weights-{digest.hexdigest()}"
