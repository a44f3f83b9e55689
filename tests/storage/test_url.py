"""`check_url`: every malformed storage URL is a ConfigError saying what is wrong, before
anything is built or connected (tests/storage/test_factory.py covers the backends built)."""

from __future__ import annotations

import pytest

from aiohicache import ConfigError, HiCacheConfig, KVSpec
from aiohicache.storage import PageFormat, backend_from_url, check_url
from aiohicache.storage.redis import RedisBackend, RedisClusterBackend

FMT = PageFormat.make(namespace="t", spec_fingerprint="mha-L1-1x8-float16", page_size=4,
                      payload_bytes=64)


@pytest.mark.parametrize("url", [
    "memory://", "MEMORY://", "file:///var/cache/kv", "file://localhost/kv", "file:rel/dir",
    "redis://localhost", "redis://h:6379/0", "rediss://:pw@h:1/15", "redis://[::1]:6379/2",
    "redis://h/", "redis://h:6379?socket_keepalive=true",
])
def test_good_urls_pass(url: str) -> None:
    check_url(url)


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://x", "unknown URL scheme 'ftp'"),
    ("/plain/path", "not a URL"),
    ("", "not a URL"),
    ("memory://x", "memory URLs take nothing"),
    ("memory:", "memory URLs take nothing"),
    ("file://otherhost/dir", "names host 'otherhost'"),
    ("file://localhost:80/dir", "names host"),
    ("file://", "names no directory"),
    ("file:///x?a=1", "take the options"),
    ("file:///a%00b", "NUL"),
    ("file://[bad/dir", "malformed"),
    ("redis://h:notaport/0", "port 'notaport'"),
    ("redis://h:0/0", "port '0'"),
    ("redis://h:70000/0", "port '70000'"),
    ("redis://h:-1/0", "port '-1'"),
    ("redis://h:1/x", "database number"),
    ("redis://h:1/0/1", "database number"),
    ("redis://h:1/-1", "database number"),
    ("redis://:pw@/0", "names no host"),
    ("redis:h", "names no host"),
    ("redis://[::1/0", "malformed"),
    ("redis://h:1/0#frag", "fragment"),
    ("redis://h\n:1/0", "control character"),
    # a cluster URL's query is read as the cluster client reads it, before a server loads
    # its model (these failed only when the store was built)
    ("redis+cluster://h:7000?bogus=1", "unexpected keyword argument 'bogus'"),
    ("redis+cluster://h:7000?decode_responses=1", "'decode_responses' is not allowed"),
    ("redis+cluster://h:7000?max_connections=x", "Invalid value for 'max_connections'"),
    ("redis+cluster://h:7000?socket_timeout=3", "multiple values"),
])
def test_a_malformed_url_says_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match="^storage: ") as info:
        check_url(url)
    assert why in str(info.value)
    with pytest.raises(ConfigError, match="^storage: "):
        backend_from_url(url, FMT)


SECRET = "S3CRet"


@pytest.mark.parametrize("url", [
    f"redis://:pa#{SECRET}@127.0.0.1:6390/0",  # '#', '/' or '?' in a password, unencoded
    f"redis://:pa/{SECRET}@127.0.0.1:6390/0",
    f"redis+cluster://:pa/{SECRET}@127.0.0.1:7000",
    f"redis://127.0.0.1:6390/x?password={SECRET}",  # a password option of the query
])
def test_a_password_written_any_way_is_not_in_the_message(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_url(url)
    assert SECRET not in str(info.value)
    for cls in (RedisBackend, RedisClusterBackend):
        try:
            cls(url, FMT)
        except ConfigError as exc:
            assert SECRET not in str(exc)


@pytest.mark.parametrize("url", [f"redis://user:{SECRET}@127.0.0.1:6390/0",
                                 f"redis+cluster://:{SECRET}@127.0.0.1:7000?nosuch=1"])
def test_bad_options_do_not_show_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        backend_from_url(url, FMT, bogus=1)
    assert SECRET not in str(info.value) and "***@" in str(info.value)


def test_a_password_is_not_repeated_in_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        check_url("redis://user:s3cret@h:notaport/0")
    assert "s3cret" not in str(info.value) and "***@h" in str(info.value)


def test_a_config_with_a_bad_url_raises_config_error_naming_storage() -> None:
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, dtype="fp16")
    with pytest.raises(ConfigError, match="^storage: unknown URL scheme"):
        HiCacheConfig(spec=spec, page_size=4, device_pages=4, storage="ftp://x")
