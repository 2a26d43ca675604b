"""What the fault tests share: the services as processes, the fake model, the broker's controls.

The services run as real processes (`devtools.stack.Stack`) in a RabbitMQ vhost of the test
module's own, so a test may cut that vhost without touching anyone else's; the model is the
fake OpenAI-compatible server, in this process on the test's event loop. Nothing here blocks
that loop: stack operations run in a worker thread, `rabbitmqctl` as an asyncio subprocess.

Every HTTP answer the gateway gives a test is counted (`Scorebox.answers`), so a test can
say how many 503s and 500s its clients saw; the figures of each test go through `Figures`
into `.run/results/faults.json`, which `python -m devtools.reliability` renders.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import httpx

from bench.infra import reference_workload_ms
from devtools.fake_llm import FakeLLM
from devtools.infra import is_local_node
from devtools.stack import Stack, StackConfig, free_ports
from shared.topology import SCORE_REQUESTS
from tests.support import eventually

REPO = Path(__file__).resolve().parents[2]
RESULTS_PATH = REPO / ".run" / "results" / "faults.json"

READY_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 180.0
RABBITMQCTL_TIMEOUT_S = 90.0
TERMINAL = frozenset({"completed", "failed"})
SERVICES = ("status", "scorer", "gateway")  # the scheduler plays no part in these faults

# What every fault stack shares: the OpenAI provider pointed at the fake, short back-offs and
# a short lease margin so a lost claim is taken over within seconds, not minutes.
BASE_ENV: dict[str, str] = {
    "LLM_PROVIDER": "openai",
    "LLM_API_KEY": "fault-test-key",
    "LLM_MODEL": "fake-judge-1",
    "LLM_TIMEOUT_S": "5",
    "RETRY_BASE_S": "0.2",
    "RETRY_CAP_S": "1",
    "LEASE_MARGIN_S": "1",
    "LOG_LEVEL": "INFO",
    "RATE_LIMIT_PER_MIN": "0",  # the tests submit faster than a client is allowed to
}


def api_key() -> str:
    """A key in the gateway's format (`sbx_<16 hex>_<43 URL-safe>`), for BOOTSTRAP_API_KEY."""
    return f"sbx_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


def new_marker() -> str:
    """A task key for the fake model's `by_id` counters, unique per task."""
    return f"f{uuid.uuid4().hex[:12]}"


def essay(marker: str, faults: str = "") -> str:
    """A unique text (so the result cache never answers it) keyed `marker` for the fake."""
    return f"A fault-test essay about queues, number {marker}. [[id:{marker}]] {faults}".strip()


# ------------------------------------------------------------------------------ the stack


def repeated_calls(beyond_attempts: Mapping[str, int]) -> int:
    """The repeated model calls in `Scorebox.calls_beyond_attempts`."""
    return sum(n for n in beyond_attempts.values() if n > 0)


@dataclass
class Scorebox:
    """A running stack, the fake model it calls, and an HTTP client that counts answers."""

    stack: Stack
    llm: FakeLLM
    amqp_url: str
    api: httpx.AsyncClient
    answers: Counter[int] = field(default_factory=Counter)

    async def post(
        self, text: str, *, headers: Mapping[str, str] | None = None, **fields: Any
    ) -> httpx.Response:
        """`POST /v1/scores`, counted; a transport error is counted as 0 and re-raised."""
        try:
            response = await self.api.post(
                "/v1/scores", json={"text": text, **fields}, headers=headers
            )
        except httpx.HTTPError:
            self.answers[0] += 1
            raise
        self.answers[response.status_code] += 1
        return response

    async def submit(self, text: str) -> str:
        response = await self.post(text)
        assert response.status_code == 202, response.text
        task_id: str = response.json()["task_id"]
        return task_id

    async def view(self, task_id: str) -> dict[str, Any] | None:
        """The poll answer, or None when the gateway could not answer it (counted)."""
        try:
            response = await self.api.get(f"/v1/scores/{task_id}")
        except httpx.HTTPError:
            self.answers[0] += 1
            return None
        self.answers[response.status_code] += 1
        if response.status_code != 200:
            return None
        view: dict[str, Any] = response.json()
        return view

    async def finish(
        self, task_ids: Iterable[str], *, timeout_s: float = FINISH_TIMEOUT_S
    ) -> dict[str, dict[str, Any]]:
        """Poll until every task is completed or failed; their last views."""
        pending = set(task_ids)
        done: dict[str, dict[str, Any]] = {}
        gate = asyncio.Semaphore(8)

        async def poll(task_id: str) -> None:
            async with gate:
                view = await self.view(task_id)
            if view is not None and view["status"] in TERMINAL:
                done[task_id] = view
                pending.discard(task_id)

        async def all_done() -> bool:
            await asyncio.gather(*(poll(task_id) for task_id in list(pending)))
            return not pending

        try:
            await eventually(all_done, timeout_s=timeout_s, what="every task terminal")
        except AssertionError as error:
            stuck = {t: await self.view(t) for t in sorted(pending)[:5]}
            raise AssertionError(f"{error}; still pending: {stuck}\n{self.logs()}") from None
        return done

    def calls(self, marker: str) -> int:
        return int(self.llm.stats()["by_id"].get(marker, 0))

    def calls_beyond_attempts(
        self, markers: Mapping[str, str], views: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, int]:
        """Model calls beyond one per attempt, by marker, of tasks (task id → marker) whose
        last views are `views`: a timeout's retry is an attempt, not a repeat."""
        return {m: self.calls(m) - views[t]["attempts"] for t, m in markers.items()}

    def http_5xx(self) -> dict[str, int]:
        seen = {"500": self.answers[500], "503": self.answers[503]}
        seen |= {str(code): n for code, n in self.answers.items() if code > 500 and code != 503}
        return seen

    async def kill(self, service: str) -> None:
        await asyncio.to_thread(self.stack.kill, service)

    async def restart(self, service: str) -> float:
        """Start a (killed) service again; seconds until it answered `/readyz` with 200."""
        started = time.monotonic()
        await asyncio.to_thread(self.stack.restart, service, ready_timeout_s=READY_TIMEOUT_S)
        return time.monotonic() - started

    async def ready(self, service: str) -> int:
        """The status of the service's `/readyz` (which may take a dependency's timeout)."""
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
            return (await client.get(f"{self.stack.url(service)}/readyz")).status_code

    async def answers_ready(self, service: str, status: int = 200) -> bool:
        return await self.ready(service) == status

    async def all_ready(self, *, timeout_s: float) -> None:
        """Wait until every service of the stack answers `/readyz` with 200."""
        for service in SERVICES:
            await eventually(
                functools.partial(self.answers_ready, service),
                timeout_s=timeout_s,
                what=f"{service} ready",
            )

    @asynccontextmanager
    async def calls_in_flight(
        self, tasks: int, *, latency_ms: int, timeout_s: float
    ) -> AsyncIterator[tuple[dict[str, str], int]]:
        """Submit `tasks` tasks with the model slowed to `latency_ms`; inside, at least one of
        their calls is in flight. Yields their task id → marker and the calls in flight then;
        the model's latency is restored on the way out."""
        self.llm.config.latency_ms = latency_ms
        try:
            markers = [new_marker() for _ in range(tasks)]
            accepted = {await self.submit(essay(m)): m for m in markers}
            async with asyncio.timeout(timeout_s):
                await self.llm.wait_for_stats(lambda stats: stats["in_flight"] >= 1)
            yield accepted, int(self.llm.stats()["in_flight"])
        finally:
            self.llm.config.latency_ms = 0

    def logs(self, lines: int = 25) -> str:
        tails = [
            f"--- {p.name} ({p.log_path}):\n{self.stack.log_tail(p.service, p.replica, lines)}"
            for p in self.stack.processes()
        ]
        return "\n".join(tails)


@dataclass(frozen=True)
class BoxParts:
    """What every fault module's stack is started from: the module's vhost, the test database
    and the module's prefix in it, the fake model, and the folder for the services' logs."""

    amqp_url: str
    mongo_url: str
    db_prefix: str
    llm: FakeLLM
    log_dir: Path


@asynccontextmanager
async def running_scorebox(
    parts: BoxParts,
    *,
    mongo_url: str | None = None,
    env: Mapping[str, str] | None = None,
    commands: dict[str, list[str]] | None = None,
    scorer_replicas: int = 1,
) -> AsyncIterator[Scorebox]:
    """Start status, scorer(s) and gateway as processes; stop them on the way out.

    `mongo_url` replaces the test database for a module whose services must reach it through
    something it controls (a proxy, a stand-in it stops and starts).
    """
    config = StackConfig(
        rabbitmq_url=parts.amqp_url,
        mongo_url=parts.mongo_url if mongo_url is None else mongo_url,
        db_prefix=parts.db_prefix,
        gateway_port=0,
        services=SERVICES,
        log_dir=parts.log_dir,
        env={**BASE_ENV, "LLM_BASE_URL": parts.llm.url, **(env or {})},
        commands=commands,
        scorer_replicas=scorer_replicas,
    )
    key = api_key()
    config.env["BOOTSTRAP_API_KEY"] = key
    stack = Stack(config)
    await asyncio.to_thread(stack.start, ready_timeout_s=READY_TIMEOUT_S)
    try:
        async with httpx.AsyncClient(
            base_url=stack.gateway_url,
            timeout=HTTP_TIMEOUT_S,
            headers={"Authorization": f"Bearer {key}"},
        ) as api:
            yield Scorebox(stack=stack, llm=parts.llm, amqp_url=parts.amqp_url, api=api)
    finally:
        await asyncio.to_thread(stack.stop)


# ------------------------------------------------------------------------------ MongoDB

STANDIN_START_TIMEOUT_S = 60.0


@dataclass
class StandIn:
    """`python -m devtools.mongo_standin` on a fixed port, stopped and started by the test.

    It is mongoeco's wire-protocol server, NOT MongoDB, on its sqlite engine with a file, so
    that like a MongoDB server it keeps its data across a restart (its memory engine would
    lose everything, API keys and indexes included).
    """

    port: int
    database_file: Path
    log_path: Path
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/?directConnection=true"

    async def start(self) -> None:
        command = [
            *(sys.executable, "-m", "devtools.mongo_standin", "--host", "127.0.0.1"),
            *("--port", str(self.port), "--engine", "sqlite", "--path", str(self.database_file)),
            "--exit-with-parent",
        ]
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
            )
        assert self.process.stdout is not None
        async with asyncio.timeout(STANDIN_START_TIMEOUT_S):
            line = await self.process.stdout.readline()
        assert line, f"the stand-in did not start; see {self.log_path}"
        assert json.loads(line)["url"].startswith(f"mongodb://127.0.0.1:{self.port}/")

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            async with asyncio.timeout(STANDIN_START_TIMEOUT_S):
                await self.process.wait()
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


@asynccontextmanager
async def running_standin(log_dir: Path, name: str) -> AsyncIterator[StandIn]:
    """A `StandIn` of a module's own on a free port, its files `<name>.sqlite` and
    `<name>.log` in `log_dir`; stopped on the way out."""
    (port,) = free_ports("127.0.0.1", 1)
    server = StandIn(port, log_dir / f"{name}.sqlite", log_dir / f"{name}.log")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


# ------------------------------------------------------------------------------ the broker


def vhost_of(amqp_url: str) -> str:
    return unquote(urlsplit(amqp_url).path[1:]) or "/"


def rabbitmqctl_available(amqp_url: str) -> bool:
    """`rabbitmqctl` is installed and acts on the broker under test (not a container's)."""
    return is_local_node(amqp_url) and shutil.which("rabbitmqctl") is not None


async def rabbitmqctl(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(RABBITMQCTL_TIMEOUT_S):
            out, err = await process.communicate()
    except BaseException:  # timed out, or the caller's own deadline cancelled it
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args)} failed: {(out + err).decode()}")
    return out.decode()


async def queue_depths(amqp_url: str) -> dict[str, int]:
    """Messages (ready + unacknowledged) of every queue of the vhost."""
    out = await rabbitmqctl(
        "list_queues", "-p", vhost_of(amqp_url), "name", "messages", "--formatter", "json", "-q"
    )
    return {row["name"]: int(row["messages"]) for row in json.loads(out or "[]")}


@dataclass(frozen=True)
class DeadLetter:
    body: bytes
    headers: dict[str, Any]


async def dead_letters(amqp_url: str) -> list[DeadLetter]:
    """What the score-requests DLQ holds, read without consuming it (each is returned)."""
    connection = await aio_pika.connect(amqp_url, timeout=30)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(SCORE_REQUESTS.dead_letter_routing_key, ensure=True)
        held = []
        while (message := await queue.get(no_ack=False, fail=False, timeout=10)) is not None:
            held.append(message)
        for message in held:
            await message.nack(requeue=True)
        return [DeadLetter(bytes(m.body), dict(m.headers)) for m in held]


# ------------------------------------------------------------------------------ the figures


@dataclass
class Outcome:
    """One fault test's figures, as the README's reliability table shows them."""

    name: str
    accepted: int
    completed: int
    failed: int
    duplicate_model_calls: int
    http_5xx_seen: dict[str, int]
    time_to_recover_s: float | None
    broker: str
    database: str
    notes: str = ""


@dataclass
class Figures:
    """Collects the outcomes of one test session; written once at its end."""

    path: Path
    command: str
    invocation: str
    outcomes: list[Outcome] = field(default_factory=list)

    def record(self, outcome: Outcome) -> None:
        self.outcomes = [o for o in self.outcomes if o.name != outcome.name]
        self.outcomes.append(outcome)

    def write(self) -> None:
        if not self.outcomes:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": self.command,
            "invocation": self.invocation,
            "python": sys.version.split()[0],
            # Recovery times scale with how fast the machine runs Python at the time.
            "host": f"{os.cpu_count()} CPU(s), reference workload {reference_workload_ms()} ms "
            "of CPU (`bench.infra.reference_workload_ms`)",
            "results": [asdict(o) for o in self.outcomes],
        }
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(document, indent=2) + "\n")
        temporary.replace(self.path)


def make_target(args: Iterable[str], cwd: Path) -> str:
    """`make test-faults` when pytest was pointed at tests/faults only, else `make test`."""
    faults = REPO / "tests" / "faults"
    paths = [(cwd / arg.split("::", 1)[0]).resolve() for arg in args]
    if paths and all(path == faults or faults in path.parents for path in paths):
        return "make test-faults"
    return "make test"


# --- A real memory alarm -------------------------------------------------------------------------

ALARMING_WATERMARK = "0.0001"  # a fraction of the machine's memory far below what it uses


@dataclass(frozen=True)
class MemoryAlarm:
    """The broker's memory watermark set below what it uses (a real alarm: every connection
    that publishes is blocked), and the setting that ends it."""

    restore: list[str]  # the `set_vm_memory_high_watermark` arguments of the setting before
    timeout_s: float

    @classmethod
    async def prepared(cls, *, timeout_s: float) -> MemoryAlarm:
        setting = (await _broker_status())["vm_memory_high_watermark_setting"]
        if "relative" in setting:
            return cls([str(setting["relative"])], timeout_s)
        return cls(["absolute", str(setting["absolute"])], timeout_s)

    async def raise_(self) -> None:
        await rabbitmqctl("set_vm_memory_high_watermark", ALARMING_WATERMARK)
        await eventually(self._raised, timeout_s=self.timeout_s, what="a memory alarm")

    async def lift(self) -> None:
        await rabbitmqctl("set_vm_memory_high_watermark", *self.restore)
        await eventually(self._cleared, timeout_s=self.timeout_s, what="the alarm cleared")

    async def _raised(self) -> bool:
        alarms = (await _broker_status())["alarms"]
        return any(alarm.get("resource") == "memory" for alarm in alarms)

    async def _cleared(self) -> bool:
        return not await self._raised()


@asynccontextmanager
async def memory_alarm(*, timeout_s: float) -> AsyncIterator[MemoryAlarm]:
    """A memory alarm for the block's duration, lifted on the way out (also when the block
    lifted it already)."""
    alarm = await MemoryAlarm.prepared(timeout_s=timeout_s)
    try:
        await alarm.raise_()
        yield alarm
    finally:
        await alarm.lift()


async def _broker_status() -> dict[str, Any]:
    status: dict[str, Any] = json.loads(await rabbitmqctl("status", "--formatter", "json"))
    return status
