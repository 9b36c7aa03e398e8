"""The connector's configuration: one typed object, built once from ``kv_connector_extra_config``.

Keys follow the ``lmcache.mp.*`` names that the lazy offload documentation uses, so an
operator can take a launch line written for LMCache's MP connector and point it at kvshelf.
kvshelf's own tuning knobs live under ``kvshelf.*``. Every value is validated here, with an
error that names the key; nothing is parsed again on the hot path.

This module is the only place that names a key or validates a value: the rest of kvshelf
receives typed values (``KVShelfConfig``, ``LazyOffloadConfig``) and, where it checks an
argument, checks it with the value readers of :mod:`kvshelf.config_values`. It must not
import ``kvshelf.lazy`` (lazy offload imports this module, never the other way round).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvshelf.config_values import (
    finite_float,
    parse_bool,
    parse_int,
    parse_positive_float,
    parse_str,
    require_positive_int,
)
from kvshelf.curve import ClientCurve, CurveKeyError

logger = logging.getLogger(__name__)

T = TypeVar("T")

HOST = "lmcache.mp.host"
PORT = "lmcache.mp.port"
LAZY_OFFLOAD = "lmcache.mp.lazy_offload"
LAZY_OFFLOAD_POLICY = "lmcache.mp.lazy_offload_policy"
LAZY_OFFLOAD_THRESHOLD = "lmcache.mp.lazy_offload_threshold"
LAZY_OFFLOAD_SELECT_COUNT = "lmcache.mp.lazy_offload_select_count"
LAZY_OFFLOAD_MAX_DELAY_MS = "lmcache.mp.lazy_offload_max_delay_ms"
LAZY_OFFLOAD_EVICTION_WINDOW = "lmcache.mp.lazy_offload_eviction_window"
# The values lmcache.mp.lazy_offload_policy accepts (matched exactly): FIFO is the specified
# policy, EVICTION_AWARE kvshelf's own. kvshelf.lazy's policy registry maps each to a class.
FIFO_POLICY = "FIFO"
EVICTION_AWARE_POLICY = "EVICTION_AWARE"
LAZY_OFFLOAD_POLICIES = (FIFO_POLICY, EVICTION_AWARE_POLICY)
# The eviction-aware policy flushes a finished request's blocks after this long by default;
# FIFO has no default delay, so that it behaves exactly as specified.
EVICTION_AWARE_DEFAULT_MAX_DELAY_MS = 2000
REQUEST_TIMEOUT_S = "kvshelf.request_timeout_s"
RECONNECT_INTERVAL_S = "kvshelf.reconnect_interval_s"
STATS_LOG_INTERVAL_S = "kvshelf.stats_log_interval_s"
# How long a stopping worker keeps copying and committing its queued stores (docs/safety.md).
STOP_DRAIN_TIMEOUT_S = "kvshelf.stop_drain_timeout_s"
# The model identity (kvshelf.roles.fingerprint): kvshelf.model_id names the weights (e.g. a
# checkpoint revision) instead of digesting them; kvshelf.weights_digest picks the digest.
MODEL_ID = "kvshelf.model_id"
WEIGHTS_DIGEST = "kvshelf.weights_digest"
WEIGHTS_DIGEST_SAMPLED = "sampled"
WEIGHTS_DIGEST_FULL = "full"
WEIGHTS_DIGEST_MODES = (WEIGHTS_DIGEST_SAMPLED, WEIGHTS_DIGEST_FULL)

CURVE_KEYS_DIR = "kvshelf.curve_keys_dir"

# vLLM's KVTransferConfig.kv_role (not an extra config key): what this engine does with kvshelf.
# A producer (disaggregated prefill's prefill engine) stores and never looks up or loads; a
# consumer (its decode engine) looks up and loads and never stores; kv_both does both.
KV_ROLE = "kv_role"
KV_PRODUCER = "kv_producer"
KV_CONSUMER = "kv_consumer"
KV_BOTH = "kv_both"
KV_ROLES = (KV_PRODUCER, KV_CONSUMER, KV_BOTH)

# LMCache MP connector keys with a kvshelf equivalent: each is read as the key it maps to
# (docs/configuration.md has the table). Setting both names of one setting is an error.
# lmcache.mp.mq_timeout is not one: a kvshelf call blocks its caller until the timeout, and
# LMCache's 300 s default would stall vLLM's step on a dead server; it is warned about.
LMCACHE_HEARTBEAT_INTERVAL = "lmcache.mp.heartbeat_interval"
LMCACHE_LAZY_OFFLOAD_MAX_DEFERRAL_SECONDS = "lmcache.mp.lazy_offload_max_deferral_seconds"
# The one URL scheme lmcache.mp.host may carry (LMCache writes "tcp://localhost").
HOST_SCHEME = "tcp://"

LMCACHE_PREFIX = "lmcache.mp."
KVSHELF_PREFIX = "kvshelf."

# Both connector roles parse the same config; an ignored key is worth one warning per process.
_warned_keys: set[str] = set()


def parse_weights_digest(key: str, value: Any) -> str:
    """One of :data:`WEIGHTS_DIGEST_MODES`, matched exactly."""
    if value not in WEIGHTS_DIGEST_MODES:
        raise ValueError(f"{key} must be one of {', '.join(WEIGHTS_DIGEST_MODES)}, got {value!r}")
    return str(value)


def parse_kv_role(value: Any) -> str:
    """One of :data:`KV_ROLES`, matched exactly; None (no role given) is ``kv_both``."""
    if value is None:
        return KV_BOTH
    if value not in KV_ROLES:
        raise ValueError(f"{KV_ROLE} must be one of {', '.join(KV_ROLES)}, got {value!r}")
    return str(value)


def parse_host(key: str, value: Any) -> str:
    """Accept ``HOST``, ``tcp://HOST`` or an IPv6 literal (``[::1]``, ``tcp://[::1]``, ``::1``).

    Returns the bare host (brackets removed); the client adds ZeroMQ's ``tcp://`` and brackets.
    A port belongs in ``lmcache.mp.port``, and any scheme but ``tcp://`` is refused: kvshelf
    only speaks TCP.
    """
    host = parse_str(key, value)
    if host.lower().startswith(HOST_SCHEME):
        host = host[len(HOST_SCHEME) :]
    elif "://" in host:
        raise ValueError(
            f"{key} must be HOST or tcp://HOST (kvshelf speaks only tcp), got {value!r}"
        )
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{key}: an IPv6 literal must be written [ADDRESS], got {value!r}")
        host = host[1:-1]
        _require_ipv6(key, host, value)
    elif ":" in host:
        _require_ipv6(key, host, value)
    if not host or "/" in host or any(c.isspace() for c in host):
        raise ValueError(f"{key} must be a host name or address, got {value!r}")
    return host


def _require_ipv6(key: str, host: str, value: Any) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(
            f"{key} must be a host without a port (set the port with {PORT}), got {value!r}"
        ) from None


def parse_deferral_seconds_as_ms(key: str, value: Any) -> int | None:
    """LMCache's deferral bound in seconds (0 turns it off) as kvshelf's delay in milliseconds."""
    seconds = finite_float(key, value, "a number of seconds >= 0")
    if seconds < 0:
        raise ValueError(f"{key} must be a number of seconds >= 0, got {value!r}")
    return max(1, round(seconds * 1000)) if seconds else None


def parse_curve_keys(key: str, value: Any) -> ClientCurve:
    """A ``kvshelf keygen`` folder's client keys; a folder that cannot be used names the key."""
    try:
        return ClientCurve.load(parse_str(key, value))
    except CurveKeyError as exc:
        raise ValueError(f"{key}: {exc}") from None


@dataclass(frozen=True)
class LazyOffloadConfig:
    """Lazy offload settings, from ``kv_connector_extra_config``.

    ``enabled`` is the connector's switch (``lmcache.mp.lazy_offload``): the offloader is only
    built when it is set, and does not read it.
    """

    enabled: bool = False
    # LMCache 0.5.6's default (its #4847): an LMCache launch line that only turns lazy offload on
    # gets the same policy here. FIFO's threshold of 100 never fires for a service with fewer
    # finished requests in its window, so it stays opt-in, exactly as specified when named.
    policy: str = EVICTION_AWARE_POLICY
    threshold: int = 100
    select_count: int = 10
    # None: no time-based flush. FIFO then behaves exactly as the specification describes.
    max_delay_ms: int | None = None
    # Blocks at the head of vLLM's free queue the EVICTION_AWARE policy inspects per step;
    # None lets the connector size it from vLLM's step budget.
    eviction_window: int | None = None

    def validate(self) -> None:
        """Raise ValueError, naming the offending key, for a setting lazy offload cannot use."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{LAZY_OFFLOAD} must be true or false, got {self.enabled!r}")
        if not isinstance(self.policy, str):
            raise ValueError(f"{LAZY_OFFLOAD_POLICY} must be a string, got {self.policy!r}")
        if self.policy not in LAZY_OFFLOAD_POLICIES:
            raise ValueError(f"Unknown offload policy: {self.policy}")
        require_positive_int(LAZY_OFFLOAD_THRESHOLD, self.threshold)
        require_positive_int(LAZY_OFFLOAD_SELECT_COUNT, self.select_count)
        if self.max_delay_ms is not None:
            require_positive_int(LAZY_OFFLOAD_MAX_DELAY_MS, self.max_delay_ms)
        if self.eviction_window is not None:
            require_positive_int(LAZY_OFFLOAD_EVICTION_WINDOW, self.eviction_window)


@dataclass(frozen=True)
class KVShelfConfig:
    """Everything the connector reads from ``kv_connector_extra_config``.

    Build it with :meth:`from_extra_config`; the constructor itself does not validate.
    """

    host: str = "localhost"
    port: int = 5555
    request_timeout_s: float = 1.0
    reconnect_interval_s: float = 2.0
    stats_log_interval_s: float = 10.0
    # A stopping worker commits its queued stores for this long, then aborts the rest. vLLM
    # waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s by default) for a stopped worker to exit
    # before it sends SIGTERM, which ends the worker at once: 3 s, plus the aborts' round trips
    # (kvshelf.roles.store_thread.ABORT_GRACE_S, 1 s), ends within it.
    stop_drain_timeout_s: float = 3.0
    # None: the weights are digested (weights_digest) into the model identity.
    model_id: str | None = None
    weights_digest: str = WEIGHTS_DIGEST_SAMPLED
    # CURVE keys for a server started with --curve-keys; None talks without authentication.
    curve: ClientCurve | None = None
    lazy: LazyOffloadConfig = field(default_factory=LazyOffloadConfig)
    # vLLM's kv_role (KV_ROLES); a consumer never stores, so its lazy offload is off.
    role: str = KV_BOTH

    @property
    def looks_up(self) -> bool:
        """Whether this engine looks up and loads (every role but the producer)."""
        return self.role != KV_PRODUCER

    @property
    def stores(self) -> bool:
        """Whether this engine stores (every role but the consumer)."""
        return self.role != KV_CONSUMER

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, kv_role: Any = KV_BOTH
    ) -> KVShelfConfig:
        """Validate ``kv_connector_extra_config`` and vLLM's ``kv_role``, and build the config.

        Args:
            extra: the ``kv_connector_extra_config`` mapping (may be None).
            kv_role: ``KVTransferConfig.kv_role`` (None: ``kv_both``).

        Returns:
            The validated configuration.

        Raises:
            ValueError: a key has a bad value; the message names the key.
        """
        role = parse_kv_role(kv_role)
        extra = dict(extra or {})
        reader = _KeyReader(extra)
        default = cls()
        default_lazy = LazyOffloadConfig()
        policy = reader.get(LAZY_OFFLOAD_POLICY, default_lazy.policy, parse_str)
        default_delay = (
            EVICTION_AWARE_DEFAULT_MAX_DELAY_MS if policy == EVICTION_AWARE_POLICY else None
        )
        lazy = LazyOffloadConfig(
            enabled=reader.get(LAZY_OFFLOAD, default_lazy.enabled, parse_bool),
            policy=policy,
            threshold=reader.get(
                LAZY_OFFLOAD_THRESHOLD,
                default_lazy.threshold,
                lambda k, v: parse_int(k, v, minimum=1),
            ),
            select_count=reader.get(
                LAZY_OFFLOAD_SELECT_COUNT,
                default_lazy.select_count,
                lambda k, v: parse_int(k, v, minimum=1),
            ),
            max_delay_ms=reader.get_either(
                LAZY_OFFLOAD_MAX_DELAY_MS,
                lambda k, v: parse_int(k, v, minimum=1),
                LMCACHE_LAZY_OFFLOAD_MAX_DEFERRAL_SECONDS,
                parse_deferral_seconds_as_ms,
                default_delay,
            ),
            eviction_window=reader.get(
                LAZY_OFFLOAD_EVICTION_WINDOW, None, lambda k, v: parse_int(k, v, minimum=1)
            ),
        )
        config = cls(
            host=reader.get(HOST, default.host, parse_host),
            port=reader.get(
                PORT, default.port, lambda k, v: parse_int(k, v, minimum=1, maximum=65535)
            ),
            request_timeout_s=reader.get(
                REQUEST_TIMEOUT_S, default.request_timeout_s, parse_positive_float
            ),
            reconnect_interval_s=reader.get_either(
                RECONNECT_INTERVAL_S,
                parse_positive_float,
                LMCACHE_HEARTBEAT_INTERVAL,
                parse_positive_float,
                default.reconnect_interval_s,
            ),
            stats_log_interval_s=reader.get(
                STATS_LOG_INTERVAL_S, default.stats_log_interval_s, parse_positive_float
            ),
            stop_drain_timeout_s=reader.get(
                STOP_DRAIN_TIMEOUT_S, default.stop_drain_timeout_s, parse_positive_float
            ),
            model_id=reader.get(MODEL_ID, None, parse_str),
            weights_digest=reader.get(WEIGHTS_DIGEST, default.weights_digest, parse_weights_digest),
            curve=reader.get(CURVE_KEYS_DIR, None, parse_curve_keys),
            lazy=lazy,
            role=role,
        )
        lazy.validate()
        reader.warn_unknown()
        if role == KV_CONSUMER and lazy.enabled:
            logger.info("%s is off in a %s engine, which never stores", LAZY_OFFLOAD, role)
            config = dataclasses.replace(config, lazy=dataclasses.replace(lazy, enabled=False))
        elif role == KV_PRODUCER and lazy.enabled:
            # A producer's answer sends the request on to its consumer; lazy offload stores the
            # request only after that answer, so the consumer may look up before the store.
            logger.warning(
                "%s in a %s engine stores each request after it answered: a consumer asked "
                "right after may miss and recompute the prompt; turn it off for "
                "disaggregated prefill",
                LAZY_OFFLOAD,
                role,
            )
        return config


class _KeyReader:
    """Reads keys out of the extra config and remembers which ones it used."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self._extra = extra
        self._used: set[str] = set()

    def get(self, key: str, default: T, parse: Callable[[str, Any], T]) -> T:
        self._used.add(key)
        if key not in self._extra or self._extra[key] is None:
            return default
        return parse(key, self._extra[key])

    def get_either(
        self,
        key: str,
        parse: Callable[[str, Any], T],
        lmcache_key: str,
        parse_lmcache: Callable[[str, Any], T],
        default: T,
    ) -> T:
        """Read a setting that has a kvshelf name and an LMCache name; both set is an error."""
        given = [k for k in (key, lmcache_key) if self._extra.get(k) is not None]
        if len(given) == 2:
            raise ValueError(f"{key} and {lmcache_key} set the same thing: set only one")
        if lmcache_key in given:
            self._used.add(key)
            return self.get(lmcache_key, default, parse_lmcache)
        self._used.add(lmcache_key)
        return self.get(key, default, parse)

    def warn_unknown(self) -> None:
        for key in sorted(self._extra):
            if key in self._used:
                continue
            if key.startswith(LMCACHE_PREFIX):
                if key in _warned_keys:
                    continue
                _warned_keys.add(key)
                logger.warning(
                    "kv_connector_extra_config key %s is not supported by kvshelf and is ignored",
                    key,
                )
            elif key.startswith(KVSHELF_PREFIX):
                raise ValueError(f"unknown kvshelf config key {key}")
