"""The server's configuration: one frozen :class:`ServerConfig`, and its checks against this host.

The command line (:mod:`kvshelf.cli.server`) builds the config once from its flags; everything
after that (the app, the tiers) reads it and never sees ``argparse``. A new tier adds its
fields here and its flags there. A :class:`ConfigError` names the flag at fault, so the
command line reports it as argparse reports a bad value.

Must not import torch or vLLM.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from kvshelf.curve import CurveKeyError, ServerCurve
from kvshelf.platform.shm import SHM_DIR
from kvshelf.server.limits import (
    DEFAULT_MAX_LEASE_UNITS_PER_POOL,
    DEFAULT_MAX_POOLS,
    IndexLimits,
)
from kvshelf.server.policy import DEFAULT_POLICY, DEFAULT_POLICY_ABOVE_DISK, POLICIES
from kvshelf.server.tenants import TenantQuota

GIB = 1 << 30
# The smallest arena: one 4 KiB memory page.
MIN_ARENA_BYTES = 4096


class ConfigError(Exception):
    """A setting this host cannot honour.

    Args:
        flag: the command-line flag of the setting, e.g. ``--l1-size-gb``.
        message: why, e.g. ``0.5 GiB does not fit in /dev/shm (0.25 GiB)``.
    """

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag
        self.message = message


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``kvshelf server`` is told; the defaults are the flags' defaults.

    Attributes:
        host: address to bind.
        port: TCP port to bind; also part of the arena's name.
        l1_size_gb: size of the shared-memory arena in GiB.
        eviction_watermark: in (0, 1]; see :class:`~kvshelf.server.tiers.arena.ArenaTier`.
        eviction_policy: which pages of a pool L1 evicts first, a name in
            :data:`kvshelf.server.policy.POLICIES`; None (the default) picks
            :data:`~kvshelf.server.policy.DEFAULT_POLICY`, or
            :data:`~kvshelf.server.policy.DEFAULT_POLICY_ABOVE_DISK` with a disk tier
            (``l1_policy`` is the one in force).
        lease_timeout_s: lifetime of a reservation or a lock before it is reclaimed.
        prefault: allocate the whole arena at start and zero it in the background.
        log_level: the logging level name.
        max_pools: the most pools at once (:mod:`kvshelf.server.limits`).
        max_lease_units_per_pool: the most reservation keys and locked pages live in one pool.
        stats_log_interval_s: seconds between the INFO lines of key counters.
        curve_keys: a ``kvshelf keygen`` folder: serve over ZeroMQ CURVE, accepting only the
            client keys of its allow-list. None: no authentication.
        allow_unauthenticated: bind a non-loopback address without ``curve_keys``.
        metrics_port: TCP port of the Prometheus ``/metrics`` and ``/healthz`` endpoint, bound
            to ``host``; None (the default) serves none.
        l2_disk_path: the disk tier's directory; None: no disk tier.
        l2_disk_size_gb: the disk tier's budget in GiB (with ``l2_disk_path``).
        l2_disk_eviction_policy: which objects the disk tier evicts first (a name in
            :data:`kvshelf.server.policy.POLICIES`).
        l3_redis_url: the shared Redis tier's URL; None: no Redis tier.
        l3_secret_file: a file holding the secret that authenticates Redis values (keyed BLAKE3).
        l3_ttl_s: the Redis keys' time to live; None: until Redis evicts them.
        adopt: adopt the arena of a dead server on this port (``kvshelf.server.adoption``);
            False removes it and starts empty.
        keep_arena_on_exit: leave the arena in /dev/shm at a clean stop, for the next server
            on the port to adopt.
        local_socket: also serve clients on this node over an abstract Unix socket
            (:mod:`kvshelf.server.local_socket`); registrations tell clients its name.
        tenant_quota: the most L1 bytes one tenant holds in a pool
            (:mod:`kvshelf.server.tenants`); None: no hard cap, only the soft share.
    """

    host: str = "127.0.0.1"
    port: int = 5555
    l1_size_gb: float = 4.0
    eviction_watermark: float = 0.95
    eviction_policy: str | None = None
    lease_timeout_s: float = 30.0
    prefault: bool = True
    log_level: str = "INFO"
    max_pools: int = DEFAULT_MAX_POOLS
    max_lease_units_per_pool: int = DEFAULT_MAX_LEASE_UNITS_PER_POOL
    stats_log_interval_s: float = 60.0
    curve_keys: str | None = None
    allow_unauthenticated: bool = False
    metrics_port: int | None = None
    l2_disk_path: str | None = None
    l2_disk_size_gb: float | None = None
    l2_disk_eviction_policy: str = DEFAULT_POLICY
    l3_redis_url: str | None = None
    l3_secret_file: str | None = None
    l3_ttl_s: float | None = None
    adopt: bool = True
    keep_arena_on_exit: bool = False
    local_socket: bool = True
    tenant_quota: TenantQuota | None = None

    @property
    def l1_policy(self) -> str:
        """L1's eviction policy: ``eviction_policy``, or its default for this disk tier."""
        if self.eviction_policy is not None:
            return self.eviction_policy
        return DEFAULT_POLICY if self.l2_disk_path is None else DEFAULT_POLICY_ABOVE_DISK

    @property
    def limits(self) -> IndexLimits:
        """The bounds the index enforces."""
        return IndexLimits(
            max_pools=self.max_pools,
            max_lease_units_per_pool=self.max_lease_units_per_pool,
            policy_bytes_per_page=POLICIES[self.l1_policy].extra_bytes_per_page,
        )

    def worst_case_index_bytes(self) -> int:
        """The most memory the server's index can hold beyond the arena (see limits)."""
        return self.limits.index_bytes(self.arena_bytes)

    @property
    def arena_bytes(self) -> int:
        """The arena's size in bytes."""
        return int(self.l1_size_gb * GIB)

    @property
    def endpoint(self) -> str:
        """The ZMQ endpoint to bind."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """Whether the bind address is a loopback address (or resolves to one)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            try:
                return ipaddress.ip_address(socket.gethostbyname(self.host)).is_loopback
            except (OSError, ValueError):
                return False

    def check_security(self) -> ServerCurve | None:
        """Load the CURVE keys, and refuse an open non-loopback bind.

        Returns:
            The server's keys, or None when it runs without authentication.

        Raises:
            ConfigError: the keys folder cannot be used, or the bind address is not loopback
                while there are no keys and ``allow_unauthenticated`` is off.
        """
        if self.curve_keys is not None:
            try:
                return ServerCurve.load(self.curve_keys)
            except CurveKeyError as exc:
                raise ConfigError("--curve-keys", str(exc)) from None
        if not self.loopback and not self.allow_unauthenticated:
            raise ConfigError(
                "--host",
                f"refusing to bind the non-loopback address {self.host} without "
                "authentication: any host that reaches the port could read and overwrite the "
                "cache. Pass --curve-keys DIR (ZeroMQ CURVE with an allow-list of client keys; "
                "create DIR with kvshelf keygen DIR), or --allow-unauthenticated to bind it "
                "anyway",
            )
        return None

    @property
    def l2_disk_bytes(self) -> int:
        """The disk tier's budget in bytes (0 without one)."""
        return int((self.l2_disk_size_gb or 0) * GIB)

    def check_host(self, meminfo: str = "/proc/meminfo") -> None:
        """Check that this host can hold the arena and the disk tier's directory.

        Args:
            meminfo: the ``/proc/meminfo`` file to read the available memory from.

        Raises:
            ConfigError: the arena does not fit in ``/dev/shm``, or it is to be pre-faulted
                and does not fit in the available memory; or the disk tier's directory
                cannot be created or written.
        """
        if self.l2_disk_path is not None:
            _check_directory(self.l2_disk_path)
        self.check_redis()
        shm = os.statvfs(SHM_DIR)
        shm_bytes = shm.f_blocks * shm.f_frsize
        if self.arena_bytes > shm_bytes:
            raise ConfigError(
                "--l1-size-gb",
                f"{self.l1_size_gb} GiB does not fit in {SHM_DIR} ({shm_bytes / GIB:.2f} GiB)",
            )
        available = available_memory_bytes(meminfo)
        if self.prefault and available is not None and self.arena_bytes > available:
            raise ConfigError(
                "--l1-size-gb",
                f"{self.l1_size_gb} GiB cannot be pre-faulted: only {available / GIB:.2f} GiB of "
                "memory is available; lower --l1-size-gb or pass --no-prefault",
            )

    def check_redis(self) -> None:
        """Check the Redis tier's flags: a Redis URL, a readable secret; none without a URL.

        Raises:
            ConfigError: naming the flag at fault.
        """
        if self.l3_redis_url is None:
            for flag, value in (
                ("--l3-secret-file", self.l3_secret_file),
                ("--l3-ttl-s", self.l3_ttl_s),
            ):
                if value is not None:
                    raise ConfigError(flag, "needs --l3-redis-url")
            return
        try:
            # Imported here: the redis package is needed only with a Redis tier.
            from kvshelf.server.tiers.redis_link import check_url
        except ImportError as exc:
            raise ConfigError(
                "--l3-redis-url", f"needs the redis package ({exc}): pip install 'kvshelf[redis]'"
            ) from None

        problem = check_url(self.l3_redis_url)
        if problem is not None:
            raise ConfigError("--l3-redis-url", problem)
        self.l3_secret()

    def l3_secret(self) -> bytes | None:
        """The Redis tier's secret, from which the values' tag key is derived (the secret file's
        bytes, without a final newline).

        Raises:
            ConfigError: the file cannot be read or is empty.
        """
        if self.l3_secret_file is None:
            return None
        try:
            with open(self.l3_secret_file, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(
                "--l3-secret-file", f"cannot read {self.l3_secret_file}: {exc.strerror}"
            ) from None
        if not secret:
            raise ConfigError("--l3-secret-file", f"{self.l3_secret_file} is empty")
        return secret


def _check_directory(path: str) -> None:
    """Create the disk tier's directory (owner-only) if needed and check it is writable."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--l2-disk-path", f"cannot create {path}: {exc.strerror}") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("--l2-disk-path", f"{path} is not a writable directory")


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Return the memory the kernel estimates can be allocated without swapping.

    Args:
        meminfo: the ``/proc/meminfo`` file to read.

    Returns:
        ``MemAvailable`` in bytes, or None where it cannot be read.
    """
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
