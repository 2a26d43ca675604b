"""What a benchmark runs against: broker, database, fake model, vhosts, machine facts.

- RabbitMQ: `devtools.infra.resolve_rabbitmq` (RABBITMQ_URL, Docker, or the local broker);
  its pid, for CPU accounting, when the broker runs on this machine.
- MongoDB: `MONGO_URL` or Docker when present (the lead's quiet-machine run), else a fresh
  mongoeco stand-in per scenario, started here so that its pid is known and each scenario
  starts from empty collections.
- The fake model: `python -m devtools.fake_llm` as a subprocess with latency and jitter.

Every subprocess wait and network call is bounded.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from bench.procstat import find_processes
from devtools import infra as devinfra
from devtools.infra import read_first_line

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
HTTP_TIMEOUT_S = 5.0
RABBITMQCTL_TIMEOUT_S = 30.0
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

VERSIONED_PACKAGES = (
    "faststream",
    "aio-pika",
    "aiormq",
    "pymongo",
    "fastapi",
    "starlette",
    "uvicorn",
    "uvloop",
    "httpx",
    "httpx-aiohttp",
    "aiohttp",
    "orjson",
    "pydantic",
    "mongoeco",
    "celery",
    "kombu",
    "gevent",
    "requests",
)


class BenchError(RuntimeError):
    """The benchmark could not set up or finish a scenario."""


# --------------------------------------------------------------------------- subprocesses


@dataclass
class ChildProcess:
    """A subprocess that announced itself with one JSON line on stdout."""

    name: str
    process: subprocess.Popen[bytes]
    announced: dict[str, Any]
    log: BinaryIO

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=grace_s)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.log.close()


def start_announcing(name: str, command: list[str], log_path: Path) -> ChildProcess:
    """Start `command` and wait (bounded) for the JSON line it prints once it listens."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("wb")
    process = subprocess.Popen(  # noqa: S603 - our own interpreter and modules
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
    )
    child = ChildProcess(name, process, {}, log)
    try:
        child.announced = json.loads(read_first_line(process, START_TIMEOUT_S))
    except BaseException as error:
        child.stop()
        tail = log_path.read_bytes()[-2000:].decode(errors="replace")
        raise BenchError(f"{name} did not start: {error}\n{tail}") from error
    return child


@contextlib.contextmanager
def fake_model(latency_ms: float, jitter_ms: float, log_path: Path) -> Iterator[ChildProcess]:
    """The fake OpenAI-compatible model as a process; `announced["url"]` ends in `/v1`."""
    command = [
        sys.executable,
        "-m",
        "devtools.fake_llm",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--latency-ms",
        str(latency_ms),
        "--jitter-ms",
        str(jitter_ms),
        "--seed",
        "1",
        "--exit-with-parent",
    ]
    child = start_announcing("fake model", command, log_path)
    try:
        yield child
    finally:
        child.stop()


def fake_stats(base_url: str) -> dict[str, Any]:
    """`GET /_stats` of the fake model (base URL without `/v1`)."""
    with urllib.request.urlopen(f"{base_url}/_stats", timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310 - loopback URL we started
        return dict(json.loads(response.read()))


def fake_root(v1_url: str) -> str:
    return v1_url.removesuffix("/").removesuffix("/v1")


# --------------------------------------------------------------------------- database


@dataclass
class Database:
    """The MongoDB a scenario writes to; `pid` is known when we started it."""

    url: str
    kind: str
    is_standin: bool
    pid: int | None = None
    _child: ChildProcess | None = field(default=None, repr=False)
    _endpoint: devinfra.Endpoint | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._child is not None:
            self._child.stop()
        if self._endpoint is not None:
            self._endpoint.close()


def external_mongo() -> bool:
    """A real (or configured) MongoDB is available: MONGO_URL, or a Docker engine."""
    return bool(os.environ.get("MONGO_URL")) or devinfra.docker_available()


def describe_database() -> tuple[str, bool]:
    """(label, is the stand-in) of what `database()` will give the scenarios."""
    url = os.environ.get("MONGO_URL")
    if url:
        info = devinfra.mongo_build_info(url)
        if info.get("gitVersion") == "mongoeco":
            return f"{devinfra.standin_label()} from MONGO_URL", True
        return f"MongoDB {info.get('version', '?')} from MONGO_URL", False
    if devinfra.docker_available():
        return f"MongoDB (testcontainers {devinfra.MONGO_IMAGE}, one per scenario)", False
    return f"{devinfra.standin_label()}, one per scenario", True


@contextlib.contextmanager
def database(log_path: Path) -> Iterator[Database]:
    """MONGO_URL / Docker when available, else a fresh stand-in process of our own."""
    if external_mongo():
        endpoint = devinfra.resolve_mongo()
        db = Database(endpoint.url, endpoint.kind, endpoint.is_standin, _endpoint=endpoint)
        db.pid = _local_mongod_pid(endpoint.url)
    else:
        command = [sys.executable, "-m", "devtools.mongo_standin", "--port", "0"]
        child = start_announcing("MongoDB stand-in", [*command, "--exit-with-parent"], log_path)
        db = Database(
            url=str(child.announced["url"]),
            kind=devinfra.standin_label(),
            is_standin=True,
            pid=child.pid,
            _child=child,
        )
    try:
        yield db
    finally:
        db.close()


def _local_mongod_pid(url: str) -> int | None:
    if urlsplit(url).hostname not in LOOPBACK:
        return None
    pids = find_processes("mongod", "mongod")
    return pids[0] if len(pids) == 1 else None


# --------------------------------------------------------------------------- broker


@dataclass
class Broker:
    url: str
    kind: str
    version: str
    management_url: str | None
    pid: int | None

    @property
    def is_local(self) -> bool:
        return urlsplit(self.url).hostname in LOOPBACK


def resolve_broker() -> Broker:
    endpoint = devinfra.resolve_rabbitmq()
    version = devinfra.amqp_server_version(endpoint.url)
    broker = Broker(endpoint.url, endpoint.kind, version, endpoint.management_url, None)
    if broker.is_local:
        broker.pid = local_broker_pid()
    return broker


def local_broker_pid() -> int | None:
    """The pid of the local RabbitMQ node: `rabbitmqctl status`, else a /proc scan."""
    if shutil.which("rabbitmqctl"):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            result = subprocess.run(
                ["rabbitmqctl", "status"],  # noqa: S607 - the broker's own CLI, found on PATH
                capture_output=True,
                text=True,
                timeout=RABBITMQCTL_TIMEOUT_S,
                check=False,
            )
            for line in result.stdout.splitlines():
                if line.strip().startswith("OS PID:"):
                    return int(line.split(":", 1)[1])
    pids = find_processes("beam.smp", "-s rabbit boot")
    return pids[0] if len(pids) == 1 else None


@contextlib.contextmanager
def vhost(broker: Broker, name: str) -> Iterator[str]:
    """A vhost of our own for one scenario (deleted afterwards); yields its AMQP URL."""
    url = devinfra.create_vhost(broker.url, name, management_url=broker.management_url)
    try:
        yield url
    finally:
        with contextlib.suppress(devinfra.InfraError):
            devinfra.delete_vhost(broker.url, name, management_url=broker.management_url)


# --------------------------------------------------------------------------- machine facts


def machine_facts() -> dict[str, Any]:
    """CPU, memory, OS, Python, load at the start (other users of the machine show here)."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kib = int(Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1])
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "reference_workload_ms": reference_workload_ms(),
    }


def reference_workload_ms(repeats: int = 5) -> float:
    """CPU milliseconds of a fixed pure-Python workload (JSON, dicts, strings), best of
    `repeats`: how fast this machine runs Python, so runs on different machines can be set
    side by side (CPU per task scales with it)."""
    document = {"task_id": "0" * 32, "score": 7.5, "flags": ["a", "b"], "text": "word " * 40}
    best = math.inf
    for _ in range(repeats):
        started = time.process_time()
        for i in range(20_000):
            encoded = json.dumps({**document, "n": i})
            decoded = json.loads(encoded)
            _ = "-".join(sorted(decoded))
        best = min(best, time.process_time() - started)
    return round(best * 1000, 1)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_revision(cwd: Path) -> str:
    """`<commit>` or `<commit>+dirty` of the work tree, `unknown` outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],  # noqa: S607
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],  # noqa: S607
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


def queue_depths(broker: Broker, vhost_name: str) -> dict[str, int] | None:
    """Messages (ready + unacknowledged) of every queue of a vhost, via `rabbitmqctl`
    (local broker only); None when it cannot tell."""
    if not (broker.is_local and shutil.which("rabbitmqctl")):
        return None
    try:
        result = subprocess.run(  # noqa: S603 - fixed arguments, vhost names are ours
            [  # noqa: S607 - the broker's own CLI, found on PATH
                "rabbitmqctl",
                "list_queues",
                "-p",
                vhost_name,
                "name",
                "messages",
                "--quiet",
                "--no-table-headers",
            ],
            capture_output=True,
            text=True,
            timeout=RABBITMQCTL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    depths = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            depths[parts[0]] = int(parts[1])
    return depths


def mongo_opcounters(url: str, *, timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, int] | None:
    """The server's `opcounters` (insert, query, update, delete, getmore, command), or None.

    Server-wide: on a MongoDB that others use too, their operations count as well.
    """
    from pymongo import MongoClient  # noqa: PLC0415
    from pymongo.errors import PyMongoError  # noqa: PLC0415

    timeout_ms = int(timeout_s * 1000)
    client: MongoClient[dict[str, Any]] = MongoClient(
        url,
        serverSelectionTimeoutMS=timeout_ms,
        connectTimeoutMS=timeout_ms,
        socketTimeoutMS=timeout_ms,
    )
    try:
        status = client.admin.command("serverStatus")
        return {str(k): int(v) for k, v in dict(status.get("opcounters", {})).items()}
    except PyMongoError:
        return None
    finally:
        client.close()
