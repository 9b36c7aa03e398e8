"""``make bench-chaos``'s pieces that need no engine: the seeded plan, the figures, the targets,
the plot and the flags. (The harness itself starts three vLLM servers, minutes on this test bed:
it runs as ``make bench-chaos``, not in ``make test``.)"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import itertools
import json
import mmap
import os
import signal
import threading
import time

import httpx
import pytest

from benchmarks.chaos import analysis
from benchmarks.chaos.actions import ChaosLoop
from benchmarks.chaos.cli import add_arguments
from benchmarks.chaos.cli import main as chaos_main
from benchmarks.chaos.config import ChaosConfig
from benchmarks.chaos.freezes import FreezeWatch
from benchmarks.chaos.monitor import STAT_FIELDS, process_memory, read_stats
from benchmarks.chaos.plots import plot
from benchmarks.chaos.schedule import (
    ENGINE_KILL,
    KINDS,
    SERVER_KILL,
    SERVER_STALL,
    PlannedEvent,
    plan_events,
)
from benchmarks.chaos.shm import SegmentWatch, leftovers
from benchmarks.chaos.workload import Budget, Clock, Sent, describe_failure
from benchmarks.e2e.multiround import KEEPALIVE_EXPIRY_S, client_limits
from testbed.server import ServerProcess, free_port


def test_plan_is_seeded_spaced_and_covers_every_kind() -> None:
    plan = plan_events(7, 600.0, min_gap_s=30.0, warmup_s=60.0)
    assert plan == plan_events(7, 600.0, min_gap_s=30.0, warmup_s=60.0)
    assert plan != plan_events(8, 600.0, min_gap_s=30.0, warmup_s=60.0)
    assert sorted(e.kind for e in plan) == sorted(KINDS * 2)  # twice each in 10 minutes
    times = [e.at_s for e in plan]
    assert times == sorted(times)
    assert all(60.0 <= t <= 600.0 for t in times)
    assert min(b - a for a, b in itertools.pairwise(times)) >= 30.0


def test_short_plan_still_has_each_kind_once() -> None:
    plan = plan_events(0, 45.0, min_gap_s=11.25, warmup_s=11.25)
    assert sorted(e.kind for e in plan) == sorted(KINDS)
    assert all(11.25 <= e.at_s <= 45.0 for e in plan)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"duration_s": 0.0, "warmup_s": 0.0},
        {"duration_s": 60.0, "warmup_s": 60.0},
        {"duration_s": 60.0, "warmup_s": 0.0, "kinds": ()},
    ],
)
def test_plan_refuses_impossible_spans(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="warmup_s"):
        plan_events(0, min_gap_s=1.0, **kwargs)


def sent(start: float, cached: int, *, prompt: int = 100, error: str | None = None, **kw) -> Sent:
    return Sent(
        kw.get("engine", "A"),
        0,
        0,
        start,
        start + kw.get("latency", 0.5),
        0.1,
        kw.get("tokens", [1] * prompt),
        kw.get("output", [5, 6]),
        cached,
        error,
    )


def test_restart_windows_take_requests_before_the_kill_and_after_reconnection() -> None:
    before = [sent(t, 90) for t in range(10)]  # end by 9.5 s: before the kill at 10 s
    in_flight = [sent(9.8, 0)]  # ends after the kill: in neither window
    settling = [sent(12.0, 0)]  # the new server answered at 11 s; the settle runs to 13 s
    after = [sent(13.0 + t, 45) for t in range(5)]
    events = [
        {"kind": SERVER_STALL, "at_s": 5.0},
        {"kind": SERVER_KILL, "at_s": 10.0, "ready_after_s": 1.0},
    ]
    records = before + in_flight + settling + after + [sent(14.0, 0, error="boom")]
    (window,) = analysis.restart_windows(records, events, before=4, after=3, settle_s=2.0)
    assert (window["requests_before"], window["requests_after"]) == (4, 3)
    assert window["hit_before"] == pytest.approx(0.9)
    assert window["ratio"] == pytest.approx(0.5)


def test_identical_fraction_matches_by_prompt() -> None:
    ref = [sent(0, 0, tokens=[1, 2]), sent(1, 0, tokens=[3], output=[9])]
    runs = [
        sent(0, 0, tokens=[1, 2]),  # same answer
        sent(1, 0, tokens=[3], output=[8]),  # different answer
        sent(2, 0, tokens=[4]),  # not in the reference: not counted
        sent(3, 0, tokens=[1, 2], error="x"),  # failed: not counted
    ]
    assert analysis.identical_fraction(runs, ref) == {
        "matched": 2,
        "identical": 1,
        "fraction": 0.5,
    }
    assert analysis.sequential_identity(runs[:2], ref)["identical"] == 1


def test_series_growth_flags_a_leak() -> None:
    flat = [{"shm_bytes": 100}, {"shm_bytes": None}, {"shm_bytes": 100}, {"shm_bytes": 105}]
    leak = [{"shm_bytes": 100}, {"shm_bytes": 200}, {"shm_bytes": 200}, {"shm_bytes": 100}]
    assert analysis.series_growth(flat, "shm_bytes")["flat"] is True
    assert analysis.series_growth(leak, "shm_bytes")["flat"] is False
    assert analysis.series_growth([], "shm_bytes")["flat"] is None


def mode_document(failed: int, quarantined: int | None) -> dict:
    records = [sent(t, 50, engine="A") for t in range(30)]
    return {
        "mode": "kvshelf-eager",
        "events": [
            {"kind": SERVER_KILL, "at_s": 10.0, "ready_after_s": 0.5},
            {"kind": ENGINE_KILL, "at_s": 20.0},
        ],
        "requests": {"sent": 30, "failed": failed},
        "restarts": analysis.restart_windows(
            records,
            [{"kind": SERVER_KILL, "at_s": 10.0, "ready_after_s": 0.5}],
            before=5,
            after=5,
            settle_s=1.0,
        ),
        "memory": {
            "rss_bytes": analysis.series_growth([{"rss_bytes": 1}, {"rss_bytes": 1}], "rss_bytes"),
            "shm_bytes": analysis.series_growth([{"shm_bytes": 1}, {"shm_bytes": 3}], "shm_bytes"),
        },
        "end": {
            "reserved_objects": 0,
            "locked_objects": 0,
            "l1_reserved_bytes": None,
            "l1_quarantined_bytes": quarantined,
            "protected_blocks": None,
            "arenas_left_after_stop": 0,
            "vllm_shm_segments_left": 0,
            "vllm_shm_segments_removed": 3,
        },
        "verification": {"total": 5, "identical": 5},
        "latency": {"worst_s": 3.0, "no_connector_worst_s": 1.0},
        "stalls": analysis.stall_windows(
            [sent(14.0, 0, latency=2.5), sent(40.0, 0, latency=9.0)],
            [
                {"kind": SERVER_STALL, "at_s": 15.0, "done_s": 25.0, "stall_s": 10.0},
                {"kind": SERVER_STALL, "at_s": 50.0, "done_s": 110.0, "stall_s": 60.0},
            ],
            [],
            no_connector_worst_s=0.5,
            request_timeout_s=1.0,
        ),
        "concurrent_identical": {
            "vs_no_connector": {"fraction": 0.9},
            "no_connector_pair": {"fraction": 0.95},
        },
        "timeline": analysis.timeline([*records, sent(31.0, 0, error="x")], bin_s=10.0),
        "failures": [{"engine": "A", "start_s": 31.0, "latency_s": 0.5, "error": "x"}],
        "samples": [{"t_s": 0.0, "rss_bytes": 1 << 20, "shm_bytes": None}],
    }


STALL_TARGET = "worst latency less machine freezes (s) in flight during the"


def test_targets_give_verdicts_and_tolerate_missing_fields() -> None:
    rows = {r["target"]: r for r in analysis.evaluate_mode(mode_document(0, None))}
    assert rows["failed requests (engine A)"]["verdict"] == "PASS"
    assert rows["hit rate after / before each restart (worst)"]["verdict"] == "PASS"
    assert rows["/dev/shm arena bytes flat (peak / first sample)"]["verdict"] == "FAIL"
    assert rows["l1_quarantined_bytes at the end"]["verdict"] == "n/a"
    assert rows["protected blocks at the end (engine A)"]["verdict"] == "n/a"
    # 2.5 <= 0.5 + 1 + margin during the 10 s stall; nothing in flight during the 60 s one.
    assert rows[f"{STALL_TARGET} 10 s stall"]["verdict"] == "PASS"
    assert rows[f"{STALL_TARGET} 60 s stall"]["verdict"] == "n/a"
    assert rows["worst latency (s) over the run vs no connector's"]["verdict"] == "info"
    assert rows["vLLM /dev/shm segments left by the mode's engines"]["verdict"] == "PASS"
    failed = mode_document(2, 4096)
    failed["events"].append({"kind": ENGINE_KILL, "at_s": 30.0, "error": "RuntimeError()"})
    failed["stalls"][0]["worst_unfrozen_s"] = 10.4  # waited for the whole stall
    failing = analysis.evaluate_mode(failed)
    verdicts = {r["target"]: r["verdict"] for r in failing}
    assert verdicts["chaos events that failed (e.g. a victim that did not start)"] == "FAIL"
    assert verdicts["failed requests (engine A)"] == "FAIL"
    assert verdicts["l1_quarantined_bytes at the end"] == "FAIL"
    assert verdicts[f"{STALL_TARGET} 10 s stall"] == "FAIL"
    json.dumps(failing)  # the rows go into chaos.json as they are


def test_table_and_plot(tmp_path) -> None:
    mode = mode_document(0, None)
    mode["targets"] = analysis.evaluate_mode(mode)
    document = {"modes": {"kvshelf-eager": mode}}
    table = analysis.format_table(document)
    assert "failed requests (engine A)" in table and "PASS" in table and "FAIL" in table
    bins = mode["timeline"]
    assert [(b["t_s"], b["requests"], b["failed"]) for b in bins] == [
        (0.0, 10, 0),
        (10.0, 10, 0),
        (20.0, 10, 0),
        (30.0, 1, 1),
    ]
    assert bins[0]["hit_rate"] == pytest.approx(0.5) and bins[3]["hit_rate"] is None
    assert bins[0]["latency_max_s"] == pytest.approx(0.5) and bins[3]["latency_max_s"] is None
    path = plot(document, tmp_path / "chaos.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_monitor_reads_this_process_and_tolerates_a_missing_server() -> None:
    memory = process_memory(os.getpid())
    assert memory["rss_bytes"] and memory["rss_bytes"] > 0
    assert process_memory(2**22 + 12345)["rss_bytes"] is None
    assert read_stats("127.0.0.1", free_port(), timeout_s=0.1) == dict.fromkeys(STAT_FIELDS)


def test_cli_names_a_bad_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        chaos_main(["--minutes", "0"])
    assert "--minutes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chaos_main(["--modes", "kvshelf-lazy-fifo"])
    assert "--modes" in capsys.readouterr().err


def test_budget_runs_past_the_deadline_until_the_chaos_loop_is_done() -> None:
    clock = Clock(origin=time.monotonic() - 10.0)  # 10 s into the run
    done = False
    budget = Budget(deadline_s=5.0, also_until=lambda: done)
    assert budget.take(clock)  # a late event still runs under load
    done = True
    assert not budget.take(clock)
    counted = Budget(requests=1)
    assert not counted.over(clock)
    assert counted.take(clock) and not counted.take(clock) and counted.over(clock)


def test_plan_has_one_stall_of_each_length() -> None:
    plan = plan_events(3, 300.0, min_gap_s=30.0, warmup_s=60.0, stall_seconds=(10.0, 60.0))
    stalls = sorted(e.stall_s for e in plan if e.kind == SERVER_STALL)
    assert stalls == [10.0, 60.0]
    assert all(e.stall_s is None for e in plan if e.kind != SERVER_STALL)
    with pytest.raises(ValueError, match="stall_seconds"):
        plan_events(3, 300.0, min_gap_s=30.0, warmup_s=60.0, stall_seconds=(10.0, 0.0))


def test_stall_window_counts_every_request_in_flight_during_the_stall() -> None:
    records = [
        sent(1.0, 0, latency=3.0),  # ended before the stop at 5 s
        sent(4.0, 0, latency=2.0),  # sent before, ended during
        sent(7.0, 0, latency=1.2),  # within
        sent(14.0, 0, latency=11.0),  # sent during, ended long after the continue at 15 s
        sent(15.0, 0, latency=9.0),  # sent after the continue
    ]
    events = [
        {"kind": SERVER_KILL, "at_s": 2.0, "ready_after_s": 0.5},
        {"kind": SERVER_STALL, "at_s": 5.0, "done_s": 15.0, "stall_s": 10.0},
        {"kind": SERVER_STALL, "at_s": 30.0, "error": "ProcessLookupError()", "done_s": 30.0},
    ]
    (window,) = analysis.stall_windows(
        records, events, [], no_connector_worst_s=0.25, request_timeout_s=1.0
    )
    assert window["requests"] == 3 and window["worst_s"] == pytest.approx(11.0)
    assert window["worst_unfrozen_s"] == pytest.approx(11.0) and window["frozen_s"] == 0
    assert window["bound_s"] == pytest.approx(0.25 + 1.0 + analysis.STALL_MARGIN_S)
    assert (
        analysis.stall_windows(records, events, [], no_connector_worst_s=None, request_timeout_s=1)[
            0
        ]["bound_s"]
        is None
    )


def test_the_stall_target_takes_each_request_less_the_machine_freezes_it_was_in_flight_during() -> (
    None
):
    records = [sent(4.0, 0, latency=2.0), sent(14.0, 0, latency=11.0)]
    events = [{"kind": SERVER_STALL, "at_s": 5.0, "done_s": 15.0, "stall_s": 10.0}]
    # Frozen 13-17 s (inside the second request) and 30-31 s (after every request).
    freezes = [(13.0, 17.0), (30.0, 31.0)]
    (window,) = analysis.stall_windows(
        records, events, freezes, no_connector_worst_s=0.25, request_timeout_s=1.0
    )
    assert window["worst_s"] == pytest.approx(11.0)
    # 14-25 s in flight, 3 s of it frozen (14-17 s); the first request met no freeze.
    assert window["worst_unfrozen_s"] == pytest.approx(8.0)
    assert window["frozen_s"] == pytest.approx(4.0)  # 13-17 s, while requests were in flight
    # The window names its slowest request, by latency less freezes.
    slowest = window["slowest"]
    assert (slowest["start_s"], slowest["end_s"]) == (14.0, 25.0)
    assert slowest["unfrozen_s"] == pytest.approx(8.0) and slowest["prompt_tokens"] == 100
    record, unfrozen = analysis.slowest_unfrozen(records, freezes)
    assert record is records[1] and unfrozen == pytest.approx(8.0)
    assert analysis.slowest_unfrozen([], freezes) is None


def test_a_process_that_is_not_scheduled_is_recorded_as_a_machine_freeze() -> None:
    clock = Clock()
    with FreezeWatch(clock.now) as watch:
        time.sleep(0.5)  # the child started and sleeps
        os.kill(watch.pid, signal.SIGSTOP)
        stopped = clock.now()
        time.sleep(1.0)
        os.kill(watch.pid, signal.SIGCONT)
        time.sleep(0.5)
    # A loaded machine may add short freezes of its own; the stop is the one long one.
    long = [span for span in watch.spans if span[1] - span[0] > 0.7]
    assert len(long) == 1, watch.spans
    (start, end) = long[0]
    assert watch.faulted <= len(watch.spans)
    assert end - start == pytest.approx(1.0, abs=0.3)
    assert stopped - 0.1 <= start <= stopped + 0.3


def test_cli_takes_stall_lengths_and_names_a_bad_one(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--stall-seconds", "10,60"]).stall_seconds == (10.0, 60.0)
    assert parser.parse_args([]).stall_seconds == ChaosConfig().stall_seconds
    for bad in ("10,-1", "x", ""):
        with pytest.raises(SystemExit):
            chaos_main(["--stall-seconds", bad])
        assert "--stall-seconds" in capsys.readouterr().err


def test_segment_sweep_removes_only_new_unused_vllm_segments(tmp_path) -> None:
    shm_dir = str(tmp_path)
    for name in ("psm_old", "sem.mp-old", "kvshelf-1-a"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    watch = SegmentWatch(shm_dir=shm_dir)
    watch.mark()  # an engine starts
    for name in ("psm_left", "sem.mp-left", "psm_live", "kvshelf-1-b", "other"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    with open(tmp_path / "psm_live", "r+b") as f, mmap.mmap(f.fileno(), 0):
        # A live process (this one) maps psm_live: another engine's, kept.
        assert watch.sweep() == 2
    assert sorted(os.listdir(tmp_path)) == [
        "kvshelf-1-a",
        "kvshelf-1-b",
        "other",
        "psm_live",
        "psm_old",
        "sem.mp-old",
    ]
    assert watch.removed == 2 and watch.removed_bytes >= 2 * 4096
    assert leftovers({"a"}, ["a", "b", "c"], {"c"}) == {"b"}


def test_attack_targets_fail_on_a_lost_ping_a_slow_ping_growth_or_a_failed_request() -> None:
    def run(name: str, worst: float | None, unanswered: int = 0, failed: int = 0) -> dict:
        ping = {"pings": 50, "unanswered": unanswered, "worst_ms": worst}
        return {"attack": name, "ping": ping, "engine_a": {"requests": 9, "failed": failed}}

    runs = [
        run("ends_flood", 3.0),
        run("wide_pool_repeats", 2.0, unanswered=4),
        run("max_frames", 250.0),
        run("pool_churn", 1.0, failed=1),
        {"attack": "paused_redis", "skipped": "no Redis tier"},
    ]
    mode = mode_document(0, None)
    mode["attacks"] = {
        "quiet": {"worst_ms": 1.5},
        "rss_anon_before_bytes": 100 * 2**20,
        "rss_anon_peak_bytes": 100 * 2**20 + analysis.ATTACK_RSS_GROWTH_BYTES + 1,
        "runs": runs,
    }
    # The ping target is judged on the idle machine; under load the pings are reported.
    mode["attacks_idle"] = {"quiet": {"worst_ms": 0.9}, "runs": runs}
    verdicts = {r["target"]: r["verdict"] for r in analysis.evaluate_mode(mode)}
    assert verdicts["attack ends_flood, idle machine: worst ping (ms) vs quiet"] == "PASS"
    assert verdicts["attack ends_flood: engine A failed requests"] == "PASS"
    assert verdicts["attack wide_pool_repeats, idle machine: worst ping (ms) vs quiet"] == "FAIL"
    assert verdicts["attack max_frames, idle machine: worst ping (ms) vs quiet"] == "FAIL"
    assert verdicts["attack max_frames under load: worst ping (ms) vs quiet"] == "info"
    assert verdicts["attack pool_churn: engine A failed requests"] == "FAIL"
    assert verdicts["attack paused_redis"] == "n/a"
    assert verdicts["server RssAnon growth under attack (MiB)"] == "FAIL"


def test_engines_a_and_b_compute_on_their_own_halves_of_the_machine() -> None:
    from benchmarks.chaos.config import split_cpus

    assert split_cpus(1) == ("0", "0")
    assert split_cpus(2) == ("0", "1")
    assert split_cpus(3) == ("0", "1-2")
    assert split_cpus(16) == ("0-7", "8-15")


def test_a_failed_request_is_described_with_the_errors_under_it() -> None:
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as reset:
            raise httpx.ReadError("") from reset
    except httpx.ReadError as exc:
        described = describe_failure(exc)
    assert described == "ReadError <- ConnectionResetError: [Errno 104] Connection reset by peer"


def test_an_event_that_comes_due_during_the_one_before_starts_a_settle_time_after_it() -> None:
    plan = [
        PlannedEvent(at_s=0.0, kind=SERVER_STALL, stall_s=1.0),
        # Due during the first stall: starts once it ended and the settle time passed.
        PlannedEvent(at_s=0.2, kind=SERVER_STALL, stall_s=0.1),
    ]
    with ServerProcess(l1_size_gb=1 / 64, extra_args=["--no-prefault"]) as server:
        loop = ChaosLoop(plan, server, victim=None, clock=Clock(), settle_s=0.5)  # type: ignore[arg-type]
        loop.start()
        loop.join()
        assert server.client().ping()  # continued after each stall
    first, second = loop.events
    assert second["planned_s"] == 0.2
    assert second["at_s"] >= first["done_s"] + 0.5
    assert first["done_s"] - first["at_s"] == pytest.approx(1.0, abs=0.3)


def test_the_load_client_does_not_reuse_a_connection_idle_longer_than_its_expiry() -> None:
    # vLLM's HTTP server closes a connection idle for 5 s; a client waking from a machine
    # freeze must not send on one it kept that long.
    ports: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_GET(self) -> None:
            ports.append(self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    async def three_requests() -> None:
        async with httpx.AsyncClient(limits=client_limits(1)) as client:
            await client.get(url)
            await client.get(url)  # at once: the same connection
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
            await client.get(url)  # idle past the expiry: a new one

    try:
        asyncio.run(three_requests())
    finally:
        server.shutdown()
    assert ports[0] == ports[1] != ports[2]
    assert KEEPALIVE_EXPIRY_S < 5.0  # vLLM's (uvicorn's) keep-alive timeout
