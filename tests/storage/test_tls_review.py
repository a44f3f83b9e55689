"""A review of the Redis L3's security and operations paths (TLS, AUTH, certificate rotation)
against real ``redis-server --tls-port`` processes, certificates made by `trustme`.

What is required here: secrets in a storage URL (the password, and the client key's
passphrase ``ssl_password``) appear in no error, repr or log; a TLS file that is not there is
a `ConfigError` naming the option and the file, before anything connects; and a client
certificate rewritten on disk (mTLS rotation) is used by the connections opened after it,
as a rotated server certificate is, with no restart.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import trustme

from aiohicache import ConfigError
from aiohicache._redis_server import RedisServer
from aiohicache.storage import check_url
from aiohicache.storage.factory import shown_url
from aiohicache.storage.redis import RedisBackend, RedisClusterBackend
from tests.conftest import make_config

from .conftest import FMT, make_keys
from .conftest import page_views as pages
from .redis_server import started

SECRET = "S3cret-pass"
KEY_PASS = "Key-passphrase-42"


def _dead_port() -> int:
    """A loopback port nothing listens on (a connection is refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# ---------------------------------------------------------------------- secrets never shown


@pytest.mark.parametrize("url", [
    f"rediss://kv:{SECRET}@127.0.0.1:6379/0?ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
    f"&ssl_password={KEY_PASS}&no_such_option=1",
    f"rediss+cluster://kv:{SECRET}@127.0.0.1:7000?ssl_password={KEY_PASS}&no_such_option=1",
])
def test_a_key_passphrase_in_the_url_is_in_no_error(url: str) -> None:
    """``ssl_password`` (the passphrase of the client's key, for mTLS) is a secret like the
    password: a URL refused for another reason names neither."""
    with pytest.raises(ConfigError) as info:
        check_url(url)
    assert KEY_PASS not in str(info.value) and SECRET not in str(info.value)
    assert "no_such_option" in str(info.value)  # and the error still names what is wrong


def test_shown_url_hides_the_key_passphrase() -> None:
    """`shown_url` (what replay results and errors show) hides ``ssl_password`` too."""
    url = (f"rediss://127.0.0.1:6379/0?ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
           f"&ssl_password={KEY_PASS}")
    shown = shown_url(url)
    assert KEY_PASS not in shown
    assert "ssl_certfile=/c.pem" in shown  # the rest is shown


def test_a_configs_repr_shows_no_password() -> None:
    """A config is what a serving framework logs: its repr (and its L3 group's) names the
    store, never its password or key passphrase."""
    url = f"rediss://kv:{SECRET}@127.0.0.1:6379/0?ssl_password={KEY_PASS}"
    cfg = make_config(storage=url, host_ratio=4.0)
    for text in (repr(cfg), str(cfg), repr(cfg.l3)):
        assert SECRET not in text and KEY_PASS not in text
        assert "127.0.0.1:6379" in text


def test_the_sglang_plugin_logs_no_password(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's plug-in logs its store when it opens it and when calls fail: by its URL
    without credentials."""
    from tests.test_sglang_plugin import MHAHostPool, make_backend, page_hashes

    backend = make_backend(f"redis://kv:{SECRET}@127.0.0.1:{_dead_port()}/0")
    backend.options["connect_timeout"] = 0.2
    backend.timeout_s = 5.0
    with caplog.at_level(logging.DEBUG):
        backend.register_mem_pool_host(MHAHostPool(4))
        try:
            assert backend.batch_exists(page_hashes(list(range(16)))) == 0
        finally:
            backend.close()
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert "127.0.0.1" in logged  # the store is named...
    assert SECRET not in logged  # ...without its password


# ---------------------------------------------------------------------- TLS files


@pytest.mark.parametrize("option", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile"])
@pytest.mark.parametrize("scheme", ["rediss", "rediss+cluster"])
def test_a_missing_tls_file_is_a_config_error_naming_it(tmp_path: Path, option: str,
                                                        scheme: str) -> None:
    """A CA, certificate or key file that is not there failed each connection as ``Error 2
    connecting to 127.0.0.1:6379. No such file or directory`` (read as the server's socket
    missing; the breaker opened, L3 was lost, no file named). It is a `ConfigError` naming
    the option and the file, raised before anything connects."""
    missing = tmp_path / "no-such.pem"
    files = {"ssl_ca_certs": tmp_path / "ca.pem", "ssl_certfile": tmp_path / "c.pem",
             "ssl_keyfile": tmp_path / "c.key"}
    for path in files.values():
        path.write_text("placeholder")
    files[option] = missing
    query = "&".join(f"{name}={quote(str(path))}" for name, path in files.items())
    url = f"{scheme}://127.0.0.1:{_dead_port()}/?{query}"
    cls = RedisClusterBackend if "cluster" in scheme else RedisBackend
    with pytest.raises(ConfigError, match=rf"{option}.*{missing.name}"):
        check_url(url)
    with pytest.raises(ConfigError, match=rf"{option}.*{missing.name}"):
        cls(url, FMT)


# ---------------------------------------------------------------------- mTLS rotation


@dataclass
class MtlsServer:
    server: RedisServer
    tmp: Path

    def url(self) -> str:
        t = self.tmp
        return (f"rediss://127.0.0.1:{self.server.tls_port}/0"
                f"?ssl_ca_certs={quote(str(t / 'ca.pem'))}"
                f"&ssl_certfile={quote(str(t / 'client.pem'))}"
                f"&ssl_keyfile={quote(str(t / 'client.key'))}")

    def plain(self) -> redis.Redis:
        return redis.Redis(port=self.server.port, socket_timeout=5)


def _write_client_cert(ca: trustme.CA, tmp: Path) -> None:
    """The operator's (or cert-manager's) step: the client's files rewritten in place."""
    cert = ca.issue_cert("kv-client")
    cert.cert_chain_pems[0].write_to_path(str(tmp / "client.pem"))
    cert.private_key_pem.write_to_path(str(tmp / "client.key"))


@pytest.fixture
def mtls(tmp_path: Path) -> Iterator[tuple[MtlsServer, trustme.CA, trustme.CA]]:
    """A server that requires client certificates and trusts two client CAs (old, new);
    the client's certificate is from the old one."""
    server_ca, old, new = trustme.CA(), trustme.CA(), trustme.CA()
    server_ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    old.cert_pem.write_to_path(str(tmp_path / "old-clients.pem"))
    new.cert_pem.write_to_path(str(tmp_path / "new-clients.pem"))
    (tmp_path / "clients.pem").write_bytes((tmp_path / "old-clients.pem").read_bytes()
                                           + (tmp_path / "new-clients.pem").read_bytes())
    cert = server_ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    _write_client_cert(old, tmp_path)
    server = RedisServer(extra_args=(
        "--tls-cert-file", str(tmp_path / "server.pem"),
        "--tls-key-file", str(tmp_path / "server.key"),
        "--tls-ca-cert-file", str(tmp_path / "clients.pem"), "--tls-auth-clients", "yes"))
    server.tls_port = 0
    started(server)
    try:
        yield MtlsServer(server, tmp_path), old, new
    finally:
        server.stop()


async def test_a_client_certificate_rewritten_on_disk_is_used_by_new_connections(
        mtls: tuple[MtlsServer, trustme.CA, trustme.CA]) -> None:
    """Client certificates rotate as server ones do: the files are rewritten, then the
    server stops trusting the old issuer. A running cache's connections opened after that
    present the new certificate (redis-py kept each connection's first TLS context for
    good: every reconnect presented the old certificate, refused, until a restart)."""
    tls, _, new = mtls
    keys = make_keys(4, seed=31)
    async with RedisBackend(tls.url(), FMT) as backend:
        assert await backend.set_from(keys, pages(keys)) == [True] * 4
        _write_client_cert(new, tls.tmp)
        with tls.plain() as client:
            client.execute_command("CONFIG", "SET", "tls-ca-cert-file",
                                   str(tls.tmp / "new-clients.pem"))
            client.client_kill_filter(_type="normal", skipme=True)  # connections drop
        assert await backend.exists(keys) == 4
