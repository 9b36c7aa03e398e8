"""Offload modes: when the scheduler role hands store work to the workers, and what a finished
request's blocks wait for.

``OffloadMode`` is the interface the scheduler role calls; ``EagerOffload`` is the default
mode, and ``kvshelf.lazy.offloader.LazyOffloader`` the lazy one. The scheduler role names no
mode but the default: the connector builds the mode and hands it over. This module imports
neither vLLM nor ``kvshelf.lazy`` (lazy offload depends on it, not the other way round).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvshelf.plan import StoreJob


class OffloadMode(ABC):
    """What the scheduler role does with the store work it makes.

    The scheduler role makes a ``StoreJob`` for each request's newly computed full blocks,
    every step (or once, when the request finishes, if ``capture_on_finish``), and passes it to
    ``add``; each step it submits to the workers what ``drain`` returns, and accounts it until
    every worker reports it, then calls ``store_completed``.

    Contract: every block id of a job returned by ``drain`` holds the KV its hash names until
    ``store_completed`` is called for that job's request, whether the mode keeps the blocks
    by itself or asks vLLM to keep them (``finish`` returning True).
    """

    @property
    @abstractmethod
    def capture_on_finish(self) -> bool:
        """Whether store work is made once, when a request finishes, instead of every step."""

    @abstractmethod
    def add(self, job: StoreJob, frees_early: Sequence[int] = ()) -> None:
        """Take one job of store work: submit it this step, or keep it for later.

        Args:
            job: the store work.
            frees_early: the job's blocks of window groups, which vLLM frees while their
                request runs (given only when the job is made in the step that computes them).
        """

    @abstractmethod
    def drain(self, num_scheduled_tokens: int) -> list[StoreJob]:
        """The jobs to submit to the workers this step.

        Args:
            num_scheduled_tokens: the step's total scheduled tokens (0: vLLM runs no forward
                pass this step).
        """

    @abstractmethod
    def finish(self, request_id: str, *, stores_in_flight: bool) -> bool:
        """Note that vLLM finished a request.

        Args:
            request_id: the finished request.
            stores_in_flight: whether jobs of it were submitted and not yet reported by every
                worker.

        Returns:
            True when vLLM must keep the request's blocks until the workers report its stores.
        """

    @abstractmethod
    def store_completed(self, request_id: str) -> int:
        """Every worker reported every submitted job of ``request_id``.

        Returns:
            The number of GPU block references the mode dropped (0 when it held none).
        """

    @abstractmethod
    def has_pending_work(self) -> bool:
        """Whether vLLM should keep stepping, idle or not, for this mode's sake."""

    @abstractmethod
    def snapshot(self) -> dict[str, int]:
        """The mode's own counters and gauges, by name (flat ints, read every step)."""

    def note_stored(self, block_hashes: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Learn block hashes the server holds (a lookup hit); a mode may skip storing them."""

    def note_missing(self, block_hashes: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Learn block hashes the server does not hold (a lookup miss), whatever the mode
        believed: they must be stored again (e.g. after the server restarted empty)."""


class EagerOffload(OffloadMode):
    """Submit store work in the step that makes it.

    A finished request whose stores are still in flight keeps its blocks through vLLM's
    delayed free; the mode itself holds no block.
    """

    def __init__(self) -> None:
        # This step's jobs, in the order they were made.
        self._jobs: list[StoreJob] = []

    @property
    def capture_on_finish(self) -> bool:
        return False

    def add(self, job: StoreJob, frees_early: Sequence[int] = ()) -> None:
        # Submitted this step; the workers copy out blocks vLLM frees before the next one.
        self._jobs.append(job)

    def drain(self, num_scheduled_tokens: int) -> list[StoreJob]:
        jobs, self._jobs = self._jobs, []
        return jobs

    def finish(self, request_id: str, *, stores_in_flight: bool) -> bool:
        return stores_in_flight

    def store_completed(self, request_id: str) -> int:
        return 0

    def has_pending_work(self) -> bool:
        return False

    def snapshot(self) -> dict[str, int]:
        return {}
