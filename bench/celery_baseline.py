"""The Celery baseline: a gevent worker on the workload Scorebox gets, measured alike.

    python -m bench.celery_baseline produce   # the producer process (driven over stdin)

A run starts, in a vhost of its own and against a fake model of its own:
- the worker: `celery -A bench.celery_app worker -P gevent -c C` (one process, gevent
  monkey-patched by Celery itself), consuming `bench.score`;
- a producer process that publishes tasks when told (`send N` on stdin) and answers with one
  JSON line (timings and its own CPU time).

Completions are counted at the fake model (`GET /_stats`, answers with status 200), sampled
every 100 ms and interpolated: a Celery task stores no result, so the model's answer is its
completion. CPU comes from /proc like Scorebox's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.infra import BenchError, Broker, ChildProcess, fake_model, fake_root, vhost
from bench.load import essay, wait_for_queue
from bench.procstat import CpuMeter, GroupUsage
from bench.stats import quarter_rates, ratio, rounded, tenth_rates

QUEUE = "bench.score"
WORKER_READY_TIMEOUT_S = 60.0
PRODUCER_TIMEOUT_S = 300.0
STATS_INTERVAL_S = 0.1
STATS_TIMEOUT_S = 5.0
STOP_GRACE_S = 15.0
IDLE_S = 2.0


# --------------------------------------------------------------------------- producer process


def produce() -> int:
    """Publish tasks on command: `send N TAG` → N tasks, one JSON line back; `quit` ends."""
    from bench.celery_app import TASK, app  # noqa: PLC0415 - only the producer needs Celery

    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=3)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "quit":
                break
            count, tag = int(command[1]), command[2]
            started, cpu_before = time.monotonic(), time.process_time()
            for index in range(count):
                app.send_task(TASK, args=[essay(tag, index)])
            print(
                json.dumps(
                    {
                        "sent": count,
                        "started": started,
                        "finished": time.monotonic(),
                        "cpu_s": time.process_time() - cpu_before,
                    }
                ),
                flush=True,
            )
    return 0


@dataclass
class Producer:
    process: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.process.pid

    async def send(self, count: int, tag: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"send {count} {tag}\n")
        self.process.stdin.flush()
        return await asyncio.wait_for(asyncio.to_thread(self._answer), PRODUCER_TIMEOUT_S)

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise BenchError(f"the Celery producer exited with {self.process.wait(timeout=5)}")
        return dict(json.loads(line))

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.process.stdin is not None:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_GRACE_S)


def _celery_env(amqp_url: str, model_url: str, concurrency: int, queue_type: str) -> dict[str, str]:
    return {
        **os.environ,
        "BENCH_CELERY_BROKER": amqp_url,
        "BENCH_MODEL_URL": model_url,
        "BENCH_CONCURRENCY": str(concurrency),
        "BENCH_CELERY_QUEUE_TYPE": queue_type,
        "PYTHONUNBUFFERED": "1",
    }


@contextlib.contextmanager
def producer(env: dict[str, str], log_path: Path) -> Iterator[Producer]:
    log = log_path.open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.celery_baseline", "produce"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    handle = Producer(process)
    try:
        ready = handle._answer()
        if not ready.get("ready"):
            raise BenchError(f"the Celery producer did not start: {ready}")
        yield handle
    finally:
        handle.stop()
        log.close()


@contextlib.contextmanager
def worker(env: dict[str, str], concurrency: int, log_path: Path) -> Iterator[ChildProcess]:
    """`celery worker -P gevent -c C` in its own process group, stopped (warm) on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.celery_app",
        "worker",
        "-P",
        "gevent",
        "-c",
        str(concurrency),
        "-Q",
        QUEUE,
        "-n",
        f"bench-{os.getpid()}@localhost",
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "WARNING",
    ]
    process = subprocess.Popen(  # noqa: S603 - our own interpreter and Celery
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    child = ChildProcess("celery worker", process, {}, log)
    try:
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_GRACE_S)
        log.close()


async def wait_worker_consuming(amqp_url: str, process: subprocess.Popen[bytes]) -> None:
    def consuming(counts: tuple[int, int] | None) -> bool:
        if process.poll() is not None:
            raise BenchError(f"the Celery worker exited with {process.returncode}")
        return counts is not None and counts[1] >= 1

    await wait_for_queue(amqp_url, QUEUE, ready=consuming, timeout_s=WORKER_READY_TIMEOUT_S)


# --------------------------------------------------------------------------- counting answers


@dataclass
class AnswerCounter:
    """Samples the fake model's count of 200 answers: (time, count) every 100 ms."""

    root_url: str
    session: aiohttp.ClientSession
    samples: list[tuple[float, int]]

    async def count(self) -> int:
        async with self.session.get(f"{self.root_url}/_stats") as response:
            stats = orjson.loads(await response.read())
        return int(stats["status_counts"].get("200", 0))

    async def reset(self) -> None:
        async with self.session.post(f"{self.root_url}/_reset") as response:
            await response.read()
        self.samples.clear()

    async def wait_for(self, target: int, timeout_s: float) -> bool:
        """Sample until `target` answers were counted; False when `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            count = await self.count()
            self.samples.append((time.monotonic(), count))
            if count >= target:
                return True
            await asyncio.sleep(STATS_INTERVAL_S)
        return False

    def time_at(self, count: float) -> float | None:
        """When the count reached `count`, interpolated between samples."""
        previous: tuple[float, int] | None = None
        for sample in self.samples:
            if sample[1] >= count:
                if previous is None or sample[1] == previous[1]:
                    return sample[0]
                share = (count - previous[1]) / (sample[1] - previous[1])
                return previous[0] + share * (sample[0] - previous[0])
            previous = sample
        return None

    def completion_times(self, total: int) -> list[float]:
        """An estimated completion time per task (interpolated from the samples)."""
        times = [self.time_at(k) for k in range(1, total + 1)]
        return [t for t in times if t is not None]


def stats_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STATS_TIMEOUT_S))


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class CeleryRun:
    broker: Broker
    latency_ms: float
    jitter_ms: float
    concurrency: int
    log_dir: Path
    name: str
    queue_type: str = "classic"
    timeout_s: float = 600.0


def _usage(usage: dict[str, GroupUsage], tasks: int) -> dict[str, Any]:
    return {name: group.as_dict(tasks) for name, group in usage.items()}


def _groups(
    broker: Broker, worker_pid: int, producer_pid: int, fake_pid: int
) -> dict[str, list[int]]:
    groups = {
        "celery-worker": [worker_pid],
        "celery-producer": [producer_pid],
        "fake-model": [fake_pid],
        "bench": [os.getpid()],
    }
    if broker.pid is not None:
        groups["rabbitmq"] = [broker.pid]
    return groups


async def celery_burst(run: CeleryRun, n: int, *, warmup: int) -> dict[str, Any]:
    """N tasks published as a burst to a running worker: tasks/s and worker CPU per task."""
    tag = f"{run.name}-{os.getpid()}"
    with (
        vhost(run.broker, f"bench-{tag}-{time.time_ns() % 10**9}") as amqp_url,
        fake_model(run.latency_ms, run.jitter_ms, run.log_dir / "fake-model.log") as fake,
    ):
        model_url = str(fake.announced["url"])
        env = _celery_env(amqp_url, model_url, run.concurrency, run.queue_type)
        with (
            worker(env, run.concurrency, run.log_dir / "celery-worker.log") as celery,
            producer(env, run.log_dir / "celery-producer.log") as publisher,
        ):
            await wait_worker_consuming(amqp_url, celery.process)
            async with stats_session() as session:
                counter = AnswerCounter(fake_root(model_url), session, [])
                if warmup:
                    await publisher.send(warmup, f"{tag}-warm")
                    if not await counter.wait_for(warmup, run.timeout_s):
                        raise BenchError("the Celery warm-up did not finish in time")
                await counter.reset()
                meter = CpuMeter(_groups(run.broker, celery.pid, publisher.pid, fake.pid))
                await meter.idle(IDLE_S)
                meter.start()
                # Count while publishing: the worker completes tasks before the last is sent.
                counter.samples.append((time.monotonic(), 0))
                sampling = asyncio.create_task(counter.wait_for(n, run.timeout_s))
                try:
                    sent = await publisher.send(n, tag)
                    finished = await sampling
                finally:
                    sampling.cancel()
                usage = await meter.stop()
                stats = await _stats_of(session, fake_root(model_url))
        times = counter.completion_times(n)
        return _celery_result(
            run, n=n, sent=sent, times=times, usage=usage, stats=stats, finished=finished
        )


async def celery_backlog(run: CeleryRun, n: int) -> dict[str, Any]:
    """N tasks queued first, the worker started late: drain rate, first vs last quarter."""
    tag = f"{run.name}-{os.getpid()}"
    with (
        vhost(run.broker, f"bench-{tag}-{time.time_ns() % 10**9}") as amqp_url,
        fake_model(run.latency_ms, run.jitter_ms, run.log_dir / "fake-model.log") as fake,
    ):
        model_url = str(fake.announced["url"])
        env = _celery_env(amqp_url, model_url, run.concurrency, run.queue_type)
        with producer(env, run.log_dir / "celery-producer.log") as publisher:
            sent = await publisher.send(n, tag)
            async with stats_session() as session:
                counter = AnswerCounter(fake_root(model_url), session, [])
                # Sample from before the worker starts, so the first completions are timed.
                sampling = asyncio.create_task(counter.wait_for(n, run.timeout_s))
                try:
                    with worker(env, run.concurrency, run.log_dir / "celery-worker.log") as celery:
                        await wait_worker_consuming(amqp_url, celery.process)
                        meter = CpuMeter(_groups(run.broker, celery.pid, publisher.pid, fake.pid))
                        meter.start()
                        finished = await sampling
                        usage = await meter.stop()
                        stats = await _stats_of(session, fake_root(model_url))
                finally:
                    sampling.cancel()
        times = counter.completion_times(n)
        first, last = quarter_rates(times)
        result = _celery_result(
            run, n=n, sent=sent, times=times, usage=usage, stats=stats, finished=finished
        )
        result["drain"] = {
            "first_quarter_per_s": rounded(first),
            "last_quarter_per_s": rounded(last),
            "last_over_first": rounded(ratio(last, first), 3),
            "tenths_per_s": [rounded(rate) for rate in tenth_rates(times)],
        }
        return result


async def _stats_of(session: aiohttp.ClientSession, root: str) -> dict[str, Any]:
    async with session.get(f"{root}/_stats") as response:
        stats: dict[str, Any] = await response.json()
    return {k: stats[k] for k in ("calls", "max_in_flight", "status_counts")}


def _celery_result(
    run: CeleryRun,
    *,
    n: int,
    sent: dict[str, Any],
    times: list[float],
    usage: dict[str, GroupUsage],
    stats: dict[str, Any],
    finished: bool,
) -> dict[str, Any]:
    from bench.scorebox import log_problems  # noqa: PLC0415 - one log reader for both
    from bench.stats import overall_rate, steady_rate  # noqa: PLC0415

    worker_cpu = usage["celery-worker"].cpu_s
    return {
        "system": f"Celery gevent (-c {run.concurrency}, {run.queue_type} queue)",
        "tasks": n,
        "completed": len(times),
        "finished_in_time": finished,
        "publish_s": rounded(sent["finished"] - sent["started"], 3),
        "producer_cpu_ms_per_task": rounded(sent["cpu_s"] * 1000 / n, 3) if n else None,
        "tasks_per_s": rounded(steady_rate(times)),
        "tasks_per_s_overall": rounded(overall_rate(times, sent["started"])),
        "limit_per_s": round(run.concurrency / (run.latency_ms / 1000), 1),
        "worker_cpu_ms_per_task": rounded(worker_cpu * 1000 / n, 3) if n else None,
        "worker_mean_cores": rounded(usage["celery-worker"].mean_utilisation, 3),
        "model": stats,
        "log_problems": log_problems(run.log_dir),
        "processes": _usage(usage, n),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["produce"]:
        return produce()
    print("usage: python -m bench.celery_baseline produce", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
