"""Scorebox under load: the real services as processes (`devtools.stack.Stack`) against the
fake model, in a vhost and database prefix of their own, measured from outside.

Each function here is one kind of run and answers a dict ready for the JSON results:
`burst` (throughput, many in flight, cost), `open_loop` (submit latency) and `backlog`
(growth: drain with scorers started late, then status reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
from pymongo import AsyncMongoClient

from bench.infra import (
    BenchError,
    Broker,
    ChildProcess,
    Database,
    database,
    fake_model,
    fake_root,
    mongo_opcounters,
    queue_depths,
    vhost,
)
from bench.load import (
    AMQP_TIMEOUT_S,
    EVENTS_EXCHANGE,
    CompletionListener,
    Posted,
    essay,
    http_session,
    read_latencies,
    submit_burst,
    submit_open_loop,
)
from bench.procstat import MACHINE, CpuMeter, GroupUsage
from bench.stats import (
    overall_rate,
    quarter_rates,
    ratio,
    rounded,
    steady_rate,
    summary_ms,
    tenth_rates,
)
from devtools.stack import SERVICES, Stack, StackConfig

REPO = Path(__file__).resolve().parent.parent
# Whatever services the stack runs (the set grows: gateway, scorer, status, scheduler, ...).
SCOREBOX_SERVICES = tuple(SERVICES)
STACK_READY_TIMEOUT_S = 90.0
SETTLE_TIMEOUT_S = 120.0
# Queues that hold messages on purpose, which "settled" does not wait for.
# `scorebox.ops-log` keeps the scheduler's housekeeping reports for operators: a run long
# enough to see a housekeeping firing finds one there, which is not an unconsumed event.
UNSETTLED = re.compile(r"(\.dlq$|^scorebox\.wait\.|^scorebox\.score-requests$|^scorebox\.ops-log$)")
VERIFY_SAMPLE = 20
STANDIN_BOUND_CORES = 0.75  # the stand-in is one Python thread: busier than this, it limits
CPU_BOUND_CORES = 0.9
MACHINE_BOUND_CORES = 1.8  # of 2
FILL_BATCH = 500
LIMIT_CEILING = 1_000_000_000
# Log levels as the services (`WARNING [gateway]`) and Celery (`WARNING/MainProcess`) write them.
_WARNING = re.compile(r"\bWARNING[ /]")
_ERROR = re.compile(r"\b(?:ERROR|CRITICAL)[ /]")
OPEN_LOOP_CONNECTIONS = 1000
IDLE_S = 2.0  # background use of each process, measured before a window


def new_api_key() -> str:
    """A key in the gateway's format (`sbx_<16 hex>_<43 URL-safe>`), for BOOTSTRAP_API_KEY."""
    return f"sbx_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


@dataclass(frozen=True)
class ScoreboxRun:
    """One scenario's parameters; `concurrency` is the total over all scorer processes."""

    broker: Broker
    latency_ms: float
    jitter_ms: float
    concurrency: int
    scorers: int
    log_dir: Path
    name: str
    submit_concurrency: int = 64
    timeout_s: float = 600.0
    limits: bool = True
    api_key: str = field(default_factory=new_api_key)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def per_scorer(self) -> int:
        return math.ceil(self.concurrency / self.scorers)

    @property
    def limit_per_s(self) -> float:
        return self.per_scorer * self.scorers / (self.latency_ms / 1000)


def stack_config(
    run: ScoreboxRun,
    *,
    amqp_url: str,
    mongo_url: str,
    model_url: str,
    db_prefix: str,
    services: tuple[str, ...],
    log_dir: Path,
) -> StackConfig:
    """The services as `make run` starts them, pointed at the fake model."""
    env = {
        "SCORER_CONCURRENCY": str(run.per_scorer),
        "LLM_PROVIDER": "openai",
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "bench",
        "LLM_TIMEOUT_S": "30",
        "LOG_LEVEL": "WARNING",
        "BOOTSTRAP_API_KEY": run.api_key,
        # Limits stay switched on (their bookkeeping is part of the cost) with ceilings no
        # run reaches, unless the run asks for them off.
        "RATE_LIMIT_PER_MIN": str(LIMIT_CEILING if run.limits else 0),
        "MAX_IN_FLIGHT_PER_TENANT": str(LIMIT_CEILING if run.limits else 0),
        **run.extra_env,
    }
    return StackConfig(
        rabbitmq_url=amqp_url,
        mongo_url=mongo_url,
        db_prefix=db_prefix,
        gateway_port=0,
        scorer_replicas=run.scorers,
        env=env,
        log_dir=log_dir,
        services=services,
        cwd=REPO,
    )


@dataclass
class System:
    run: ScoreboxRun
    stack: Stack
    db: Database
    fake: ChildProcess
    amqp_url: str
    vhost: str
    db_prefix: str
    late: Stack | None = None
    # Queues still holding messages when `settle` gave up (what "not settled" means).
    unsettled: dict[str, int] = field(default_factory=dict)

    @property
    def gateway_url(self) -> str:
        return self.stack.gateway_url

    def groups(self) -> dict[str, list[int]]:
        pids: dict[str, list[int]] = {}
        for stack in (self.stack, self.late):
            if stack is not None:
                for service, found in stack.pids().items():
                    pids.setdefault(service, []).extend(found)
        groups = {service: pids.get(service, []) for service in SCOREBOX_SERVICES}
        if self.run.broker.pid is not None:
            groups["rabbitmq"] = [self.run.broker.pid]
        if self.db.pid is not None:
            groups["mongodb"] = [self.db.pid]
        groups["fake-model"] = [self.fake.pid]
        groups["bench"] = [os.getpid()]
        return groups

    @property
    def model_root(self) -> str:
        return fake_root(str(self.fake.announced["url"]))

    async def start_late_scorers(self) -> None:
        config = stack_config(
            self.run,
            amqp_url=self.amqp_url,
            mongo_url=self.db.url,
            model_url=str(self.fake.announced["url"]),
            db_prefix=self.db_prefix,
            services=("scorer",),
            log_dir=self.run.log_dir / "late",
        )
        self.late = Stack(config)
        await asyncio.to_thread(self.late.start, ready_timeout_s=STACK_READY_TIMEOUT_S)

    async def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> bool | None:
        """Wait until every consumer (projection, caches, notifier, metering...) has taken
        and acknowledged every event (bounded); None when the broker cannot tell us."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            depths = await asyncio.to_thread(queue_depths, self.run.broker, self.vhost)
            if depths is None:
                await asyncio.sleep(1.0)  # no rabbitmqctl: a short grace instead
                return None
            waiting = {name: n for name, n in depths.items() if n and not UNSETTLED.search(name)}
            if not waiting:
                return True
            self.unsettled = waiting
            await asyncio.sleep(0.25)
        return False

    async def projected(self, tasks: int, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
        """Wait until the status projection holds `tasks` tasks. The broker's queue depths
        (`settle`) are statistics refreshed every few seconds: right after a burst of
        publishes they can still read 0, and reads timed then met a projection still
        catching up (404s, slow answers)."""
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            self.db.url, serverSelectionTimeoutMS=10_000, socketTimeoutMS=30_000
        )
        try:
            collection = client[f"{self.db_prefix}_status"]["tasks"]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if await collection.count_documents({}) >= tasks:
                    return True
                await asyncio.sleep(0.25)
            return False
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def scorebox(run: ScoreboxRun, *, scorers_now: bool = True) -> AsyncIterator[System]:
    """The whole stack, fresh: vhost, database (prefix), fake model, services."""
    tag = f"{run.name}-{uuid.uuid4().hex[:8]}"
    name = f"bench-{tag}"
    with (
        vhost(run.broker, name) as amqp_url,
        database(run.log_dir / "mongo.log") as db,
        fake_model(run.latency_ms, run.jitter_ms, run.log_dir / "fake-model.log") as fake,
    ):
        services = SERVICES if scorers_now else tuple(s for s in SERVICES if s != "scorer")
        db_prefix = f"b{tag}".replace("-", "_")
        config = stack_config(
            run,
            amqp_url=amqp_url,
            mongo_url=db.url,
            model_url=str(fake.announced["url"]),
            db_prefix=db_prefix,
            services=services,
            log_dir=run.log_dir,
        )
        system = System(run, Stack(config), db, fake, amqp_url, name, db_prefix)
        await asyncio.to_thread(system.stack.start, ready_timeout_s=STACK_READY_TIMEOUT_S)
        try:
            yield system
        finally:
            if system.late is not None:
                await asyncio.to_thread(system.late.stop)
            await asyncio.to_thread(system.stack.stop)


async def fill_projection(amqp_url: str, count: int, *, tag: str) -> list[str]:
    """`count` synthetic `task.completed` events for the projection (confirms in flight)."""
    from shared.contracts import (  # noqa: PLC0415
        Phase,
        ScoreResult,
        TaskCompleted,
        event_sequence,
        utcnow,
    )

    result = ScoreResult(score=5.0, comment="Synthetic.", model="fake-judge-1")
    sequence = event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL)
    task_ids = [f"fill{tag}{i:07d}" for i in range(count)]
    connection = await aio_pika.connect(amqp_url, timeout=AMQP_TIMEOUT_S)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(EVENTS_EXCHANGE, ensure=True)
        for start in range(0, count, FILL_BATCH):
            now = utcnow()
            batch = [
                TaskCompleted(
                    task_id=task_id, sequence=sequence, attempt=1, submitted_at=now, result=result
                )
                for task_id in task_ids[start : start + FILL_BATCH]
            ]
            async with asyncio.timeout(AMQP_TIMEOUT_S * 3):
                await asyncio.gather(
                    *(
                        exchange.publish(
                            aio_pika.Message(
                                event.model_dump_json().encode(),
                                content_type="application/json",
                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                message_id=event.message_id,
                                correlation_id=event.task_id,
                            ),
                            routing_key=event.routing_key,
                        )
                        for event in batch
                    )
                )
    finally:
        async with asyncio.timeout(AMQP_TIMEOUT_S):
            await connection.close()
    return task_ids


# --------------------------------------------------------------------------- measurements


def _usage(usage: dict[str, GroupUsage], tasks: int) -> dict[str, Any]:
    return {name: group.as_dict(tasks) for name, group in usage.items()}


def _cpu_per_task(usage: dict[str, GroupUsage], tasks: int) -> dict[str, float | None]:
    def per_task(*names: str) -> float | None:
        present = [usage[n].cpu_s for n in names if n in usage]
        return rounded(sum(present) * 1000 / tasks, 3) if present and tasks else None

    return {
        "scorer": per_task("scorer"),
        "gateway": per_task("gateway"),
        "status": per_task("status"),
        "scheduler": per_task("scheduler"),
        "scorebox_total": per_task(*SCOREBOX_SERVICES),
        "rabbitmq": per_task("rabbitmq"),
        "mongodb": per_task("mongodb"),
        "fake_model": per_task("fake-model"),
        "bench": per_task("bench"),
    }


def bounds(usage: dict[str, GroupUsage], db: Database) -> list[str]:
    """What limited the run, read from how busy each process was."""
    found = []
    mongo = usage.get("mongodb")
    ours = sum(usage[name].cpu_s for name in SCOREBOX_SERVICES if name in usage)
    if db.is_standin and mongo is not None:
        if mongo.mean_utilisation >= STANDIN_BOUND_CORES:
            found.append(
                f"bounded by the MongoDB stand-in ({mongo.mean_utilisation:.2f} cores busy on "
                "average; it is one Python thread)"
            )
        elif mongo.cpu_s >= ours:
            found.append(
                "bounded by the MongoDB stand-in (it spent more CPU than all Scorebox "
                f"processes together: {mongo.cpu_s:.1f} s against {ours:.1f} s)"
            )
    for name in (*SCOREBOX_SERVICES, "bench"):
        group = usage.get(name)
        per_process = group.mean_utilisation / max(1, len(group.peak_rss_kib)) if group else 0.0
        if per_process >= CPU_BOUND_CORES:
            found.append(f"{name} CPU-bound ({per_process:.2f} cores per process)")
    machine = usage.get(MACHINE)
    if machine is not None and machine.mean_utilisation >= MACHINE_BOUND_CORES:
        other = _other_load(usage)
        found.append(
            f"machine CPU saturated ({machine.mean_utilisation:.2f} of 2 cores busy, "
            f"{other or 0:.2f} by processes outside this run)"
        )
    return found


def _sent_rate(posted: list[Posted]) -> float | None:
    """Arrivals per second the load generator actually achieved."""
    sent = sorted(p.sent_at for p in posted)
    if len(sent) < 2 or sent[-1] <= sent[0]:
        return None
    return (len(sent) - 1) / (sent[-1] - sent[0])


def log_problems(log_dir: Path) -> dict[str, dict[str, int]]:
    """Warnings, errors and tracebacks each service logged during the run (a degraded run
    shows here: database timeouts, retries, crashes)."""
    found: dict[str, dict[str, int]] = {}
    for path in sorted(log_dir.rglob("*.log")):
        counts = {"warnings": 0, "errors": 0, "tracebacks": 0}
        with contextlib.suppress(OSError), path.open(errors="replace") as lines:
            for line in lines:
                if _WARNING.search(line):
                    counts["warnings"] += 1
                elif _ERROR.search(line):
                    counts["errors"] += 1
                elif line.startswith("Traceback"):
                    counts["tracebacks"] += 1
        if any(counts.values()):
            found[str(path.relative_to(log_dir).with_suffix(""))] = counts
    return found


def _ops_per_task(
    before: dict[str, int] | None, after: dict[str, int] | None, tasks: int
) -> dict[str, float] | None:
    """MongoDB operations per task by kind (server-wide counters: what the server counts as
    a `command` varies; the stand-in counts driver handshakes and pings there)."""
    if before is None or after is None or not tasks:
        return None
    per_task = {
        kind: round((after.get(kind, 0) - before.get(kind, 0)) / tasks, 2)
        for kind in ("insert", "query", "update", "delete", "getmore", "command")
    }
    per_task["total"] = round(sum(per_task.values()), 2)
    return per_task


def _other_load(usage: dict[str, GroupUsage]) -> float | None:
    """Cores busy with processes we did not measure (other users of the machine)."""
    machine = usage.get(MACHINE)
    if machine is None:
        return None
    ours = sum(g.cpu_s for name, g in usage.items() if name != MACHINE)
    return rounded((machine.cpu_s - ours) / machine.wall_s, 3) if machine.wall_s else None


async def _model_stats(root: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(f"{root}/_stats") as response,
    ):
        stats: dict[str, Any] = await response.json()
    return {k: stats[k] for k in ("calls", "max_in_flight", "status_counts")}


async def _reset_model(root: str) -> None:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.post(f"{root}/_reset") as response,
    ):
        await response.read()


def _posted_summary(posted: list[Posted]) -> dict[str, Any]:
    errors: dict[str, int] = {}
    for p in posted:
        if p.task_id is None:
            key = str(p.status) if p.status else (p.error or "error").split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "submitted": len(posted),
        "accepted": sum(1 for p in posted if p.task_id is not None),
        "errors": errors,
        "refused_then_retried": sum(p.refusals for p in posted),
    }


async def _warm_up(system: System, listener: CompletionListener, count: int) -> None:
    """A few tasks end to end first: connections open, code paths warm."""
    if count <= 0:
        return
    async with http_session(system.run.submit_concurrency, system.run.api_key) as session:
        texts = [essay(f"{system.run.name}-warm", i) for i in range(count)]
        posted = await submit_burst(
            session, system.gateway_url, texts, concurrency=16, on_accepted=listener.track
        )
    accepted = sum(1 for p in posted if p.task_id is not None)
    if accepted < count or not await listener.wait_for(accepted, system.run.timeout_s):
        first_error = next((f"{p.status} {p.error}" for p in posted if p.error), "none")
        raise BenchError(
            f"warm-up: {accepted}/{count} accepted, {listener.done} finished; "
            f"first error: {first_error}"
        )


async def _verify(system: System, task_ids: list[str]) -> dict[str, int]:
    """Poll a sample of tasks through the public API: each should read `completed`."""
    sample = random.Random(1).sample(  # noqa: S311 - a sample, not a secret
        task_ids, min(VERIFY_SAMPLE, len(task_ids))
    )
    async with http_session(8, system.run.api_key) as session:
        _, statuses = await read_latencies(session, system.gateway_url, sample, concurrency=4)
    return statuses


def _completions(
    run: ScoreboxRun, posted: list[Posted], listener: CompletionListener, started: float
) -> dict[str, Any]:
    accepted = [p for p in posted if p.task_id is not None]
    finished = listener.finished(p.task_id for p in accepted if p.task_id is not None)
    times = [c.at for c in finished.values()]
    end_to_end = [
        finished[p.task_id].at - p.sent_at
        for p in accepted
        if p.task_id is not None and p.task_id in finished
    ]
    model_ms = [c.model_ms / 1000 for c in finished.values() if c.model_ms is not None]
    model = summary_ms(model_ms)
    tasks_per_s = steady_rate(times)
    return {
        "completed": sum(1 for c in finished.values() if c.status == "completed"),
        "failed": sum(1 for c in finished.values() if c.status == "failed"),
        "missing": len(accepted) - len(finished),
        "duplicate_events": listener.duplicates,
        "tasks_per_s": rounded(tasks_per_s),
        "tasks_per_s_overall": rounded(overall_rate(times, started)),
        "limit_per_s": round(run.limit_per_s, 1),
        "ratio_to_limit": rounded(ratio(tasks_per_s, run.limit_per_s), 3),
        "end_to_end_ms": summary_ms(end_to_end),
        "model_call_ms": model,
        "model_overhead_p50_ms": rounded((model["p50"] or 0) - run.latency_ms)
        if model["p50"] is not None
        else None,
    }


# --------------------------------------------------------------------------- scenarios


async def burst(run: ScoreboxRun, n: int, *, warmup: int) -> dict[str, Any]:
    """N submissions over HTTP as a burst; completions timed by events."""
    async with scorebox(run) as system, CompletionListener(system.amqp_url) as listener:
        await _warm_up(system, listener, warmup)
        await _reset_model(system.model_root)
        texts = [essay(run.name, i) for i in range(n)]
        meter = CpuMeter(system.groups())
        await meter.idle(IDLE_S)
        ops_before = await asyncio.to_thread(mongo_opcounters, system.db.url)
        async with http_session(run.submit_concurrency, run.api_key) as session:
            before = listener.done
            meter.start()
            started = time.monotonic()
            posted = await submit_burst(
                session,
                system.gateway_url,
                texts,
                concurrency=run.submit_concurrency,
                on_accepted=listener.track,
            )
            submitted_at = time.monotonic()
            accepted = sum(1 for p in posted if p.task_id is not None)
            in_time = await listener.wait_for(before + accepted, run.timeout_s)
            settled = await system.settle()
            usage = await meter.stop()
        ops_after = await asyncio.to_thread(mongo_opcounters, system.db.url)
        stats = await _model_stats(system.model_root)
        task_ids = [p.task_id for p in posted if p.task_id is not None]
        verified = await _verify(system, task_ids)
        return {
            "system": f"Scorebox ({run.scorers} scorer x {run.per_scorer})",
            "tasks": n,
            **_posted_summary(posted),
            "submit_s": round(submitted_at - started, 3),
            "submit_per_s": rounded(accepted / (submitted_at - started)),
            "submit_ms": summary_ms([p.latency_s for p in posted]),
            **_completions(run, posted, listener, started),
            "finished_in_time": in_time,
            "settled": settled,
            "unsettled_queues": system.unsettled if settled is False else {},
            "verified_reads": verified,
            "model": stats,
            "cpu_ms_per_task": _cpu_per_task(usage, n),
            "mongodb_ops_per_task": _ops_per_task(ops_before, ops_after, n),
            "log_problems": log_problems(run.log_dir),
            "other_load_cores": _other_load(usage),
            "bounds": bounds(usage, system.db),
            "processes": _usage(usage, n),
        }


async def open_loop(
    run: ScoreboxRun, rate: float, seconds: float, *, scorers: bool = True
) -> dict[str, Any]:
    """Arrivals at `rate`/s for `seconds`: POST latency and errors. With `scorers`, the
    scorers run meanwhile (the whole stack is loaded); without, the tasks wait in the queue
    and the figures are those of the submit path alone."""
    async with (
        scorebox(run, scorers_now=scorers) as system,
        CompletionListener(system.amqp_url) as listener,
    ):
        if scorers:
            await _warm_up(system, listener, min(32, run.concurrency))
        meter = CpuMeter(system.groups())
        await meter.idle(IDLE_S)
        # Enough connections that the open loop practically never waits for one (a wait would
        # still count: latency runs from the due time), few enough for the open-files limit.
        async with http_session(OPEN_LOOP_CONNECTIONS, run.api_key) as session:
            meter.start()
            posted = await submit_open_loop(
                session,
                system.gateway_url,
                rate=rate,
                duration_s=seconds,
                tag=run.name,
                on_accepted=listener.track,
            )
            usage = await meter.stop()
        latencies = [p.latency_s for p in posted if p.status]
        accepted = [p.latency_s for p in posted if p.task_id is not None]
        refused = [p.latency_s for p in posted if p.status == HTTPStatus.SERVICE_UNAVAILABLE]
        late = [p.sent_at - p.due_at for p in posted]
        return {
            "system": f"Scorebox ({run.scorers} scorer x {run.per_scorer})"
            if scorers
            else "Scorebox (scorers stopped)",
            "scorers_running": scorers,
            "rate_per_s": rate,
            "seconds": seconds,
            **_posted_summary(posted),
            "sent_per_s": rounded(_sent_rate(posted)),
            "post_ms": summary_ms(latencies),
            "accepted_post_ms": summary_ms(accepted),
            "refused_post_ms": summary_ms(refused),
            "sender_lag_ms": summary_ms(late),
            "gateway_cpu_ms_per_submit": rounded(usage["gateway"].cpu_s * 1000 / len(posted), 3)
            if posted
            else None,
            "cpu_ms_per_task": _cpu_per_task(usage, len(posted)),
            "log_problems": log_problems(run.log_dir),
            "other_load_cores": _other_load(usage),
            "bounds": bounds(usage, system.db),
            "processes": _usage(usage, len(posted)),
        }


async def backlog(
    run: ScoreboxRun,
    n: int,
    *,
    reads: int,
    read_concurrency: int,
    projection_size: int,
    scorers_alone: bool = False,
) -> dict[str, Any]:
    """N tasks submitted while no scorer runs; scorers started late drain them.

    `scorers_alone` stops every other service before the scorers start: their outcomes then
    wait in the other services' queues, and the database serves only the scorers' claims and
    decisions, so the drain measures the scorers rather than the whole stack's writes (no
    status reads follow: the gateway is stopped).

    CPU is measured from the moment the scorers answer `/readyz` (their start-up is not a
    per-task cost) and divided by the tasks finished after it. Then status reads through the
    gateway, with the projection topped up to `projection_size` by synthetic completions.
    """
    async with (
        scorebox(run, scorers_now=False) as system,
        CompletionListener(system.amqp_url) as listener,
    ):
        texts = [essay(run.name, i) for i in range(n)]
        async with http_session(run.submit_concurrency, run.api_key) as session:
            filled_from = time.monotonic()
            posted = await submit_burst(
                session,
                system.gateway_url,
                texts,
                concurrency=run.submit_concurrency,
                on_accepted=listener.track,
            )
            fill_s = time.monotonic() - filled_from
        accepted = [p.task_id for p in posted if p.task_id is not None]
        await system.settle()
        if scorers_alone:
            await asyncio.to_thread(system.stack.stop)
        ops_before = await asyncio.to_thread(mongo_opcounters, system.db.url)
        scorers_from = time.monotonic()
        await system.start_late_scorers()
        ready_at = time.monotonic()
        meter = CpuMeter(system.groups())
        meter.start()
        in_time = await listener.wait_for(len(accepted), run.timeout_s)
        # Alone, the outcomes stay queued for the stopped services: nothing to settle.
        settled = None if scorers_alone else await system.settle()
        usage = await meter.stop()
        ops_after = await asyncio.to_thread(mongo_opcounters, system.db.url)
        stats = await _model_stats(system.model_root)
        finished = listener.finished(accepted)
        times = [c.at for c in finished.values()]
        metered_tasks = sum(1 for t in times if t >= ready_at)
        first, last = quarter_rates(times)
        extra = max(0, projection_size - len(accepted))
        filled = (
            await fill_projection(system.amqp_url, extra, tag=system.db_prefix[-8:])
            if extra
            else []
        )
        population = [*accepted, *filled]
        fill_settled: bool | None = True
        if filled:
            fill_settled = await system.settle(run.timeout_s)
            if not await system.projected(len(population), run.timeout_s):
                fill_settled = False
        sample = random.Random(2).sample(  # noqa: S311 - a sample, not a secret
            population, min(reads, len(population))
        )
        async with http_session(read_concurrency, run.api_key) as session:
            read_s, statuses = await read_latencies(
                session, system.gateway_url, sample, concurrency=read_concurrency
            )
        model_ms = [c.model_ms / 1000 for c in finished.values() if c.model_ms is not None]
        tasks_per_s = steady_rate(times)
        alone = ", the other services stopped" if scorers_alone else ""
        return {
            "system": f"Scorebox ({run.scorers} scorer x {run.per_scorer}{alone})",
            "scorers_alone": scorers_alone,
            "tasks": n,
            **_posted_summary(posted),
            "fill_s": round(fill_s, 2),
            "submit_per_s": rounded(len(accepted) / fill_s) if fill_s else None,
            "submit_ms": summary_ms([p.latency_s for p in posted]),
            "scorers_ready_s": round(ready_at - scorers_from, 2),
            "completed": sum(1 for c in finished.values() if c.status == "completed"),
            "failed": sum(1 for c in finished.values() if c.status == "failed"),
            "missing": len(accepted) - len(finished),
            "finished_in_time": in_time,
            "settled": settled,
            "unsettled_queues": system.unsettled if settled is False else {},
            # The drain as a throughput: what the scorers sustain, submission excluded.
            "tasks_per_s": rounded(tasks_per_s),
            "tasks_per_s_overall": rounded(steady_rate(times, 0.0, 1.0)),
            "limit_per_s": round(run.limit_per_s, 1),
            "ratio_to_limit": rounded(ratio(tasks_per_s, run.limit_per_s), 3),
            "end_to_end_ms": None,  # queued on purpose: the wait says nothing
            "model_call_ms": summary_ms(model_ms),
            "model": stats,
            "mongodb_ops_per_task": _ops_per_task(ops_before, ops_after, metered_tasks),
            "drain": {
                "first_quarter_per_s": rounded(first),
                "last_quarter_per_s": rounded(last),
                "last_over_first": rounded(ratio(last, first), 3),
                "overall_per_s": rounded(steady_rate(times, 0.0, 1.0)),
                "tenths_per_s": [rounded(rate) for rate in tenth_rates(times)],
                "limit_per_s": round(run.limit_per_s, 1),
            },
            "status_reads": {
                "projection_tasks": len(population),
                "synthetic_tasks": len(filled),
                "projection_settled": fill_settled,
                "reads": len(read_s),
                "concurrency": read_concurrency,
                "latency_ms": summary_ms(read_s),
                "statuses": statuses,
            },
            "metered_tasks": metered_tasks,
            "cpu_ms_per_task": _cpu_per_task(usage, metered_tasks),
            "log_problems": log_problems(run.log_dir),
            "other_load_cores": _other_load(usage),
            "bounds": bounds(usage, system.db),
            "processes": _usage(usage, metered_tasks),
        }
