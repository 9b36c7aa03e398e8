"""The chaos loop's plan: which event happens when, drawn from a seed.

`plan_events` is pure (a seeded ``random.Random``, no clock): the same seed and duration give the
same events, which is what makes a chaos run repeatable and its plan testable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SERVER_KILL = "server_kill"
"""SIGKILL the kvshelf server, then start it again on the same port with the same flags."""
SERVER_STALL = "server_stall"
"""SIGSTOP the kvshelf server, SIGCONT it the event's ``stall_s`` later."""
ENGINE_KILL = "engine_kill"
"""SIGKILL engine B's process group (API server and engine core), then start a new one."""
KINDS = (SERVER_KILL, SERVER_STALL, ENGINE_KILL)

EVENTS_PER_KIND_EVERY_S = 300.0
"""Each kind happens once per this many seconds of chaos phase (at least once)."""


@dataclass(frozen=True)
class PlannedEvent:
    """One event of the plan.

    Attributes:
        at_s: Seconds after the chaos phase began.
        kind: One of `KINDS`.
        stall_s: How long a `SERVER_STALL` keeps the server stopped; None for other kinds.
    """

    at_s: float
    kind: str
    stall_s: float | None = None


def plan_events(
    seed: int,
    duration_s: float,
    *,
    min_gap_s: float,
    warmup_s: float,
    kinds: tuple[str, ...] = KINDS,
    stall_seconds: tuple[float, ...] = (10.0,),
) -> list[PlannedEvent]:
    """Draw the events of a chaos phase.

    Every kind occurs ``max(1, duration_s // EVENTS_PER_KIND_EVERY_S)`` times, a stall that
    many times for each of ``stall_seconds``, in a shuffled order. The span
    ``[warmup_s, duration_s]`` is cut into equal slots, one event per slot, each
    at a random point of its slot at least ``min_gap_s / 2`` from the slot's edges when the
    slot is wide enough (else at its centre): neighbours are then ``min_gap_s`` apart.

    Args:
        seed: Seed of the draw.
        duration_s: Length of the chaos phase.
        min_gap_s: Least time between events.
        warmup_s: No event before this (the hit rate needs requests before the first restart).
        kinds: Kinds to draw.
        stall_seconds: The lengths of the stalls.

    Returns:
        The events, in time order.

    Raises:
        ValueError: for a non-positive duration, a warm-up not shorter than it, no kinds, or
            no or a non-positive stall length.
    """
    if duration_s <= 0 or not 0 <= warmup_s < duration_s or not kinds or min_gap_s < 0:
        raise ValueError(
            f"need 0 <= warmup_s < duration_s, min_gap_s >= 0 and kinds; got "
            f"warmup_s={warmup_s}, duration_s={duration_s}, min_gap_s={min_gap_s}, kinds={kinds}"
        )
    if not stall_seconds or min(stall_seconds) <= 0:
        raise ValueError(f"stall_seconds must be positive lengths, got {stall_seconds}")
    rng = random.Random(seed)
    repeats = max(1, int(duration_s // EVENTS_PER_KIND_EVERY_S))
    order = [
        (kind, stall_s)
        for kind in kinds
        for stall_s in (stall_seconds if kind == SERVER_STALL else (None,))
        for _ in range(repeats)
    ]
    rng.shuffle(order)
    slot = (duration_s - warmup_s) / len(order)
    jitter = max(0.0, (slot - min_gap_s) / 2)
    return [
        PlannedEvent(warmup_s + slot * (i + 0.5) + rng.uniform(-jitter, jitter), kind, stall_s)
        for i, (kind, stall_s) in enumerate(order)
    ]
