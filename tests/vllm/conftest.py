"""Fixtures of the vLLM test bed: a locally built tiny model and the environment vLLM runs in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.models import TINY, build_model
from testbed.server import ServerProcess


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The `TINY` random-weight Llama, built once into the model cache folder.

    Returns:
        The model folder (``KVSHELF_MODEL_CACHE`` or ``<repo>/.cache/models``).
    """
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return build_model(TINY)


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Set the environment vLLM needs here, for this process, for the whole session.

    Small KV cache, offline, no usage stats, and vLLM's temporary files, caches and ZMQ
    sockets in a session folder.

    Yields:
        The variables set, to pass on to engine child processes (``EngineSpec.env``).
    """
    folder = tmp_path_factory.mktemp("vllm")
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(folder),
        "VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache"),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        yield env


@pytest.fixture
def engine_server() -> Iterator[ServerProcess]:
    """A kvshelf server for a few engine runs of the tiny model (256 MiB arena, 10 s leases)."""
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as process:
        yield process
