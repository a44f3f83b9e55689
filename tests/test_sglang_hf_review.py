"""Review of the SGLang storage plug-in as SGLang's threads call it, and of the transformers
adapter after a forward pass that raised part-way.

The plug-in: whatever SGLang (or a caller of its API) hands it, a page read is the page
stored under that key or a miss, bad input is a `ConfigError` before anything is read or
written, and a store that fails is a miss, without a traceback per call. The adapter: a pass
that raised leaves the model's cache as it was, so a retry computes what a run without the
cache computes (logits ``torch.equal``), and its tokens can still be committed.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aiohicache import ConfigError
from aiohicache._redis_server import RedisServer
from aiohicache.sglang_plugin import AiohicacheStorage
from tests.test_sglang_plugin import (
    PAGE,
    MHAHostPool,
    a_page,
    indices,
    make_backend,
    page_hashes,
    small,  # noqa: F401  (a fixture)
)

# ---------------------------------------------------------------- SGLang plug-in


def test_a_value_of_another_dtype_is_refused_not_stored_as_its_bytes(
        small: AiohicacheStorage) -> None:  # noqa: F811
    """A float16 page is as many bytes as the bfloat16 page the pool holds: `batch_set`
    stored its bytes, and every later read served them as bfloat16 KV (noise). Reads refuse
    such a target already; writes refuse such a value now, storing nothing."""
    backend, page = small, a_page()
    with pytest.raises(ConfigError, match=r"^values\[1\]: .* bytes of torch.float16"):
        backend.batch_set(["ab" * 32, "cd" * 32], [page, page.half()])
    assert backend.batch_exists(["ab" * 32]) == 0 and backend.get("cd" * 32) is None


def test_two_keys_read_into_one_target_are_refused(small: AiohicacheStorage) -> None:  # noqa: F811
    """`batch_get` with one tensor (or overlapping views) as the target of two keys reported
    both pages read, the first holding the second's KV: a wrong-KV hit. The store refuses
    overlapping buffers for this reason; the plug-in's targets now are too, before reading."""
    backend, first, second = small, a_page(), a_page()
    assert backend.batch_set(["ab" * 32, "cd" * 32], [first, second])
    target = torch.empty_like(first)
    with pytest.raises(ConfigError, match=r"^target_locations: 0 and 1 overlap"):
        backend.batch_get(["ab" * 32, "cd" * 32], [target, target])
    two = torch.empty(2 * first.numel() - 2, dtype=first.dtype)  # views 2 elements apart
    with pytest.raises(ConfigError, match=r"^target_locations: 0 and 1 overlap"):
        backend.batch_get(["ab" * 32, "cd" * 32], [two[:first.numel()], two[-first.numel():]])
    apart = torch.empty(2, first.numel(), dtype=first.dtype)
    got = backend.batch_get(["ab" * 32, "cd" * 32], [apart[0], apart[1]])
    assert torch.equal(got[0], first) and torch.equal(got[1], second)  # type: ignore[arg-type]


@pytest.mark.parametrize("call", ["batch_get_v1", "batch_set_v1"])
def test_host_indices_too_short_for_the_keys_are_refused_before_any_page_moves(
        tmp_path: Path, call: str) -> None:
    """Host indices for one page with two keys: the read wrote the first page into the host
    pool, then raised torch's IndexError into SGLang's thread; a `ConfigError` now says
    what is wrong, before any page is read, written or copied."""
    backend = make_backend(f"file://{tmp_path}")
    pool = MHAHostPool(2)
    backend.register_mem_pool_host(pool)
    keys = page_hashes(list(range(2 * PAGE)))
    try:
        assert backend.batch_set_v1(keys, indices(range(2))) == [True, True]
        pool.kv_buffer.fill_(7)
        with pytest.raises(ConfigError, match=r"^host_indices: 4 for 2 pages of 4 tokens"):
            getattr(backend, call)(keys, indices(range(1)))
        assert bool((pool.kv_buffer == 7).all())
    finally:
        backend.close()


@pytest.mark.parametrize("call", ["batch_exists", "batch_get_v1", "batch_set_v1", "batch_get"])
@pytest.mark.parametrize("key", [bytes.fromhex("ab" * 32), "ab\ud800"])
def test_a_key_that_is_not_a_string_is_a_config_error_in_every_call(
        small: AiohicacheStorage, call: str, key: object) -> None:  # noqa: F811
    """A bytes key was a miss with a logged traceback in `batch_exists` and the reads (for
    ever: nothing said why) and an AttributeError in `batch_set_v1`, after the pages were
    stored; a str with a lone surrogate, a UnicodeEncodeError. Every call now refuses it,
    naming it, and stores nothing."""
    backend = small
    args: dict[str, tuple[Any, ...]] = {
        "batch_exists": ([key],), "batch_get": ([key],),
        "batch_get_v1": ([key], indices(range(1))),
        "batch_set_v1": (["cd" * 32, key], indices(range(2)))}
    with pytest.raises(ConfigError, match=r"^keys\[\d\]: must be a str of Unicode text, got "):
        getattr(backend, call)(*args[call])
    assert backend.batch_exists(["cd" * 32]) == 0


def test_two_threads_closing_at_once_both_return_and_the_store_closes_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's detach and a shutdown path may close the plug-in together. The second
    `close` cancelled the first's close of the store as a call in flight (logged as a
    failure), waited 6 s on the stopped loop, then raised "Event loop is closed"."""
    backend = make_backend(f"file://{tmp_path}")
    backend.register_mem_pool_host(MHAHostPool(2))
    assert backend.set("ab" * 32, a_page())
    errors: list[BaseException] = []

    def close() -> None:
        try:
            backend.close()
        except BaseException as exc:  # what each closing thread saw is the point
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="aiohicache.sglang_plugin"):
        threads = [threading.Thread(target=close) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert errors == [] and not caplog.records
    reopened = make_backend(f"file://{tmp_path}")
    reopened.register_mem_pool_host(MHAHostPool(2))
    try:
        assert reopened.exists("ab" * 32)
    finally:
        reopened.close()


def test_a_failing_store_logs_its_failure_once_not_a_traceback_per_call(
        caplog: pytest.LogCaptureFixture) -> None:
    """With the store down, every batch (each request's prefetch: two calls) logged a
    warning with a 30-line traceback. The first failure is logged with its traceback; those
    that follow it add a count at most once a minute; the calls are misses all the while."""
    backend = make_backend("redis://127.0.0.1:1/0")  # nothing listens on port 1
    backend.options.update(connect_timeout=0.2, retries=0)
    backend.register_mem_pool_host(MHAHostPool(4))
    keys = page_hashes(list(range(4 * PAGE)))
    try:
        with caplog.at_level(logging.INFO, logger="aiohicache.sglang_plugin"):
            for _ in range(10):
                assert backend.batch_exists(keys) == 0
                assert backend.batch_get_v1(keys, indices(range(4))) == [False] * 4
        mine = [r for r in caplog.records if r.name == "aiohicache.sglang_plugin"]
        assert len(mine) == 1
        assert mine[0].exc_info is not None
        assert "exists on redis://127.0.0.1:1/0 failed" in mine[0].getMessage()
        assert [r.getMessage() for r in caplog.records if r not in mine] == \
            ["L3 breaker open after 3 failures: storage bypassed for 10.0 s"]
    finally:
        backend.close()


def test_a_store_that_hangs_is_skipped_after_failures_to_open_calls_then_probed() -> None:
    """A Redis that hangs (SIGSTOP: connections open, nothing answers) cost every call of
    SGLang's prefetch and backup threads its socket timeout, for as long as it hung. After
    `failures_to_open` failed calls in a row the store is skipped for `cooldown_s` (each call
    a miss at once); then one call probes it, and once it answers, pages are served again."""
    with RedisServer() as server:
        backend = make_backend(server.url(), extra={"failures_to_open": 2, "cooldown_s": 0.5})
        backend.options.update(socket_timeout=0.3, retries=0)
        backend.register_mem_pool_host(MHAHostPool(4))
        keys = page_hashes(list(range(4 * PAGE)))
        try:
            assert backend.batch_set_v1(keys, indices(range(4))) == [True] * 4
            server.pause()
            slow = [timed(backend.batch_exists, keys) for _ in range(2)]
            skipped = [timed(backend.batch_exists, keys) for _ in range(20)]
            assert [n for n, _ in slow + skipped] == [0] * 22
            assert min(t for _, t in slow) >= 0.25  # each waited its socket timeout
            assert sum(t for _, t in skipped) < 0.25  # twenty calls: no wait at all
            server.resume()
            time.sleep(0.6)  # the cool-down: the next call is the probe
            assert backend.batch_exists(keys) == 4
            assert backend.batch_get_v1(keys, indices(range(4))) == [True] * 4
        finally:
            server.resume()
            backend.close()


def test_a_second_host_pool_is_refused_and_the_first_store_serves_on(tmp_path: Path) -> None:
    """A second `register_mem_pool_host` replaced the store without closing the first (left
    open for the life of the process) and changed the page format under batches under way."""
    backend = make_backend(f"file://{tmp_path}")
    backend.register_mem_pool_host(MHAHostPool(2))
    keys = page_hashes(list(range(2 * PAGE)))
    try:
        assert backend.batch_set_v1(keys, indices(range(2))) == [True, True]
        with pytest.raises(ConfigError, match=r"^register_mem_pool_host: a host pool is"):
            backend.register_mem_pool_host(MHAHostPool(4))
        assert backend.batch_exists(keys) == 2
    finally:
        backend.close()


def test_the_breaker_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="failures_to_open"):
        make_backend("memory://", extra={"failures_to_open": 0})
    with pytest.raises(ConfigError, match="cooldown_s"):
        make_backend("memory://", extra={"cooldown_s": -1})


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    return call(*args), time.perf_counter() - start


# ---------------------------------------------------------------- transformers adapter

pytest.importorskip("transformers")

from collections.abc import Iterator  # noqa: E402

from transformers import PreTrainedModel  # noqa: E402

from aiohicache import ClosedError, HiCache  # noqa: E402
from aiohicache.hf import HFAdapter, tiny_llama  # noqa: E402
from tests.test_hf import (  # noqa: E402, F401  (an autouse fixture)
    SMALL,
    config_for,
    one_compute_thread,
    recompute,
    tokens_of,
)
from tests.test_hf_misuse_review import assert_cached_kv  # noqa: E402


class Boom(Exception):
    """What the armed module raises."""


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    return tiny_llama(seed=1, **SMALL)


@pytest.fixture
def arm(llama: PreTrainedModel) -> Iterator[Any]:
    """``arm(where)``: the model's next pass raises `Boom` once, after the module `where`
    (``"layer1"``: the second decoder layer, its KV stored; ``"norm"``: the final norm,
    every layer's KV stored) ran."""
    handles = []

    def arm_at(where: str) -> None:
        module = llama.model.layers[1] if where == "layer1" else llama.model.norm
        armed = [True]

        def hook(*_: Any) -> None:
            if armed.pop() if armed else False:
                raise Boom(where)
        handles.append(module.register_forward_hook(hook))

    yield arm_at
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("where", ["layer1", "norm"])
async def test_a_decode_step_that_raised_leaves_the_cache_as_it_was(
        llama: PreTrainedModel, arm: Any, where: str) -> None:
    """A decode step that raised part-way had extended the layers before the failure only
    (11, 11, 10 tokens): the step retried ran each layer over other positions and returned
    other logits than the model's, unsaid, and its tokens were never recorded again, so
    `commit_decoded` refused the output for ever ("fed another way"). The cache is now cut
    back to where it was: the retry is exact, and commits the model's own KV."""
    prompt = tokens_of(10, seed=21)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            past, first = out.past_key_values, int(out.logits[0, -1].argmax())
            arm(where)
            with pytest.raises(Boom):
                await adapter.decode(past, first)
            assert past.get_seq_length() == 10 and past.tokens == prompt
            logits = await adapter.decode(past, first)
            assert torch.equal(logits, recompute(llama, [*prompt, first], 10)[0, -1])
            second = int(logits.argmax())
            await adapter.decode(past, second)
            await adapter.commit_decoded(hit, out, [*prompt, first, second])
        assert await assert_cached_kv(cache, llama, [*prompt, first, second],
                                      [10, 1, 1]) == 12
        cache.check_invariants()


async def test_a_prefill_that_raised_can_be_run_again_in_its_context(
        llama: PreTrainedModel, arm: Any) -> None:
    """A prefill whose pass raised left the slots it leased for the new tokens with the
    context: run again there, it leased the slots after them (a page's middle), ran the whole
    pass, then its commit was refused ("slots: must cover whole pages in order"). Run again
    now, it reuses them: its logits are the model's, and it commits the model's KV."""
    prompt = tokens_of(11, seed=22)
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt[:8]) as hit:
            await adapter.prefill(hit, prompt[:8])
        async with cache.fetch(prompt) as hit:
            arm("layer1")
            with pytest.raises(Boom):
                await adapter.prefill(hit, prompt)
            out = await adapter.prefill(hit, prompt, all_logits=True)
            assert out.num_reused_tokens == 8
            assert torch.equal(out.logits, recompute(llama, prompt, 8, [8]))
            assert hit.num_cached_tokens == 8  # the partial page stays leased, not committed
            first = int(out.logits[0, -1].argmax())
            await adapter.decode(out.past_key_values, first)
            await adapter.commit_decoded(hit, out, [*prompt, first])
        await cache.drain()
        assert cache.stats().device_pages_leased == 0
        assert await assert_cached_kv(cache, llama, [*prompt, first], [8, 3, 1]) == 12
        cache.check_invariants()


async def test_a_prefill_that_raised_is_not_run_again_after_its_context_ended(
        llama: PreTrainedModel, arm: Any) -> None:
    """The slots kept for a prefill run again are the context's lease: once its block has
    ended they are free (and may be another request's), so the prefill is refused as in any
    ended context, and nothing is written into them."""
    prompt = tokens_of(6, seed=23)  # no cached prefix: no layer to wait for
    async with HiCache(config_for(llama)) as cache:
        adapter = HFAdapter(llama, cache)
        async with cache.fetch(prompt) as hit:
            arm("layer1")
            with pytest.raises(Boom):
                await adapter.prefill(hit, prompt)
        pool = cache.device_pool
        before = [pool.k_buffer(layer).clone() for layer in range(SMALL["num_layers"])]
        with pytest.raises(ClosedError, match="not active"):
            await adapter.prefill(hit, prompt)
        assert all(torch.equal(pool.k_buffer(layer), was) for layer, was in enumerate(before))
        cache.check_invariants()
