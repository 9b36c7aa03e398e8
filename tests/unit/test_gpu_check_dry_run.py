"""``make gpu-check`` dry-run on the CPU: the same flow (real server, worker role, the CUDA
engine's code with faked streams, both layouts), every loaded block bit-exact, rows labelled
dry-run and never written as GPU results; a missing wheel stops it at once, named, the wheel
list is the check's and its server's traced imports, and the docs carry every wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvshelf
from benchmarks import gpu_check, gpu_wheels

FIELDS = {
    "layout",
    "direction",
    "batch_bytes",
    "gbps",
    "pinned_memcpy_gbps",
    "ratio",
    "hidden_fraction",
}


def test_dry_run_checks_both_layouts_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["mode"] == "dry-run"
    assert result["meta"]["bit_exact"] == {"LBNHC": True, "BLNHC": True}
    assert result["targets"]["bit_exact"] is True
    rows = result["rows"]
    assert all(set(row) == FIELDS for row in rows)
    for layout in gpu_check.LAYOUTS:
        directions = [r["direction"] for r in rows if r["layout"] == layout]
        assert directions.count("store") == directions.count("load") >= 1
        assert directions.count("layerwise_load") == 1


def test_the_dry_run_runs_every_probe_on_the_fakes(tmp_path: Path) -> None:
    """Every probe the GPU run makes runs its code on the CPU fakes first, and passes."""
    out = tmp_path / "dry.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    probes = json.loads(out.read_text())["probes"]
    assert [(p["layout"], p["probe"]) for p in probes] == [
        ("LBNHC", "copy_path"),
        ("LBNHC", "launches_per_step"),
        ("LBNHC", "forced_refusal"),
        ("LBNHC", "nothing_left_pinned"),
        ("LBNHC", "ordering"),
        ("LBNHC", "quiet_during_capture"),
        ("LBNHC", "forward_slowdown"),
        ("BLNHC", "copy_path"),
        ("BLNHC", "ordering"),
    ]
    assert all(p["ok"] for p in probes), probes
    launches = next(p["detail"] for p in probes if p["probe"] == "launches_per_step")
    layers = gpu_check.DRY_RUN.layers
    assert f"64 hits: {layers} copy launches" in launches
    ordering = next(p["detail"] for p in probes if p["probe"] == "ordering")
    assert f"stale blocks in {layers}/{layers} layers" in ordering


def test_the_ordering_probe_fails_when_a_layer_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The review's mutation: the compute stream no longer waits for a layer's copies. The
    fake device then runs the forward pass's reads before the copies, and the probe says so."""
    from kvshelf.transfer.cuda_loads import CudaLayerwiseLoad

    def enqueue_only(self: CudaLayerwiseLoad, layer: int) -> None:
        with self._engine.streams.device_scope():
            self._enqueue_through(layer)

    monkeypatch.setattr(CudaLayerwiseLoad, "wait_layer", enqueue_only)
    out = tmp_path / "dry.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 1
    probes = json.loads(out.read_text())["probes"]
    assert [p["ok"] for p in probes if p["probe"] == "ordering"] == [False, False]


def test_a_dry_run_writes_no_gpu_results() -> None:
    assert gpu_check.output_path(None, dry_run=True) is None
    assert gpu_check.output_path(None, dry_run=False) == Path("bench/results/gpu.json")


@pytest.mark.parametrize("module", sorted(gpu_wheels.WHEELS))
def test_a_missing_wheel_stops_the_check_at_once_naming_it(
    module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as on a machine without that wheel
    with pytest.raises(SystemExit, match=gpu_wheels.WHEELS[module]) as stopped:
        gpu_check.main(["--device", "cpu"])
    assert "docs/cuda-engine.md" in str(stopped.value)


def test_the_docs_list_every_wheel_the_check_and_its_server_import() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "cuda-engine.md").read_text()
    download = docs[docs.index("pip download") :]
    download = download[: download.index("```")]
    assert all(wheel in download for wheel in gpu_wheels.WHEELS.values())


def _top_level_modules(*modules: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after importing ``modules``, found on
    its path (not made up by an extension)."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        # Modules with no spec are made up by extensions (cython_runtime): nothing to carry.
        "found = {n.split('.')[0] for n, m in list(sys.modules.items())\n"
        "         if getattr(m, '__spec__', None) is not None}\n"
        "print(json.dumps(sorted(found)))\n"
    )
    src = Path(kvshelf.__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(src.parent)])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def test_the_wheel_list_is_what_the_check_and_its_server_import_besides_torch() -> None:
    """Traced, not hand-kept: the modules the check and the server it starts import, less the
    standard library, the checkout's own packages (kvshelf, the test bed, the benchmarks: the
    working tree travels) and whatever torch imports itself (torch is on the GPU machine), are
    exactly ``WHEELS``: a new import of either is caught here."""
    with_torch = _top_level_modules("torch")
    imported = _top_level_modules(
        "benchmarks.gpu_check", "kvshelf.cli.server", "kvshelf.server.app"
    )
    carried = {
        name
        for name in imported - with_torch
        if name not in sys.stdlib_module_names
        and not name.startswith("_")
        and name not in ("kvshelf", "testbed", "benchmarks")
    }
    assert carried == set(gpu_wheels.WHEELS)
