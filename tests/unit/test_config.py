"""One test per validation rule of the connector config (kv_connector_extra_config)."""

from __future__ import annotations

import logging

import pytest

from kvshelf import connector_config as config_module
from kvshelf.connector_config import KVShelfConfig
from kvshelf.roles.store_thread import ABORT_GRACE_S


def test_defaults_match_the_lazy_offload_spec() -> None:
    config = KVShelfConfig.from_extra_config(None)
    assert (config.host, config.port) == ("localhost", 5555)
    assert config.lazy.enabled is False
    assert config.lazy.policy == "EVICTION_AWARE"
    assert config.lazy.threshold == 100
    assert config.lazy.select_count == 10


def test_an_lmcache_line_that_only_turns_lazy_offload_on_gets_lmcache_s_default_policy() -> None:
    # LMCache 0.5.6 runs EVICTION_AWARE for this line; FIFO's threshold of 100 would store
    # nothing for a service with fewer finished requests in its window.
    lazy = KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload": True}).lazy
    assert (lazy.enabled, lazy.policy, lazy.max_delay_ms) == (True, "EVICTION_AWARE", 2000)
    fifo = KVShelfConfig.from_extra_config(
        {"lmcache.mp.lazy_offload": True, "lmcache.mp.lazy_offload_policy": "FIFO"}
    ).lazy
    # FIFO named: exactly as specified, no time-based flush.
    assert (fifo.policy, fifo.threshold, fifo.max_delay_ms) == ("FIFO", 100, None)


def test_the_documented_launch_line_is_accepted() -> None:
    config = KVShelfConfig.from_extra_config(
        {
            "lmcache.mp.host": "localhost",
            "lmcache.mp.port": 5555,
            "lmcache.mp.lazy_offload": True,
            "lmcache.mp.lazy_offload_policy": "FIFO",
            "lmcache.mp.lazy_offload_threshold": 20,
            "lmcache.mp.lazy_offload_select_count": 10,
        }
    )
    assert config.lazy.enabled and config.lazy.threshold == 20 and config.lazy.select_count == 10


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("False", False), ("TRUE", True)])
def test_booleans_accept_the_strings_true_and_false(text: str, expected: bool) -> None:
    config = KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload": text})
    assert config.lazy.enabled is expected


@pytest.mark.parametrize("value", ["yes", 1, 0, "1", [], 2.0])
def test_a_bad_boolean_names_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.lazy_offload\b"):
        KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload": value})


@pytest.mark.parametrize("value", [0, -1, 65536, "http", True, 1.5])
def test_a_bad_port_names_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.port"):
        KVShelfConfig.from_extra_config({"lmcache.mp.port": value})


def test_a_port_given_as_a_string_is_accepted() -> None:
    assert KVShelfConfig.from_extra_config({"lmcache.mp.port": "6000"}).port == 6000


@pytest.mark.parametrize("value", ["", "   ", 5, ["localhost"]])
def test_a_bad_host_names_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.host"):
        KVShelfConfig.from_extra_config({"lmcache.mp.host": value})


@pytest.mark.parametrize(
    "key", ["lmcache.mp.lazy_offload_threshold", "lmcache.mp.lazy_offload_select_count"]
)
@pytest.mark.parametrize("value", [0, -3, 2.5, "ten", True])
def test_threshold_and_select_count_must_be_positive_integers(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        KVShelfConfig.from_extra_config({key: value})


def test_an_unknown_policy_is_rejected_with_the_spec_message() -> None:
    with pytest.raises(ValueError, match=r"^Unknown offload policy: LIFO$"):
        KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload_policy": "LIFO"})


@pytest.mark.parametrize(
    "key",
    [
        "kvshelf.request_timeout_s",
        "kvshelf.reconnect_interval_s",
        "kvshelf.stats_log_interval_s",
        "kvshelf.stop_drain_timeout_s",
    ],
)
@pytest.mark.parametrize("value", [0, -1.0, "soon", float("inf"), False])
def test_timeouts_must_be_positive_numbers(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        KVShelfConfig.from_extra_config({key: value})


def test_the_stop_drain_bound_fits_inside_vllm_s_worker_shutdown_grace() -> None:
    """vLLM sends SIGTERM to a worker still running 5 s after it was told to stop
    (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS): the default drain, and the aborts after it, end
    before that."""
    default = KVShelfConfig.from_extra_config({}).stop_drain_timeout_s
    assert default + ABORT_GRACE_S < 5.0
    given = KVShelfConfig.from_extra_config({"kvshelf.stop_drain_timeout_s": "1.5"})
    assert given.stop_drain_timeout_s == 1.5


def test_an_unknown_kvshelf_key_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"kvshelf\.request_timeout_ms"):
        KVShelfConfig.from_extra_config({"kvshelf.request_timeout_ms": 100})


def test_unknown_lmcache_keys_are_warned_about_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_module, "_warned_keys", set())
    extra = {"lmcache.mp.mp_transfer_mode": "engine_driven", "unrelated.key": 1}
    with caplog.at_level(logging.WARNING, logger="kvshelf.connector_config"):
        KVShelfConfig.from_extra_config(extra)
        KVShelfConfig.from_extra_config(extra)
    warnings = [r for r in caplog.records if "lmcache.mp.mp_transfer_mode" in r.getMessage()]
    assert len(warnings) == 1
    assert not any("unrelated.key" in r.getMessage() for r in caplog.records)


def test_model_identity_keys() -> None:
    default = KVShelfConfig.from_extra_config(None)
    assert (default.model_id, default.weights_digest) == (None, "sampled")
    config = KVShelfConfig.from_extra_config(
        {"kvshelf.model_id": " ckpt-2026-11 ", "kvshelf.weights_digest": "full"}
    )
    assert (config.model_id, config.weights_digest) == ("ckpt-2026-11", "full")
    with pytest.raises(ValueError, match=r"kvshelf\.weights_digest must be one of sampled, full"):
        KVShelfConfig.from_extra_config({"kvshelf.weights_digest": "FULL"})
    with pytest.raises(ValueError, match=r"kvshelf\.model_id must be a non-empty string"):
        KVShelfConfig.from_extra_config({"kvshelf.model_id": ""})
