"""Multi-round QA load on vLLM's OpenAI server: throughput and time to first token.

`run_multi_round_qa` drives vLLM's OpenAI server (`benchmarks.e2e.api_server`) with a
closed-loop multi-round QA workload (`MultiRoundQA`): ``users`` conversations run concurrently; each
starts from a system prompt shared by every user followed by the user's own context, and each
round appends a question, sends the whole history as a streaming completion request, and appends
the answer the model gave (its real output token ids) before the next round. Histories grow
every round, and vLLM's KV cache (``--num-gpu-blocks-override``) is sized below what all
histories need, so its prefix cache evicts and later rounds hit only what a KV connector kept.

`stream_completion` sends one request (also for ``make bench-chaos``). Prompts are token id
lists, so every mode sees identical requests; answers are exactly
``answer_len`` tokens (``ignore_eos``) with greedy decoding. TTFT is measured by the client,
from sending a request to receiving its first streamed token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.e2e.api_server import COUNTERS, ApiServer, read_counters
from testbed.prompts import random_tokens


@dataclass(frozen=True)
class MultiRoundQA:
    """Shape of the multi-round QA workload.

    Attributes:
        users: Concurrent conversations (each has one request in flight at a time).
        rounds: Requests per conversation.
        system_len: Tokens of the system prompt that every conversation starts with.
        context_len: Tokens of each user's own context after the system prompt.
        question_len: Tokens of each round's question.
        answer_len: Tokens generated per request.
        seed: Seed of all token ids.
    """

    users: int = 6
    rounds: int = 5
    system_len: int = 512
    context_len: int = 1024
    question_len: int = 64
    answer_len: int = 32
    seed: int = 0

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt of the workload (the last round's)."""
        history = self.system_len + self.context_len
        return history + self.rounds * self.question_len + (self.rounds - 1) * self.answer_len

    def system_prompt(self) -> list[int]:
        """Return the system prompt shared by every user."""
        return random_tokens(self.system_len, seed=f"{self.seed}:system")

    def user_context(self, user: int) -> list[int]:
        """Return user ``user``'s own context."""
        return random_tokens(self.context_len, seed=f"{self.seed}:context:{user}")

    def question(self, user: int, round_index: int) -> list[int]:
        """Return the question of ``user`` in round ``round_index``."""
        return random_tokens(self.question_len, seed=f"{self.seed}:q:{user}:{round_index}")


@dataclass
class RequestRecord:
    """One request of the workload, as the client saw it.

    Attributes:
        user: Conversation index.
        round_index: Round within the conversation.
        prompt_len: Prompt tokens sent.
        output_len: Tokens received.
        ttft_s: Seconds from sending to the first streamed token.
        latency_s: Seconds from sending to the end of the stream.
    """

    user: int
    round_index: int
    prompt_len: int
    output_len: int
    ttft_s: float
    latency_s: float


@dataclass
class Streamed:
    """What one streamed completion returned.

    Attributes:
        output: The generated token ids.
        ttft_s: Seconds from sending to the first token, None if none came.
        cached_tokens: Prompt tokens vLLM did not compute (its prefix cache plus a KV
            connector's hits: ``usage.prompt_tokens_details.cached_tokens``), None unless the
            server runs with ``--enable-prompt-tokens-details``.
    """

    output: list[int]
    ttft_s: float | None
    cached_tokens: int | None


KEEPALIVE_EXPIRY_S = 1.0
"""How long the load clients keep an idle connection for reuse: well below the 5 s after which
vLLM's HTTP server (uvicorn, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) closes one. At httpx's default
(also 5 s) a client that wakes from a machine freeze (:mod:`benchmarks.chaos.freezes`)
may send on a connection the server is closing: `make bench-chaos` saw requests of engines A
and B fail at one instant with ``BrokenPipeError`` under httpx's ``ReadError``."""


def client_limits(connections: int) -> httpx.Limits:
    """The load clients' connection pool: ``connections`` at most, idle ones kept briefly."""
    return httpx.Limits(max_connections=connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> Streamed:
    """Send one greedy streaming completion of exactly ``max_tokens`` tokens and read it.

    Args:
        client: Shared HTTP client.
        url: Server base URL.
        model: Model name as the server knows it.
        prompt: Prompt token ids.
        max_tokens: Tokens to generate (``ignore_eos``).

    Returns:
        The output, the time to its first token and the cached prompt tokens.

    Raises:
        httpx.HTTPError: the request failed.
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    streamed = Streamed([], None, None)
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or []:
                tokens = choice.get("token_ids") or []
                if tokens and streamed.ttft_s is None:
                    streamed.ttft_s = time.perf_counter() - start
                streamed.output += tokens
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                streamed.cached_tokens = details["cached_tokens"]
    return streamed


async def _conversation(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    workload: MultiRoundQA,
    user: int,
    system: list[int],
) -> list[RequestRecord]:
    """Run one user's rounds one after the other.

    Args:
        client: Shared HTTP client.
        url: Server base URL.
        model: Model name as the server knows it.
        workload: The workload.
        user: This conversation's index.
        system: The shared system prompt.

    Returns:
        One record per round.
    """
    history = system + workload.user_context(user)
    records = []
    for round_index in range(workload.rounds):
        prompt = history + workload.question(user, round_index)
        start = time.perf_counter()
        streamed = await stream_completion(client, url, model, prompt, workload.answer_len)
        latency_s = time.perf_counter() - start
        output, ttft_s = streamed.output, streamed.ttft_s
        if ttft_s is None or len(output) != workload.answer_len:
            raise RuntimeError(
                f"user {user} round {round_index}: got {len(output)} of "
                f"{workload.answer_len} tokens"
            )
        records.append(
            RequestRecord(user, round_index, len(prompt), len(output), ttft_s, latency_s)
        )
        history = prompt + output
    return records


async def _run_all(url: str, model: str, workload: MultiRoundQA) -> list[RequestRecord]:
    """Run every conversation concurrently and gather their records."""
    system = workload.system_prompt()
    limits = client_limits(workload.users + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        per_user = await asyncio.gather(
            *(
                _conversation(client, url, model, workload, user, system)
                for user in range(workload.users)
            )
        )
    return [record for records in per_user for record in records]


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q`` quantile (0..1) of ``values`` by linear interpolation.

    Args:
        values: At least one number.
        q: The quantile.

    Returns:
        The interpolated quantile.
    """
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_multi_round_qa(server: ApiServer, model: str, workload: MultiRoundQA) -> dict[str, Any]:
    """Run ``workload`` against a started server and summarize it.

    Args:
        server: A healthy server.
        model: The model name the server serves (its ``--model``).
        workload: What to send.

    Returns:
        ``requests``, ``wall_s``, ``prompt_tokens`` and ``output_tokens`` (as sent and
        received), ``throughput_tok_s`` ((prompt + output tokens) / wall),
        ``output_tok_s``, ``ttft_p50_s``, ``ttft_p99_s``, ``ttft_mean_s``, the same p50 and p99
        over rounds after the first (``ttft_p50_warm_s``, ``ttft_p99_warm_s``: the first round
        of every user computes its whole context in every mode), the server's counter
        increases (``local_hit_tokens``, ``external_hit_tokens``, ...) and ``per_request``.
    """
    before = read_counters(server.url)
    start = time.perf_counter()
    records = asyncio.run(_run_all(server.url, model, workload))
    wall_s = time.perf_counter() - start
    after = read_counters(server.url)
    ttfts = [record.ttft_s for record in records]
    warm = [record.ttft_s for record in records if record.round_index > 0] or ttfts
    prompt_tokens = sum(record.prompt_len for record in records)
    output_tokens = sum(record.output_len for record in records)
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "throughput_tok_s": (prompt_tokens + output_tokens) / wall_s,
        "output_tok_s": output_tokens / wall_s,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_warm_s": percentile(warm, 0.5),
        "ttft_p99_warm_s": percentile(warm, 0.99),
        **{key: after[key] - before[key] for key in COUNTERS},
        "per_request": [record.__dict__ for record in records],
    }
