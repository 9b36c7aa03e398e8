"""The shipped deployment files run commands that exist with flags that parse, and keep the
requirements the arena sets (same user, loopback or keys)."""

from __future__ import annotations

import configparser
import json
import re
import shlex
from pathlib import Path

import pytest

from kvshelf.cli.server import build_parser as server_parser
from kvshelf.cli.stats import build_parser as stats_parser
from kvshelf.server.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def parse_server_flags(flags: list[str]) -> ServerConfig:
    parser = server_parser()
    try:
        return ServerConfig(**vars(parser.parse_args(flags)))
    except SystemExit:
        pytest.fail(f"kvshelf server rejects {flags}")


def test_the_systemd_unit_starts_the_server_with_valid_flags_on_loopback() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(DEPLOY / "kvshelf.service")
    service = unit["Service"]
    command = shlex.split(service["ExecStart"])
    assert command[0].endswith("/kvshelf") and command[1] == "server"
    config = parse_server_flags(command[2:])
    assert config.loopback and config.curve_keys is None
    assert service["KillSignal"] == "SIGTERM" and service["User"]
    assert "PrivateIPC" not in service and "PrivateDevices" not in service
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def containerfile_instruction(name: str) -> str:
    text = (DEPLOY / "Containerfile").read_text()
    (line,) = re.findall(rf"^{name} (.+)$", text, flags=re.MULTILINE)
    return line


def test_the_containerfile_runs_the_server_with_valid_flags_as_a_non_root_user() -> None:
    entrypoint = json.loads(containerfile_instruction("ENTRYPOINT"))
    assert entrypoint == ["kvshelf", "server"]
    config = parse_server_flags(json.loads(containerfile_instruction("CMD")))
    assert config.loopback  # a pod shares loopback with vLLM; other hosts need --curve-keys
    assert containerfile_instruction("USER") == "kvshelf"
    assert containerfile_instruction("STOPSIGNAL") == "SIGTERM"
    health = json.loads(containerfile_instruction("HEALTHCHECK").split(" CMD ", 1)[1])
    assert health[:2] == ["kvshelf", "stats"]
    stats_parser().parse_args(health[2:])
