"""The chaos run's client side: looping multi-round conversations, fixed-size and sequential runs.

Conversations are those of `benchmarks.e2e.multiround` (system prompt, the user's context,
a question per round, the model's real answers appended), sent with its `stream_completion`.
`run_conversations` keeps ``users`` of them in flight until a deadline or a request budget, user
after user of a pool, so that a user comes back after vLLM's own cache forgot it; every request
becomes a `Sent` record, failed ones included (a failure ends that conversation, the slot starts
the next). `run_sequential` sends a list of prompts one at a time.

The engine's URL is read from an `Endpoint` before every request: the chaos loop replaces the
victim engine under a running workload.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from benchmarks.e2e.multiround import MultiRoundQA, client_limits, stream_completion


@dataclass
class Endpoint:
    """Where an engine answers now; ``url`` is None while it is down (being restarted)."""

    url: str | None
    model: str


@dataclass
class Sent:
    """One request as the client saw it.

    Attributes:
        engine: ``A`` (measured) or ``B`` (the victim).
        user: The conversation's user.
        round_index: Round within the conversation.
        start_s: Send time, seconds on the run's clock (`Clock`).
        end_s: Time the answer (or the failure) came back.
        ttft_s: Seconds to the first token, None when it failed first.
        prompt: Prompt token ids.
        output: Generated token ids.
        cached_tokens: Prompt tokens not computed (vLLM's prefix cache plus kvshelf's hits).
        error: Why it failed, None when it did not.
    """

    engine: str
    user: int
    round_index: int
    start_s: float
    end_s: float
    ttft_s: float | None
    prompt: list[int]
    output: list[int]
    cached_tokens: int | None
    error: str | None = None

    @property
    def latency_s(self) -> float:
        """Seconds from sending to the end of the answer."""
        return self.end_s - self.start_s


@dataclass
class Clock:
    """The run's clock: seconds since ``origin`` (``time.monotonic``)."""

    origin: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self.origin


@dataclass
class Budget:
    """When a run stops starting requests: once ``deadline_s`` on the clock has passed and
    ``also_until`` (if given) returns True, or after ``requests`` were started (None: no such
    limit)."""

    deadline_s: float | None = None
    requests: int | None = None
    also_until: Callable[[], bool] | None = None
    started: int = 0

    def over(self, clock: Clock) -> bool:
        """True once the run must not start another request."""
        past_deadline = self.deadline_s is not None and clock.now() >= self.deadline_s
        if past_deadline and (self.also_until is None or self.also_until()):
            return True
        return self.requests is not None and self.started >= self.requests

    def take(self, clock: Clock) -> bool:
        """Count one more request if the budget allows it; False when the run is over."""
        if self.over(clock):
            return False
        self.started += 1
        return True


def describe_failure(exc: BaseException) -> str:
    """``exc`` and what raised it, outermost first: httpx's ``ReadError`` says nothing by
    itself, the socket error under it (a reset, an end of stream) says which way it broke."""
    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        parts.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


async def _send(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    engine: str,
    prompt: list[int],
    max_tokens: int,
    clock: Clock,
    where: tuple[int, int],
) -> Sent:
    """Send one prompt to ``endpoint`` and record it, failures included."""
    start_s = clock.now()
    url = endpoint.url
    error = None
    streamed = None
    try:
        if url is None:
            raise ConnectionError("engine down")
        streamed = await stream_completion(client, url, endpoint.model, prompt, max_tokens)
        if len(streamed.output) != max_tokens:
            error = f"got {len(streamed.output)} of {max_tokens} tokens"
    except (httpx.HTTPError, ConnectionError, ValueError) as exc:
        error = describe_failure(exc)[:300]
    return Sent(
        engine,
        where[0],
        where[1],
        start_s,
        clock.now(),
        streamed.ttft_s if streamed else None,
        prompt,
        streamed.output if streamed else [],
        streamed.cached_tokens if streamed else None,
        error,
    )


async def _slot(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    engine: str,
    workload: MultiRoundQA,
    users: list[int],
    budget: Budget,
    clock: Clock,
    records: list[Sent],
) -> None:
    """Run conversations of ``users`` in turn (cycling) until the budget is spent."""
    system = workload.system_prompt()
    for conversation in range(1 << 30):
        user = users[conversation % len(users)]
        history = system + workload.user_context(user)
        for round_index in range(workload.rounds):
            while endpoint.url is None:  # the victim being restarted: wait, do not count
                if budget.over(clock):
                    return
                await asyncio.sleep(0.2)
            if not budget.take(clock):
                return
            prompt = history + workload.question(user, round_index)
            sent = await _send(
                client, endpoint, engine, prompt, workload.answer_len, clock, (user, round_index)
            )
            records.append(sent)
            if sent.error is not None:
                await asyncio.sleep(0.2)
                break
            history = prompt + sent.output


async def run_conversations(
    endpoint: Endpoint,
    engine: str,
    workload: MultiRoundQA,
    *,
    slots: int,
    pool: list[int],
    budget: Budget,
    clock: Clock,
    records: list[Sent],
) -> None:
    """Keep ``slots`` conversations in flight until ``budget`` is spent.

    Slot ``s`` takes users ``pool[s], pool[s + slots], ...`` in turn, cycling.

    Args:
        endpoint: The engine.
        engine: Its name in the records.
        workload: Shape of each conversation.
        slots: Concurrent conversations.
        pool: Users to cycle through.
        budget: When to stop starting requests (shared by the slots).
        clock: The run's clock.
        records: Where each request's `Sent` is appended as it ends.
    """
    limits = client_limits(slots + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(
            *(
                _slot(client, endpoint, engine, workload, pool[s::slots], budget, clock, records)
                for s in range(slots)
            )
        )


async def run_sequential(
    endpoint: Endpoint, engine: str, prompts: list[list[int]], max_tokens: int, clock: Clock
) -> list[Sent]:
    """Send ``prompts`` one at a time, in order.

    Args:
        endpoint: The engine.
        engine: Its name in the records.
        prompts: The prompts.
        max_tokens: Tokens per answer.
        clock: The run's clock.

    Returns:
        One record per prompt, in order.
    """
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=client_limits(1)) as client:
        return [
            await _send(client, endpoint, engine, prompt, max_tokens, clock, (-1, i))
            for i, prompt in enumerate(prompts)
        ]
