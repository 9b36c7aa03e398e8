"""The closed loop of ``make bench-lazy``: sessions submit turns to vLLM's scheduler.

Each session has one request in flight; its next turn is submitted when that request finishes.
The loop steps like vLLM's engine loop, while the scheduler has requests (the connector can
extend that), through whichever backend's step function it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs

from benchmarks.replay.measurement import Finished
from benchmarks.replay.workloads import Turn, Workload
from testbed.vllm_scheduler import make_request


@dataclass
class Traffic:
    """What the replay loop observed."""

    finished: list[Finished] = field(default_factory=list)
    steps: int = 0
    busy_steps: int = 0
    preemptions: int = 0


def closed_loop(
    scheduler: Scheduler,
    engine_step: Callable[[], tuple[SchedulerOutput, EngineCoreOutputs]],
    workload: Workload,
    *,
    concurrency: int,
    turns: int,
    block_size: int,
    step_limit: int,
    after_step: Callable[[SchedulerOutput], None] | None = None,
) -> Traffic:
    """Run the closed loop until every session has run ``turns`` turns and vLLM is idle.

    Returns:
        Finished requests with their prefill breakdown, and step counts.
    """
    traffic = Traffic()
    live: dict[str, tuple[int, int, Turn]] = {}
    outputs: dict[str, list[int]] = {}
    stats: dict[str, Any] = {}

    def submit(session: int, turn_index: int, turn: Turn) -> None:
        request_id = f"{workload.name}-s{session}-t{turn_index}"
        live[request_id] = (session, turn_index, turn)
        outputs[request_id] = []
        scheduler.add_request(
            make_request(request_id, turn.prompt, max_tokens=turn.max_tokens, block_size=block_size)
        )

    for session in range(concurrency):
        submit(session, 0, workload.first_turn(session))
    # vLLM's engine loop steps while the scheduler has requests (the connector can extend it).
    while scheduler.has_requests():
        if traffic.steps >= step_limit:
            raise RuntimeError(f"{workload.name}: still busy after {step_limit} steps")
        scheduler_output, engine_outputs = engine_step()
        traffic.steps += 1
        traffic.busy_steps += scheduler_output.total_num_scheduled_tokens > 0
        traffic.preemptions += len(scheduler_output.preempted_req_ids or ())
        if after_step is not None:
            after_step(scheduler_output)
        for output in engine_outputs.outputs:
            outputs[output.request_id].extend(output.new_token_ids)
            if output.prefill_stats is not None:
                stats[output.request_id] = output.prefill_stats
            if not output.finished:
                continue
            session, turn_index, turn = live.pop(output.request_id)
            prefill = stats.pop(output.request_id)
            output_tokens = outputs.pop(output.request_id)
            traffic.finished.append(
                Finished(
                    request_id=output.request_id,
                    session=session,
                    turn=turn_index,
                    prompt_tokens=prefill.num_prompt_tokens,
                    local_tokens=prefill.num_local_cached_tokens,
                    external_tokens=prefill.num_external_cached_tokens,
                )
            )
            if turn_index + 1 < turns:
                next_turn = workload.next_turn(session, turn, output_tokens)
                submit(session, turn_index + 1, next_turn)
    assert not live, "every request finished"
    return traffic
