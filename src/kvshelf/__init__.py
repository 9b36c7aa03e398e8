"""kvshelf: a KV cache layer for vLLM."""

__version__ = "0.1.0"
