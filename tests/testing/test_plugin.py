"""`aiohicache.testing`: the fixtures, the KV oracle, the after-test checks, the docs' example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiohicache import HiCache, KVSpec
from aiohicache.testing import KVOracle, check_cache, kv_code, small_config, with_storage

DOCS = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def run_pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """Run `source` as a user's test file, with the plugin turned on as the docs say."""
    (tmp_path / "test_user.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "aiohicache.testing", "-p", "no:cacheprovider",
         "-q", "test_user.py"], cwd=tmp_path, capture_output=True, text=True, timeout=50,
        check=False)


def test_the_docs_example_passes_as_a_user_runs_it(tmp_path: Path) -> None:
    example = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)[-1]
    out = run_pytest(tmp_path, example)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout


def test_a_leaked_lease_fails_the_test_at_teardown(tmp_path: Path) -> None:
    out = run_pytest(tmp_path, """
import pytest

@pytest.mark.asyncio
async def test_leaks(hicache):
    await hicache.allocate(5)   # leased, never committed or freed
""")
    assert out.returncode == 1
    assert "1 passed, 1 error" in out.stdout and "2 device pages still leased" in out.stdout


async def test_the_oracle_catches_kv_of_another_prefix_position_or_layer(
        hicache: HiCache, kv: KVOracle) -> None:
    tokens = list(range(100, 120))
    await kv.prefill(tokens)
    async with hicache.fetch(tokens) as hit:
        await hit.ready()
        slots = hit.device_indices[:20]
        kv.verify(slots, tokens)
        with pytest.raises(AssertionError, match="position 0 .*layer 0 K"):
            kv.verify(slots, [99, *tokens[1:]])  # the same tokens after another first token
        with pytest.raises(AssertionError, match=r"position 0 \(token 100, slot 1\)"):
            kv.verify(slots[1:], tokens, 0)  # shifted by one position
        pool = hicache.device_pool
        saved = pool.v_buffer(2)[slots[7]].clone()
        pool.v_buffer(2)[slots[7]] = pool.v_buffer(1)[slots[7]]  # one row from another layer
        with pytest.raises(AssertionError, match=r"position 7 \(token 107, slot \d+\) in "
                                                 r"layer 2 V; 1 of 20"):
            kv.verify(slots, tokens)
        pool.v_buffer(2)[slots[7]] = saved
    assert kv.hits_checked == 0


def test_codes_depend_on_the_whole_prefix_and_the_position() -> None:
    a, b = kv_code([5, 6, 7, 8], 4), kv_code([5, 9, 7, 8], 4)
    assert a.shape == (4, 4) and ((a >= 0) & (a <= 250)).all()
    assert (a[:, 0] == b[:, 0]).all() and (a[:, 1:] != b[:, 1:]).any(axis=0).all()
    assert not (kv_code([7, 7, 7], 1)[0] == kv_code([7, 7, 7], 1)[0][0]).all()  # position


@pytest.fixture
def mla_config() -> object:
    return small_config(spec=KVSpec.mla(num_layers=2, kv_lora_rank=16, rope_dim=4,
                                        dtype="fp16"))


async def test_an_mla_cache_and_a_cache_of_ones_own(hicache_factory: object,
                                                    mla_config: object) -> None:
    cache = await hicache_factory(mla_config)  # type: ignore[operator]
    oracle = KVOracle(cache)
    assert await oracle.prefill(list(range(12))) == 0
    assert await oracle.prefill(list(range(13))) == 12 == oracle.hits_checked
    await check_cache(cache)
    with pytest.raises(ValueError, match="float32"):
        KVOracle(await hicache_factory(small_config(  # type: ignore[operator]
            spec=KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=4, dtype="fp8"))))


def test_the_caches_are_checked_and_closed_before_their_stores(tmp_path: Path) -> None:
    """Whatever order a test asks for the fixtures in: the after-test check drains the
    caches' backups, which need their store open (closed first, they failed unseen)."""
    out = run_pytest(tmp_path, """
import pytest
from aiohicache.testing import KVOracle, small_config, with_storage

SEEN = []

@pytest.mark.asyncio
async def test_backs_up(hicache_factory, faulty_storage):
    config = small_config()
    cache = await hicache_factory(with_storage(config, faulty_storage(config)))
    await KVOracle(cache).prefill(list(range(64)))
    SEEN.append(cache)

def test_after():
    storage = SEEN[0].stats().storage
    assert storage["errors"] == 0 and storage["backed_up_pages"] > 0, storage
""")
    assert out.returncode == 0, out.stdout + out.stderr


async def test_faulty_storage_injects_faults_and_hits_stay_exact(
        hicache_factory: object, faulty_storage: object) -> None:
    config = small_config(prefetch_policy="wait_complete", prefetch_threshold=4)
    store = faulty_storage(config, seed=3, corrupt_rate=0.5)  # type: ignore[operator]
    first = await hicache_factory(with_storage(config, store))  # type: ignore[operator]
    await KVOracle(first).prefill(list(range(32)))
    await first.drain()
    second = await hicache_factory(first.config)  # type: ignore[operator]
    oracle = KVOracle(second)
    cached = await oracle.prefill(list(range(32)))
    assert cached == oracle.hits_checked < 32  # some pages came back corrupt: misses
    assert second.stats().storage["corrupt"] > 0  # type: ignore[index, operator]
