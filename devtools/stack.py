"""Run the services as local processes: `make run`, the e2e and fault tests, the benchmark.

    python -m devtools.stack run [--scorers N] [--ready-timeout S] [--log-dir DIR]
                                 [--webhooks-local [--webhook-fail N]]

Each service runs as `python -m services.<name>` in its own process group (Ctrl-C handling is
ours), logs to `<log_dir>/<service>[-<replica>].log`, and is ready when `GET /readyz` answers
200. Services learn everything from the environment (the public contract): `RABBITMQ_URL`,
`MONGO_URL`, `MONGO_DB_PREFIX`, `HTTP_HOST`, `<SERVICE>_PORT`, `STATUS_URL`, `NOTIFIER_URL`,
`INTERNAL_API_KEY` and `METRICS_API_KEY` (a new one each per stack unless given), and whatever
the caller adds (`LLM_*`, `SCORER_CONCURRENCY`, ...).

`--webhooks-local` (`WEBHOOKS=local make run`) also starts `devtools.webhook_receiver` and
gives the notifier the test-only settings that reach it (`local_webhook_receiver`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, TYPE_CHECKING, Any, NoReturn

from shared.settings import DEFAULT_LLM_MODEL, MAX_PORT, url_shown

if TYPE_CHECKING:
    from devtools.infra import Endpoint

SERVICES: tuple[str, ...] = ("status", "scorer", "scheduler", "notifier", "gateway")
DEFAULT_PORTS: dict[str, int] = {
    "gateway": 8000,
    "status": 8001,
    "scorer": 8002,
    "scheduler": 8003,
    "notifier": 8004,
}
PORT_ENV: dict[str, str] = {service: f"{service.upper()}_PORT" for service in DEFAULT_PORTS}
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# Where to reach a service that listens on a wildcard address: `::` is IPv6 only (asyncio
# and uvloop bind it with IPV6_V6ONLY), the others answer on IPv4.
WILDCARD_CONNECT_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}

PR_SET_PDEATHSIG = 1
READY_POLL_INTERVAL_S = 0.1
READY_REQUEST_TIMEOUT_S = 2.0
KILL_WAIT_S = 10.0
# The consumers' cancel, the acks and the connections' closes around the scorer's grace
# period, up to BROKER_TIMEOUT_S each (as compose's `stop_grace_period` counts them).
STOP_BROKER_STEPS = 3
LOG_TAIL_LINES = 40
TOPOLOGY_FIRST_TIMEOUT_S = 15.0
TOPOLOGY_FIRST_MARGIN_S = 10.0  # the process's start and its bounded stop
# The banner's CLI example scores this (the README, once suggested, is over MAX_TEXT_CHARS).
CLI_EXAMPLE_TEXT = "Asynchronous scoring keeps the request fast and the model busy."
SUPERVISE_INTERVAL_S = 0.5
RECEIVER_LOG = "webhook-receiver.log"
RECEIVER_READY_TIMEOUT_S = 30.0
RECEIVER_STOP_S = 5.0
WEBHOOKS_MODES = ("", "local")


class StackError(RuntimeError):
    """A service could not be started, did not become ready, or died."""


class PortInUseError(StackError):
    """A fixed port is taken; the message names the environment variable to change."""


@dataclass
class StackConfig:
    """What to run and where: infrastructure URLs, ports, replicas, extra environment.

    `gateway_port=0` picks free ports for every service; otherwise the gateway listens on
    `gateway_port`, the others on `ports` (default 8001 status, 8002 scorer, 8003 scheduler,
    8004 notifier) and scorer replicas beyond the first on free ports. `commands` replaces the
    command of a service (tests run stand-ins that way); the default is
    `python -m services.<name>`.
    """

    rabbitmq_url: str
    mongo_url: str
    db_prefix: str = "scorebox"
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    scorer_replicas: int = 1
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path(".run/logs")
    services: tuple[str, ...] = SERVICES
    ports: dict[str, int] = field(default_factory=dict)
    commands: dict[str, list[str]] | None = None
    cwd: Path | None = None
    # Declare the topology before the services start (`declare_topology_first`).
    declare_topology_first: bool = True


@dataclass
class ServiceProcess:
    """One running (or stopped) replica of a service."""

    service: str
    replica: int
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.log_path.stem

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Stack:
    """The services as child processes: start, wait until ready, kill, restart, stop."""

    def __init__(self, config: StackConfig) -> None:
        unknown = set(config.services) - set(DEFAULT_PORTS)
        if unknown:
            raise StackError(f"unknown services {sorted(unknown)}; known: {list(DEFAULT_PORTS)}")
        if config.scorer_replicas < 1:
            raise StackError("scorer_replicas must be at least 1")
        self.config = config
        self.internal_key = internal_key_of(config.env)
        self.metrics_key = metrics_key_of(config.env)
        self._processes: list[ServiceProcess] = []

    # ------------------------------------------------------------------ addresses

    @property
    def gateway_url(self) -> str:
        return self.url("gateway")

    def url(self, service: str, replica: int = 0) -> str:
        host = self._connect_host
        if ":" in host:  # an IPv6 address: in brackets in a URL (RFC 3986)
            host = f"[{host}]"
        return f"http://{host}:{self._find(service, replica).port}"

    def metrics_headers(self) -> dict[str, str]:
        """What a scraper of any service of this stack sends: the metrics key they share
        (nothing when the stack was given an empty one, and their `/metrics` are open)."""
        return {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}

    @property
    def _connect_host(self) -> str:
        return WILDCARD_CONNECT_HOSTS.get(self.config.host, self.config.host)

    def log_path(self, service: str, replica: int = 0) -> Path:
        return self._find(service, replica).log_path

    def log_tail(self, service: str, replica: int = 0, lines: int = LOG_TAIL_LINES) -> str:
        return read_tail(self.log_path(service, replica), lines)

    def pids(self) -> dict[str, list[int]]:
        """The pids of the running processes, by service (CPU/RSS accounting)."""
        pids: dict[str, list[int]] = {}
        for proc in self._processes:
            if proc.running and proc.process is not None:
                pids.setdefault(proc.service, []).append(proc.process.pid)
        return pids

    def processes(self) -> list[ServiceProcess]:
        """Every replica of every service, in start order."""
        return list(self._processes)

    def dead(self) -> list[ServiceProcess]:
        """Processes that were started and have exited since (none after a clean start)."""
        return [p for p in self._processes if p.process is not None and not p.running]

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, ready_timeout_s: float = 60) -> None:
        """Spawn every service and wait until all answer `/readyz` with 200.

        On failure everything is stopped and `StackError` carries the failing service's log tail.
        """
        if self._processes:
            raise StackError("the stack is already started")
        self._processes = self._plan()
        ensure_ports_free(self.config.host, self._fixed_ports())
        if self.config.declare_topology_first:
            declare_topology_first(self.config.rabbitmq_url)
        try:
            for proc in self._processes:
                self._spawn(proc, append=False)
            self._wait_ready(self._processes, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, *, grace_s: float = 10) -> None:
        """SIGTERM every process group, wait up to `grace_s` in total, SIGKILL the rest."""
        running = [p for p in self._processes if p.running]
        for proc in running:
            signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            wait_or_kill(proc, max(0.0, deadline - time.monotonic()))

    def kill(self, service: str, replica: int = 0) -> None:
        """SIGKILL one process (fault tests); it stays dead until `restart`."""
        proc = self._find(service, replica)
        if proc.running:
            signal_group(proc, signal.SIGKILL)
            wait_or_kill(proc, KILL_WAIT_S)

    def restart(
        self, service: str, replica: int = 0, *, ready_timeout_s: float = 60, grace_s: float = 10
    ) -> None:
        """Stop the process if it still runs, start it again on the same port, wait for ready."""
        proc = self._find(service, replica)
        if proc.running:
            signal_group(proc, signal.SIGTERM)
            wait_or_kill(proc, grace_s)
        self._spawn(proc, append=True)
        self._wait_ready([proc], ready_timeout_s)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals

    def _find(self, service: str, replica: int) -> ServiceProcess:
        for proc in self._processes:
            if proc.service == service and proc.replica == replica:
                return proc
        if not self._processes:
            raise StackError("the stack is not started")
        raise StackError(f"no {service} replica {replica} in this stack")

    def replicas(self, service: str) -> int:
        return self.config.scorer_replicas if service == "scorer" else 1

    def _plan(self) -> list[ServiceProcess]:
        slots = [(s, r) for s in self.config.services for r in range(self.replicas(s))]
        fixed = self.config.gateway_port != 0
        wanted = {slot: self._fixed_port(*slot) if fixed else 0 for slot in slots}
        free = iter(free_ports(self.config.host, sum(1 for p in wanted.values() if p == 0)))
        return [
            ServiceProcess(
                service=service,
                replica=replica,
                port=wanted[(service, replica)] or next(free),
                log_path=self.config.log_dir / f"{self._instance_name(service, replica)}.log",
            )
            for service, replica in slots
        ]

    def _fixed_port(self, service: str, replica: int) -> int:
        if replica > 0:
            return 0
        if service == "gateway":
            return self.config.gateway_port
        return self.config.ports.get(service, DEFAULT_PORTS[service])

    def _fixed_ports(self) -> dict[str, int]:
        if self.config.gateway_port == 0:
            return {}
        return {p.service: p.port for p in self._processes if p.replica == 0}

    def _instance_name(self, service: str, replica: int) -> str:
        return service if self.replicas(service) == 1 else f"{service}-{replica}"

    def _command(self, service: str) -> list[str]:
        if self.config.commands and service in self.config.commands:
            return list(self.config.commands[service])
        return [sys.executable, "-m", f"services.{service}"]

    def _environment(self, proc: ServiceProcess) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            RABBITMQ_URL=self.config.rabbitmq_url,
            MONGO_URL=self.config.mongo_url,
            MONGO_DB_PREFIX=self.config.db_prefix,
            HTTP_HOST=self.config.host,
        )
        if "status" in self.config.services:
            env["STATUS_URL"] = self.url("status")
        if "notifier" in self.config.services:
            env["NOTIFIER_URL"] = self.url("notifier")
        if "scheduler" in self.config.services:
            env["SCHEDULER_URL"] = self.url("scheduler")
        env.update(self.config.env)
        env["INTERNAL_API_KEY"] = self.internal_key
        env["METRICS_API_KEY"] = self.metrics_key
        env["NO_PROXY"] = env["no_proxy"] = no_proxy_with_loopback(env)
        env[PORT_ENV[proc.service]] = str(proc.port)
        env["SCOREBOX_SERVICE"] = proc.service
        env["SCOREBOX_INSTANCE"] = proc.name
        return env

    def _spawn(self, proc: ServiceProcess, *, append: bool) -> None:
        command = self._command(proc.service)
        proc.log_path.parent.mkdir(parents=True, exist_ok=True)
        with proc.log_path.open("ab" if append else "wb") as log:
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            log.write(f"=== {stamp} starting {proc.name}: {shlex.join(command)}\n".encode())
            log.flush()
            proc.process = spawn_logged(
                command, env=self._environment(proc), log=log, cwd=self.config.cwd
            )

    def _wait_ready(self, procs: Sequence[ServiceProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        last_answer: dict[str, str] = {}
        while pending:
            for proc in list(pending):
                self._fail_if_exited(proc)
                answer = probe(f"{self.url(proc.service, proc.replica)}/readyz")
                if answer == "200":
                    pending.remove(proc)
                last_answer[proc.name] = answer
            if pending and time.monotonic() >= deadline:
                proc = pending[0]
                raise StackError(
                    f"{proc.name} did not become ready within {timeout_s:.0f}s "
                    f"(last /readyz answer: {last_answer[proc.name]}); "
                    f"last lines of {proc.log_path}:\n{read_tail(proc.log_path)}"
                )
            if pending:
                time.sleep(READY_POLL_INTERVAL_S)

    @staticmethod
    def _fail_if_exited(proc: ServiceProcess) -> None:
        if proc.process is not None and proc.process.poll() is not None:
            raise StackError(
                f"{proc.name} exited with code {proc.process.returncode} before it was ready; "
                f"last lines of {proc.log_path}:\n{read_tail(proc.log_path)}"
            )


# ---------------------------------------------------------------------- process helpers


def declare_topology_first(rabbitmq_url: str, timeout_s: float = TOPOLOGY_FIRST_TIMEOUT_S) -> bool:
    """Declare the topology once, before the services start and declare it each, at once;
    best effort (False when it could not: each service declares it all the same), in a
    process of its own (`devtools.declare_topology`), killed past `timeout_s` and a margin.

    RabbitMQ 3.10 answers a quorum queue's declaration as done while another client's
    declaration of it is still starting the queue's Raft member; a `basic.consume` on it
    then crashes the channel (`{badmatch,{error,noproc}}` in its log, `INTERNAL_ERROR` to
    the client, which closes the connection), and the service whose consumer it was ended
    its start: services started together on a fresh vhost failed now and then (CI, a
    `make run` and two fault-test stacks of one run). Under compose or Kubernetes a restart
    takes the service up again; here the stack would have failed. In this process, a broker
    that accepted the connection and never answered hung the start for good: aio-pika's
    robust connection goes on trying after a cancellation (a review)."""
    command = [sys.executable, "-m", "devtools.declare_topology", str(timeout_s)]
    env = {**os.environ, "RABBITMQ_URL": rabbitmq_url}  # not on the command line (`ps`)
    try:
        done = subprocess.run(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s + TOPOLOGY_FIRST_MARGIN_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        _declared_by_each(f"no answer within {timeout_s:g} s")
        return False
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        _declared_by_each(said[-1] if said else f"exit code {done.returncode}")
    return done.returncode == 0


def _declared_by_each(why: str) -> None:
    """One line: the child's last (its error; aiormq's log lines come before it)."""
    print(
        f"warning: the topology was not declared first ({why}); each service declares it",
        file=sys.stderr,
    )


def internal_key_of(stack_env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str:
    """The `INTERNAL_API_KEY` every service of a stack shares, kept across restarts: the one
    given (the stack's environment, then the process's; given empty, the internal routes are
    open), else a new one, so that `make run` runs authenticated as a deployment should."""
    return _stack_key("INTERNAL_API_KEY", stack_env, environ)


def metrics_key_of(stack_env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str:
    """The `METRICS_API_KEY` every service of a stack shares, chosen as `internal_key_of`
    chooses the internal key: given empty, the services' `/metrics` are open (the gateway's
    takes the admin key alone)."""
    return _stack_key("METRICS_API_KEY", stack_env, environ)


def _stack_key(name: str, stack_env: Mapping[str, str], environ: Mapping[str, str]) -> str:
    # Exported empty in the shell is given empty too (open), as the README says: taken for
    # unset, it got a new key and the routes stayed closed (found in a walkthrough).
    for given in (stack_env, environ):
        if name in given:
            return given[name]
    return secrets.token_urlsafe(32)


def spawn_logged(
    command: list[str], *, env: Mapping[str, str], log: IO[bytes], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """A child of the run in a session of its own (its group signalled as one), its output
    into `log`, dying with this process."""
    return subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,  # noqa: PLW1509 - only async-signal-safe work
    )


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the runner dies, even by SIGKILL (Linux).

    Without it, a runner killed hard (a CI timeout, a test's last resort) leaves its services
    running and holding their ports.
    """
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def signal_group(proc: ServiceProcess, signum: signal.Signals) -> None:
    """Send `signum` to the process group of `proc` (it leads its own session)."""
    if proc.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.process.pid, signum)


def wait_or_kill(proc: ServiceProcess, timeout_s: float) -> None:
    """Wait for `proc` to exit; SIGKILL its group when `timeout_s` passes."""
    if proc.process is None:
        return
    try:
        proc.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.process.wait(timeout=KILL_WAIT_S)


# For our own services only: `urlopen` would send loopback requests to an `http_proxy` from the
# environment (no proxy answers for 127.0.0.1 on our behalf; `make run` then never got ready).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe(url: str, timeout_s: float = READY_REQUEST_TIMEOUT_S) -> str:
    """The HTTP status of `GET url` as text, or a short description of why there was none.

    Always direct: proxy variables in the environment are ignored."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return str(response.status)
    except urllib.error.HTTPError as error:
        return str(error.code)
    except (OSError, ValueError) as error:
        return type(error).__name__ if not str(error) else f"{type(error).__name__}: {error}"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def no_proxy_with_loopback(env: Mapping[str, str]) -> str:
    """`NO_PROXY` of `env` with the loopback hosts added: the services honour the proxy of
    the environment for what lies outside (the model provider), and a local model server
    (the fake one of `make run`) must not be asked through it."""
    given = env.get("NO_PROXY") or env.get("no_proxy") or ""
    hosts = [host.strip() for host in given.split(",") if host.strip()]
    return ",".join([*hosts, *(host for host in LOOPBACK_HOSTS if host not in hosts)])


def read_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_bytes()[-64_000:].decode(errors="replace")
    except OSError as error:
        return f"(cannot read {path}: {error})"
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------- port helpers


# A family and a socket address of it, as `socket.getaddrinfo` gives them.
Address = tuple[socket.AddressFamily, tuple[Any, ...]]


def listen_addresses(host: str, port: int) -> list[Address]:
    """Where a server told to listen on `host` binds, as asyncio does: every address the name
    resolves to, each in its own family (an IPv6 `host` such as `::1` needs an IPv6 socket)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError) as error:
        raise StackError(f"HTTP_HOST={host!r} is not an address to listen on: {error}") from None
    addresses: list[Address] = []
    for family, _type, _proto, _name, sockaddr in infos:
        address = (family, sockaddr)
        if family in (socket.AF_INET, socket.AF_INET6) and address not in addresses:
            addresses.append(address)
    if not addresses:
        raise StackError(f"HTTP_HOST={host!r} has no IPv4 or IPv6 address")
    return addresses


def _listening_socket(family: socket.AddressFamily, *, reuse_address: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    if reuse_address:  # as uvicorn binds: a port in TIME_WAIT is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:  # as asyncio and uvloop bind it: IPv6 only
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    return sock


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago (all held open while choosing)."""
    family, sockaddr = listen_addresses(host, 0)[0]
    with contextlib.ExitStack() as held:
        sockets = [
            held.enter_context(_listening_socket(family, reuse_address=False)) for _ in range(count)
        ]
        for sock in sockets:
            sock.bind(sockaddr)
        return [sock.getsockname()[1] for sock in sockets]


def port_is_free(host: str, port: int) -> bool:
    """False when something listens on `port` at any address of `host`; `StackError` when
    `host` cannot be listened on at all (not an address of this machine, ...)."""
    for family, sockaddr in listen_addresses(host, port):
        with _listening_socket(family, reuse_address=True) as sock:
            try:
                sock.bind(sockaddr)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return False
                raise StackError(
                    f"cannot listen on {host} port {port} (HTTP_HOST): {error.strerror or error}"
                ) from None
    return True


def ensure_ports_free(host: str, ports: dict[str, int]) -> None:
    """Raise `PortInUseError` naming the variable to change for the first taken port."""
    for service, port in ports.items():
        if not port_is_free(host, port):
            raise PortInUseError(
                f"port {port} ({service}) is already in use on {host}; stop whatever listens "
                f"there or choose another port with {PORT_ENV[service]}=<port>"
            )


def ports_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """`GATEWAY_PORT`, `STATUS_PORT`, `SCORER_PORT`, `SCHEDULER_PORT`, `NOTIFIER_PORT` (or
    their defaults)."""
    ports: dict[str, int] = {}
    for service, default in DEFAULT_PORTS.items():
        raw = environ.get(PORT_ENV[service], str(default))
        try:
            port = int(raw)
        except ValueError:
            raise StackError(f"{PORT_ENV[service]}={raw!r} is not a port number") from None
        if not 0 <= port <= MAX_PORT:
            raise StackError(f"{PORT_ENV[service]}={port} is not a port (0 to {MAX_PORT})")
        ports[service] = port
    return ports


# ---------------------------------------------------------------------- `run` command


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.stack")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="RabbitMQ + MongoDB (or its stand-in) + the services")
    run.add_argument(
        "--scorers", type=int, default=None, metavar="N", help="scorer processes (SCORER_REPLICAS)"
    )
    run.add_argument("--ready-timeout", type=float, default=90.0, metavar="SECONDS")
    run.add_argument("--log-dir", type=Path, default=Path(".run/logs"))
    webhooks = os.environ.get("WEBHOOKS", "").strip().lower()
    run.add_argument(
        "--webhooks-local",
        action="store_true",
        default=webhooks == "local",
        help="start a local HTTPS webhook receiver and let the notifier reach it "
        "(WEBHOOKS=local; test-only notifier settings)",
    )
    run.add_argument(
        "--webhook-fail",
        type=int,
        default=None,  # WEBHOOK_RECEIVER_FAIL, read only with --webhooks-local (`_webhook_fail`)
        metavar="N",
        help="the local receiver answers 500 to its first N deliveries (WEBHOOK_RECEIVER_FAIL)",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        # A mistyped mode (`WEBHOOKS=locl`) is refused rather than ignored: the run would
        # start without the receiver asked for. One line, as the run's other errors.
        if webhooks not in WEBHOOKS_MODES:
            _refuse(f"WEBHOOKS={webhooks!r} is not a mode: set WEBHOOKS=local, or leave it unset")
        args.scorers = _count(args.scorers, "--scorers", "SCORER_REPLICAS", default=1, least=1)
        # WEBHOOK_RECEIVER_FAIL means nothing without a local receiver: ignored then,
        # whatever it holds.
        fail_from = "WEBHOOK_RECEIVER_FAIL" if args.webhooks_local else None
        args.webhook_fail = _count(args.webhook_fail, "--webhook-fail", fail_from, default=0)
    return args


def _refuse(message: str) -> NoReturn:
    """A setting `run` cannot start with: one `error:` line and exit 2, before anything starts
    (argparse's `parser.error` printed its usage block first; an `int()` of a setting raised a
    traceback)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _count(
    given: int | None, option: str, variable: str | None, *, default: int, least: int = 0
) -> int:
    """A count from its option, else its environment variable (empty or unset: `default`;
    no variable: `default`), at least `least`; one `error:` line otherwise (an `int()` of
    SCORER_REPLICAS or WEBHOOK_RECEIVER_FAIL raised a traceback while the defaults were
    built, whatever the run asked for)."""
    what = option
    if given is None:
        raw = os.environ.get(variable, "").strip() if variable else ""
        what = f"{variable}={raw!r}"
        try:
            given = int(raw) if raw else default
        except ValueError:
            _refuse(f"{what} is not a whole number")
    if given < least:
        _refuse(f"{what} must be {least} or more")
    return given


def curl_examples(gateway_url: str, api_key: str) -> list[str]:
    auth = f" -H 'Authorization: Bearer {api_key}'"
    return [
        f"curl -s -X POST {gateway_url}/v1/scores -H 'Content-Type: application/json'{auth} "
        """-d '{"text": "The quick brown fox jumps over the lazy dog."}'""",
        f"curl -s{auth} {gateway_url}/v1/scores/<task_id>",
    ]


@dataclass(frozen=True)
class DevKeys:
    """The API key registered for the default tenant and the admin key of a `make run`."""

    api_key: str
    admin_key: str

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> DevKeys:
        """`SCOREBOX_API_KEY` / `SCOREBOX_ADMIN_KEY` when set (scripts rely on that), else the
        services' own `ADMIN_API_KEY` for the admin key, else new ones."""
        from services.gateway.keys import generate_key, parse_key  # noqa: PLC0415

        api_key = environ.get("SCOREBOX_API_KEY") or generate_key().token
        if parse_key(api_key) is None:
            raise StackError(
                "SCOREBOX_API_KEY must look like sbx_<16 hex>_<43 url-safe chars>; "
                "make one with: .venv/bin/python -m services.gateway.keys new"
            )
        admin_key = (
            environ.get("SCOREBOX_ADMIN_KEY")
            or environ.get("ADMIN_API_KEY")
            or secrets.token_urlsafe(32)
        )
        return cls(api_key=api_key, admin_key=admin_key)

    def service_env(self) -> dict[str, str]:
        return {"BOOTSTRAP_API_KEY": self.api_key, "ADMIN_API_KEY": self.admin_key}


def service_exports(stack: Stack) -> list[str]:
    """What `scorebox cron` and `scorebox webhooks` read to reach this stack's scheduler and
    notifier (their defaults are ports 8003 and 8004: with `SCHEDULER_PORT` moved, the
    banner's exports left `cron` unreachable)."""
    variables = {"scheduler": "SCOREBOX_SCHEDULER_URL", "notifier": "SCOREBOX_NOTIFIER_URL"}
    return [
        f"  export {variable}={stack.url(service)}"
        for service, variable in variables.items()
        if service in stack.config.services
    ]


def model_line(stack_env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str:
    """Which model the scorers call (the stack's environment, then the process's): switching
    between the built-in heuristic and a provider left the banner silent about which ran."""
    env = {**environ, **stack_env}
    if env.get("LLM_PROVIDER", "heuristic") != "openai":
        return "Model:    built-in heuristic (LLM_PROVIDER=openai and LLM_BASE_URL for a model)"
    base_url = url_shown(env.get("LLM_BASE_URL", "https://api.openai.com/v1"))
    return f"Model:    {env.get('LLM_MODEL', DEFAULT_LLM_MODEL)} at {base_url} (OpenAI protocol)"


@dataclass(frozen=True)
class LocalReceiver:
    """The local webhook receiver of a `--webhooks-local` run, as it announced itself."""

    url: str
    log_path: Path
    notifier_env: dict[str, str]
    checks_signatures: bool
    pid: int = 0


@contextlib.contextmanager
def local_webhook_receiver(
    log_dir: Path,
    *,
    gateway_url: str | None,
    api_key: str,
    fail: int = 0,
    ready_timeout_s: float = RECEIVER_READY_TIMEOUT_S,
) -> Iterator[LocalReceiver]:
    """`devtools.webhook_receiver` as a child process on a free port, logging to
    `<log_dir>/webhook-receiver.log`, its CA in a temporary folder; stopped on the way out.

    It checks signatures with the secret of `api_key`'s tenant, read from `gateway_url` at
    its first delivery (none given: not checked). Its `notifier_env` is what the notifier
    needs to reach it: the CA to trust, and its name exempt from the address check and
    mapped to 127.0.0.1 (test-only settings, README "Configuration")."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / RECEIVER_LOG
    with tempfile.TemporaryDirectory(prefix="scorebox-webhooks-") as folder:
        command = [
            sys.executable,
            "-m",
            "devtools.webhook_receiver",
            "--ca-file",
            str(Path(folder) / "ca.pem"),
            "--fail",
            str(fail),
        ]
        if gateway_url:
            command += ["--gateway", gateway_url]
        env = dict(os.environ, PYTHONUNBUFFERED="1", SCOREBOX_API_KEY=api_key)
        with log_path.open("wb") as log:
            process = spawn_logged(command, env=env, log=log)
        proc = ServiceProcess("webhook-receiver", 0, 0, log_path, process)
        try:
            announcement = _receiver_announcement(proc, ready_timeout_s)
            yield LocalReceiver(
                url=str(announcement["url"]),
                log_path=log_path,
                notifier_env={str(k): str(v) for k, v in announcement["notifier_env"].items()},
                checks_signatures=gateway_url is not None,
                pid=process.pid,
            )
        finally:
            signal_group(proc, signal.SIGTERM)
            wait_or_kill(proc, RECEIVER_STOP_S)


def _receiver_announcement(proc: ServiceProcess, timeout_s: float) -> dict[str, Any]:
    """The receiver's first line (JSON), read from its log once it is written."""
    import orjson  # noqa: PLC0415 - the services' dependency, only here

    deadline = time.monotonic() + timeout_s
    while True:
        first = proc.log_path.read_bytes().split(b"\n", 1)
        if len(first) == 2:  # the whole line is there
            try:
                announcement: dict[str, Any] = orjson.loads(first[0])
            except orjson.JSONDecodeError:
                raise StackError(
                    f"the webhook receiver did not announce itself; {proc.log_path}:\n"
                    f"{read_tail(proc.log_path)}"
                ) from None
            return announcement
        if proc.process is not None and proc.process.poll() is not None:
            raise StackError(
                f"the webhook receiver exited with code {proc.process.returncode}; "
                f"last lines of {proc.log_path}:\n{read_tail(proc.log_path)}"
            )
        if time.monotonic() >= deadline:
            raise StackError(f"the webhook receiver did not start within {timeout_s:.0f}s")
        time.sleep(READY_POLL_INTERVAL_S)


def with_receiver_env(
    service_env: Mapping[str, str],
    receiver: LocalReceiver,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The services' environment with the receiver's notifier settings: the test hosts and
    their addresses added to any given (the stack's, then the process's), the CA file
    replacing one (the notifier trusts one bundle)."""
    env = dict(service_env)
    for name, value in receiver.notifier_env.items():
        given = service_env.get(name, environ.get(name, "")).strip()
        if name == "WEBHOOK_CA_FILE" or not given:
            env[name] = value
        else:
            env[name] = f"{given},{value}"
    return env


def gateway_url_before_start(host: str, port: int) -> str | None:
    """The gateway's URL from its fixed port (None when the port is picked at start)."""
    if port == 0:
        return None
    connect = WILDCARD_CONNECT_HOSTS.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


def webhook_lines(stack: Stack, keys: DevKeys, receiver: LocalReceiver | None) -> list[str]:
    """How to have a task's outcome POSTed to the local receiver, and where to see it."""
    if receiver is None:
        return []
    checked = (
        "signatures checked with the default tenant's secret"
        if receiver.checks_signatures
        else "signatures not checked"
    )
    body = f'{{"text": "{CLI_EXAMPLE_TEXT}", "callback_url": "{receiver.url}"}}'
    return [
        f"Webhooks: a local receiver at {receiver.url} ({checked});",
        f"  each delivery is a line of {receiver.log_path}:",
        f"  tail -f {receiver.log_path}",
        f"  curl -s -X POST {stack.gateway_url}/v1/scores -H 'Content-Type: application/json' "
        f"-H 'Authorization: Bearer {keys.api_key}' -d '{body}'",
        f"  echo '{CLI_EXAMPLE_TEXT}' | .venv/bin/scorebox submit - --callback-url {receiver.url}",
        "",
    ]


def banner(stack: Stack, keys: DevKeys, receiver: LocalReceiver | None = None) -> str:
    lines = ["", "Scorebox is up."]
    for proc in stack.processes():
        lines.append(f"  {proc.name:<10} {stack.url(proc.service, proc.replica)}")
    lines += [
        "",
        f"Gateway:  {stack.gateway_url}",
        f"API docs: {stack.gateway_url}/docs",
        f"Logs:     {stack.config.log_dir}/ (the run before: {PREVIOUS_LOGS}/ in it)",
        model_line(stack.config.env),
        "",
        "Keys (the API key belongs to the default tenant):",
        f"  export SCOREBOX_URL={stack.gateway_url}",
        f"  export SCOREBOX_API_KEY={keys.api_key}",
        f"  export SCOREBOX_ADMIN_KEY={keys.admin_key}",
        *service_exports(stack),
        "",
        *metrics_lines(stack),
        "Try it:",
        *(f"  {line}" for line in curl_examples(stack.gateway_url, keys.api_key)),
        f"  echo '{CLI_EXAMPLE_TEXT}' | .venv/bin/scorebox submit - --wait",
        "",
        *webhook_lines(stack, keys, receiver),
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def metrics_lines(stack: Stack) -> list[str]:
    """How to read `/metrics` with the key every service of the stack takes (no lines when
    the stack was given an empty one)."""
    if not stack.metrics_key:
        return []
    return [
        "Metrics (every service's /metrics takes this key):",
        f"  curl -s -H 'Authorization: Bearer {stack.metrics_key}' {stack.gateway_url}/metrics",
        "",
    ]


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C inside the block; both are ignored once it is left.

    Leave it before cleaning up, so a second Ctrl-C cannot cut a shutdown short. SIGINT is
    set too: a runner started in the background of a script inherits it ignored.
    """
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# A service that exits is started again, as an orchestrator would (a killed scorer, a
# stopped notifier: the run's data lives on in the stand-in and the vhost); one that exits
# this often within the window is broken, and the run stops.
RESTARTS_ALLOWED = 5
RESTART_WINDOW_S = 300.0


def supervise(
    stack: Stack,
    *,
    interval_s: float = SUPERVISE_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Block until interrupted (KeyboardInterrupt), starting again every service that exits
    (after printing its log's tail); 1 once one has exited `RESTARTS_ALLOWED` times within
    `RESTART_WINDOW_S`, or could not be started again.

    It stopped the whole run at the first exit, an operator's `kill` included, and the
    stand-in's data and the run's vhost went with it: every task accepted was lost (found in
    a walkthrough)."""
    exits: dict[str, list[float]] = {}
    while True:
        for proc in stack.dead():
            code = proc.process.returncode if proc.process else None
            print(f"\n{proc.name} exited (exit code {code}); last lines of {proc.log_path}:")
            print(read_tail(proc.log_path))
            now = clock()
            recent = [t for t in exits.get(proc.name, []) if now - t < RESTART_WINDOW_S]
            exits[proc.name] = [*recent, now]
            if len(exits[proc.name]) > RESTARTS_ALLOWED:
                print(
                    f"\n{proc.name} exited {len(recent) + 1} times within "
                    f"{RESTART_WINDOW_S:.0f} s. Stopping everything.",
                    file=sys.stderr,
                )
                return 1
            if not _started_again(stack, proc):
                return 1
        time.sleep(interval_s)


def _started_again(stack: Stack, proc: ServiceProcess) -> bool:
    print(f"Starting {proc.name} again ...", flush=True)
    try:
        stack.restart(proc.service, proc.replica)
    except (StackError, OSError) as error:  # OSError: its command could not be run
        print(f"\n{proc.name} could not be started again: {error}", file=sys.stderr)
        print("Stopping everything.", file=sys.stderr)
        return False
    print(f"{proc.name} is ready again.", flush=True)
    return True


def run(args: argparse.Namespace) -> int:
    """Resolve the infrastructure, start the stack, supervise it; stop all of it on the way out."""
    host = os.environ.get("HTTP_HOST", "127.0.0.1")
    ports = ports_from_env()
    ensure_ports_free(host, ports)  # fail before starting anything
    with contextlib.ExitStack() as resources:
        try:
            with stop_signals_interrupt():
                code = start_and_supervise(args, resources, host=host, ports=ports)
        except KeyboardInterrupt:
            print("\nStopping ...", flush=True)
            code = 0
    # The services' stops end with the resources: their output ended at "Stopping ...".
    print("Stopped." if code == 0 else f"Stopped (exit status {code}).", flush=True)
    return code


# The vhost of a `make run` on the local RabbitMQ whose database is the in-memory stand-in,
# one per gateway port (two runs at once on one broker never share one).
RUN_VHOST = "scorebox-run"


def run_vhost_name(gateway_port: int) -> str:
    return f"{RUN_VHOST}-{gateway_port}"


@contextlib.contextmanager
def run_vhost(amqp_url: str, *, vhost: str, management_url: str | None = None) -> Iterator[str]:
    """A vhost of this run's own, emptied at the start and deleted at the end: the stand-in's
    data is gone when the run stops, and the broker's went on in `/` (a next run inherited
    dead letters and queued tasks of a database that no longer held them, found in an
    acceptance run). Its URL; the broker as given, with a warning, where vhosts cannot be
    managed from here (no `rabbitmqctl`, no management API)."""
    from devtools.infra import InfraError, create_vhost, delete_vhost  # noqa: PLC0415

    try:
        delete_vhost(amqp_url, vhost, management_url=management_url)  # a run killed outright's
        url = create_vhost(amqp_url, vhost, management_url=management_url)
    except (InfraError, OSError) as error:
        print(f"warning: no vhost of its own ({error}); the broker's as given", file=sys.stderr)
        yield amqp_url
        return
    print(f"          RabbitMQ vhost {vhost}, gone with it", flush=True)
    try:
        yield url
    finally:
        try:
            delete_vhost(amqp_url, vhost, management_url=management_url)
        except (InfraError, OSError) as error:
            print(f"warning: RabbitMQ vhost {vhost} not deleted: {error}", file=sys.stderr)


PREVIOUS_LOGS = "previous"


def keep_previous_logs(log_dir: Path) -> None:
    """Move the last run's logs to `<log_dir>/previous/` (replacing the run's before), so a
    run started to look into a failure does not write over the logs of it (found in a
    walkthrough: every `make run` started its logs afresh)."""
    logs = sorted(log_dir.glob("*.log"))
    if not logs:
        return
    previous = log_dir / PREVIOUS_LOGS
    if previous.exists():
        shutil.rmtree(previous)
    previous.mkdir(parents=True)
    for log in logs:
        log.rename(previous / log.name)


def start_and_supervise(
    args: argparse.Namespace, resources: contextlib.ExitStack, *, host: str, ports: dict[str, int]
) -> int:
    from devtools.infra import InfraError, redact, resolve_mongo, resolve_rabbitmq  # noqa: PLC0415

    keep_previous_logs(args.log_dir)
    try:
        rabbitmq = resources.enter_context(resolve_infra("RabbitMQ", resolve_rabbitmq))
        print(f"RabbitMQ: {rabbitmq.kind}  {redact(rabbitmq.url)}", flush=True)
        mongo = resources.enter_context(
            resolve_infra("MongoDB", lambda: resolve_mongo(log_path=args.log_dir / "mongo.log"))
        )
        print(f"MongoDB:  {mongo.kind}  {redact(mongo.url)}", flush=True)
    except InfraError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rabbitmq_url = rabbitmq.url
    # Only a stand-in this run started loses its data at the stop: one given as MONGO_URL
    # outlives the run, and its tasks' queued messages must too (a walkthrough found a
    # delayed task stuck for good, its message deleted with the run's vhost).
    if mongo.is_standin and mongo.started_here:
        print("          (in memory: its data is gone when this stops)")
        if "RABBITMQ_URL" not in os.environ:
            rabbitmq_url = resources.enter_context(
                run_vhost(
                    rabbitmq.url,
                    vhost=run_vhost_name(ports["gateway"]),
                    management_url=rabbitmq.management_url,
                )
            )
    keys = DevKeys.from_environment()
    service_env = keys.service_env()
    receiver: LocalReceiver | None = None
    if args.webhooks_local:
        receiver = resources.enter_context(
            local_webhook_receiver(
                args.log_dir,
                gateway_url=gateway_url_before_start(host, ports["gateway"]),
                api_key=keys.api_key,
                fail=args.webhook_fail,
            )
        )
        print(f"Webhooks: local receiver at {receiver.url} (log {receiver.log_path})", flush=True)
        service_env = with_receiver_env(service_env, receiver)
    config = StackConfig(
        rabbitmq_url=rabbitmq_url,
        mongo_url=mongo.url,
        db_prefix=os.environ.get("MONGO_DB_PREFIX", "scorebox"),
        host=host,
        gateway_port=ports["gateway"],
        ports=ports,
        scorer_replicas=args.scorers,
        log_dir=args.log_dir,
        env=service_env,
    )
    stack = Stack(config)
    resources.callback(stack.stop, grace_s=run_stop_grace_s(os.environ | config.env))
    print(f"Starting {', '.join(config.services)} (logs in {args.log_dir}/) ...", flush=True)
    stack.start(ready_timeout_s=args.ready_timeout)
    print(banner(stack, keys, receiver), flush=True)
    return supervise(stack)


def run_stop_grace_s(env: Mapping[str, str]) -> float:
    """How long `make run` lets its services finish on Ctrl-C before it SIGKILLs them: the
    longer of the scorer's stop and the notifier's (`notifier_stop_s`), under the timeouts
    they run with (the scorer's, 130 s, by default).

    That is uvicorn's wait for open requests, then the deliveries' grace period (the whole
    path of one that just took a model slot, `services.scorer.app.stop_grace_s`), then the
    stop's own broker steps. A flat 60 s killed the scorer mid-decision: the model call it
    had made was made (and billed) again by the redelivery. Each process done sooner ends
    sooner. Settings the scorer refuses count at their defaults (it will not start anyway).
    """
    from pydantic import ValidationError  # noqa: PLC0415 - the services' imports, only here

    from services.scorer.app import stop_grace_s  # noqa: PLC0415
    from services.scorer.model.settings import ModelSettings  # noqa: PLC0415
    from services.scorer.settings import ScorerSettings  # noqa: PLC0415
    from shared.runtime import HTTP_DRAIN_S  # noqa: PLC0415

    try:
        settings = ScorerSettings.model_validate(env)
        model_settings = ModelSettings.model_validate(env)
    except ValidationError:
        settings, model_settings = (
            ScorerSettings.model_validate({}),
            ModelSettings.model_validate({}),
        )
    stop_steps_s = STOP_BROKER_STEPS * settings.broker_timeout_s
    scorer_s = HTTP_DRAIN_S + stop_grace_s(settings, model_settings) + stop_steps_s
    return max(scorer_s, notifier_stop_s(env))


def notifier_stop_s(env: Mapping[str, str]) -> float:
    """The notifier's whole stop: uvicorn's wait for open requests, its deliveries' grace
    (the consumers' cancel within it), then the acks and the closes, a broker timeout each.
    A raised `WEBHOOK_TIMEOUT_S` makes it the longer: killed mid-POST, the redelivery POSTs
    again once the lease runs out (the re-read of session 59)."""
    from pydantic import ValidationError  # noqa: PLC0415 - the services' imports, only here

    from services.notifier.settings import NotifierSettings  # noqa: PLC0415
    from shared.runtime import HTTP_DRAIN_S  # noqa: PLC0415

    try:
        settings = NotifierSettings.model_validate(env)
    except ValidationError:
        settings = NotifierSettings.model_validate({})
    return HTTP_DRAIN_S + settings.stop_grace_s + 2 * settings.broker_timeout_s


INFRA_URL_ENV = {"RabbitMQ": "RABBITMQ_URL", "MongoDB": "MONGO_URL"}
REASON_MAX_CHARS = 300


def resolve_infra(what: str, resolve: Callable[[], Endpoint]) -> Endpoint:
    """`resolve()`, with a Docker engine that answers but cannot run the container reported as
    an `InfraError` (one line, exit 2) rather than the Docker client's traceback.

    No fallback to the local RabbitMQ or the MongoDB stand-in: as with a `RABBITMQ_URL` that
    does not answer, the first source that answers is the one used (the stand-in is not
    MongoDB), and `SCOREBOX_NO_DOCKER=1` skips Docker on purpose.
    """
    from devtools.infra import InfraError, docker_available  # noqa: PLC0415

    try:
        return resolve()
    except InfraError:
        raise
    except Exception as error:
        if os.environ.get(INFRA_URL_ENV[what]) or not docker_available():
            raise  # not the Docker step: a bug, keep its traceback
        raise InfraError(
            f"a Docker engine answers, but the {what} container did not start: "
            f"{one_line(error)} (repair Docker, or skip it with SCOREBOX_NO_DOCKER=1: "
            "the local RabbitMQ and the MongoDB stand-in are used then)"
        ) from error


def one_line(error: BaseException) -> str:
    """`error` as `Type: first line of its message`, at most `REASON_MAX_CHARS` long."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= REASON_MAX_CHARS else text[: REASON_MAX_CHARS - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # `make run` stopped with SIGTERM does not pass the signal on to its recipe: have the
    # kernel pass it, so the services are stopped in every case.
    die_with_parent()
    try:
        return run(args)
    except StackError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
