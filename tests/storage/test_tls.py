"""TLS and AUTH against a real TLS redis-server (``--tls-port``), certificates made by
`trustme`: ``rediss://`` with verification, a wrong CA (a clear error, promptly; the cache's
breaker opens), ACL users, and a server certificate rotated while clients run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import trustme

from aiohicache import HiCache
from aiohicache._redis_server import RedisServer
from aiohicache.controller import page_format
from aiohicache.storage import StorageError
from aiohicache.storage.redis import RedisBackend
from tests.conftest import make_config, make_tokens, prefill

from .conftest import FMT, PAYLOAD, make_keys, make_page
from .conftest import page_views as pages
from .redis_server import started


@dataclass
class TlsServer:
    server: RedisServer
    ca: trustme.CA
    ca_file: Path
    other_ca_file: Path
    tmp: Path

    def url(self, *, ca_file: Path | None = None, user: str = "", password: str = "") -> str:
        auth = f"{quote(user)}:{quote(password)}@" if user or password else ""
        ca = ca_file or self.ca_file
        return (f"rediss://{auth}127.0.0.1:{self.server.tls_port}/0"
                f"?ssl_ca_certs={quote(str(ca))}")

    def plain(self) -> redis.Redis:
        return redis.Redis(port=self.server.port, socket_timeout=5)

    def issue(self, name: str) -> tuple[Path, Path]:
        """A new server certificate for 127.0.0.1 from this CA, as files."""
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        cert_file, key_file = self.tmp / f"{name}.pem", self.tmp / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(str(cert_file))
        cert.private_key_pem.write_to_path(str(key_file))
        return cert_file, key_file


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    tmp = tmp_path_factory.mktemp("tls")
    ca, other = trustme.CA(), trustme.CA()
    ca_file, other_file = tmp / "ca.pem", tmp / "other-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    other.cert_pem.write_to_path(str(other_file))
    probe = TlsServer(RedisServer(), ca, ca_file, other_file, tmp)
    cert_file, key_file = probe.issue("server")
    server = RedisServer(extra_args=(
        "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file),
        "--tls-ca-cert-file", str(ca_file), "--tls-auth-clients", "no"))
    server.tls_port = 0
    probe.server = started(server)
    try:
        yield probe
    finally:
        server.stop()



async def test_rediss_with_verification_round_trips(tls: TlsServer) -> None:
    keys = make_keys(8, seed=21)
    async with RedisBackend(tls.url(), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * 8
        buffers = [bytearray(PAYLOAD) for _ in keys]
        assert await backend.get_into(keys, [memoryview(b) for b in buffers]) == [True] * 8
        assert [bytes(b) for b in buffers] == [make_page(k) for k in keys]
    with tls.plain() as client:  # and it went over TLS: the TLS port served those commands
        assert int(client.info("stats").get("total_connections_received", 0)) >= 1


async def test_a_wrong_ca_is_a_clear_error_promptly(tls: TlsServer) -> None:
    start = time.monotonic()
    with pytest.raises(StorageError, match="certificate verify failed"):
        async with RedisBackend(tls.url(ca_file=tls.other_ca_file), FMT, connect_timeout=2.0):
            pass
    assert time.monotonic() - start < 5


async def test_a_wrong_ca_opens_the_cache_breaker_and_l1_l2_keep_serving(
        tls: TlsServer) -> None:
    cfg0 = make_config(host_ratio=4.0)
    cfg = make_config(storage=tls.url(ca_file=tls.other_ca_file), host_ratio=4.0,
                      storage_failures_to_open=2, storage_cooldown=60.0, backup_threshold=1)
    assert page_format(cfg) == page_format(cfg0)
    async with HiCache(cfg) as cache:
        for seed in range(4):
            await prefill(cache, make_tokens(16, seed=seed))
        await cache.drain()
        stats = cache.stats()
        assert stats.storage is not None and stats.storage["breaker"] == "open"
        assert stats.health == "degraded"


async def test_acl_users_get_their_keys_only(tls: TlsServer) -> None:
    keys = make_keys(4, seed=22)
    with tls.plain() as client:
        client.execute_command("ACL", "SETUSER", "kv", "on", ">kv-secret", "~ahkv:*",
                               "+@all")
        client.execute_command("ACL", "SETUSER", "other", "on", ">other-secret", "~other:*",
                               "+@all")
    async with RedisBackend(tls.url(user="kv", password="kv-secret"), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * 4
    async with RedisBackend(tls.url(user="other", password="other-secret"), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [False] * 4  # NOPERM per key
        with pytest.raises(StorageError, match="(?i)noperm|permission"):
            await backend.get_into(keys, [memoryview(bytearray(PAYLOAD)) for _ in keys])
    with pytest.raises(StorageError, match="(?i)wrongpass|invalid|auth"):
        async with RedisBackend(tls.url(user="kv", password="wrong"), FMT):
            pass


async def test_a_rotated_server_certificate_is_used_by_new_connections(
        tls: TlsServer) -> None:
    keys = make_keys(2, seed=23)
    async with RedisBackend(tls.url(), FMT) as before:
        await before.set_from(keys, pages(keys))
        cert_file, key_file = tls.issue("rotated")
        with tls.plain() as client:  # the operator's step: both at once, no restart
            client.execute_command("CONFIG", "SET", "tls-cert-file", str(cert_file),
                                   "tls-key-file", str(key_file))
            assert client.config_get("tls-cert-file")["tls-cert-file"] == str(cert_file)
        assert await before.exists(keys) == 2  # pooled connections go on
    async with RedisBackend(tls.url(), FMT) as after:  # new ones verify the new certificate
        assert await after.exists(keys) == 2
