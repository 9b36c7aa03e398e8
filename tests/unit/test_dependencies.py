"""Every third-party module that kvshelf, its test bed or its benchmarks import is declared in
pyproject.toml (the base dependencies or an extra), so nothing arrives only because vLLM happens
to depend on it."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"kvshelf", "benchmarks", "testbed"}
SCANNED = ("src/kvshelf", "benchmarks", "testbed")
# Import name -> distribution name, where they differ.
DISTRIBUTION = {"zmq": "pyzmq"}


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}
    return {name.replace("_", "-") for name in names}


def imported() -> dict[str, str]:
    """Top-level third-party module -> a file importing it."""
    found: dict[str, str] = {}
    paths = sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py"))
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_a_declared_dependency() -> None:
    have = declared()
    missing = {
        module: where
        for module, where in imported().items()
        if DISTRIBUTION.get(module, module).lower().replace("_", "-") not in have
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_scan_sees_the_imports_it_must_check() -> None:
    assert {"zmq", "msgspec", "httpx", "matplotlib", "vllm"} <= set(imported())
