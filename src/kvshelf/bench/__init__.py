"""Benchmarks, one module or package per benchmark: `transfer`, `replay` (``kvshelf bench
lazy``), `e2e` (``make bench-e2e``) and the `demo`.

They build on the test bed in `kvshelf.testbed` (server process, model-less scheduler, rig,
local models, prompts, engine runner); nothing there imports from here.
"""
