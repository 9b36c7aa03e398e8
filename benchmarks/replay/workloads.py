"""The workloads of ``make bench-lazy``: seeded sessions of turns, and the made-up sampler.

``chat``, ``agent`` and ``unique`` (see `benchmarks.replay`); equal seeds give equal turns
and equal sampled tokens in every process and mode. Imports no vLLM at run time.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from testbed.prompts import FIRST_ORDINARY_ID, ORDINARY_VOCAB, random_tokens

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    Attributes:
        prompt: the prompt token ids.
        max_tokens: tokens to generate (eos is ignored, so exactly this many).
    """

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class _SessionState:
    conversation: int = 0
    turn: int = 0


class Workload(ABC):
    """A seeded, reproducible source of turns for a number of sessions.

    A session runs conversations one after the other; a conversation is a sequence of turns,
    each one extending the previous turn's prompt and output (``follow_up``), until the next
    turn would not fit in ``max_model_len``.

    Args:
        seed: the workload seed; equal seeds give equal turns in every process.
        max_model_len: longest prompt plus output.
    """

    name: ClassVar[str]

    def __init__(self, seed: int, max_model_len: int) -> None:
        self.seed = seed
        self.max_model_len = max_model_len
        self._sessions: dict[int, _SessionState] = {}

    def first_turn(self, session: int) -> Turn:
        """The opening turn of ``session``."""
        self._sessions[session] = _SessionState()
        return self._open(session)

    def next_turn(self, session: int, previous: Turn, output: Sequence[int]) -> Turn:
        """The turn after ``previous``, whose generated tokens were ``output``.

        Args:
            session: the session index.
            previous: the session's last turn.
            output: the tokens generated for it.

        Returns:
            The continuation of the conversation, or a new conversation when it would not fit.
        """
        state = self._sessions[session]
        state.turn += 1
        rng = self._rng(session, "turn")
        max_tokens = self._output_len(rng)
        follow_up = self._follow_up(rng, self._key(session, "follow-up"))
        if follow_up is not None:
            prompt = (*previous.prompt, *output, *follow_up)
            if len(prompt) + max_tokens <= self.max_model_len:
                return Turn(prompt, max_tokens)
        state.conversation += 1
        state.turn = 0
        return self._open(session)

    def _open(self, session: int) -> Turn:
        rng = self._rng(session, "open")
        max_tokens = self._output_len(rng)
        prompt = self._opening(rng, self._key(session, "opening"))
        assert len(prompt) + max_tokens <= self.max_model_len, "opening turn too long"
        return Turn(tuple(prompt), max_tokens)

    def _key(self, session: int, what: str) -> str:
        state = self._sessions[session]
        return f"{self.seed}:{self.name}:{session}:{state.conversation}:{state.turn}:{what}"

    def _rng(self, session: int, what: str) -> random.Random:
        return random.Random(self._key(session, what))

    @abstractmethod
    def _output_len(self, rng: random.Random) -> int:
        """Draw the number of tokens to generate for a turn.

        Args:
            rng: the turn's random source.

        Returns:
            The ``max_tokens`` of the turn.
        """

    @abstractmethod
    def _opening(self, rng: random.Random, key: str) -> list[int]:
        """Make the prompt that opens a conversation.

        Args:
            rng: the turn's random source (lengths).
            key: the seed of the turn's token ids.

        Returns:
            The prompt.
        """

    @abstractmethod
    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        """Make the tokens appended after the previous prompt and output.

        Args:
            rng: the turn's random source (lengths).
            key: the seed of the appended token ids.

        Returns:
            The tokens, or None for a workload whose conversations never continue.
        """


class ChatWorkload(Workload):
    """Multi-turn chat: prompt = previous prompt + previous answer + a new user message."""

    name = "chat"
    MESSAGE_TOKENS = (32, 128)
    ANSWER_TOKENS = (8, 32)

    def _output_len(self, rng: random.Random) -> int:
        return rng.randint(*self.ANSWER_TOKENS)

    def _opening(self, rng: random.Random, key: str) -> list[int]:
        return random_tokens(rng.randint(*self.MESSAGE_TOKENS), seed=key)

    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        return random_tokens(rng.randint(*self.MESSAGE_TOKENS), seed=key)


class AgentWorkload(Workload):
    """Agent loop: shared system prompt + per-agent task, then tool calls and tool results."""

    name = "agent"
    SYSTEM_TOKENS = 384
    TASK_TOKENS = (48, 96)
    TOOL_CALL_TOKENS = (16, 32)
    TOOL_RESULT_TOKENS = (32, 128)

    def __init__(self, seed: int, max_model_len: int) -> None:
        super().__init__(seed, max_model_len)
        system_tokens = min(self.SYSTEM_TOKENS, max_model_len // 2)
        self.system_prompt = random_tokens(system_tokens, seed=f"{seed}:{self.name}:system")

    def _output_len(self, rng: random.Random) -> int:
        return rng.randint(*self.TOOL_CALL_TOKENS)

    def _opening(self, rng: random.Random, key: str) -> list[int]:
        return self.system_prompt + random_tokens(rng.randint(*self.TASK_TOKENS), seed=key)

    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        return random_tokens(rng.randint(*self.TOOL_RESULT_TOKENS), seed=key)


class UniqueWorkload(Workload):
    """A fresh random prompt every turn: nothing to reuse, only overhead to measure."""

    name = "unique"
    PROMPT_TOKENS = (128, 448)
    OUTPUT_TOKENS = (8, 32)

    def _output_len(self, rng: random.Random) -> int:
        return rng.randint(*self.OUTPUT_TOKENS)

    def _opening(self, rng: random.Random, key: str) -> list[int]:
        high = min(self.PROMPT_TOKENS[1], self.max_model_len - self.OUTPUT_TOKENS[1])
        return random_tokens(rng.randint(self.PROMPT_TOKENS[0], high), seed=key)

    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        return None


WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls for cls in (ChatWorkload, AgentWorkload, UniqueWorkload)
}


def sampled_token(seed: int) -> Callable[[Request], int]:
    """The made-up sampler: a token that depends only on the request id and the position.

    Args:
        seed: the run seed.

    Returns:
        A function of the request that returns its next token.
    """

    def sample(request: Request) -> int:
        key = f"{seed}:{request.request_id}:{len(request.output_token_ids)}"
        return random.Random(key).randrange(FIRST_ORDINARY_ID, ORDINARY_VOCAB)

    return sample
