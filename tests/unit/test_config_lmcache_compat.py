"""lmcache.mp.host in every form LMCache launch lines write it, LMCache keys kvshelf maps, and
kvshelf.curve_keys_dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshelf.connector_config import KVShelfConfig
from kvshelf.curve import ClientCurve, keygen


@pytest.mark.parametrize(
    ("value", "host"),
    [
        ("tcp://localhost", "localhost"),
        ("tcp://127.0.0.1", "127.0.0.1"),
        ("TCP://example.internal", "example.internal"),
        ("localhost", "localhost"),
        (" 10.0.0.7 ", "10.0.0.7"),
        ("[::1]", "::1"),
        ("tcp://[::1]", "::1"),
        ("::1", "::1"),
        ("tcp://[fd00::5]", "fd00::5"),
    ],
)
def test_a_host_is_accepted_with_or_without_tcp_scheme_and_as_ipv6_literal(
    value: str, host: str
) -> None:
    assert KVShelfConfig.from_extra_config({"lmcache.mp.host": value}).host == host


@pytest.mark.parametrize(
    "value", ["ipc:///tmp/kvshelf", "http://localhost", "udp://[::1]", "inproc://x", "ws://h"]
)
def test_any_other_scheme_is_a_value_error_naming_the_key(value: str) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.host.*tcp"):
        KVShelfConfig.from_extra_config({"lmcache.mp.host": value})


@pytest.mark.parametrize(
    "value", ["tcp://localhost:5555", "localhost:5555", "[::1", "tcp://[nothost]", "tcp://", "a/b"]
)
def test_a_port_in_the_host_or_a_broken_literal_is_a_value_error_naming_the_key(
    value: str,
) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.host"):
        KVShelfConfig.from_extra_config({"lmcache.mp.host": value})


@pytest.mark.parametrize(("seconds", "ms"), [(30, 30000), ("1.5", 1500), (0.0004, 1), (0, None)])
def test_lmcache_max_deferral_seconds_is_the_bounded_delay_flush(
    seconds: object, ms: int | None
) -> None:
    config = KVShelfConfig.from_extra_config(
        {"lmcache.mp.lazy_offload_max_deferral_seconds": seconds}
    )
    assert config.lazy.max_delay_ms == ms


def test_lmcache_heartbeat_interval_is_the_reconnect_interval() -> None:
    config = KVShelfConfig.from_extra_config({"lmcache.mp.heartbeat_interval": "0.5"})
    assert config.reconnect_interval_s == 0.5


@pytest.mark.parametrize(
    ("kvshelf_key", "lmcache_key", "value"),
    [
        ("lmcache.mp.lazy_offload_max_delay_ms", "lmcache.mp.lazy_offload_max_deferral_seconds", 1),
        ("kvshelf.reconnect_interval_s", "lmcache.mp.heartbeat_interval", 1.0),
    ],
)
def test_both_names_of_one_setting_is_an_error_naming_both(
    kvshelf_key: str, lmcache_key: str, value: object
) -> None:
    with pytest.raises(ValueError, match=rf"{kvshelf_key}.*{lmcache_key}"):
        KVShelfConfig.from_extra_config({kvshelf_key: value, lmcache_key: value})


@pytest.mark.parametrize("value", [-1, "soon", True, float("inf")])
def test_a_bad_max_deferral_names_the_lmcache_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.lazy_offload_max_deferral_seconds"):
        KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload_max_deferral_seconds": value})


def test_the_eviction_aware_default_delay_applies_when_neither_name_is_set() -> None:
    config = KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"})
    assert config.lazy.max_delay_ms == 2000


def test_curve_keys_dir_loads_the_client_keys(tmp_path: Path) -> None:
    keygen(tmp_path / "keys")
    config = KVShelfConfig.from_extra_config({"kvshelf.curve_keys_dir": str(tmp_path / "keys")})
    assert config.curve == ClientCurve.load(tmp_path / "keys")
    assert KVShelfConfig.from_extra_config(None).curve is None


@pytest.mark.parametrize("value", ["/nonexistent", "", 5])
def test_an_unusable_curve_keys_dir_names_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"kvshelf\.curve_keys_dir"):
        KVShelfConfig.from_extra_config({"kvshelf.curve_keys_dir": value})
