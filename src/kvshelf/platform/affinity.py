"""Which cores kvshelf's helper threads run on inside a vLLM CPU worker.

vLLM's CPU backend (``vllm.utils.ompmultiprocessing`` in vLLM 0.32) starts each worker process
with OpenMP binding variables that name the cores of its compute threads: ``OMP_PLACES`` and
``OMP_PROC_BIND``, or ``KMP_AFFINITY`` (``proclist=[...]``) with Intel's OpenMP and
``GOMP_CPU_AFFINITY`` with GNU's preloaded. With ``VLLM_CPU_OMP_THREADS_BIND=auto`` those are
the CPUs of the engine process's mask minus ``VLLM_CPU_NUM_OF_RESERVED_CPU`` taken from the end,
with an explicit list they are that list, and with ``nobind`` nothing is set. The OpenMP runtime
binds the worker's main thread as soon as torch loads it, and a thread inherits its creator's
binding, so a helper thread started by the worker would share the model's core. The cores the
variables leave out are the ones vLLM keeps free for everything else: helper threads belong
there, but only those that no other rank computes on either. A worker sees only its own
binding: with an explicit list the other ranks' CPUs are the other ``|``-separated lists of
``VLLM_CPU_OMP_THREADS_BIND`` (inherited by every worker); with ``auto`` each rank has a NUMA node
of its own, so only CPUs of this rank's nodes can be spare (unless ``VLLM_CPU_SIM_MULTI_NUMA``
splits one node between ranks, which a worker cannot see: then none is).

No torch import: the server's prefault uses :func:`pin_current_thread`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

_ABSTRACT_PLACES = re.compile(r"^\s*(threads|cores|sockets|ll_caches|numa_domains)\b")
# One place of an OMP_PLACES list: "{resources}" with an optional ":count[:stride]" repeat.
_PLACE = re.compile(r"\{([\d:,]+)\}((?::\d+){0,2})(?:,|$)")


def parse_cpu_ranges(text: str) -> frozenset[int]:
    """Parse a CPU list such as ``0-3,8`` or ``0 2 4-15:2`` (ranges with optional strides).

    Args:
        text: ids, ``first-last`` or ``first-last:stride`` items, separated by commas or spaces.

    Returns:
        The CPU ids.

    Raises:
        ValueError: an item that is none of these.
    """
    cpus: set[int] = set()
    for item in text.replace(",", " ").split():
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", item)
        if match is None:
            raise ValueError(f"bad CPU list item {item!r}")
        first = int(match[1])
        last = int(match[2]) if match[2] else first
        stride = int(match[3]) if match[3] else 1
        if last < first or stride < 1:
            raise ValueError(f"bad CPU range {item!r}")
        cpus.update(range(first, last + 1, stride))
    return frozenset(cpus)


def _interval(text: str) -> tuple[int, int, int]:
    """Parse an OpenMP interval ``start[:length[:stride]]`` into its three numbers."""
    parts = [int(p) for p in text.split(":")]
    if not 1 <= len(parts) <= 3 or min(parts) < 0:
        raise ValueError(f"bad OpenMP interval {text!r}")
    start, length, stride = (*parts, 1, 1)[:3]
    return start, length, stride


def parse_omp_places(text: str) -> frozenset[int] | None:
    """Return the CPUs of an explicit ``OMP_PLACES`` list.

    For example ``{0,1,2}`` (one place of three CPUs, as vLLM writes it), ``{0:4},{4:4}`` (two
    places of four) or ``{0}:4:2`` (a place repeated 4 times, 2 CPUs apart).

    Args:
        text: the variable's value.

    Returns:
        The union of all places, or None for abstract names (``cores``...) and exclusions
        (``!``), which do not name CPUs.

    Raises:
        ValueError: a malformed list.
    """
    if _ABSTRACT_PLACES.match(text) or "!" in text:
        return None
    text = text.replace(" ", "")
    cpus: set[int] = set()
    pos = 0
    while pos < len(text):
        match = _PLACE.match(text, pos)
        if match is None:
            raise ValueError(f"bad OMP_PLACES {text!r}")
        pos = match.end()
        place: set[int] = set()
        for resource in match[1].split(","):
            start, length, stride = _interval(resource)
            place.update(start + i * stride for i in range(length))
        _, count, step = _interval("0" + match[2])
        for k in range(count):
            cpus.update(cpu + k * step for cpu in place)
    return frozenset(cpus) or None


def openmp_bound_cpus(env: Mapping[str, str]) -> frozenset[int] | None:
    """Return the CPUs the OpenMP runtime binds this process's threads to, per ``env``.

    Args:
        env: the process environment.

    Returns:
        The bound CPUs, or None when threads are not bound or the variables do not say to
        which CPUs (abstract places, an affinity type without a list, a malformed value).
    """
    try:
        kmp = env.get("KMP_AFFINITY")
        if kmp is not None:
            proclist = re.search(r"proclist=\[([^\]]*)\]", kmp)
            return parse_cpu_ranges(re.sub(r"[{}]", " ", proclist[1])) if proclist else None
        if env.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_ranges(env["GOMP_CPU_AFFINITY"]) or None
        places = env.get("OMP_PLACES")
        if places and env.get("OMP_PROC_BIND", "true").strip().lower() != "false":
            return parse_omp_places(places)
    except ValueError as exc:
        logger.debug("cannot tell which CPUs OpenMP binds to: %s", exc)
    return None


def other_ranks_cpus(env: Mapping[str, str]) -> frozenset[int] | None:
    """Return the CPUs that any rank of this engine computes on, per ``env``, where vLLM says.

    Args:
        env: a worker's environment.

    Returns:
        The union of an explicit ``VLLM_CPU_OMP_THREADS_BIND`` (``0-3|4-7``: one list per rank);
        None for ``auto`` and ``nobind``, which name no CPUs, or a malformed list.
    """
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if bind in ("auto", "nobind", ""):
        return None
    try:
        return frozenset().union(*(parse_cpu_ranges(part) for part in bind.split("|")))
    except ValueError as exc:
        logger.debug("cannot tell which CPUs vLLM's ranks compute on: %s", exc)
        return None


def spare_cpus(
    allowed: Collection[int],
    env: Mapping[str, str],
    numa_nodes: Collection[frozenset[int]] = (),
) -> frozenset[int] | None:
    """Return the CPUs of ``allowed`` that neither this rank nor another computes on.

    Args:
        allowed: the CPUs the process may use.
        env: its environment (see :func:`openmp_bound_cpus` and :func:`other_ranks_cpus`).
        numa_nodes: the CPUs of each NUMA node; with ``auto`` binding, only the nodes of this
            rank's CPUs can hold spare ones (the other nodes are other ranks'). Empty: one node.

    Returns:
        The free CPUs, or None when threads are not bound, the binding is unknown, or it takes
        every allowed CPU: then there is no better place for a helper thread than the one it
        inherits.
    """
    bound = openmp_bound_cpus(env)
    if bound is None:
        return None
    free = frozenset(allowed) - bound
    ranks = other_ranks_cpus(env)
    if ranks is not None:
        free -= ranks
    elif "VLLM_CPU_SIM_MULTI_NUMA" in env:
        return None
    elif len(numa_nodes) > 1:
        free &= frozenset().union(*(node for node in numa_nodes if node & bound))
    return free or None


def numa_node_cpus(root: Path = Path("/sys/devices/system/node")) -> list[frozenset[int]]:
    """Return the CPUs of each NUMA node of this machine (empty where Linux does not say)."""
    nodes = []
    for cpulist in sorted(root.glob("node[0-9]*/cpulist")):
        try:
            nodes.append(parse_cpu_ranges(cpulist.read_text()))
        except (OSError, ValueError):
            return []
    return nodes


def worker_spare_cpus() -> frozenset[int] | None:
    """Return the CPUs vLLM leaves free of compute threads in this (worker) process.

    The allowed CPUs are the parent's: the OpenMP runtime has already narrowed this process's
    main thread, while vLLM chose compute and reserved cores from the mask of the engine
    process that started this worker.

    Returns:
        See :func:`spare_cpus`.
    """
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        allowed = os.sched_getaffinity(0)
    return spare_cpus(allowed, os.environ, numa_node_cpus())


def pin_current_thread(cpus: Collection[int] | None) -> bool:
    """Run the calling thread (only it, on Linux) on ``cpus`` from now on.

    Args:
        cpus: the CPUs; None or empty leaves the affinity as it is.

    Returns:
        Whether the affinity was set.
    """
    if not cpus:
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.debug("cannot pin thread to CPUs %s: %s", sorted(cpus), exc)
        return False
    return True


def limit_openmp_team(threads: int = 1) -> bool:
    """Limit the parallel regions the calling thread starts to ``threads`` OpenMP threads.

    This sets the OpenMP runtime's thread count of the calling thread only. With one thread,
    torch runs the thread's kernels inline instead of starting a parallel region, in which the
    runtime would rebind the thread to a compute place and run team threads there.

    Args:
        threads: the team size.

    Returns:
        Whether an OpenMP runtime is loaded (and the limit set).
    """
    try:
        set_num_threads = ctypes.CDLL(None).omp_set_num_threads
    except AttributeError:
        return False
    set_num_threads.argtypes = [ctypes.c_int]
    set_num_threads.restype = None
    set_num_threads(threads)
    return True
