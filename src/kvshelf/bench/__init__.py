"""``kvshelf bench``: the benchmark an operator runs on their own hardware.

`transfer` stores and loads batches of KV blocks through a real server and its arena beside a
raw memory copy of the same bytes: what this machine's memory gives kvshelf, with nothing but
kvshelf and torch installed. The research benchmarks that compare kvshelf with its peers, and
the test bed they share with the tests, live outside the package (``benchmarks/`` and
``testbed/`` in the source tree) and are not installed with it.
"""
