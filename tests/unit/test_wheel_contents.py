"""The wheel ships the product: built from this checkout, it holds kvshelf's modules and no
research benchmark or test-bed module (those live in ``benchmarks/`` and ``testbed/``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The one benchmark an operator runs on their own machine: `kvshelf bench transfer`.
SHIPPED_BENCH = {"__init__.py", "cli.py", "transfer.py", "gather.py", "server_process.py"}


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip_wheel, "-q", "--wheel-dir", str(out), str(source)],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("kvshelf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_the_product(wheel_files: list[str]) -> None:
    for module in (
        "kvshelf/server/index.py",
        "kvshelf/vllm/connector.py",
        "kvshelf/lazy/offloader.py",
        "kvshelf/bench/transfer.py",
    ):
        assert module in wheel_files


def test_no_benchmark_or_test_bed_module_is_in_the_wheel(wheel_files: list[str]) -> None:
    modules = [name for name in wheel_files if name.endswith(".py")]
    tops = {name.partition("/")[0] for name in modules}
    assert tops == {"kvshelf"}, tops
    bench = {name.removeprefix("kvshelf/bench/") for name in modules if "/bench/" in name}
    assert bench == SHIPPED_BENCH
    assert not [name for name in modules if "testbed" in name or "benchmarks" in name]
