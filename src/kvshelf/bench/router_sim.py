"""A KV-aware router's view with and without kvshelf's events: two nodes, two engines.

``python -m kvshelf.bench.router_sim`` (``make bench-router``) starts two kvshelf servers (two
nodes on loopback) and one vLLM OpenAI server on each, with vLLM's KV events on, and a router
in this process that follows both engines' event streams (:class:`EventSubscriber`, vLLM's
own types) and sends each request to the engine holding the longest prefix of it, ties going
to the engine that served fewer requests. The engines' GPU caches are small, so a document's
prefix soon leaves vLLM's cache but stays in its node's kvshelf server. Two routers take
turns on the same engines, each with its own documents (same shapes, other tokens):

* ``gpu``: what vLLM's ``GPU`` events tell (a router without kvshelf's events);
* ``gpu+kvshelf``: ``GPU`` and kvshelf's ``CPU``/``STORAGE`` events.

Requests are sent one at a time, streamed; the router waits for the engines' events after
each. Prints one JSON line per router, side by side: prefix hit tokens (vLLM's local prefix
cache plus kvshelf loads, from the engines' counters), requests sent to the node holding the
document in kvshelf, and mean TTFT; writes ``bench/results/router-sim.json``.
"""

from __future__ import annotations

import argparse
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

from kvshelf.bench.e2e.api_server import ApiServer, read_counters
from kvshelf.bench.e2e.config import LOAD_MODEL
from kvshelf.bench.e2e.load import openai_server_args
from kvshelf.testbed.events import EventEndpoints, EventSubscriber
from kvshelf.testbed.models import TINY, build_model
from kvshelf.testbed.prompts import random_tokens
from kvshelf.testbed.run_engine import kvshelf_transfer_config
from kvshelf.testbed.scheduler import make_request
from kvshelf.testbed.server import ServerProcess

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
    served: int = 0

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


def stream_ttft(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """Send a streamed greedy completion; seconds to its first token."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    ttft = None
    with (
        httpx.Client(timeout=300.0) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - started
    assert ttft is not None, "no token came"
    return ttft


def hit_tokens(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        counters = read_counters(url)
        total += counters["local_hit_tokens"] + counters["external_hit_tokens"]
    return total


def route(
    name: str,
    mediums: tuple[str, ...],
    workload: Workload,
    seed: int,
    engines: list[tuple[ApiServer, EngineView]],
    model: str,
) -> dict[str, Any]:
    """Send the workload's requests through a router that knows ``mediums``."""
    urls = [server.url for server, _ in engines]
    before = hit_tokens(urls)
    home: dict[int, int] = {}
    ttfts = []
    at_home = 0
    for document, prompt in workload.requests(seed):
        hashes = [
            maybe_convert_block_hash(h)
            for h in make_request("r", prompt, max_tokens=1, block_size=BLOCK).block_hashes
        ]
        for _, view in engines:
            view.follow()
        scores = [view.prefix(hashes, mediums) for _, view in engines]
        best = max(range(len(engines)), key=lambda i: (scores[i], -engines[i][1].served))
        home.setdefault(document, best)
        at_home += home[document] == best
        server, view = engines[best]
        ttfts.append(stream_ttft(server.url, model, prompt, workload.answer_tokens))
        view.served += 1
        # Stores and their events settle before the router looks again.
        time.sleep(0.5)
    return {
        "router": name,
        "requests": len(ttfts),
        "prefix_hit_tokens": hit_tokens(urls) - before,
        "to_document_home": at_home,
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4),
        "ttft_after_first_pass_mean_s": round(
            sum(ttfts[workload.documents :]) / len(ttfts[workload.documents :]), 4
        ),
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
        args += ["--kv-events-config", json.dumps(endpoints.engine_config())]
        server = stack.enter_context(ApiServer(sys.executable, model_path, args, env))
        subscriber = EventSubscriber(endpoints)
        stack.callback(subscriber.close)
        yield server, EngineView(subscriber)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["load", "tiny"], default="load")
    parser.add_argument("--passes", type=int, default=Workload.passes)
    args = parser.parse_args(argv)
    model = LOAD_MODEL if args.model == "load" else TINY
    workload = Workload(passes=args.passes)
    model_path = str(build_model(model))
    with ExitStack() as stack:
        engines = list(_engines(stack, model_path, model, workload))
        rows = [
            route("gpu", ("GPU",), workload, 1, engines, model_path),
            route("gpu+kvshelf", ("GPU", "KVSHELF"), workload, 2, engines, model_path),
        ]
    for row in rows:
        print(json.dumps(row), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"workload": workload.__dict__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
