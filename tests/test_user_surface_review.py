"""Review of what a user touches first, taken literally: the CLI's tier options, the config
rule that L3 needs L2, the pytest plugin in a user's own project (strict and auto mode,
anyio), and the transformers adapter generating over a shared, restarted file L3.

The rule throughout: a tier asked for either works or is refused with an error naming the
option or field; it is never quietly dropped.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from aiohicache import HiCacheConfig, KVSpec
from aiohicache.cli import cli
from aiohicache.errors import ConfigError
from aiohicache.events import AllBlocksCleared, BlockStored, EventBatch, EventStream
from aiohicache.replay.runner import MODELS, ReplayConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ["replay", "synthetic", "--limit", "2", "--no-progress", "--model", "tiny",
        "--kv-scale", "1", "--page-size", "16"]
"""A replay that allocates next to nothing."""


def _error_line(args: list[str]) -> str:
    """The one error line of a refused command: exit 2, no traceback."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result.output.strip().splitlines()[-1]


# -- an L2 smaller than a page, an L3 with no L2 ------------------------------------------------


@pytest.mark.parametrize("l3", ["none", "memory://"])
def test_replay_refuses_an_l2_of_less_than_one_page_naming_the_option(l3: str) -> None:
    """``--l2 8`` with 16-token pages was rounded down to no L2 at all and the replay ran a
    single tier (and with ``--l3 memory://`` an L3 that no page ever reached), where
    ``--l2 0 --l3 ...`` is refused and ``aiohicache serve --l2 8`` is too."""
    line = _error_line([*TINY, "--l2", "8", "--l3", l3])
    assert line == ("Error: Invalid value for '--l2': 8 is less than one page (16 tokens); "
                    "0 for no L2"), line


def test_replay_names_the_l1_option_when_it_is_less_than_a_page() -> None:
    """The user typed ``--l1``; the error said ``device_tokens`` (serve says ``--l1``)."""
    line = _error_line([*TINY, "--l3", "none", "--l1", "8"])
    assert line == "Error: Invalid value for '--l1': 8 is less than one page (16 tokens)", line


def test_a_config_with_storage_but_no_l2_is_a_config_error() -> None:
    """L3 pages are prefetched into L2 and backed up from it: ``host_pages=0`` with a store
    opened the store and never used it, unsaid."""
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, dtype="fp16")
    with pytest.raises(ConfigError, match=r"^storage: .*host_pages 0"):
        HiCacheConfig(spec=spec, page_size=4, device_pages=8, host_pages=0,
                      storage="memory://")
    HiCacheConfig(spec=spec, page_size=4, device_pages=8, host_pages=0)  # no L3: fine


def test_a_replay_config_with_storage_but_no_l2_is_a_config_error() -> None:
    """``ReplayConfig(host_tokens=0, storage="tmp")`` made its temporary store and replayed
    without it (the CLI leaves L3 out under ``--l2 0`` itself)."""
    with pytest.raises(ConfigError, match=r"^storage: .*host_tokens 0"):
        ReplayConfig(spec=MODELS["tiny"], device_tokens=1024, host_tokens=0, storage="tmp")
    with pytest.raises(ConfigError, match=r"^host_tokens: 8 is less than one page"):
        ReplayConfig(spec=MODELS["tiny"], device_tokens=1024, host_tokens=8)


def test_serve_refuses_an_l3_with_no_l2_naming_l3() -> None:
    """``aiohicache serve --l2 0 --l3 file:///...`` started and never touched its L3; now the
    engine's config refuses it, named as ``--l3`` (checked before the model loads:
    tests/test_today_review2.py)."""
    pytest.importorskip("transformers")
    from aiohicache.serve import EngineConfig

    with pytest.raises(ConfigError, match="storage: .*L2"):
        EngineConfig(page_size=16, device_tokens=256, host_tokens=0, storage="memory://")


# -- the pytest plugin in a user's project ------------------------------------------------------

USER_TESTS = """
import pytest

@pytest.mark.anyio
async def test_anyio_gets_the_fixtures(hicache, kv, anyio_backend):
    assert await kv.prefill(list(range(20))) == 0
    assert await kv.prefill(list(range(21))) == 20

@pytest.mark.asyncio
async def test_planted_wrong_kv_is_caught(hicache, kv):
    tokens = list(range(16))
    await kv.prefill(tokens)
    async with hicache.fetch(tokens) as hit:
        await hit.ready()
        hicache.device_pool.v_buffer(2)[hit.device_indices[9]] += 1
    with pytest.raises(AssertionError, match=r"position 9 .*layer 2 V"):
        await kv.prefill(tokens + [1])
"""


def _run_user_suite(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "aiohicache.testing", "-p", "no:cacheprovider",
         "-q", "-rA", "-o", f"asyncio_mode={mode}", "-o",
         "asyncio_default_fixture_loop_scope=function", "test_user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=50, check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_the_plugin_serves_anyio_tests_in_strict_mode_on_asyncio_and_trio(
        tmp_path: Path) -> None:
    """As docs/testing.md says: in strict mode anyio runs the plugin's fixtures itself, so an
    ``@pytest.mark.anyio`` test gets a cache on its own loop (asyncio or trio); the KV
    oracle catches a planted wrong value, naming position and layer."""
    pytest.importorskip("trio")
    out = _run_user_suite(tmp_path, "strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout, out.stdout


def test_anyio_tests_in_auto_mode_get_a_loop_error_not_a_hang(tmp_path: Path) -> None:
    """In auto mode pytest-asyncio runs every async fixture on its own loop: an anyio test's
    first call is a `LoopError` that says why (docs/testing.md), never a hang."""
    pytest.importorskip("trio")
    out = _run_user_suite(tmp_path, "auto")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed" in out.stdout and "2 failed" in out.stdout, out.stdout
    assert out.stdout.count("LoopError: the cache was opened on another event loop") >= 2
    docs = (ROOT / "docs" / "testing.md").read_text()
    assert "anyio" in docs and "LoopError" in docs


def test_a_fetch_context_never_exited_fails_the_test_at_teardown(tmp_path: Path) -> None:
    """docs/testing.md: a test that leaks a lease fails at teardown. A context entered by
    hand and dropped holds its pin and leases, but the garbage collector released them as
    the test returned (with a ResourceWarning that Python's default filters hide), so the
    teardown check found nothing and the test passed."""
    (tmp_path / "test_user.py").write_text("""
async def test_leaks_a_context(hicache, kv):
    tokens = list(range(10))
    hit = await hicache.fetch(tokens).__aenter__()   # never exited
    slots = await hit.allocate(10)
    kv.fill(slots, tokens)
    await hit.commit(tokens, slots)                  # the partial page stays leased
""")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "aiohicache.testing", "-p", "no:cacheprovider",
         "-q", "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
         "test_user.py"], cwd=tmp_path, capture_output=True, text=True, timeout=50,
        check=False, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed, 1 error" in out.stdout, out.stdout
    assert "1 fetch context(s) entered and never exited" in out.stdout, out.stdout


# -- the transformers adapter over a shared file L3 ---------------------------------------------


async def test_generate_over_a_restarted_file_l3_with_events_matches_no_cache(
        tmp_path: Path) -> None:
    """Concurrent requests (one prompt several times at once, its prefix, an extension) give
    the tokens the model gives without a cache: first run, then a second engine over the same
    L3 directory (prompts past the 256-token prefetch threshold, so L3 serves them); the
    events stream sees L3 backups and ends with `AllBlocksCleared`."""
    pytest.importorskip("transformers")
    from aiohicache.hf import tiny_llama
    from aiohicache.serve.engine import ByteTokenizer, Engine, EngineConfig, SamplingParams, Usage

    model = tiny_llama(seed=3, vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1)
    shared = [(i * 7) % 290 + 1 for i in range(280)]
    prompts = [shared] * 3 + [shared[:140], [*shared, 5, 6]]
    params = SamplingParams(max_tokens=3)

    async def run(engine: Engine) -> list[list[int]]:
        async def one(prompt: list[int]) -> list[int]:
            return [t async for t in engine.generate(prompt, params, Usage(len(prompt)))]
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async with Engine(model, ByteTokenizer(), EngineConfig(use_cache=False)) as plain:
        want = await run(plain)
    config = EngineConfig(page_size=16, device_tokens=1024, host_tokens=512,
                          storage=f"file://{tmp_path}", max_running=8)
    for restart in range(2):
        async with Engine(model, ByteTokenizer(), config) as engine:
            assert engine.cache is not None
            batches: list[EventBatch] = []
            listener = asyncio.create_task(_listen(engine.cache.events(), batches))
            await asyncio.sleep(0)
            assert await run(engine) == want, f"restart {restart}"
            assert await run(engine) == want, f"restart {restart}, warm"
            await engine.cache.drain()
            engine.cache.check_invariants()
            if restart:
                assert engine.cache.stats().storage_hit_tokens > 0
        await asyncio.wait_for(listener, 5)
        events = [e for b in batches for e in b.events]
        assert any(isinstance(e, BlockStored) and e.medium == "storage" for e in events)
        assert isinstance(events[-1], AllBlocksCleared)


async def _listen(stream: EventStream, batches: list[EventBatch]) -> None:
    async with stream:
        batches.extend([b async for b in stream])


async def test_commit_decoded_refuses_a_token_whose_kv_was_never_computed() -> None:
    """`commit_decoded` takes the prompt and the tokens fed back since: the last decoded
    token has no KV until it is fed. Given it anyway, the pool's indexed write broadcast the
    one KV row there was (the token before) into both slots, and where that completed a page
    the page was committed: a later request for that sequence was served wrong KV. Now a
    `ConfigError` names the counts and nothing is written."""
    pytest.importorskip("transformers")
    from aiohicache import HiCache
    from aiohicache.hf import HFAdapter, kv_spec, tiny_llama

    model = tiny_llama(seed=4, vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1)
    prompt = list(range(1, 19))
    config = HiCacheConfig(spec=kv_spec(model.config, model.dtype), page_size=2,
                           device_pages=64)
    async with HiCache(config) as cache:
        adapter = HFAdapter(model, cache)
        async with cache.fetch(prompt) as hit:
            out = await adapter.prefill(hit, prompt)
            first = int(out.logits[0, -1].argmax())
            second = int((await adapter.decode(out.past_key_values, first)).argmax())
            with pytest.raises(ConfigError, match=r"^tokens: 20 given, .* KV of 19"):
                await adapter.commit_decoded(hit, out, [*prompt, first, second])
            await adapter.commit_decoded(hit, out, [*prompt, first])  # what was fed: fine
        async with cache.fetch([*prompt, first, second, 7]) as hit:
            assert hit.num_cached_tokens == 18  # the page of `second` was never committed


async def test_the_oracle_names_slots_and_tokens_that_do_not_match() -> None:
    """`fill`/`verify` of more slots than `tokens` has past `start` was a reshape's
    "shape '[8, 2, 8]' is invalid" RuntimeError; it says what does not match."""
    from aiohicache import HiCache
    from aiohicache.testing import KVOracle, small_config

    async with HiCache(small_config()) as cache:
        kv = KVOracle(cache)
        slots = await cache.allocate(8)
        with pytest.raises(ValueError, match="tokens: 5 of them, 8 slots from position 0"):
            kv.fill(slots, list(range(5)))
        with pytest.raises(ValueError, match="tokens: 20 of them, 8 slots from position 15"):
            kv.verify(slots, list(range(20)), 15)
        kv.fill(slots, list(range(20)), 12)
        kv.verify(slots, list(range(20)), 12)
        cache.free(slots)
