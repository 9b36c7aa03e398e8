"""Make kvshelf's log lines visible inside a vLLM process.

vLLM configures only its own ``vllm`` logger. Without a handler of their own, kvshelf's INFO
lines (lazy offload enabled, server reachable again, ...) would vanish, so the connector
attaches one, in vLLM's format, unless the application has configured logging itself.
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "KVSHELF_LOG_LEVEL"
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def configure_kvshelf_logging() -> None:
    """Attach a stderr handler to the ``kvshelf`` logger when nothing would print its lines.

    The level comes from ``KVSHELF_LOG_LEVEL`` (default INFO). Records still propagate, so
    handlers set up by the application (or by pytest) see them too.
    """
    kvshelf_logger = logging.getLogger("kvshelf")
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    kvshelf_logger.setLevel(level)
    if kvshelf_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    kvshelf_logger.addHandler(handler)
