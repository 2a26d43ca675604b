"""From results (the JSON dict) to tables: printed by `bench.run`, put in README by
`bench.report`. Markdown tables, readable in a terminal too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DASH = "\u2013"  # en dash: no value
TIMES = "\u00d7"  # multiplication sign

Row = Sequence[str]


@dataclass
class Table:
    title: str
    headers: Row
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines)


def num(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}{suffix}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{suffix}"
    return str(value)


def times(value: Any, digits: int = 2) -> str:
    return DASH if value is None else f"{value:.{digits}f}{TIMES}"


def trio(summary: dict[str, Any] | None, keys: tuple[str, ...] = ("p50", "p95", "p99")) -> str:
    if not summary:
        return DASH
    return " / ".join(num(summary.get(k), 0) for k in keys)


def div(a: Any, b: Any) -> float | None:
    if a is None or not b:
        return None
    return float(a) / float(b)


def _bounds(result: dict[str, Any]) -> str:
    notes = list(result.get("bounds") or [])
    if result.get("finished_in_time") is False:
        notes.append("did NOT finish within the time limit")
    if result.get("settled") is False:
        queues = ", ".join(
            f"{name} {n}" for name, n in (result.get("unsettled_queues") or {}).items()
        )
        where = f": {queues}" if queues else ""
        notes.append(
            f"events still unconsumed at the end (a consumer stalled or fell behind){where}"
        )
    if result.get("missing"):
        notes.append(f"{result['missing']} tasks never finished")
    if result.get("errors"):
        notes.append(f"submit errors {result['errors']}")
    if result.get("refused_then_retried"):
        notes.append(
            f"{result['refused_then_retried']} submissions shed (503, admission) and retried "
            "after Retry-After"
        )
    problems = result.get("log_problems") or {}
    if problems:
        logged = ", ".join(
            f"{name}: " + " ".join(f"{n} {kind}" for kind, n in counts.items() if n)
            for name, counts in problems.items()
        )
        notes.append(f"services logged problems ({logged})")
    return "; ".join(notes) or DASH


def _celery_all_cpu(result: dict[str, Any]) -> float | None:
    worker = result.get("worker_cpu_ms_per_task")
    producer = result.get("producer_cpu_ms_per_task")
    return None if worker is None else worker + (producer or 0.0)


BURST_NOTE = (
    "Scorebox: submitted over HTTP as a burst, completions timed by `task.completed` events; "
    "own processes = every Scorebox service process. Celery: published by a producer process, "
    "completions counted at the fake model; own processes = worker + producer."
)
BACKLOG_NOTE = (
    "Backlog mode: N queued first (Scorebox over HTTP), then the scorers (the Celery worker) "
    "start; tasks/s is the drain, submission excluded."
)
ALONE_NOTE = (
    "Alone mode: as backlog mode, but every other Scorebox service is stopped before the "
    "scorers start, so the database serves only their claims and decisions and nothing else "
    "consumes their outcomes: what the scorers sustain by themselves; the Celery worker "
    "drains the same backlog."
)


def burst_table(title: str, scenario: dict[str, Any]) -> Table:
    params = scenario["parameters"]
    headers = (
        "system",
        "tasks/s",
        "of C/L",
        "end-to-end p50 / p95 / p99 ms",
        "model call p50 / p99 ms",
        "worker CPU ms/task",
        "own processes CPU ms/task",
        "limited by",
    )
    rows: list[Row] = []
    sb = scenario.get("scorebox")
    if sb:
        cpu = sb["cpu_ms_per_task"]
        model = sb["model_call_ms"]
        rows.append(
            (
                sb["system"],
                num(sb["tasks_per_s"]),
                times(sb["ratio_to_limit"]),
                trio(sb["end_to_end_ms"]),
                f"{num(model['p50'], 0)} / {num(model['p99'], 0)}",
                num(cpu["scorer"], 3),
                num(cpu["scorebox_total"], 3),
                _bounds(sb),
            )
        )
    cel = scenario.get("celery")
    if cel:
        rows.append(
            (
                cel["system"],
                num(cel["tasks_per_s"]),
                times(div(cel["tasks_per_s"], cel["limit_per_s"])),
                DASH,
                DASH,
                num(cel["worker_cpu_ms_per_task"], 3),
                num(_celery_all_cpu(cel), 3),
                _bounds(cel),
            )
        )
    if sb and cel:
        rows.append(
            (
                "Scorebox / Celery",
                times(div(sb["tasks_per_s"], cel["tasks_per_s"])),
                "",
                "",
                "",
                times(div(sb["cpu_ms_per_task"]["scorer"], cel["worker_cpu_ms_per_task"])),
                times(div(sb["cpu_ms_per_task"]["scorebox_total"], _celery_all_cpu(cel))),
                "",
            )
        )
    mode_notes = {"backlog": BACKLOG_NOTE, "alone": ALONE_NOTE}
    notes = [
        f"N = {num(params['n'])}, C = {params['concurrency']}, L = {num(params['latency_ms'], 0)}"
        f" ms ± {num(params['jitter_ms'], 0)} ms, limit C/L = {num(params['limit_per_s'])}"
        " tasks/s; tasks/s is the steady rate between 10 % and 90 % of completions.",
        mode_notes.get(params.get("mode", "burst"), BURST_NOTE),
    ]
    if params["n"] < 10 * params["concurrency"]:
        notes.append(
            f"N < 10 {TIMES} C: the run spans few waves of C tasks, so its rates are rough "
            "(harness check sizes, not a measurement)."
        )
    if sb and sb.get("mongodb_ops_per_task"):
        ops = sb["mongodb_ops_per_task"]
        kinds = ", ".join(f"{k} {num(v, 2)}" for k, v in ops.items() if k != "total" and v)
        notes.append(f"Scorebox MongoDB operations per task: {num(ops['total'], 1)} ({kinds}).")
    if sb:
        notes.append(
            f"Scorebox submit: {num(sb['submit_per_s'])} accepted/s, POST p50 / p95 / p99 "
            f"{trio(sb['submit_ms'])} ms; model calls per task "
            f"{num(div(sb['model']['calls'], sb['tasks']), 3)}, peak in flight "
            f"{sb['model']['max_in_flight']}; other load on the machine "
            f"{num(sb['other_load_cores'], 2)} cores."
        )
    return Table(title, headers, rows, notes)


def _accepted_ms(run: dict[str, Any]) -> dict[str, Any]:
    """POST latency of the accepted submissions (results before admission control: all)."""
    accepted: dict[str, Any] = run.get("accepted_post_ms") or run["post_ms"]
    return accepted


def _refusals_note(runs: list[dict[str, Any]]) -> str | None:
    refused = [
        f"{run['system']}: {num(run['errors'].get('503', 0))}, answered in p50 / p99 "
        f"{trio(run['refused_post_ms'], ('p50', 'p99'))} ms"
        for run in runs
        if run.get("refused_post_ms")
    ]
    if not refused:
        return None
    return (
        "503s (in errors: submissions the gateway shed because it was taking on as many as it "
        "could finish in its latency target, or a dependency was down; nothing kept): "
        + "; ".join(refused)
        + "."
    )


def submit_table(scenario: dict[str, Any]) -> Table:
    runs = [scenario[key] for key in ("scorebox", "scorebox_submit_path") if scenario.get(key)]
    sb = runs[0]
    headers = (
        "system",
        f"arrivals/s {TIMES} s",
        "requests",
        "errors",
        "accepted POST p50 / p95 / p99 ms",
        "max ms",
        "gateway CPU ms/submit",
        "limited by",
    )
    rows: list[Row] = [
        (
            run["system"],
            f"{num(run['rate_per_s'], 0)} {TIMES} {num(run['seconds'], 0)}",
            num(run["submitted"]),
            num(sum(run["errors"].values())),
            trio(_accepted_ms(run)),
            num(_accepted_ms(run).get("max"), 0),
            num(run["gateway_cpu_ms_per_submit"], 3),
            _bounds({k: v for k, v in run.items() if k != "errors"}),
        )
        for run in runs
    ]
    notes = [
        "Open loop: each POST is sent at its due time whatever the earlier ones take; latency "
        "counts from the due time. First row: the scorers run meanwhile (the whole stack is "
        "loaded); second row: no scorer runs, the tasks wait in their queue, so the row "
        "measures the submit path alone (gateway, its database writes, the broker's confirms, "
        "and the projection taking its copy of each command).",
        f"Sent {num(sb.get('sent_per_s'))} requests/s; sender lag p99 "
        f"{num(sb['sender_lag_ms']['p99'])} ms (the load generator's own delay).",
    ]
    if (refusals := _refusals_note(runs)) is not None:
        notes.append(refusals)
    return Table("Submit latency", headers, rows, notes)


def cost_table(scenario: dict[str, Any]) -> Table:
    headers = ("system", "process", "CPU ms/task", "busy cores mean / peak", "peak RSS MiB")
    rows: list[Row] = []
    for key in ("scorebox", "celery"):
        result = scenario.get(key)
        if not result:
            continue
        for name, usage in result["processes"].items():
            rss = usage["peak_rss_mib"]
            rows.append(
                (
                    result["system"],
                    name,
                    num(usage["cpu_ms_per_task"], 3),
                    f"{num(usage['mean_cores'], 2)} / {num(usage['peak_cores'], 2)}",
                    ", ".join(num(v) for v in rss.values()) or DASH,
                )
            )
    notes = [
        "CPU from /proc (utime + stime) over the measured window, divided by the tasks; "
        "`machine` is every process on the machine, `bench` the load generator. The broker "
        "is shared with whatever else runs on the machine.",
        f"Workload: {scenario.get('source', 'the throughput run')}.",
    ]
    return Table("Cost per task", headers, rows, notes)


def growth_table(scenario: dict[str, Any]) -> Table:
    headers = (
        "system",
        "backlog",
        "drain first quarter /s",
        "last quarter /s",
        "last / first",
        "status read p50 / p95 / p99 ms",
        "tasks in projection",
        "limited by",
    )
    rows: list[Row] = []
    sb = scenario.get("scorebox")
    if sb:
        drain, reads = sb["drain"], sb["status_reads"]
        rows.append(
            (
                sb["system"],
                num(sb["accepted"]),
                num(drain["first_quarter_per_s"]),
                num(drain["last_quarter_per_s"]),
                times(drain["last_over_first"]),
                trio(reads["latency_ms"]),
                num(reads["projection_tasks"]),
                _bounds(sb),
            )
        )
    cel = scenario.get("celery")
    if cel:
        drain = cel["drain"]
        rows.append(
            (
                cel["system"],
                num(cel["tasks"]),
                num(drain["first_quarter_per_s"]),
                num(drain["last_quarter_per_s"]),
                times(drain["last_over_first"]),
                DASH,
                DASH,
                _bounds(cel),
            )
        )
    notes = [
        "The backlog is queued with no scorer (worker) running; they start late and drain it. "
        "Rates are over the first and the last quarter of completions.",
    ]
    shapes = [
        f"{run['system']}: {', '.join(num(rate) for rate in run['drain']['tenths_per_s'])}"
        for run in (sb, cel)
        if run and run["drain"].get("tenths_per_s")
    ]
    if shapes:
        notes.append(
            "Drain rate /s in each tenth of completions, first to last: " + "; ".join(shapes) + "."
        )
    if sb:
        notes.append(
            f"Status reads: {sb['status_reads']['reads']} GET /v1/scores/{{id}} through the "
            f"gateway, {sb['status_reads']['concurrency']} at a time, answers "
            f"{sb['status_reads']['statuses']}."
        )
    return Table("Growth", headers, rows, notes)


def tables(results: dict[str, Any]) -> list[Table]:
    found: list[Table] = []
    scenarios = results.get("scenarios", {})
    if "throughput" in scenarios:
        found.append(burst_table("Throughput", scenarios["throughput"]))
    if "inflight" in scenarios:
        found.append(burst_table("Many in flight", scenarios["inflight"]))
    if "submit" in scenarios:
        found.append(submit_table(scenarios["submit"]))
    if "cost" in scenarios:
        found.append(cost_table(scenarios["cost"]))
    if "growth" in scenarios:
        found.append(growth_table(scenarios["growth"]))
    return found


def targets_table(results: dict[str, Any]) -> Table:
    rows: list[Row] = [
        (t["target"], t["measured"], {True: "met", False: "NOT met"}.get(t["met"], DASH), t["note"])
        for t in results.get("targets", [])
    ]
    return Table("Targets (issue #4)", ("target", "measured", "", "note"), rows)


def setting_lines(results: dict[str, Any]) -> list[str]:
    machine = results["machine"]
    versions = results["versions"]
    return [
        f"Command: `{results['command']}`",
        f"Run: {results['started_at']} to {results['finished_at']}, commit {results['git']}",
        f"Machine: {machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine['os']}, Python {machine['python']}; load average at start "
        f"{machine['load_average_at_start']}; reference workload "
        f"{machine.get('reference_workload_ms', DASH)} ms of CPU (`bench.infra."
        "reference_workload_ms`: CPU per task scales with it across machines)",
        f"Broker: {results['broker']['kind']}",
        f"Database: {results['database']['kind']}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
    ]
