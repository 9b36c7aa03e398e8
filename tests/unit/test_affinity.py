"""Choosing and applying the CPUs of kvshelf's helper threads: kvshelf.platform.affinity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvshelf.platform.affinity import (
    numa_node_cpus,
    openmp_bound_cpus,
    parse_cpu_ranges,
    parse_omp_places,
    pin_current_thread,
    spare_cpus,
)

CPUS = range(8)


def test_parse_cpu_ranges() -> None:
    assert parse_cpu_ranges("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_ranges(" 0 2 4-10:3 ") == {0, 2, 4, 7, 10}
    assert parse_cpu_ranges("") == frozenset()
    for bad in ("x", "3-1", "1-4:0", "1,-2"):
        with pytest.raises(ValueError):
            parse_cpu_ranges(bad)


@pytest.mark.parametrize(
    ("places", "cpus"),
    [
        ("{0,1,2}", {0, 1, 2}),  # what vLLM writes: one place of all compute CPUs
        ("{0},{1},{2}", {0, 1, 2}),
        ("{0:4}", {0, 1, 2, 3}),
        ("{0:2:4},{1:2:4}", {0, 4, 1, 5}),
        ("{0}:4:2", {0, 2, 4, 6}),
        ("{0,1}:2", {0, 1, 2}),
        (" {3} , {5} ", {3, 5}),
        ("cores", None),
        ("threads(4)", None),
        ("{0:4},!{1}", None),
    ],
)
def test_parse_omp_places(places: str, cpus: set[int] | None) -> None:
    assert parse_omp_places(places) == (None if cpus is None else frozenset(cpus))


@pytest.mark.parametrize("places", ["{0", "0,1", "{a}", "{0}{1}", "{0}:1:2:3"])
def test_malformed_omp_places(places: str) -> None:
    with pytest.raises(ValueError):
        parse_omp_places(places)


@pytest.mark.parametrize(
    ("env", "spare"),
    [
        # VLLM_CPU_OMP_THREADS_BIND=auto with VLLM_CPU_NUM_OF_RESERVED_CPU=2 on 8 CPUs.
        ({"OMP_PLACES": "{0,1,2,3,4,5}", "OMP_PROC_BIND": "true"}, {6, 7}),
        # An explicit VLLM_CPU_OMP_THREADS_BIND=2-5 with Intel's OpenMP preloaded.
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3,4,5]"}, {0, 1, 6, 7}),
        ({"KMP_AFFINITY": "explicit,proclist=[{0,1},{2-5}]"}, {6, 7}),
        # GNU OpenMP preloaded.
        ({"GOMP_CPU_AFFINITY": "0 1 2 3 4 5 6"}, {7}),
        # OMP_PROC_BIND unset still binds when places are given.
        ({"OMP_PLACES": "{0:4}"}, {4, 5, 6, 7}),
        # VLLM_CPU_OMP_THREADS_BIND=nobind: nothing set, nothing bound.
        ({}, None),
        ({"OMP_PLACES": "{0}", "OMP_PROC_BIND": "false"}, None),
        # Every CPU computes (too few CPUs to reserve one): nowhere better to go.
        ({"OMP_PLACES": "{0,1,2,3,4,5,6,7}"}, None),
        # Bindings that name no CPUs.
        ({"OMP_PLACES": "cores"}, None),
        ({"KMP_AFFINITY": "compact"}, None),
        ({"OMP_PLACES": "{zero}"}, None),
    ],
)
def test_spare_cpus(env: dict[str, str], spare: set[int] | None) -> None:
    assert spare_cpus(CPUS, env) == (None if spare is None else frozenset(spare))


@pytest.mark.parametrize(
    ("env", "numa_nodes", "spare"),
    [
        # TP=2 with VLLM_CPU_OMP_THREADS_BIND=0|1: CPU 1 is rank 1's compute core, not a spare
        # one for rank 0.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_PLACES": "{0}"}, [], set(range(2, 8))),
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-2|3-5", "OMP_PLACES": "{0,1,2}"}, [], {6, 7}),
        # A malformed list names no other rank's CPUs: only this rank's are left out.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-2|x", "OMP_PLACES": "{0,1,2}"}, [], {3, 4, 5, 6, 7}),
        # auto over two NUMA nodes: rank 0 computes on 0-2 of node 0, rank 1 on node 1.
        ({"OMP_PLACES": "{0,1,2}"}, [frozenset(range(4)), frozenset(range(4, 8))], {3}),
        # auto with nodes simulated by vLLM: which CPUs the others use cannot be told.
        ({"OMP_PLACES": "{0,1,2}", "VLLM_CPU_SIM_MULTI_NUMA": "1"}, [], None),
    ],
)
def test_spare_cpus_leave_out_every_rank_s_compute_cpus(
    env: dict[str, str], numa_nodes: list[frozenset[int]], spare: set[int] | None
) -> None:
    assert spare_cpus(CPUS, env, numa_nodes) == (None if spare is None else frozenset(spare))


def test_two_ranks_on_two_cpus_leave_no_spare_cpu() -> None:
    # What the TP=2 engine tests run here: vLLM reserves none, so there is none.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}
    assert spare_cpus({0, 1}, env) is None


def test_numa_node_cpus_reads_each_node_s_list(tmp_path: Path) -> None:
    for node, cpus in ((0, "0-3\n"), (1, "4-7\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus)
    assert numa_node_cpus(tmp_path) == [frozenset(range(4)), frozenset(range(4, 8))]
    assert numa_node_cpus(tmp_path / "absent") == []


def test_openmp_bound_cpus_prefers_the_runtime_specific_variables() -> None:
    env = {"OMP_PLACES": "{0}", "GOMP_CPU_AFFINITY": "1", "KMP_AFFINITY": "proclist=[2]"}
    assert openmp_bound_cpus(env) == {2}
    del env["KMP_AFFINITY"]
    assert openmp_bound_cpus(env) == {1}


def test_pin_current_thread_pins_only_that_thread() -> None:
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    seen: dict[str, object] = {}

    def run() -> None:
        seen["pinned"] = pin_current_thread({cpu})
        seen["cpus"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == {"pinned": True, "cpus": {cpu}}
    assert os.sched_getaffinity(0) == before
    assert not pin_current_thread(None) and not pin_current_thread(set())


# A thread pinned off the OpenMP place runs torch copies; with OMP_NUM_THREADS=2 each copy
# starts a parallel region unless the thread's team is limited to one thread.
PROBE = """
import json, os, threading, torch
from kvshelf.platform.affinity import limit_openmp_team, pin_current_thread
spare = int(os.environ["SPARE_CPU"])
out = {}
def run(limit):
    torch.get_num_threads()
    pin_current_thread({spare})
    if limit:
        out["limited"] = limit_openmp_team(1)
    src = torch.ones(1 << 22)
    torch.index_select(src.view(-1, 16), 0, torch.arange(1 << 17))
    out[f"cpus_limit_{limit}"] = sorted(os.sched_getaffinity(0))
for limit in (False, True):
    thread = threading.Thread(target=run, args=(limit,))
    thread.start()
    thread.join()
out["main_threads"] = torch.get_num_threads()
print(json.dumps(out))
"""


def test_limited_openmp_team_keeps_a_pinned_thread_off_the_compute_place() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    compute, spare = allowed[0], allowed[-1]
    env = {
        **os.environ,
        "OMP_PLACES": f"{{{compute}}}",
        "OMP_PROC_BIND": "true",
        "OMP_NUM_THREADS": "2",
        "SPARE_CPU": str(spare),
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    # Without the limit the OpenMP runtime moved the thread back to the compute place.
    assert out["cpus_limit_False"] == [compute]
    assert out == {
        "cpus_limit_False": [compute],
        "limited": True,
        "cpus_limit_True": [spare],
        "main_threads": 2,
    }
