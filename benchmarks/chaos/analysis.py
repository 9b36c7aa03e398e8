"""From the chaos run's records to its figures and targets: pure functions on plain data.

Hit rates are vLLM's own per-request figure: ``usage.prompt_tokens_details.cached_tokens``
(prompt tokens vLLM did not compute: its prefix cache plus the connector's hits) over prompt
tokens, summed over a window of engine A's successful requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.chaos.freezes import frozen_s, unfrozen_latency
from benchmarks.chaos.schedule import SERVER_KILL, SERVER_STALL
from benchmarks.chaos.workload import Sent

HIT_RATE_KEEP = 0.9
"""Target: the hit rate after a server restart is at least this share of the rate before."""
FLAT_GROWTH = 1.1
"""Target: a sampled series is flat when its peak is at most this times its first sample."""
STALL_MARGIN_S = 1.0
"""The promise for a stalled server: a request in flight at any moment of a stall (of any
length) takes at most the worst latency without a connector, plus the connector's request
timeout (what one call may wait for the server), plus this margin: while the server is stopped
every lookup misses, so engines A and B both recompute whole prompts on the same cores. Both
latencies are taken less the machine's freezes (:mod:`benchmarks.chaos.freezes`), which
no connector can shorten."""


def ok(records: Sequence[Sent]) -> list[Sent]:
    """The requests that succeeded."""
    return [r for r in records if r.error is None]


def hit_rate(records: Sequence[Sent]) -> float | None:
    """Cached prompt tokens over prompt tokens of ``records`` (None without any figure)."""
    counted = [r for r in records if r.cached_tokens is not None]
    prompt = sum(len(r.prompt) for r in counted)
    return sum(r.cached_tokens or 0 for r in counted) / prompt if prompt else None


def restart_windows(
    records: Sequence[Sent],
    events: Sequence[dict[str, Any]],
    *,
    before: int,
    after: int,
    settle_s: float,
) -> list[dict[str, Any]]:
    """The hit rate over the requests before and after each server restart.

    Before: the last ``before`` successful requests that ended before the kill. After: the
    first ``after`` successful requests sent at least ``settle_s`` after the new server
    answered (the connector retries a lost server only that often).

    Args:
        records: Engine A's requests.
        events: The chaos events (`benchmarks.chaos.actions.ChaosLoop.events`).
        before: Size of the window before.
        after: Size of the window after.
        settle_s: Reconnection allowance.

    Returns:
        Per server kill: ``at_s``, ``hit_before``, ``hit_after``, ``ratio``, the windows' sizes.
    """
    done = sorted(ok(records), key=lambda r: r.start_s)
    windows = []
    for event in events:
        if event["kind"] != SERVER_KILL:
            continue
        ready_s = event["at_s"] + event["ready_after_s"] + settle_s
        prior = [r for r in done if r.end_s <= event["at_s"]][-before:]
        later = [r for r in done if r.start_s >= ready_s][:after]
        hit_before, hit_after = hit_rate(prior), hit_rate(later)
        windows.append(
            {
                "at_s": event["at_s"],
                "requests_before": len(prior),
                "requests_after": len(later),
                "hit_before": hit_before,
                "hit_after": hit_after,
                "ratio": hit_after / hit_before if hit_before and hit_after is not None else None,
            }
        )
    return windows


def identical_fraction(runs: Sequence[Sent], reference: Sequence[Sent]) -> dict[str, Any]:
    """How many of ``runs``' answers equal ``reference``'s answer to the same prompt.

    Only prompts both sent (successfully) count: in a multi-round conversation a later prompt
    carries earlier answers, so it exists in both runs only while the answers agreed.

    Returns:
        ``matched``, ``identical`` and ``fraction`` (None when nothing matched).
    """
    answers = {tuple(r.prompt): r.output for r in ok(reference)}
    matched = [r for r in ok(runs) if tuple(r.prompt) in answers]
    same = sum(r.output == answers[tuple(r.prompt)] for r in matched)
    return {
        "matched": len(matched),
        "identical": same,
        "fraction": same / len(matched) if matched else None,
    }


def sequential_identity(with_kv: Sequence[Sent], without: Sequence[Sent]) -> dict[str, Any]:
    """Compare two sequential passes over the same prompts, prompt by prompt.

    Returns:
        ``total``, ``identical`` (failed requests count as different) and ``hit_rate`` of
        ``with_kv``.
    """
    pairs = list(zip(with_kv, without, strict=True))
    same = sum(a.error is None and b.error is None and a.output == b.output for a, b in pairs)
    return {"total": len(pairs), "identical": same, "hit_rate": hit_rate(ok(with_kv))}


def pick_prompts(records: Sequence[Sent], count: int) -> list[list[int]]:
    """``count`` distinct prompts of successful requests, spread evenly over the run."""
    distinct = list({tuple(r.prompt): r.prompt for r in ok(records)}.values())
    if len(distinct) <= count:
        return distinct
    step = len(distinct) / count
    return [distinct[int(i * step)] for i in range(count)]


def series_growth(samples: Sequence[dict[str, Any]], field: str) -> dict[str, Any]:
    """A sampled series' first value, peak and last value, and whether it stayed flat.

    The first sample is taken once the server has zeroed its arena, before any load; a leak at
    any later moment (a killed server's arena left behind) raises the peak.

    Returns:
        ``first``, ``peak``, ``last``, ``growth`` (peak / first) and ``flat`` (growth at most
        `FLAT_GROWTH`; None without two samples).
    """
    values = [s[field] for s in samples if s.get(field) is not None]
    if len(values) < 2 or values[0] <= 0:
        return {"first": None, "peak": None, "last": None, "growth": None, "flat": None}
    growth = max(values) / values[0]
    return {
        "first": values[0],
        "peak": max(values),
        "last": values[-1],
        "growth": round(growth, 3),
        "flat": growth <= FLAT_GROWTH,
    }


def timeline(records: Sequence[Sent], bin_s: float) -> list[dict[str, Any]]:
    """Engine A's requests in bins of ``bin_s`` seconds by send time (what ``chaos.png`` draws).

    Returns:
        Per bin with requests: ``t_s`` (its start), ``requests``, ``failed``, ``hit_rate``
        (None without figures), ``latency_p50_s`` and ``latency_max_s`` (successful requests).
    """
    bins: dict[int, list[Sent]] = {}
    for record in records:
        if record.engine == "A":
            bins.setdefault(int(record.start_s // bin_s), []).append(record)
    rows = []
    for index in sorted(bins):
        done = sorted(r.latency_s for r in ok(bins[index]))
        rows.append(
            {
                "t_s": round(index * bin_s, 3),
                "requests": len(bins[index]),
                "failed": len(bins[index]) - len(done),
                "hit_rate": hit_rate(ok(bins[index])),
                "latency_p50_s": done[len(done) // 2] if done else None,
                "latency_max_s": done[-1] if done else None,
            }
        )
    return rows


def slowest_unfrozen(
    records: Sequence[Sent], freezes: Sequence[tuple[float, float]], *, failed: bool = False
) -> tuple[Sent, float] | None:
    """The record of the worst latency less the machine's freezes while it was in flight, and
    that latency (None without any); only successful records unless ``failed`` (then a failed
    one counts its time to failure)."""
    return max(
        (
            (r, unfrozen_latency(r.latency_s, r.start_s, freezes))
            for r in (records if failed else ok(records))
        ),
        key=lambda pair: pair[1],
        default=None,
    )


def stall_windows(
    records: Sequence[Sent],
    events: Sequence[dict[str, Any]],
    freezes: Sequence[tuple[float, float]],
    *,
    no_connector_worst_s: float | None,
    request_timeout_s: float,
) -> list[dict[str, Any]]:
    """Per server stall, the requests in flight at any moment of it and their worst latency.

    A request counts when it was sent before the server was continued and ended after it was
    stopped; failed requests count too (their time to failure).

    Args:
        records: Engine A's requests.
        events: The chaos events (a stall's ``at_s`` to ``done_s`` is SIGSTOP to SIGCONT).
        freezes: The machine's freezes on the same clock (`FreezeWatch.spans`).
        no_connector_worst_s: The worst latency without a connector, less the freezes of its
            own run (None: not measured).
        request_timeout_s: The connector's request timeout.

    Returns:
        Per stall: ``at_s``, ``stall_s``, ``requests``, ``worst_s`` (None without requests),
        ``worst_unfrozen_s`` (each request's latency less the freezes while it was in flight),
        ``frozen_s`` (how long the machine froze while they were in flight), ``bound_s``
        (no-connector worst + request timeout + `STALL_MARGIN_S`; None without the reference)
        and ``slowest`` (`describe` of the request of ``worst_unfrozen_s``; None without).
    """
    windows = []
    for event in events:
        if event["kind"] != SERVER_STALL or "done_s" not in event or event.get("error"):
            continue
        during = [r for r in records if r.start_s < event["done_s"] and r.end_s > event["at_s"]]
        worst = max((r.latency_s for r in during), default=None)
        slowest = slowest_unfrozen(during, freezes, failed=True)
        span = (
            (min(r.start_s for r in during), max(r.end_s for r in during))
            if during
            else (event["at_s"], event["done_s"])
        )
        bound = (
            None
            if no_connector_worst_s is None
            else no_connector_worst_s + request_timeout_s + STALL_MARGIN_S
        )
        windows.append(
            {
                "at_s": event["at_s"],
                "stall_s": event["stall_s"],
                "requests": len(during),
                "worst_s": None if worst is None else round(worst, 4),
                "worst_unfrozen_s": None if slowest is None else round(slowest[1], 4),
                "frozen_s": round(frozen_s(freezes, *span), 3),
                "bound_s": None if bound is None else round(bound, 4),
                "slowest": None if slowest is None else describe(*slowest),
            }
        )
    return windows


def describe(record: Sent, unfrozen_s: float) -> dict[str, Any]:
    """What a request's record says of where its time went: when it was sent and answered,
    its first token, its latency with and without the machine's freezes, how much of its
    prompt was computed, and its error."""
    return {
        "user": record.user,
        "round": record.round_index,
        "start_s": round(record.start_s, 3),
        "end_s": round(record.end_s, 3),
        "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 4),
        "latency_s": round(record.latency_s, 4),
        "unfrozen_s": round(unfrozen_s, 4),
        "prompt_tokens": len(record.prompt),
        "cached_tokens": record.cached_tokens,
        "output_tokens": len(record.output),
        "error": record.error,
    }


ATTACK_PING_WORST_MS = 100.0
"""Target: the worst ping round trip while a hostile client attacks the server (on an idle
machine; a loaded one adds its own scheduling delays, which the quiet window shows)."""
ATTACK_RSS_GROWTH_BYTES = 256 * 2**20
"""Target: the server's anonymous memory (``RssAnon``: everything but the arena) grows by at
most this much from the sample before the attacks to its peak during them."""


def attack_windows(
    results: Sequence[dict[str, Any]],
    records: Sequence[Sent],
    samples: Sequence[dict[str, Any]],
    quiet_at_s: float,
) -> dict[str, Any]:
    """Engine A's requests and the server's memory during each attack.

    Args:
        results: The attacks (`benchmarks.chaos.attacks.AttackRunner.results`).
        records: Engine A's requests.
        samples: The sampler's samples.
        quiet_at_s: When the quiet window before the attacks began.

    Returns:
        ``rss_anon_before_bytes`` (the last sample before the quiet window),
        ``rss_anon_peak_bytes`` (the peak from then on), and per attack that ran, its result
        with ``engine_a`` (requests in flight during it, failed ones, the worst latency of
        the others) added.
    """
    before = [s["rss_anon_bytes"] for s in samples if s["t_s"] <= quiet_at_s]
    during = [s["rss_anon_bytes"] for s in samples if s["t_s"] > quiet_at_s]
    rows = []
    for result in results:
        row = dict(result)
        if "at_s" in result:
            inside = [
                r for r in records if r.start_s < result["done_s"] and r.end_s > result["at_s"]
            ]
            row["engine_a"] = {
                "requests": len(inside),
                "failed": len(inside) - len(ok(inside)),
                "worst_s": latency_summary(inside)["worst_s"],
            }
        rows.append(row)
    known_before = [v for v in before if v is not None]
    known_during = [v for v in during if v is not None]
    return {
        "rss_anon_before_bytes": known_before[-1] if known_before else None,
        "rss_anon_peak_bytes": max(known_during) if known_during else None,
        "runs": rows,
    }


def latency_summary(records: Sequence[Sent]) -> dict[str, Any]:
    """Worst and median latency of the successful requests (seconds)."""
    latencies = sorted(r.latency_s for r in ok(records))
    if not latencies:
        return {"worst_s": None, "median_s": None}
    return {"worst_s": latencies[-1], "median_s": latencies[len(latencies) // 2]}


def _target(name: str, value: Any, target: str, passed: bool | None) -> dict[str, Any]:
    verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
    return {"target": name, "value": value, "goal": target, "verdict": verdict}


def evaluate_mode(mode: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of one mode's results (``chaos.json``'s per-mode object).

    Returns:
        Rows of ``target``, ``value``, ``goal`` and ``verdict`` (PASS, FAIL, n/a or info).
    """
    failed_events = [e for e in mode["events"] if e.get("error")]
    rows = [
        _target(
            "chaos events that failed (e.g. a victim that did not start)",
            len(failed_events),
            "0",
            not failed_events,
        ),
        _target(
            "failed requests (engine A)",
            mode["requests"]["failed"],
            "0",
            mode["requests"]["failed"] == 0,
        ),
    ]
    ratios = [w["ratio"] for w in mode["restarts"]]
    worst_ratio = min((r for r in ratios if r is not None), default=None)
    known = bool(ratios) and None not in ratios
    rows.append(
        _target(
            "hit rate after / before each restart (worst)",
            None if worst_ratio is None else round(worst_ratio, 3),
            f">= {HIT_RATE_KEEP}",
            (worst_ratio >= HIT_RATE_KEEP) if known and worst_ratio is not None else None,
        )
    )
    for field, name in (("rss_bytes", "server RSS"), ("shm_bytes", "/dev/shm arena bytes")):
        growth = mode["memory"][field]
        rows.append(
            _target(
                f"{name} flat (peak / first sample)",
                growth["growth"],
                f"<= {FLAT_GROWTH}",
                growth["flat"],
            )
        )
    end = mode["end"]
    for field in (
        "reserved_objects",
        "locked_objects",
        "l1_reserved_bytes",
        "l1_quarantined_bytes",
    ):
        rows.append(
            _target(
                f"{field} at the end",
                end[field],
                "0",
                None if end[field] is None else end[field] == 0,
            )
        )
    protected = end["protected_blocks"]
    rows.append(
        _target(
            "protected blocks at the end (engine A)",
            protected,
            "0",
            None if protected is None else protected == 0,
        )
    )
    rows.append(
        _target(
            "arenas left after a clean stop",
            end["arenas_left_after_stop"],
            "0",
            end["arenas_left_after_stop"] == 0,
        )
    )
    left = end.get("vllm_shm_segments_left")
    rows.append(
        _target(
            "vLLM /dev/shm segments left by the mode's engines",
            None if left is None else f"{left} ({end['vllm_shm_segments_removed']} removed)",
            "0",
            None if left is None else left == 0,
        )
    )
    verify = mode["verification"]
    rows.append(
        _target(
            "sequential verification identical",
            f"{verify['identical']}/{verify['total']}",
            "all",
            verify["identical"] == verify["total"],
        )
    )
    for stall in mode["stalls"]:
        worst, bound = stall["worst_unfrozen_s"], stall["bound_s"]
        rows.append(
            _target(
                f"worst latency less machine freezes (s) in flight during the "
                f"{stall['stall_s']:g} s stall",
                None
                if worst is None
                else f"{worst:.2f} ({stall['worst_s']:.2f} with {stall['frozen_s']:.1f} s frozen)",
                "<= no-connector worst + request timeout + "
                f"{STALL_MARGIN_S:g}" + ("" if bound is None else f" = {bound:.2f}"),
                None if worst is None or bound is None else worst <= bound,
            )
        )
    rows += _attack_rows(mode.get("attacks"))
    rows += _idle_attack_rows(mode.get("attacks_idle"))
    worst, reference = mode["latency"]["worst_s"], mode["latency"]["no_connector_worst_s"]
    rows.append(
        {
            "target": "worst latency (s) over the run vs no connector's",
            "value": None
            if worst is None
            else f"{worst:.2f} vs {reference:.2f}"
            if reference
            else round(worst, 2),
            "goal": "compare: engine B and its restarts share the cores",
            "verdict": "info",
        }
    )
    concurrent = mode["concurrent_identical"]
    rows.append(
        {
            "target": "concurrent outputs identical to a no-connector run",
            "value": concurrent["vs_no_connector"]["fraction"],
            "goal": f"compare: two no-connector runs {concurrent['no_connector_pair']['fraction']}",
            "verdict": "info",
        }
    )
    return rows


def _attack_rows(attacks: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The hostile clients' targets: engine A's failures and the ping round trip during each
    attack (next to the quiet window's), and the server's memory over all of them."""
    if not attacks:
        return []
    quiet = attacks["quiet"].get("worst_ms")
    rows = []
    for run in attacks["runs"]:
        name = run["attack"]
        if "skipped" in run:
            rows.append(_target(f"attack {name}", run["skipped"], "runs", None))
            continue
        failed = run["engine_a"]["failed"]
        rows.append(_target(f"attack {name}: engine A failed requests", failed, "0", failed == 0))
        rows.append(
            {
                "target": f"attack {name} under load: worst ping (ms) vs quiet",
                "value": _ping_value(run["ping"], quiet),
                "goal": "compare: both engines keep the cores busy",
                "verdict": "info",
            }
        )
    before, peak = attacks["rss_anon_before_bytes"], attacks["rss_anon_peak_bytes"]
    growth = None if before is None or peak is None else peak - before
    rows.append(
        _target(
            "server RssAnon growth under attack (MiB)",
            None if growth is None else round(growth / 2**20, 1),
            f"<= {ATTACK_RSS_GROWTH_BYTES / 2**20:g}",
            None if growth is None else growth <= ATTACK_RSS_GROWTH_BYTES,
        )
    )
    return rows


def _ping_value(ping: dict[str, Any], quiet: Any) -> str:
    """An attack's worst ping next to the quiet window's, with the unanswered count."""
    worst, unanswered = ping["worst_ms"], ping["unanswered"]
    value = "-" if worst is None else f"{worst:.1f} vs {quiet}"
    return f"{value}, {unanswered} unanswered" if unanswered else value


def _idle_attack_rows(attacks: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ping target: the same attacks once the load has stopped (engine A idle, engine B
    stopped), every ping answered and the worst within `ATTACK_PING_WORST_MS`."""
    if not attacks:
        return []
    quiet = attacks["quiet"].get("worst_ms")
    rows = []
    for run in attacks["runs"]:
        if "skipped" in run:
            continue
        ping = run["ping"]
        worst = ping["worst_ms"]
        rows.append(
            _target(
                f"attack {run['attack']}, idle machine: worst ping (ms) vs quiet",
                _ping_value(ping, quiet),
                f"<= {ATTACK_PING_WORST_MS:g}, all answered",
                None
                if not ping["pings"]
                else not ping["unanswered"] and worst is not None and worst <= ATTACK_PING_WORST_MS,
            )
        )
    return rows


def format_table(document: dict[str, Any]) -> str:
    """The summary table: per mode, each target with its value and verdict."""
    lines = [f"{'mode':<18} {'target':<52} {'value':>22}  {'goal':<44} verdict"]
    for name, mode in document["modes"].items():
        for row in mode["targets"]:
            value = "-" if row["value"] is None else str(row["value"])
            lines.append(
                f"{name:<18} {row['target']:<52} {value:>22}  {row['goal']:<44} {row['verdict']}"
            )
    return "\n".join(lines)
