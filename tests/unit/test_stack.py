"""The process runner (`devtools.stack`) against a tiny fake service of our own.

The fake reads the same environment a real service does (`<SERVICE>_PORT`, `HTTP_HOST`) and
answers `/healthz`, `/readyz` and `/env`; `FAKE_MODE_<SERVICE>` makes it misbehave.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

import devtools.stack
from devtools.stack import (
    DEFAULT_PORTS,
    LOOPBACK_HOSTS,
    RESTART_WINDOW_S,
    RESTARTS_ALLOWED,
    DevKeys,
    PortInUseError,
    ServiceProcess,
    Stack,
    StackConfig,
    StackError,
    curl_examples,
    ensure_ports_free,
    internal_key_of,
    metrics_key_of,
    metrics_lines,
    model_line,
    no_proxy_with_loopback,
    ports_from_env,
    probe,
    stop_signals_interrupt,
    supervise,
)
from services.gateway.keys import generate_key, parse_key

FAKE_SERVICE = textwrap.dedent(
    """
    import http.server, json, os, signal, socket, sys

    service = os.environ["SCOREBOX_SERVICE"]
    port = int(os.environ[service.upper() + "_PORT"])
    mode = os.environ.get("FAKE_MODE_" + service.upper(), "ready")
    if mode == "crash":
        print("boom: the fake", service, "gives up", flush=True)
        sys.exit(3)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    polls = {"n": 0}
    SHOWN = ("RABBITMQ_URL", "MONGO_URL", "MONGO_DB_PREFIX", "HTTP_HOST", "STATUS_URL",
             "SCOREBOX_INSTANCE", "EXTRA", "NO_PROXY", "INTERNAL_API_KEY", "METRICS_API_KEY",
             service.upper() + "_PORT")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/readyz":
                polls["n"] += 1
                ready = mode != "never-ready" and (mode != "slow" or polls["n"] > 3)
                self.answer(200 if ready else 503, {"ready": ready})
            elif self.path == "/healthz":
                self.answer(200, {"ok": True})
            elif self.path == "/env":
                self.answer(200, {name: os.environ.get(name) for name in SHOWN})
            else:
                self.answer(404, {})

        def answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in os.environ["HTTP_HOST"] else socket.AF_INET

    print("fake", service, "listening on", port, flush=True)
    Server((os.environ["HTTP_HOST"], port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_command(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_service.py"
    script.write_text(FAKE_SERVICE)
    return [sys.executable, str(script)]


def make_config(tmp_path: Path, fake_command: list[str], **overrides: object) -> StackConfig:
    config = StackConfig(
        rabbitmq_url="amqp://guest:guest@127.0.0.1:5672/some-vhost",
        mongo_url="mongodb://127.0.0.1:1/?directConnection=true",
        db_prefix="tprefix",
        gateway_port=0,
        log_dir=tmp_path / "logs",
        commands=dict.fromkeys(DEFAULT_PORTS, fake_command),
        declare_topology_first=False,  # no broker here (`test_the_topology_is_declared_*`)
    )
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    """Stacks a test creates; all stopped afterwards, whatever happened."""
    created: list[Stack] = []
    yield created
    for stack in created:
        stack.stop(grace_s=2)


def get_json(url: str) -> dict[str, str | None]:
    with urllib.request.urlopen(url, timeout=5) as response:
        data: dict[str, str | None] = json.load(response)
    return data


def all_pids(stack: Stack) -> list[int]:
    return [pid for pids in stack.pids().values() for pid in pids]


def test_start_waits_for_readiness_on_free_ports_and_stop_ends_everything(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    config = make_config(
        tmp_path, fake_command, scorer_replicas=2, env={"EXTRA": "yes", "FAKE_MODE_STATUS": "slow"}
    )
    stack = Stack(config)
    stacks.append(stack)

    stack.start(ready_timeout_s=30)

    urls = [stack.url(s) for s in ("status", "scheduler", "gateway")]
    urls += [stack.url("scorer", 0), stack.url("scorer", 1)]
    assert len(set(urls)) == 5
    assert all(probe(f"{url}/readyz") == "200" for url in urls)
    assert {service: len(pids) for service, pids in stack.pids().items()} == {
        "status": 1,
        "scorer": 2,
        "scheduler": 1,
        "notifier": 1,
        "gateway": 1,
    }
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "gateway.log",
        "notifier.log",
        "scheduler.log",
        "scorer-0.log",
        "scorer-1.log",
        "status.log",
    ]

    stack.stop(grace_s=5)

    assert stack.pids() == {}
    assert all(probe(f"{url}/healthz", timeout_s=1) != "200" for url in urls)


def test_the_topology_is_declared_before_any_service_is_spawned(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Services declaring a fresh vhost's quorum queues at once met RabbitMQ 3.10's race
    between one's declaration and another's consume (`declare_topology_first`)."""
    stack = Stack(make_config(tmp_path, fake_command, declare_topology_first=True))
    stacks.append(stack)
    spawned_before: list[dict[str, list[int]]] = []

    def declared(rabbitmq_url: str) -> bool:
        assert rabbitmq_url == stack.config.rabbitmq_url
        spawned_before.append(stack.pids())
        return True

    monkeypatch.setattr(devtools.stack, "declare_topology_first", declared, raising=True)
    stack.start(ready_timeout_s=30)

    assert spawned_before == [{}]


def test_every_service_gets_the_environment_contract(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    stack = Stack(make_config(tmp_path, fake_command, scorer_replicas=2, env={"EXTRA": "x"}))
    stacks.append(stack)
    stack.start(ready_timeout_s=30)

    gateway = get_json(f"{stack.gateway_url}/env")
    scorer = get_json(f"{stack.url('scorer', 1)}/env")

    assert gateway["RABBITMQ_URL"] == "amqp://guest:guest@127.0.0.1:5672/some-vhost"
    assert gateway["MONGO_URL"] == "mongodb://127.0.0.1:1/?directConnection=true"
    assert gateway["MONGO_DB_PREFIX"] == "tprefix"
    assert gateway["HTTP_HOST"] == "127.0.0.1"
    assert gateway["STATUS_URL"] == stack.url("status")
    assert gateway["EXTRA"] == "x"
    assert stack.gateway_url.endswith(f":{gateway['GATEWAY_PORT']}")
    assert stack.url("scorer", 1).endswith(f":{scorer['SCORER_PORT']}")
    assert scorer["SCOREBOX_INSTANCE"] == "scorer-1"
    # The scorer honours the proxy of the environment; a local model server is never behind it.
    assert set(LOOPBACK_HOSTS) <= set((scorer["NO_PROXY"] or "").split(","))


def _stack_key(stack: Stack, name: str) -> str:
    return stack.internal_key if name == "INTERNAL_API_KEY" else stack.metrics_key


@pytest.mark.parametrize("name", ["INTERNAL_API_KEY", "METRICS_API_KEY"])
def test_every_service_of_a_stack_shares_its_own_key_across_restarts(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack], name: str
) -> None:
    """`make run` (and the e2e tests) run with the internal routes and `/metrics`
    authenticated."""
    stack = Stack(make_config(tmp_path, fake_command, scorer_replicas=2))
    stacks.append(stack)
    stack.start(ready_timeout_s=30)
    key = _stack_key(stack, name)

    def keys() -> set[str | None]:
        return {get_json(f"{stack.url(p.service, p.replica)}/env")[name] for p in stack.processes()}

    assert keys() == {key}
    assert len(key) >= 32
    stack.restart("status", ready_timeout_s=30)
    assert keys() == {key}
    other = Stack(make_config(tmp_path / "other", fake_command))
    assert _stack_key(other, name) != key


KeyOf = Callable[[Mapping[str, str], Mapping[str, str]], str]


@pytest.mark.parametrize(
    ("name", "key_of"),
    [("INTERNAL_API_KEY", internal_key_of), ("METRICS_API_KEY", metrics_key_of)],
    ids=["internal", "metrics"],
)
def test_a_key_given_to_a_stack_is_the_one_its_services_share(name: str, key_of: KeyOf) -> None:
    assert key_of({name: "given"}, {name: "shell"}) == "given"
    assert key_of({name: ""}, {name: "shell"}) == ""  # open
    assert key_of({}, {name: "shell"}) == "shell"
    assert key_of({}, {name: ""}) == ""  # exported empty: open too
    fresh = key_of({}, {})
    assert len(fresh) >= 32
    assert fresh != key_of({}, {})


def test_a_scraper_of_the_stack_sends_its_metrics_key(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    given = {"METRICS_API_KEY": "given-metrics-key"}
    stack = Stack(make_config(tmp_path, fake_command, env=given))
    stacks.append(stack)
    stack.start(ready_timeout_s=30)
    assert stack.metrics_headers() == {"Authorization": "Bearer given-metrics-key"}
    curl = f"curl -s -H 'Authorization: Bearer given-metrics-key' {stack.gateway_url}/metrics"
    assert f"  {curl}" in metrics_lines(stack)
    # Given empty, the services' /metrics are open: nothing to send, nothing to print.
    open_stack = Stack(make_config(tmp_path / "open", fake_command, env={"METRICS_API_KEY": ""}))
    assert (open_stack.metrics_headers(), metrics_lines(open_stack)) == ({}, [])


def test_loopback_hosts_join_the_hosts_no_proxy_names() -> None:
    assert no_proxy_with_loopback({"no_proxy": "corp.example, localhost"}) == (
        "corp.example,localhost,127.0.0.1,::1"
    )
    assert no_proxy_with_loopback({}) == "127.0.0.1,localhost,::1"


def test_kill_then_restart_one_replica_on_the_same_port(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    stack = Stack(make_config(tmp_path, fake_command, scorer_replicas=2))
    stacks.append(stack)
    stack.start(ready_timeout_s=30)
    before = stack.pids()
    url = stack.url("scorer", 1)

    stack.kill("scorer", 1)

    assert stack.pids()["scorer"] == [before["scorer"][0]]
    assert [p.name for p in stack.dead()] == ["scorer-1"]
    assert probe(f"{url}/healthz", timeout_s=1) != "200"

    stack.restart("scorer", 1, ready_timeout_s=30)

    after = stack.pids()
    assert after["scorer"][0] == before["scorer"][0]
    assert after["scorer"][1] != before["scorer"][1]
    assert stack.url("scorer", 1) == url
    assert probe(f"{url}/readyz") == "200"
    assert stack.dead() == []
    assert stack.log_path("scorer", 1).read_text().count("starting scorer-1") == 2


def test_restart_of_a_running_service_replaces_the_process(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    stack = Stack(make_config(tmp_path, fake_command, services=("status", "gateway")))
    stacks.append(stack)
    stack.start(ready_timeout_s=30)
    old_pid = stack.pids()["gateway"]

    stack.restart("gateway", ready_timeout_s=30)

    assert stack.pids()["gateway"] != old_pid
    assert probe(f"{stack.gateway_url}/readyz") == "200"


def test_a_service_that_never_gets_ready_is_a_clear_error_and_nothing_is_left_running(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    stack = Stack(make_config(tmp_path, fake_command, env={"FAKE_MODE_SCHEDULER": "never-ready"}))
    stacks.append(stack)

    with pytest.raises(StackError, match="scheduler did not become ready") as failure:
        stack.start(ready_timeout_s=10)  # the other four are ready well before

    message = str(failure.value)
    assert "last /readyz answer: 503" in message
    assert "fake scheduler listening on" in message  # the tail of its log
    assert stack.pids() == {}


def test_a_service_that_exits_during_start_up_is_reported_with_its_log(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    stack = Stack(make_config(tmp_path, fake_command, env={"FAKE_MODE_SCORER": "crash"}))
    stacks.append(stack)

    with pytest.raises(StackError, match="scorer exited with code 3") as failure:
        stack.start(ready_timeout_s=30)

    assert "boom: the fake scorer gives up" in str(failure.value)
    assert stack.pids() == {}


def test_stop_kills_a_process_that_ignores_sigterm(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    config = make_config(
        tmp_path, fake_command, services=("gateway",), env={"FAKE_MODE_GATEWAY": "ignore-term"}
    )
    stack = Stack(config)
    stacks.append(stack)
    stack.start(ready_timeout_s=30)

    stack.stop(grace_s=0.5)

    assert stack.pids() == {}
    assert [p.process.returncode for p in stack.dead() if p.process] == [-9]


def test_a_taken_fixed_port_names_the_variable_to_change(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stack = Stack(make_config(tmp_path, fake_command, services=("gateway",), gateway_port=port))
        stacks.append(stack)

        with pytest.raises(PortInUseError, match="GATEWAY_PORT"):
            stack.start(ready_timeout_s=5)


def test_addresses_before_start_are_an_error(tmp_path: Path, fake_command: list[str]) -> None:
    stack = Stack(make_config(tmp_path, fake_command))

    with pytest.raises(StackError, match="not started"):
        _ = stack.gateway_url


def test_unknown_service_names_are_rejected(tmp_path: Path, fake_command: list[str]) -> None:
    with pytest.raises(StackError, match="unknown services"):
        Stack(make_config(tmp_path, fake_command, services=("gateway", "billing")))


def test_ports_come_from_the_public_variables() -> None:
    assert ports_from_env({}) == {
        "gateway": 8000,
        "status": 8001,
        "scorer": 8002,
        "scheduler": 8003,
        "notifier": 8004,
    }
    assert ports_from_env({"GATEWAY_PORT": "9000"})["gateway"] == 9000
    with pytest.raises(StackError, match="STATUS_PORT='x' is not a port number"):
        ports_from_env({"STATUS_PORT": "x"})
    # It died with an OverflowError traceback at its free-port check.
    with pytest.raises(StackError, match="GATEWAY_PORT=70000 is not a port"):
        ports_from_env({"GATEWAY_PORT": "70000"})


def test_curl_examples_are_ready_to_paste_with_the_api_key() -> None:
    lines = curl_examples("http://127.0.0.1:8000", "sbx_key")

    assert lines[0].startswith("curl -s -X POST http://127.0.0.1:8000/v1/scores")
    assert (
        lines[1]
        == "curl -s -H 'Authorization: Bearer sbx_key' http://127.0.0.1:8000/v1/scores/<task_id>"
    )
    assert all("-H 'Authorization: Bearer sbx_key'" in line for line in lines)


def test_dev_keys_honour_the_environment_and_refuse_malformed_keys() -> None:
    given = generate_key().token
    keys = DevKeys.from_environment({"SCOREBOX_API_KEY": given, "SCOREBOX_ADMIN_KEY": "adm"})
    assert keys == DevKeys(api_key=given, admin_key="adm")
    assert keys.service_env() == {"BOOTSTRAP_API_KEY": given, "ADMIN_API_KEY": "adm"}
    # The services' own variable: it was replaced by a new key, and calls with it got 401.
    assert DevKeys.from_environment({"ADMIN_API_KEY": "mine"}).admin_key == "mine"
    fresh = DevKeys.from_environment({})
    assert parse_key(fresh.api_key) is not None
    assert len(fresh.admin_key) >= 32
    with pytest.raises(StackError, match="SCOREBOX_API_KEY must look like"):
        DevKeys.from_environment({"SCOREBOX_API_KEY": "dev-secret"})


# ---------------------------------------------------------------------- IPv6, proxies, Docker


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


@needs_ipv6
def test_an_ipv6_host_is_checked_with_ipv6_sockets() -> None:
    """HTTP_HOST=::1 was refused as 'port in use': the check bound an IPv4 socket to it."""
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} .gateway. is already in use"):
            ensure_ports_free("::1", {"gateway": port})
    ensure_ports_free("::1", {"gateway": port})  # free again once closed
    ensure_ports_free("::", {"gateway": port})


def test_a_host_that_cannot_be_listened_on_is_not_called_a_port_in_use() -> None:
    with pytest.raises(StackError, match="HTTP_HOST") as failure:
        ensure_ports_free("host.invalid", {"gateway": 8000})
    assert not isinstance(failure.value, PortInUseError)


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "::"])
def test_a_stack_on_ipv6_gets_ready_with_bracketed_urls(
    tmp_path: Path, fake_command: list[str], stacks: list[Stack], host: str
) -> None:
    stack = Stack(make_config(tmp_path, fake_command, host=host, services=("status", "gateway")))
    stacks.append(stack)

    stack.start(ready_timeout_s=30)  # free ports on IPv6, then /readyz over IPv6

    assert stack.gateway_url.startswith("http://[::1]:")
    gateway = get_json(f"{stack.gateway_url}/env")
    assert gateway["HTTP_HOST"] == host
    assert gateway["STATUS_URL"] == stack.url("status")
    assert stack.url("status").startswith("http://[::1]:")


class _Answer(http.server.BaseHTTPRequestHandler):
    """200 from a service, 502 from the proxy (the server's `status` attribute)."""

    def do_GET(self) -> None:
        status: int = self.server.status  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[list[http.server.ThreadingHTTPServer]]:
    """HTTP servers on 127.0.0.1 that answer every GET with their `status`; stopped after."""
    servers: list[http.server.ThreadingHTTPServer] = []
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def _serve(servers: list[http.server.ThreadingHTTPServer], status: int) -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.status = status  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_the_readiness_probe_ignores_proxy_variables(
    monkeypatch: pytest.MonkeyPatch, answering: list[http.server.ThreadingHTTPServer]
) -> None:
    """With http_proxy set, `make run` asked the proxy for 127.0.0.1 and never got ready."""
    service = _serve(answering, 200)
    proxy = _serve(answering, 502)
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, proxy)
    # urlopen's shared opener reads the proxy variables once, at its first use in the process.
    monkeypatch.setattr("urllib.request._opener", None)

    assert probe(f"{service}/readyz") == "200"


class _BrokenDocker(socketserver.StreamRequestHandler):
    """A Docker engine that answers its ping and fails everything else."""

    def handle(self) -> None:
        request_line = self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        if b"/_ping" in request_line:
            status, body = b"200 OK", b"OK"
        else:
            status, body = b"500 Internal Server Error", b'{"message": "the engine is broken"}'
        head = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        head += "Connection: close\r\n\r\n"
        self.wfile.write(b"HTTP/1.1 " + status + b"\r\n" + head.encode() + body)


def test_make_run_with_a_broken_docker_engine_exits_2_with_one_line(tmp_path: Path) -> None:
    """It printed the Docker client's traceback (and exited 1)."""
    with tempfile.TemporaryDirectory(prefix="sbx-") as short:  # a socket path is <= 107 bytes
        engine = socketserver.ThreadingUnixStreamServer(f"{short}/docker.sock", _BrokenDocker)
        threading.Thread(target=engine.serve_forever, daemon=True).start()
        try:
            skipped = ("RABBITMQ_URL", "MONGO_URL", "SCOREBOX_NO_DOCKER", "DOCKER_HOST")
            env = {k: v for k, v in os.environ.items() if k not in skipped}
            env |= {f"{service.upper()}_PORT": "0" for service in DEFAULT_PORTS}
            env["DOCKER_HOST"] = f"unix://{short}/docker.sock"
            result = subprocess.run(
                [sys.executable, "-m", "devtools.stack", "run", "--log-dir", str(tmp_path)],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
                check=False,
            )
        finally:
            engine.shutdown()
            engine.server_close()

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: a Docker engine answers, but the RabbitMQ container did not")
    assert "the engine is broken" in line
    assert "SCOREBOX_NO_DOCKER=1" in line


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_runner_started_with_stop_signals_ignored_still_stops_on_them(
    signum: signal.Signals,
) -> None:
    """A shell's background job inherits SIGINT ignored: `kill -INT` must stop the runner."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt), stop_signals_interrupt():
            _signal_self_and_wait(signum)
        assert signal.getsignal(signum) is signal.SIG_IGN
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _signal_self_and_wait(signum: signal.Signals) -> None:
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_service_that_exits_is_started_again_and_one_that_cannot_be_stops_the_run(
    tmp_path: Path,
    fake_command: list[str],
    stacks: list[Stack],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A service's exit stopped the whole run, and the stand-in's data with it: every task
    accepted was lost to an operator's `kill` (found in a walkthrough)."""
    config = make_config(tmp_path, fake_command)
    stack = Stack(config)
    stacks.append(stack)
    stack.start(ready_timeout_s=30)
    [first] = stack.pids()["scorer"]
    outcome: list[int] = []
    supervising = threading.Thread(
        target=lambda: outcome.append(supervise(stack, interval_s=0.05)), daemon=True
    )
    supervising.start()

    said: list[str] = []

    def started_again() -> bool:
        said.append(capsys.readouterr().out)
        return "scorer is ready again." in "".join(said)

    os.kill(first, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not started_again() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started_again()
    [second] = stack.pids()["scorer"]
    assert second != first
    assert probe(f"{stack.url('scorer')}/readyz") == "200"

    config.env["FAKE_MODE_SCORER"] = "crash"  # its next start fails
    os.kill(second, signal.SIGKILL)
    supervising.join(timeout=30)
    assert outcome == [1]
    log = stack.log_path("scorer").read_text()
    assert "boom: the fake scorer gives up" in log


class _CrashingStack:
    """A stack whose scorer exits again as soon as it is started."""

    def __init__(self, log_path: Path) -> None:
        self.proc = ServiceProcess("scorer", 0, 1, log_path)
        self.restarts = 0

    def dead(self) -> list[ServiceProcess]:
        return [self.proc]

    def restart(self, service: str, replica: int = 0) -> None:
        self.restarts += 1


@pytest.mark.parametrize(("seconds_apart", "stops"), [(1.0, True), (RESTART_WINDOW_S, False)])
def test_a_service_exiting_again_and_again_within_the_window_stops_the_run(
    tmp_path: Path, seconds_apart: float, stops: bool
) -> None:
    log = tmp_path / "scorer.log"
    log.write_text("boom\n")
    stack = _CrashingStack(log)
    now = [0.0]

    def clock() -> float:
        now[0] += seconds_apart
        if now[0] > 100 * RESTART_WINDOW_S:
            raise KeyboardInterrupt  # spread out: it went on restarting; the test ends here
        return now[0]

    if stops:
        assert supervise(stack, interval_s=0, clock=clock) == 1  # type: ignore[arg-type]
        assert stack.restarts == RESTARTS_ALLOWED
    else:
        with pytest.raises(KeyboardInterrupt):
            supervise(stack, interval_s=0, clock=clock)  # type: ignore[arg-type]
        assert stack.restarts > RESTARTS_ALLOWED


def test_the_banner_names_the_model_url_without_its_credentials_or_query() -> None:
    """It printed `LLM_BASE_URL` whole, a basic-auth password or a query key in it (a
    review)."""
    line = model_line(
        {"LLM_PROVIDER": "openai", "LLM_BASE_URL": "https://proxy:s3cret@llm.example/v1?key=k"},
        {},
    )
    assert "at https://llm.example/v1 (OpenAI protocol)" in line
    assert "s3cret" not in line
    assert "key=k" not in line
