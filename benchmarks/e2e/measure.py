"""Machine-level measurements of ``make bench-e2e``: the memcpy reference and child CPU use.

`measure_memcpy` is the bandwidth a load is compared with; `descendants_cpu_s` and `wait_quiet`
read how busy the engines and cache servers this process started are (store tails, CPU cost).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import psutil


def descendants_cpu_s() -> float:
    """Return the CPU seconds used so far by every live descendant of this process."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def wait_quiet(window_s: float = 0.25, busy: float = 0.1, timeout_s: float = 60.0) -> float:
    """Wait until the engines and cache servers this process started are idle.

    Idle: together they use less than ``busy`` of a core over ``window_s``. A paused engine
    uses under 1% of a core; stores still in flight after a request returned use a whole one.

    Args:
        window_s: Length of the measuring window.
        busy: Fraction of one core that still counts as idle.
        timeout_s: Give up after this long.

    Returns:
        Seconds until the first idle window began (the store tail, for a storing engine).
    """
    start = time.perf_counter()
    while True:
        begin = time.perf_counter()
        before = descendants_cpu_s()
        time.sleep(window_s)
        if descendants_cpu_s() - before < busy * window_s:
            return begin - start
        if begin - start > timeout_s:
            raise TimeoutError(f"engines still busy after {timeout_s} s")


def measure_memcpy(mib: int, repeats: int = 7) -> dict[str, float]:
    """Measure a cache-cold memory copy with one and with two torch threads.

    Source and destination are ``mib`` MiB each, so one copy touches twice that (more than
    the last-level cache when ``mib`` is large); 1- and 2-thread repetitions alternate, so
    noise from other processes hits both alike.

    Args:
        mib: Buffer size in MiB.
        repeats: Timed copies per thread count (after one warm-up each).

    Returns:
        ``memcpy_1t_gbps`` and ``memcpy_2t_gbps`` (1e9 bytes/s, medians).
    """
    import torch

    threads_before = torch.get_num_threads()
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        for rep in range(repeats + 1):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                start = time.perf_counter()
                dst.copy_(src)
                if rep > 0:
                    times[threads].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads_before)
    return {f"memcpy_{t}t_gbps": (mib << 20) / statistics.median(times[t]) / 1e9 for t in (1, 2)}
