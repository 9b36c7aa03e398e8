"""The logic modules stay importable without vLLM (and the server without torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

VLLM_FREE = [
    "kvshelf.config",
    "kvshelf.plan",
    "kvshelf.client",
    "kvshelf.lazy",
    "kvshelf.lazy.offloader",
    "kvshelf.roles.scheduler",
    "kvshelf.roles.worker",
    "kvshelf.transfer",
    "kvshelf.roles.fingerprint",
]


def loaded_after_import(module: str) -> set[str]:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "print(' '.join(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(result.stdout.split())


@pytest.mark.parametrize("module", VLLM_FREE)
def test_logic_modules_do_not_import_vllm(module: str) -> None:
    assert "vllm" not in loaded_after_import(module)


def test_the_connector_module_does_import_vllm() -> None:
    # The check above would pass vacuously if the probe could not see vLLM being imported.
    assert "vllm" in loaded_after_import("kvshelf.vllm")
