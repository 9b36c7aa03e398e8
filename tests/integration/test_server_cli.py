"""The server command line: flag validation, help, loopback warning and clean signal shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvshelf.cli.server import main
from kvshelf.platform.shm import SHM_DIR
from kvshelf.server.config import GIB, available_memory_bytes
from testbed.server import ServerProcess, free_port


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "0"),
        ("--port", "70000"),
        ("--port", "http"),
        ("--l1-size-gb", "0"),
        ("--l1-size-gb", "-1"),
        ("--l1-size-gb", "nan"),
        ("--l1-size-gb", "lots"),
        ("--l1-size-gb", "1e-9"),
        ("--l1-size-gb", "100000"),
        ("--eviction-watermark", "0"),
        ("--eviction-watermark", "1.01"),
        ("--eviction-watermark", "inf"),
        ("--eviction-policy", "fifo"),
        ("--l2-disk-eviction-policy", "arc"),
        ("--lease-timeout-s", "0"),
        ("--lease-timeout-s", "-5"),
        ("--log-level", "LOUD"),
    ],
)
def test_bad_flag_values_exit_non_zero_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([flag, value]) != 0
    assert flag in capsys.readouterr().err


def test_bad_flag_from_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvshelf", "server", "--lease-timeout-s", "zero"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2 and "--lease-timeout-s" in result.stderr


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--l1-size-gb",
        "--eviction-watermark",
        "--eviction-policy",
        "--l2-disk-eviction-policy",
        "--lease-timeout-s",
        "--prefault",
        "--no-prefault",
        "--log-level",
        "--stats-log-interval-s",
        "--curve-keys",
        "--allow-unauthenticated",
    ):
        assert flag in out


@pytest.mark.parametrize("stop", ["terminate", "interrupt"])
def test_signals_shut_down_cleanly_and_unlink_the_arena(stop: str) -> None:
    server = ServerProcess()
    with server:
        shm_path = server.shm_path
        assert os.path.exists(shm_path)
        assert getattr(server, stop)() == 0
    assert not os.path.exists(shm_path)
    assert not [
        name for name in os.listdir("/dev/shm") if name.startswith(f"kvshelf-{server.port}-")
    ]
    log = server.log()
    assert f"listening on tcp://127.0.0.1:{server.port}" in log and shm_path in log
    assert "kvshelf server stopped" in log


def test_non_loopback_bind_logs_a_loud_warning() -> None:
    # Refused without --allow-unauthenticated (or keys): see test_server_curve.py.
    server = ServerProcess(extra_args=["--host", "0.0.0.0", "--allow-unauthenticated"])
    with server:
        pass
    assert "WARNING" in server.log() and "NON-LOOPBACK" in server.log()


def test_port_in_use_fails_and_leaves_no_arena() -> None:
    port = free_port()
    with ServerProcess(port=port):
        result = subprocess.run(
            [sys.executable, "-m", "kvshelf.server", "--port", str(port), "--l1-size-gb", "0.01"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 1 and "cannot bind" in result.stderr
        assert len([n for n in os.listdir("/dev/shm") if n.startswith(f"kvshelf-{port}-")]) == 1


def test_server_and_client_import_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, kvshelf.protocol, kvshelf.server.app, kvshelf.cli.server, kvshelf.cli.stats,"
        " kvshelf.client, testbed.server;"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def shmem_resident_bytes(pid: int) -> int:
    """Shared-memory bytes a process has mapped and faulted in (``RssShmem``)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))


def test_the_arena_is_allocated_at_start_and_zeroed_in_the_background() -> None:
    with ServerProcess(l1_size_gb=1 / 16) as server:
        # Allocated before the server answers; zeroed (faulted in) by its thread soon after.
        # Beyond the pages, the page table's trailer has only its header's page allocated
        # (docs/crash-recovery.md): the table grows with the pages that exist.
        assert os.stat(server.shm_path).st_blocks * 512 == GIB // 16 + 4096
        deadline = time.monotonic() + 30
        while shmem_resident_bytes(server.pid) < GIB // 16:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.01)
        assert server.terminate() == 0
    log = server.log()
    assert f"allocated the arena: {GIB // 16} bytes in" in log
    assert f"pre-faulted arena {server.shm_path}: 0.062 GiB in" in log


def test_no_prefault_leaves_the_arena_unallocated() -> None:
    with ServerProcess(l1_size_gb=1 / 16, extra_args=["--no-prefault"]) as server:
        # Only the page table header's page (docs/crash-recovery.md); no page of the arena.
        assert os.stat(server.shm_path).st_blocks * 512 == 4096
        assert shmem_resident_bytes(server.pid) == 0
    assert "allocated the arena" not in server.log()


def test_available_memory_is_read_from_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemAvailable:   1024 kB\n")
    assert available_memory_bytes(str(meminfo)) == 1024 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_memory_bytes(str(meminfo)) is None
    assert available_memory_bytes(str(tmp_path / "missing")) is None
    assert available_memory_bytes() is not None  # this is Linux


def test_an_arena_larger_than_free_memory_fails_at_start_naming_the_flag() -> None:
    # An arena that fits in /dev/shm but not in memory: tmpfs may be sized above free RAM.
    shm = os.statvfs(SHM_DIR)
    shm_bytes = shm.f_blocks * shm.f_frsize
    available = available_memory_bytes()
    assert available is not None
    if shm_bytes <= available + 64 * 2**20:
        pytest.skip(f"{SHM_DIR} is no larger than the available memory")
    size_gb = f"{(available + shm_bytes) / 2 / GIB:.3f}"
    command = [sys.executable, "-m", "kvshelf.server", "--port", str(free_port())]
    result = subprocess.run(
        [*command, "--l1-size-gb", size_gb], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "--l1-size-gb" in result.stderr and "--no-prefault" in result.stderr


def test_stats_report_the_background_zeroing_until_it_ends() -> None:
    with ServerProcess(l1_size_gb=0.25) as server:
        server.wait_zeroed(timeout_s=60.0)
        with server.client() as client:
            assert client.stats()["arena_zeroing"] == 0
    with (
        ServerProcess(l1_size_gb=0.0625, extra_args=("--no-prefault",)) as server,
        server.client() as client,
    ):
        assert client.stats()["arena_zeroing"] == 0
