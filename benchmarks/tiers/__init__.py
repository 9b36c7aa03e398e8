"""``make bench-tiers``: loads from kvshelf's disk tier (L2) against L1 and a plain file read.

`benchmarks.tiers.run` fills a disk tier from a storing engine, restarts the server on the
filled directory (L1 empty) and has fresh engines load the prompts with the page cache cold and
warm; `benchmarks.tiers.raw` is the plain sequential read of the same bytes each load is
compared with. Results go to ``bench/results/tiers.json``.
"""
