"""Import boundaries between kvshelf's packages, checked on every module of each package.

- ``kvshelf.server`` and ``kvshelf.protocol`` import neither torch nor vLLM: the server stores
  opaque pages and must start without either installed.
- ``kvshelf.lazy``, ``kvshelf.transfer``, ``kvshelf.roles`` (and the other logic modules) do
  not import vLLM, so they can be unit-tested alone; only ``kvshelf.vllm`` adapts vLLM's API.
- A module that a class's work is split into does not import the module of that class (its
  owner), which imports it: the leases, reservations and locks of the cache index, the
  extents of the arena tier, and the CUDA engine's layer-wise load.
- The product never imports what the wheel leaves out: no module of ``kvshelf`` imports the
  test bed (``testbed``) or the research benchmarks (``benchmarks``), and the test bed never
  imports the benchmarks.

Modules are found by walking each package, so a module added later is checked too.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

NEITHER_TORCH_NOR_VLLM = [
    "kvshelf.server",
    "kvshelf.protocol",
    "kvshelf.metrics",
    "kvshelf.metric_types",
    "kvshelf.platform",
    "kvshelf.client",
    "kvshelf.connector_config",
    "kvshelf.plan",
    "kvshelf.curve",
]
NO_VLLM = [
    "kvshelf.lazy",
    "kvshelf.transfer",
    "kvshelf.roles",
    # The GPU check runs where vLLM is not installed.
    "benchmarks.gpu_check",
    "testbed.kv_layouts",
    "testbed.worker",
]
# Module -> the module that owns it, which it must not import.
NOT_THEIR_OWNER = {
    "kvshelf.server.leases": "kvshelf.server.index",
    "kvshelf.server.reservations": "kvshelf.server.index",
    "kvshelf.server.locks": "kvshelf.server.index",
    "kvshelf.server.tiers.extents": "kvshelf.server.tiers.arena",
    "kvshelf.transfer.cuda_loads": "kvshelf.transfer.cuda",
}
ROOT = Path(__file__).resolve().parents[2]
# Folder -> the top-level packages its modules must not import.
NOT_SHIPPED = {
    "src/kvshelf": ("benchmarks", "testbed"),
    "testbed": ("benchmarks",),
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


def imports_in(path: Path) -> set[str]:
    """Every module name a source file imports (absolute imports, any nesting)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.add(node.module)
    return names


@pytest.mark.parametrize(("folder", "forbidden"), NOT_SHIPPED.items())
def test_shipped_code_never_imports_what_the_wheel_leaves_out(
    folder: str, forbidden: tuple[str, ...]
) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert len(files) > 10, folder
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in imports_in(path) if name.partition(".")[0] in forbidden
        )
        for path in files
    }
    assert not {path: names for path, names in offenders.items() if names}


def test_the_scan_sees_the_test_beds_imports() -> None:
    # The check above would pass vacuously if the scan missed a first-party import.
    assert "testbed.server" in imports_in(ROOT / "benchmarks" / "demo.py")
