"""Research benchmarks: kvshelf against recompute, vLLM's own cache and LMCache, on real engines.

One module or package per ``make bench-*`` target (`e2e`, `serve`, `tiers`, `trace`, `chaos`,
`hybrid`, `hybrid_decode`, `router_sim`, `replay`, `tp_stop`), the `demo` behind ``make demo``,
the GPU probes behind ``make gpu-check`` and small cost probes (`event_cost`, `handler_timing`,
`page_table_cost`). Run from a source checkout (``python -m benchmarks.<name>``); not part of
the kvshelf wheel. They build on the test bed (`testbed`) and kvshelf's public modules; kvshelf
never imports from here.
"""
