"""The test bed that tests and benchmarks share; import its modules, not this package.

- `server`: a real kvshelf server process (`ServerProcess`), `free_port`, arena helpers;
  neither torch nor vLLM.
- `scheduler`: vLLM's real ``Scheduler`` without a model (`make_scheduler`, `make_request`,
  `step`, ...); imports vLLM.
- `rig`: that scheduler with kvshelf's connector, both roles, and a real server
  (`ConnectorRig`); imports vLLM and torch.
- `kv_layouts`: KV caches laid out as vLLM 0.32 lays them out, per ``KVCacheLayout``
  (`make_kv_caches`); torch only.
- `worker`: drive the worker role against a real server (`store_and_lock`); no vLLM.
- `models`: random-weight Llama models built locally (`ModelSpec`, `TINY`, `build_model`).
- `prompts`: deterministic token-id prompts.
- `run_engine`: a real vLLM engine in a child process (`EngineSpec`, `run_engine`,
  `start_engine`); the child is ``python -m testbed.run_engine``.

It lives beside the package, not in it (the kvshelf wheel never ships it), and imports nothing
from `benchmarks`: benchmarks build on the test bed, not the other way round; kvshelf imports
nothing from either.
"""
