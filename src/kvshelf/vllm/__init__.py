"""kvshelf's vLLM connector: ``kv_connector_module_path: "kvshelf.vllm"``."""

from kvshelf.logs import configure_kvshelf_logging
from kvshelf.vllm.connector import KVShelfConnector, LMCacheMPConnector

configure_kvshelf_logging()

__all__ = ["KVShelfConnector", "LMCacheMPConnector"]
