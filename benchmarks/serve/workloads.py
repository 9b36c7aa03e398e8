"""The workloads of ``make bench-serve``: what vLLM's ``bench serve`` client is asked to send,
and the converter from a Mooncake trace to a scaled ``timed_trace`` file.

Plain data and arithmetic: this module starts nothing and imports neither torch nor vLLM.

Every token count scales with ``--scale`` (default 1): prompt lengths, the tokens one trace
block stands for, and vLLM's KV cache, so that a smaller run keeps the same pressure on vLLM's
own cache (a smoke run at 0.25 fits in minutes; its figures are not comparable to 1's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

TRACE_BLOCK_TOKENS = 512
"""Tokens one ``hash_ids`` entry of the Mooncake traces stands for."""
BLOCK_SIZE = 64
"""vLLM's KV block size in every row."""
GPU_BLOCKS = 64
"""vLLM's KV cache at scale 1 (``--num-gpu-blocks-override``): 4,096 tokens, less than the
workloads' prefixes, so that the external cache matters."""
CONCURRENCY = 2
"""Requests in flight (``--max-concurrency`` of the client, ``--max-num-seqs`` of the server)."""
SYSTEMS = ("none", "ideal", "kvshelf", "lmcache")
"""What serves the KV cache: no connector, no connector with room for the whole workload,
kvshelf, LMCache 0.5.6 (its MP server)."""
IDEAL = "ideal"
"""No connector, vLLM's KV cache large enough to keep every block of the ``prefix``
workload (`ideal_gpu_blocks`): every repeated prefix hits and costs no copy, which no external
cache can beat; the row bounds what any connector can reach with the same engine. Only the
``prefix`` workload runs it: the traces would need gigabytes of KV cache."""


@dataclass(frozen=True)
class PrefixRepetition:
    """vLLM's ``prefix_repetition`` dataset: ``num_prefixes`` random prefixes, each followed by
    ``prompts_per_prefix`` random suffixes, shuffled (the issue's run at scale 1)."""

    prefix_len: int = 1536
    suffix_len: int = 128
    output_len: int = 16
    prompts_per_prefix: int = 6
    num_prefixes: int = 8


@dataclass(frozen=True)
class TraceScaling:
    """How a prefix of a Mooncake trace becomes a run a CPU engine serves in minutes.

    Attributes:
        token_divisor: Every length (input, output, trace block) is divided by this: at 16 a
            512-token trace block becomes 32 tokens, a 14,000-token prompt 875.
        max_input: Longer scaled prompts keep their first ``max_input`` tokens (whole trace
            blocks), so that two fit in vLLM's KV cache at once.
        time_stretch: Arrival gaps are multiplied by this: a CPU engine prefills about as many
            tokens a second at 1/16 of the length as the trace's GPUs did at full length only
            if requests also arrive more slowly.
    """

    token_divisor: int = 16
    max_input: int = 1984
    time_stretch: float = 4.0


@dataclass(frozen=True)
class Workload:
    """One table of the run.

    Attributes:
        name: ``prefix``, ``trace-conversation``, ``trace-synthetic`` or ``launch``.
        dataset: vLLM's ``--dataset-name``.
        requests: Requests sent.
        systems: Systems it runs through.
        lazy_only: The connector config is ``"lmcache.mp.lazy_offload": true`` and nothing else
            (each system then picks its own lazy policy); else eager stores.
        trace: The Mooncake trace of a ``timed_trace`` workload.
    """

    name: str
    dataset: str
    requests: int
    systems: tuple[str, ...]
    lazy_only: bool = False
    trace: str | None = None


WORKLOADS = ("prefix", "trace-conversation", "trace-synthetic", "launch")
DEFAULT_REQUESTS = {"prefix": 48, "launch": 48, "trace-conversation": 100, "trace-synthetic": 100}


def scaled(value: int, scale: float, what: str) -> int:
    """Return ``value * scale`` as a whole number.

    Raises:
        ValueError: The product is not a positive whole number (naming ``what``).
    """
    result = value * scale
    if result < 1 or result != int(result):
        raise ValueError(
            f"--scale {scale:g}: {what} {value} x {scale:g} is not a whole number >= 1"
        )
    return int(result)


def make_workloads(
    names: Iterable[str], systems: Iterable[str], requests: int | None
) -> list[Workload]:
    """Return the workloads ``names`` run through ``systems`` (``launch`` never runs ``none``,
    and only ``prefix`` runs ``ideal``).

    Args:
        names: Workload names (`WORKLOADS`).
        systems: System names (`SYSTEMS`).
        requests: Requests per workload, or None for `DEFAULT_REQUESTS`.

    Raises:
        ValueError: An unknown workload or system name, or fewer requests than one prefix's
            prompts.
    """
    systems = tuple(systems)
    for name in systems:
        if name not in SYSTEMS:
            raise ValueError(f"--systems: unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    out = []
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(
                f"--workloads: unknown workload {name!r} (known: {', '.join(WORKLOADS)})"
            )
        count = DEFAULT_REQUESTS[name] if requests is None else requests
        per_prefix = PrefixRepetition().prompts_per_prefix
        if name in ("prefix", "launch") and count < per_prefix:
            raise ValueError(f"--requests {count}: {name} needs at least {per_prefix}")
        if name.startswith("trace-"):
            traced = tuple(s for s in systems if s != IDEAL)
            out.append(Workload(name, "timed_trace", count, traced, trace=name[len("trace-") :]))
        elif name == "launch":
            both = tuple(s for s in systems if s not in ("none", IDEAL))
            out.append(Workload(name, "prefix_repetition", count, both, lazy_only=True))
        else:
            out.append(Workload(name, "prefix_repetition", count, systems))
    return out


def num_prefixes(workload: Workload, spec: PrefixRepetition) -> int:
    """Return how many prefixes a ``prefix_repetition`` workload's requests share."""
    return max(1, workload.requests // spec.prompts_per_prefix)


def ideal_gpu_blocks(workload: Workload, scale: float, spec: PrefixRepetition) -> int:
    """Return vLLM's KV cache, in blocks, that keeps every block of a ``prefix_repetition``
    workload: each prefix once, each prompt's suffix and output, and vLLM's null block."""
    prefix_blocks = -(-scaled(spec.prefix_len, scale, "prefix") // BLOCK_SIZE)
    tail = scaled(spec.suffix_len, scale, "suffix") + spec.output_len
    tail_blocks = -(-tail // BLOCK_SIZE)
    return num_prefixes(workload, spec) * prefix_blocks + workload.requests * tail_blocks + 1


def prefix_args(workload: Workload, scale: float, spec: PrefixRepetition) -> list[str]:
    """Return the ``bench serve`` flags of a ``prefix_repetition`` workload at ``scale``."""
    return [
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        str(workload.requests),
        "--prefix-repetition-prefix-len",
        str(scaled(spec.prefix_len, scale, "prefix length")),
        "--prefix-repetition-suffix-len",
        str(scaled(spec.suffix_len, scale, "suffix length")),
        "--prefix-repetition-num-prefixes",
        str(num_prefixes(workload, spec)),
        "--prefix-repetition-output-len",
        str(spec.output_len),
        "--max-concurrency",
        str(CONCURRENCY),
    ]


def trace_chunk_tokens(scale: float, scaling: TraceScaling) -> int:
    """Return the tokens one trace block stands for after scaling."""
    if TRACE_BLOCK_TOKENS % scaling.token_divisor:
        raise ValueError(
            f"token divisor {scaling.token_divisor} does not divide {TRACE_BLOCK_TOKENS}"
        )
    return scaled(TRACE_BLOCK_TOKENS // scaling.token_divisor, scale, "trace block tokens")


def convert_trace(
    records: Iterable[dict[str, Any]], requests: int, scale: float, scaling: TraceScaling
) -> Iterator[dict[str, Any]]:
    """Yield the first ``requests`` Mooncake records as ``timed_trace`` records, scaled.

    Lengths are divided by ``scaling.token_divisor`` and multiplied by ``scale`` (rounded up,
    output at least 1 token); a prompt longer than ``scaling.max_input * scale`` keeps that
    many tokens and the ``hash_ids`` they span, so equal prefixes stay equal. Timestamps
    become seconds from the first request, times ``scaling.time_stretch``.

    Args:
        records: The trace's records (``timestamp`` in ms, ``input_length``,
            ``output_length``, ``hash_ids``).
        requests: How many to convert.
        scale: The run's ``--scale``.
        scaling: The scaling.

    Yields:
        ``{"timestamp", "input_length", "output_length", "hash_ids"}`` per request.

    Raises:
        ValueError: A record lacks a field (naming it and the record's line number).
    """
    chunk = trace_chunk_tokens(scale, scaling)
    max_input = scaled(scaling.max_input, scale, "max input")
    start = None
    for index, record in enumerate(records):
        if index == requests:
            return
        missing = [
            k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in record
        ]
        if missing:
            raise ValueError(f"trace record {index + 1}: no field {missing[0]!r}")
        start = record["timestamp"] if start is None else start
        length = -(-int(record["input_length"]) * chunk // TRACE_BLOCK_TOKENS)
        length = min(length, max_input)
        output = max(1, -(-int(record["output_length"]) * chunk // TRACE_BLOCK_TOKENS))
        yield {
            "timestamp": round((record["timestamp"] - start) / 1000 * scaling.time_stretch, 3),
            "input_length": length,
            "output_length": output,
            "hash_ids": list(record["hash_ids"][: -(-length // chunk)]),
        }


def trace_args(workload: Workload, path: str, scale: float, scaling: TraceScaling) -> list[str]:
    """Return the ``bench serve`` flags of a ``timed_trace`` workload read from ``path``."""
    return [
        "--dataset-name",
        "timed_trace",
        "--dataset-path",
        path,
        "--num-prompts",
        str(workload.requests),
        "--timed-trace-chunk-hash-size",
        str(trace_chunk_tokens(scale, scaling)),
        "--timed-trace-sec-multiplier",
        "1",
        "--max-concurrency",
        str(CONCURRENCY),
    ]


def write_trace(records: Iterable[dict[str, Any]], path: str) -> int:
    """Write ``records`` as JSON lines to ``path``; return how many."""
    count = 0
    with open(path, "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
            count += 1
    return count
