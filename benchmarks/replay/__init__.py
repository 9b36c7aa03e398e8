"""Lazy offload replay benchmark: eager, lazy FIFO and newer policies side by side, under load.

Each run replays one seeded workload at one concurrency in one mode through `ConnectorRig`:
vLLM's real ``Scheduler`` and ``BlockPool``, kvshelf's real scheduler-role connector, a real
kvshelf server (one process per run, so modes never share cache contents) and a worker side
that really copies KV pages in and out, so every hit counted is a real hit. Mode ``none`` runs
the same scheduler with no connector at all. No model runs: sampled tokens are made up,
deterministically per request and position, so every mode sees the same requests.

Workloads (closed loop: each of ``concurrency`` sessions has one request in flight, and its next
turn is submitted when that request finishes):

- ``chat``: each turn's prompt is the previous prompt, the previous output and a new user
  message, so histories grow; a conversation that would outgrow ``max_model_len`` starts over.
- ``agent``: a long system prompt shared by every agent, a per-agent task, then one tool call
  (the output) and one tool result appended per turn; a full context starts a new task.
- ``unique``: a fresh random prompt every turn, never reused: pure connector overhead.

vLLM's KV cache holds ``gpu_blocks_per_session`` blocks per session, fewer than the sessions'
histories need, so vLLM evicts its own prefix cache and later turns can only hit through
kvshelf. Per run it reports:

- hit rates over the turns after a warm-up: prompt tokens not recomputed over prompt tokens,
  split into vLLM's own prefix cache and kvshelf, from the prefill stats the scheduler reports;
- blocks stored (worker counters, cross-checked by the server's committed objects), and lazy
  offload's requests skipped on a block hash mismatch;
- connector time per scheduler step that schedules tokens: the five scheduler-side hooks, timed
  around the connector instance's methods (wall time, mean and p99, and CPU time);
- once vLLM's engine loop would go idle (no request, no store work the connector asks it to
  step for): blocks lazy offload still protects, references still held on vLLM's blocks, and
  the tail: buffered store work never submitted, in blocks and requests.

Modules: `config` (modes, `ReplayConfig`), `workloads` (chat, agent, unique), `loop` (the closed
loop over vLLM's scheduler), `backends` (no connector, or the connector rig with its server),
`measurement` (hook timer, hit rates, step times), `report` (table and plot), `run` (``make
bench-lazy``). The test bed it drives is `testbed`.
"""
