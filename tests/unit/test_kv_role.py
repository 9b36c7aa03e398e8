"""vLLM's kv_role in kvshelf's typed config: what each role does, and a bad role's error."""

from __future__ import annotations

import logging

import pytest

from kvshelf.connector_config import KVShelfConfig


@pytest.mark.parametrize(
    ("role", "looks_up", "stores"),
    [("kv_producer", False, True), ("kv_consumer", True, False), ("kv_both", True, True)],
)
def test_each_role_says_whether_it_looks_up_and_stores(
    role: str, looks_up: bool, stores: bool
) -> None:
    config = KVShelfConfig.from_extra_config({}, role)
    assert (config.role, config.looks_up, config.stores) == (role, looks_up, stores)


def test_no_role_is_kv_both() -> None:
    assert KVShelfConfig.from_extra_config({}, None).role == "kv_both"
    assert KVShelfConfig.from_extra_config({}).role == "kv_both"


@pytest.mark.parametrize("role", ["kv_prefill", "KV_PRODUCER", "", 1])
def test_an_unknown_role_is_a_value_error_naming_the_key(role: object) -> None:
    with pytest.raises(ValueError, match=r"^kv_role must be one of kv_producer, kv_consumer"):
        KVShelfConfig.from_extra_config({}, role)


def test_a_consumer_never_offloads_lazily() -> None:
    extra = {"lmcache.mp.lazy_offload": True}
    assert not KVShelfConfig.from_extra_config(extra, "kv_consumer").lazy.enabled
    assert KVShelfConfig.from_extra_config(extra, "kv_producer").lazy.enabled


def test_a_producer_with_lazy_offload_is_warned_that_its_stores_come_after_its_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvshelf.connector_config"):
        config = KVShelfConfig.from_extra_config({"lmcache.mp.lazy_offload": True}, "kv_producer")
        KVShelfConfig.from_extra_config({}, "kv_producer")
    assert config.lazy.enabled  # honoured, but said
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "lmcache.mp.lazy_offload" in warning.getMessage()
    assert "kv_producer" in warning.getMessage()
