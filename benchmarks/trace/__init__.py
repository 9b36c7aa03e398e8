"""``make bench-trace``: which blocks to keep, measured on the Mooncake traces.

- :mod:`.traces`: the traces as the cache server sees them, vLLM's own prefix cache in front;
- :mod:`.reference`: offline reference policies (S3-FIFO, ARC, Belady) for the simulator;
- :mod:`.sim`: the replay in process, any policy; where the server's policy was designed;
- :mod:`.server_replay`: the same demands through a real ``kvshelf server``;
- :mod:`.run`: the command line, the results file and the plot.
"""
