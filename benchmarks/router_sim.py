"""A KV-aware router's view with and without kvshelf's events: two nodes, two engines.

``python -m benchmarks.router_sim`` (``make bench-router``) starts two kvshelf servers (two
nodes on loopback) and one vLLM OpenAI server on each, with vLLM's KV events on, and a router
in this process that follows both engines' event streams (:class:`EventSubscriber`, vLLM's
own types) and sends each request to the engine holding the longest prefix of it, ties going
to the engine it sent fewer requests. The engines' GPU caches are small, so a document's
prefix soon leaves vLLM's cache but stays in its node's kvshelf server. Two routers take
turns on the same engines, request by request, each with its own documents (same shapes,
other tokens):

* ``gpu``: what vLLM's ``GPU`` events tell (a router without kvshelf's events);
* ``gpu+kvshelf``: ``GPU`` and kvshelf's ``CPU``/``STORAGE`` events.

Requests are sent one at a time, streamed; the routers wait for the engines' events after
each. Prints one JSON line per router, side by side: prefix hit tokens (each answer's
``cached_tokens``: vLLM's local prefix cache plus kvshelf loads), requests sent to the node
whose kvshelf holds the document (where its first request went), and mean TTFT (all requests,
and those after each document's first); writes ``bench/results/router-sim.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from benchmarks.e2e import multiround
from benchmarks.e2e.api_server import ApiServer
from benchmarks.e2e.config import LOAD_MODEL
from benchmarks.e2e.load import openai_server_args
from benchmarks.e2e.multiround import Streamed
from testbed.events import EventEndpoints, EventSubscriber
from testbed.models import TINY, build_model
from testbed.prompts import random_tokens
from testbed.run_engine import kvshelf_transfer_config
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_request

BLOCK = 32
RESULTS = Path("bench/results/router-sim.json")


@dataclass(frozen=True)
class Workload:
    """Documents queried in turns; each request is a document and a question of its own."""

    documents: int = 10
    document_blocks: int = 16
    question_tokens: int = 40
    passes: int = 2
    answer_tokens: int = 4
    # vLLM's KV cache per engine, in blocks: about two of the five documents each engine gets.
    gpu_blocks: int = 40

    def requests(self, seed: int) -> list[tuple[int, list[int]]]:
        """``(document, prompt)`` in sending order: every document once, then shuffled passes."""
        docs = [
            random_tokens(self.document_blocks * BLOCK, seed=f"doc-{seed}-{d}")
            for d in range(self.documents)
        ]
        rng = random.Random(seed)
        order = list(range(self.documents))
        for _ in range(self.passes - 1):
            later = list(range(self.documents))
            rng.shuffle(later)
            order += later
        return [
            (d, docs[d] + random_tokens(self.question_tokens, seed=f"q-{seed}-{i}"))
            for i, d in enumerate(order)
        ]


@dataclass
class EngineView:
    """What a router knows of one engine: block hashes it can reuse, by medium."""

    subscriber: EventSubscriber
    blocks: dict[str, set[Any]] = field(default_factory=lambda: {"GPU": set(), "KVSHELF": set()})
    seen: int = 0

    def follow(self) -> None:
        events = self.subscriber.events()
        for event in events[self.seen :]:
            if isinstance(event, AllBlocksCleared):
                self.blocks["KVSHELF"].clear()
                continue
            medium = "GPU" if event.medium == "GPU" else "KVSHELF"
            if isinstance(event, BlockStored):
                self.blocks[medium].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks[medium].difference_update(event.block_hashes)
        self.seen = len(events)

    def prefix(self, hashes: list[Any], mediums: tuple[str, ...]) -> int:
        known = set().union(*(self.blocks[m] for m in mediums))
        count = 0
        for block_hash in hashes:
            if block_hash not in known:
                break
            count += 1
        return count


def stream_completion(
    url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, int]:
    """Send a streamed greedy completion (:func:`benchmarks.e2e.multiround.stream_completion`).

    Returns:
        Seconds to its first token, and its prompt tokens vLLM did not compute (local prefix
        cache plus kvshelf loads).
    """

    async def send() -> Streamed:
        async with httpx.AsyncClient(timeout=300.0) as client:
            return await multiround.stream_completion(client, url, model, prompt, max_tokens)

    streamed = asyncio.run(send())
    assert streamed.ttft_s is not None and streamed.cached_tokens is not None, (
        "no token or no usage came"
    )
    return streamed.ttft_s, streamed.cached_tokens


@dataclass
class Router:
    """One routing policy: which events it reads, where it sent what, what it measured."""

    name: str
    mediums: tuple[str, ...]
    served: list[int] = field(default_factory=lambda: [0, 0])
    home: dict[int, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    at_home: int = 0

    def send(
        self,
        document: int,
        prompt: list[int],
        engines: list[tuple[ApiServer, EngineView]],
        model: str,
        max_tokens: int,
    ) -> None:
        hashes = [
            maybe_convert_block_hash(h)
            for h in make_request("r", prompt, max_tokens=1, block_size=BLOCK).block_hashes
        ]
        for _, view in engines:
            view.follow()
        scores = [view.prefix(hashes, self.mediums) for _, view in engines]
        best = max(range(len(engines)), key=lambda i: (scores[i], -self.served[i]))
        self.home.setdefault(document, best)
        self.at_home += self.home[document] == best
        self.served[best] += 1
        ttft, cached = stream_completion(engines[best][0].url, model, prompt, max_tokens)
        self.ttfts.append(ttft)
        self.hit_tokens += cached

    def row(self, first_pass: int) -> dict[str, Any]:
        later = self.ttfts[first_pass:]
        return {
            "router": self.name,
            "requests": len(self.ttfts),
            "prefix_hit_tokens": self.hit_tokens,
            "to_document_home": self.at_home,
            "ttft_mean_s": round(sum(self.ttfts) / len(self.ttfts), 4),
            "ttft_after_first_pass_mean_s": round(sum(later) / len(later), 4),
        }


def _engines(
    stack: ExitStack, model_path: str, model: Any, workload: Workload
) -> Iterator[tuple[ApiServer, EngineView]]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    max_len = workload.document_blocks * BLOCK + workload.question_tokens + 64
    for _ in range(2):
        kvshelf = stack.enter_context(ServerProcess(l1_size_gb=0.5, lease_timeout_s=10.0))
        endpoints = EventEndpoints.free()
        args = openai_server_args(
            model,
            block_size=BLOCK,
            max_model_len=max_len,
            gpu_blocks=workload.gpu_blocks,
            max_num_seqs=4,
            kv_transfer_config=kvshelf_transfer_config(kvshelf.port),
        )
        args += [
            "--kv-events-config",
            json.dumps(endpoints.engine_config()),
            "--enable-prompt-tokens-details",
        ]
        server = stack.enter_context(ApiServer(sys.executable, model_path, args, env))
        subscriber = EventSubscriber(endpoints)
        stack.callback(subscriber.close)
        yield server, EngineView(subscriber)


def run(model: Any, workload: Workload) -> list[dict[str, Any]]:
    """Run both routers over two fresh nodes; one result row per router."""
    model_path = str(build_model(model))
    with ExitStack() as stack:
        print("[router-sim] starting two kvshelf servers and two vLLM servers", flush=True)
        engines = list(_engines(stack, model_path, model, workload))
        routers = [Router("gpu", ("GPU",)), Router("gpu+kvshelf", ("GPU", "KVSHELF"))]
        # The two routers take turns request by request, each with its own documents, so
        # that the machine's load drifts alike for both.
        streams = [workload.requests(seed) for seed in (1, 2)]
        print(f"[router-sim] {len(streams[0])} requests per router", flush=True)
        for turn in zip(*streams, strict=True):
            for router, (document, prompt) in zip(routers, turn, strict=True):
                router.send(document, prompt, engines, model_path, workload.answer_tokens)
                # Stores and their events settle before a router looks again.
                time.sleep(0.5)
        return [router.row(workload.documents) for router in routers]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_sim", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=["load", "tiny"], default="load")
    parser.add_argument("--passes", type=int, default=Workload.passes)
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON results file")
    args = parser.parse_args(argv)
    workload = Workload(passes=args.passes)
    rows = run(LOAD_MODEL if args.model == "load" else TINY, workload)
    for row in rows:
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"workload": workload.__dict__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
