"""The two halves of the connector, one per vLLM connector role, with no vLLM import.

``scheduler`` decides what to load and store each step, with ``lookups`` (what the server
holds) and an offload mode (``offload``: when store work goes to the workers; eager here, lazy
in ``kvshelf.lazy``); ``worker`` moves the bytes. The vLLM-facing class in ``kvshelf.vllm``
only adapts vLLM's calls to them, so both can be driven and tested without an engine.
"""
