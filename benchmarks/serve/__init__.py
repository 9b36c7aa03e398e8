"""``make bench-serve``: vLLM's own ``bench serve`` client against vLLM's OpenAI server with no
connector, with kvshelf and with LMCache 0.5.6, same engine settings, same requests, one run.

Part 2 of the trace benchmark of issue 36 (part 1, ``make bench-trace``, replays the Mooncake
traces block by block through a kvshelf server): here the traces, scaled, and vLLM's
``prefix_repetition`` dataset go through real engines. `run` orchestrates, `workloads` says
what is sent (and converts traces), `report` builds rows, ratios and tables, `client` is the
only module that imports vLLM (a child process).
"""
