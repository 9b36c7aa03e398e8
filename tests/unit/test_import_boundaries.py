"""Import boundaries between kvshelf's packages, checked on every module of each package.

- ``kvshelf.server`` and ``kvshelf.protocol`` import neither torch nor vLLM: the server stores
  opaque pages and must start without either installed.
- ``kvshelf.lazy``, ``kvshelf.transfer``, ``kvshelf.roles`` (and the other logic modules) do
  not import vLLM, so they can be unit-tested alone; only ``kvshelf.vllm`` adapts vLLM's API.
- A module that a class's work is split into does not import the module of that class (its
  owner), which imports it: the leases, reservations and locks of the cache index, and the
  extents of the arena tier.

Modules are found by walking each package, so a module added later is checked too.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys

import pytest

NEITHER_TORCH_NOR_VLLM = [
    "kvshelf.server",
    "kvshelf.protocol",
    "kvshelf.metrics",
    "kvshelf.metric_types",
    "kvshelf.platform",
    "kvshelf.client",
    "kvshelf.config",
    "kvshelf.plan",
    "kvshelf.curve",
]
NO_VLLM = [
    "kvshelf.lazy",
    "kvshelf.transfer",
    "kvshelf.roles",
    # The GPU check runs where vLLM is not installed.
    "kvshelf.bench.gpu_check",
    "kvshelf.testbed.kv_layouts",
    "kvshelf.testbed.worker",
]
# Module -> the module that owns it, which it must not import.
NOT_THEIR_OWNER = {
    "kvshelf.server.leases": "kvshelf.server.index",
    "kvshelf.server.reservations": "kvshelf.server.index",
    "kvshelf.server.locks": "kvshelf.server.index",
    "kvshelf.server.tiers.extents": "kvshelf.server.tiers.arena",
}

# Imports each module of a package (or the module itself) in a fresh interpreter, one after the
# other, and reports for each the heavy frameworks loaded so far.
PROBE = """
import importlib, json, pkgutil, sys
root = importlib.import_module(sys.argv[1])
names = [root.__name__]
if hasattr(root, "__path__"):
    modules = pkgutil.walk_packages(root.__path__, root.__name__ + ".")
    # A __main__ module runs its command when imported.
    names += sorted(m.name for m in modules if not m.name.endswith(".__main__"))
seen = {}
for name in names:
    importlib.import_module(name)
    seen[name] = [m for m in ("torch", "vllm") if m in sys.modules]
print(json.dumps(seen))
"""


def loaded_after_import(package: str) -> dict[str, list[str]]:
    """Module -> frameworks loaded once it (and the modules before it) were imported."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, package],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return json.loads(result.stdout)


def first_offender(seen: dict[str, list[str]], framework: str) -> str | None:
    return next((name for name, loaded in seen.items() if framework in loaded), None)


@pytest.mark.parametrize("package", NEITHER_TORCH_NOR_VLLM)
def test_server_side_modules_import_neither_torch_nor_vllm(package: str) -> None:
    seen = loaded_after_import(package)
    assert len(seen) >= 1
    assert first_offender(seen, "torch") is None, seen
    assert first_offender(seen, "vllm") is None, seen


@pytest.mark.parametrize("package", NO_VLLM)
def test_logic_packages_do_not_import_vllm(package: str) -> None:
    seen = loaded_after_import(package)
    assert first_offender(seen, "vllm") is None, seen


def test_the_probe_sees_vllm_and_torch_imports() -> None:
    # The checks above would pass vacuously if the probe could not see an import.
    seen = loaded_after_import("kvshelf.vllm")
    assert first_offender(seen, "vllm") == "kvshelf.vllm"
    assert first_offender(seen, "torch") == "kvshelf.vllm"


def imported_names(module: str) -> set[str]:
    """Every module (or module attribute) ``module``'s source imports, by full name."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(("module", "owner"), NOT_THEIR_OWNER.items())
def test_split_modules_do_not_import_their_owner(module: str, owner: str) -> None:
    imported = imported_names(module)
    assert not any(name == owner or name.startswith(f"{owner}.") for name in imported), imported
