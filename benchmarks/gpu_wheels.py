"""The wheels ``make gpu-check`` needs besides torch, and the check that they are importable.

A GPU machine may have torch but neither vLLM nor network: the operator carries these wheels
(``docs/cuda-engine.md``). The check itself imports ``pyzmq`` and ``msgspec`` (the client);
the kvshelf server it starts also imports ``xxhash`` (page checksums) and
``prometheus_client`` (its metrics). Naming a missing one up front beats a server that dies
at start-up behind a timeout.

Standard library only (it must run before anything that needs the wheels); no vLLM, no torch.
"""

from __future__ import annotations

import importlib
import sys

WHEELS: dict[str, str] = {
    "zmq": "pyzmq",
    "msgspec": "msgspec",
    "xxhash": "xxhash",
    "prometheus_client": "prometheus_client",
}
"""Import name -> the wheel (PyPI project) that provides it."""


def missing_wheels() -> list[str]:
    """The wheels of :data:`WHEELS` whose module cannot be imported here."""
    absent = []
    for module, wheel in WHEELS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            absent.append(wheel)
    return absent


def require_wheels() -> None:
    """Exit with a message naming every missing wheel, if any.

    Raises:
        SystemExit: some wheel is missing.
    """
    absent = missing_wheels()
    if absent:
        raise SystemExit(
            f"make gpu-check needs the wheel(s) {', '.join(absent)} (the check and the kvshelf "
            f"server it starts import them); {sys.executable} cannot import them. Carry them as "
            "wheels: docs/cuda-engine.md, section make gpu-check."
        )


if __name__ == "__main__":
    require_wheels()
