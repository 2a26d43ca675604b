"""Find the RabbitMQ and MongoDB to run against, and say which one was used.

Order of preference (the first that answers wins):

- RabbitMQ: `RABBITMQ_URL` -> a testcontainers broker when a Docker engine answers -> the
  broker on 127.0.0.1:5672 (started with `rabbitmq-server -detached` when it is installed but
  stopped; a broker started that way is the machine's own and is left running).
- MongoDB: `MONGO_URL` -> a testcontainers `mongo:7` when a Docker engine answers -> the
  mongoeco wire-protocol stand-in as a subprocess (NOT MongoDB: dev and tests only).

Set `SCOREBOX_NO_DOCKER=1` to skip the Docker step. Everything is synchronous (fixtures and the
CLI call it) and every subprocess and network call has an explicit timeout.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import selectors
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import quote, unquote, urlsplit, urlunsplit

RABBITMQ_IMAGE = "rabbitmq:4.1-management"
MONGO_IMAGE = "mongo:7"
LOCAL_AMQP_HOST = "127.0.0.1"
LOCAL_AMQP_PORT = 5672
MANAGEMENT_PORT = 15672
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

DOCKER_PING_TIMEOUT_S = 1.5
PROBE_TIMEOUT_S = 3.0
BROKER_START_TIMEOUT_S = 90.0
RABBITMQCTL_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 5.0
STANDIN_START_TIMEOUT_S = 30.0
STANDIN_STOP_GRACE_S = 5.0


class InfraError(RuntimeError):
    """No usable RabbitMQ or MongoDB, or a vhost could not be managed."""


@dataclass
class Endpoint:
    """Where a piece of infrastructure answers, what it is, and how to stop it if we started it."""

    url: str
    kind: str
    is_standin: bool = False
    management_url: str | None = None
    _closer: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def started_here(self) -> bool:
        """Whether we started it (and `close` stops it): not one given by URL."""
        return self._closer is not None

    def close(self) -> None:
        """Stop what we started (container, stand-in subprocess); a no-op otherwise."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- Docker


def docker_available() -> bool:
    """True when a Docker engine answers `/_ping` quickly (and Docker is not switched off)."""
    if os.environ.get("SCOREBOX_NO_DOCKER", "").lower() in {"1", "true", "yes"}:
        return False
    target = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        with _docker_socket(target) as sock:
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = sock.recv(1024)
    except OSError:
        return False
    return reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n", 1)[0]


def _docker_socket(target: str) -> socket.socket:
    parts = urlsplit(target)
    if parts.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(DOCKER_PING_TIMEOUT_S)
        try:
            sock.connect(parts.path)
        except OSError:
            sock.close()
            raise
        return sock
    if parts.scheme in {"tcp", "http"} and parts.hostname:
        return socket.create_connection(
            (parts.hostname, parts.port or 2375), timeout=DOCKER_PING_TIMEOUT_S
        )
    raise OSError(f"unsupported DOCKER_HOST {target!r}")


def _quiet_testcontainers_import() -> Any:
    """Import testcontainers' community modules without their deprecation warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.community import mongodb, rabbitmq  # noqa: PLC0415

    return mongodb, rabbitmq


# --------------------------------------------------------------------------- RabbitMQ


def resolve_rabbitmq(*, start_local: bool = True) -> Endpoint:
    """RabbitMQ from `RABBITMQ_URL`, else a testcontainers broker, else the local one."""
    url = os.environ.get("RABBITMQ_URL")
    if url:
        version = _require_amqp(url, "RABBITMQ_URL")
        return Endpoint(url=url, kind=f"RabbitMQ {version} from RABBITMQ_URL")
    if docker_available():
        return _rabbitmq_container()
    return _local_rabbitmq(start_local=start_local)


def amqp_server_version(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> str:
    """The broker's version, read from the AMQP `Connection.Start` frame (no login needed)."""
    return str(amqp_server_properties(url, timeout=timeout).get("version", "(version unknown)"))


def amqp_server_properties(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The server properties a broker announces before any login (product, version, ...)."""
    parts = urlsplit(url)
    host = parts.hostname or LOCAL_AMQP_HOST
    port = parts.port or (5671 if parts.scheme == "amqps" else LOCAL_AMQP_PORT)
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sock = _maybe_tls(raw, host, tls=parts.scheme == "amqps")
        sock.settimeout(timeout)
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        return _parse_connection_start(_read_frame(sock))


def _maybe_tls(sock: socket.socket, host: str, *, tls: bool) -> socket.socket:
    if not tls:
        return sock
    return ssl.create_default_context().wrap_socket(sock, server_hostname=host)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("the server closed the connection during the AMQP handshake")
        chunks += chunk
    return bytes(chunks)


def _read_frame(sock: socket.socket) -> bytes:
    header = _recv_exactly(sock, 7)
    if header.startswith(b"AMQP"):
        raise ConnectionError("the server does not speak AMQP 0-9-1")
    frame_type, _channel, size = struct.unpack("!BHI", header)
    payload = _recv_exactly(sock, size + 1)[:-1]  # frame-end octet
    if frame_type != 1:
        raise ConnectionError(f"unexpected AMQP frame type {frame_type}")
    return payload


def _parse_connection_start(payload: bytes) -> dict[str, Any]:
    class_id, method_id = struct.unpack_from("!HH", payload, 0)
    if (class_id, method_id) != (10, 10):
        raise ConnectionError("expected AMQP Connection.Start")
    table, _ = _parse_field_table(payload, 6)  # after class, method, major, minor
    return table


def _parse_field_table(data: bytes, offset: int) -> tuple[dict[str, Any], int]:
    (length,) = struct.unpack_from("!I", data, offset)
    offset += 4
    end = offset + length
    table: dict[str, Any] = {}
    while offset < end:
        name_length = data[offset]
        name = data[offset + 1 : offset + 1 + name_length].decode()
        offset += 1 + name_length
        kind = chr(data[offset])
        offset += 1
        value, offset = _parse_field_value(kind, data, offset)
        if value is _UNKNOWN:
            break  # a type we do not need: stop reading, keep what we have
        table[name] = value
    return table, end


_UNKNOWN = object()
_FIXED_FIELDS = {"t": "!?", "b": "!b", "B": "!B", "s": "!h", "u": "!H", "I": "!i", "i": "!I"}
_FIXED_FIELDS |= {"l": "!q", "f": "!f", "d": "!d", "T": "!Q"}


def _parse_field_value(kind: str, data: bytes, offset: int) -> tuple[Any, int]:
    if kind == "S":
        (length,) = struct.unpack_from("!I", data, offset)
        return data[offset + 4 : offset + 4 + length].decode(errors="replace"), offset + 4 + length
    if kind == "F":
        return _parse_field_table(data, offset)
    if kind == "V":
        return None, offset
    if kind in _FIXED_FIELDS:
        fmt = _FIXED_FIELDS[kind]
        return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)
    return _UNKNOWN, offset


def _require_amqp(url: str, source: str) -> str:
    try:
        return amqp_server_version(url)
    except (OSError, ConnectionError, struct.error) as error:
        raise InfraError(
            f"RabbitMQ at {source} ({redact(url)}) does not answer: {error}"
        ) from error


def _rabbitmq_container() -> Endpoint:
    _, rabbitmq = _quiet_testcontainers_import()
    container = rabbitmq.RabbitMqContainer(RABBITMQ_IMAGE).with_exposed_ports(MANAGEMENT_PORT)
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(container.port)
        url = f"amqp://{container.username}:{container.password}@{host}:{port}/"
        management = f"http://{host}:{container.get_exposed_port(MANAGEMENT_PORT)}"
        version = amqp_server_version(url)
    except BaseException:
        container.stop()
        raise
    return Endpoint(
        url=url,
        kind=f"RabbitMQ {version} (testcontainers {RABBITMQ_IMAGE})",
        management_url=management,
        _closer=container.stop,
    )


def _local_rabbitmq(*, start_local: bool) -> Endpoint:
    url = f"amqp://guest:guest@{LOCAL_AMQP_HOST}:{LOCAL_AMQP_PORT}/"
    started = ""
    if not _port_open(LOCAL_AMQP_HOST, LOCAL_AMQP_PORT):
        if not (start_local and shutil.which("rabbitmq-server")):
            raise InfraError(
                "no RabbitMQ: RABBITMQ_URL is not set, no Docker engine answers and nothing "
                f"listens on {LOCAL_AMQP_HOST}:{LOCAL_AMQP_PORT} (install `rabbitmq-server` "
                "or set RABBITMQ_URL)"
            )
        start_local_broker()
        started = ", started with rabbitmq-server -detached"
    version = _require_amqp(url, "the local broker")
    return Endpoint(
        url=url,
        kind=f"RabbitMQ {version} (local {LOCAL_AMQP_HOST}:{LOCAL_AMQP_PORT}{started})",
        management_url=f"http://{LOCAL_AMQP_HOST}:{MANAGEMENT_PORT}",
    )


def start_local_broker(*, timeout: float = BROKER_START_TIMEOUT_S) -> None:
    """`rabbitmq-server -detached`, then wait for the port and `rabbitmqctl await_startup`."""
    deadline = time.monotonic() + timeout
    _run(["rabbitmq-server", "-detached"], timeout=min(30.0, timeout), check=False)
    if not _wait_for_port(LOCAL_AMQP_HOST, LOCAL_AMQP_PORT, deadline):
        raise InfraError(
            f"started rabbitmq-server, but nothing listens on {LOCAL_AMQP_HOST}:"
            f"{LOCAL_AMQP_PORT} after {timeout:.0f}s (see /var/log/rabbitmq/)"
        )
    remaining = max(1.0, deadline - time.monotonic())
    _run(
        ["rabbitmqctl", "await_startup", "--timeout", str(int(remaining))],
        timeout=remaining + 10,
    )


# --------------------------------------------------------------------------- vhosts


def vhost_url(amqp_url: str, vhost: str) -> str:
    """`amqp_url` with its virtual host replaced by `vhost`."""
    parts = urlsplit(amqp_url)
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


def create_vhost(amqp_url: str, vhost: str, *, management_url: str | None = None) -> str:
    """Create `vhost` (idempotent), grant the URL's user everything on it, return its URL.

    Uses `rabbitmqctl` for a broker on this machine, else the management HTTP API
    (`management_url`, `RABBITMQ_MANAGEMENT_URL` or port 15672 on the broker's host).
    """
    user = unquote(urlsplit(amqp_url).username or "guest")
    _vhost_admin(amqp_url, management_url).create(vhost, user)
    return vhost_url(amqp_url, vhost)


def delete_vhost(amqp_url: str, vhost: str, *, management_url: str | None = None) -> None:
    """Delete `vhost` and everything in it; a vhost that does not exist is fine."""
    _vhost_admin(amqp_url, management_url).delete(vhost)


def set_queue_policy(
    amqp_url: str,
    name: str,
    queue: str,
    definition: dict[str, Any],
    *,
    management_url: str | None = None,
) -> None:
    """Give `queue` of `amqp_url`'s vhost the policy `name` (`definition`, e.g.
    `{"max-length": 0}`), as `create_vhost` reaches the broker. A broker applies it a moment
    later, not when this returns."""
    pattern = "^" + re.escape(queue) + "$"
    _vhost_admin(amqp_url, management_url).set_policy(
        _vhost_of(amqp_url), name, pattern, definition
    )


def clear_queue_policy(amqp_url: str, name: str, *, management_url: str | None = None) -> None:
    """Remove the policy `name` of `amqp_url`'s vhost."""
    _vhost_admin(amqp_url, management_url).clear_policy(_vhost_of(amqp_url), name)


def _vhost_of(amqp_url: str) -> str:
    return unquote(urlsplit(amqp_url).path[1:]) or "/"


class _Rabbitmqctl:
    def create(self, vhost: str, user: str) -> None:
        _run(["rabbitmqctl", "add_vhost", vhost], timeout=RABBITMQCTL_TIMEOUT_S)
        _run(
            ["rabbitmqctl", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
            timeout=RABBITMQCTL_TIMEOUT_S,
        )

    def delete(self, vhost: str) -> None:
        result = _run(
            ["rabbitmqctl", "delete_vhost", vhost], timeout=RABBITMQCTL_TIMEOUT_S, check=False
        )
        if result.returncode != 0 and "does not exist" not in result.stdout + result.stderr:
            raise InfraError(f"rabbitmqctl delete_vhost {vhost} failed: {_output(result)}")

    def set_policy(self, vhost: str, name: str, pattern: str, definition: dict[str, Any]) -> None:
        command = ["rabbitmqctl", "set_policy", "-p", vhost, "--apply-to", "queues", name]
        _run([*command, pattern, json.dumps(definition)], timeout=RABBITMQCTL_TIMEOUT_S)

    def clear_policy(self, vhost: str, name: str) -> None:
        _run(["rabbitmqctl", "clear_policy", "-p", vhost, name], timeout=RABBITMQCTL_TIMEOUT_S)


@dataclass
class _ManagementApi:
    base_url: str
    user: str
    password: str

    def create(self, vhost: str, user: str) -> None:
        name = quote(vhost, safe="")
        self._request("PUT", f"/api/vhosts/{name}", {})
        permissions = {"configure": ".*", "write": ".*", "read": ".*"}
        self._request("PUT", f"/api/permissions/{name}/{quote(user, safe='')}", permissions)

    def delete(self, vhost: str) -> None:
        try:
            self._request("DELETE", f"/api/vhosts/{quote(vhost, safe='')}", None)
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise

    def set_policy(self, vhost: str, name: str, pattern: str, definition: dict[str, Any]) -> None:
        body = {"pattern": pattern, "definition": definition, "apply-to": "queues"}
        self._request("PUT", _policy_path(vhost, name), body)

    def clear_policy(self, vhost: str, name: str) -> None:
        self._request("DELETE", _policy_path(vhost, name), None)

    def reachable(self) -> bool:
        try:
            self._request("GET", "/api/overview", None)
        except (OSError, ValueError):
            return False
        return True

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> None:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url.rstrip("/") + path, data, method=method)
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            response.read()


def _policy_path(vhost: str, name: str) -> str:
    return f"/api/policies/{quote(vhost, safe='')}/{quote(name, safe='')}"


def is_local_node(amqp_url: str) -> bool:
    """Whether the broker at `amqp_url` is this machine's own node, the one `rabbitmqctl`
    talks to: a loopback address on the standard port. A container's port is mapped to
    another one on loopback; `rabbitmqctl` would act on the local node instead of it."""
    parts = urlsplit(amqp_url)
    return parts.hostname in LOOPBACK_HOSTS and (parts.port or LOCAL_AMQP_PORT) == LOCAL_AMQP_PORT


def _vhost_admin(amqp_url: str, management_url: str | None) -> _VhostAdmin:
    parts = urlsplit(amqp_url)
    base = (
        management_url
        or os.environ.get("RABBITMQ_MANAGEMENT_URL")
        or f"http://{parts.hostname}:{MANAGEMENT_PORT}"
    )
    api = _ManagementApi(
        base, unquote(parts.username or "guest"), unquote(parts.password or "guest")
    )
    if is_local_node(amqp_url) and shutil.which("rabbitmqctl"):
        return _FirstThatWorks(_Rabbitmqctl(), api)
    if api.reachable():
        return api
    raise InfraError(_no_vhost_admin(amqp_url, base, "the broker is not on this machine"))


class _VhostAdmin(Protocol):
    def create(self, vhost: str, user: str) -> None: ...
    def delete(self, vhost: str) -> None: ...
    def set_policy(
        self, vhost: str, name: str, pattern: str, definition: dict[str, Any]
    ) -> None: ...
    def clear_policy(self, vhost: str, name: str) -> None: ...


@dataclass
class _FirstThatWorks:
    """rabbitmqctl first (it needs no plugin); the management API when it is not usable."""

    rabbitmqctl: _Rabbitmqctl
    api: _ManagementApi

    def create(self, vhost: str, user: str) -> None:
        self._either(lambda admin: admin.create(vhost, user))

    def delete(self, vhost: str) -> None:
        self._either(lambda admin: admin.delete(vhost))

    def set_policy(self, vhost: str, name: str, pattern: str, definition: dict[str, Any]) -> None:
        self._either(lambda admin: admin.set_policy(vhost, name, pattern, definition))

    def clear_policy(self, vhost: str, name: str) -> None:
        self._either(lambda admin: admin.clear_policy(vhost, name))

    def _either(self, action: Callable[[_VhostAdmin], None]) -> None:
        try:
            action(self.rabbitmqctl)
        except InfraError as error:
            if not self.api.reachable():
                raise InfraError(
                    _no_vhost_admin("the local broker", self.api.base_url, str(error))
                ) from error
            action(self.api)


def _no_vhost_admin(broker: str, management_url: str, reason: str) -> str:
    return (
        f"cannot manage vhosts of {redact(broker)}: {reason}; and the management API at "
        f"{management_url} does not answer (enable it with "
        "`rabbitmq-plugins enable rabbitmq_management`, or set RABBITMQ_MANAGEMENT_URL)"
    )


# --------------------------------------------------------------------------- MongoDB


def resolve_mongo(*, port: int = 0, log_path: Path | None = None) -> Endpoint:
    """MongoDB from `MONGO_URL`, else a testcontainers `mongo:7`, else the mongoeco stand-in.

    `port` and `log_path` apply to the stand-in only (`log_path` receives its stderr).
    """
    url = os.environ.get("MONGO_URL")
    if url:
        return _mongo_from_env(url)
    if docker_available():
        return _mongo_container()
    return start_mongo_standin(port=port, log_path=log_path)


def _mongo_from_env(url: str) -> Endpoint:
    info = mongo_build_info(url)
    if info.get("gitVersion") == "mongoeco":
        return Endpoint(url=url, kind=f"{standin_label()} from MONGO_URL", is_standin=True)
    return Endpoint(url=url, kind=f"MongoDB {info.get('version', '?')} from MONGO_URL")


def mongo_build_info(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """`buildInfo` of the server at `url`; raises `InfraError` when it does not answer."""
    from pymongo import MongoClient  # noqa: PLC0415
    from pymongo.errors import PyMongoError  # noqa: PLC0415

    timeout_ms = int(timeout * 1000)
    client: MongoClient[dict[str, Any]] = MongoClient(
        url,
        serverSelectionTimeoutMS=timeout_ms,
        connectTimeoutMS=timeout_ms,
        socketTimeoutMS=timeout_ms,
    )
    try:
        return dict(client.admin.command("buildInfo"))
    except PyMongoError as error:
        raise InfraError(
            f"MongoDB at MONGO_URL ({redact(url)}) does not answer: {error}"
        ) from error
    finally:
        client.close()


def _mongo_container() -> Endpoint:
    mongodb, _ = _quiet_testcontainers_import()
    container = mongodb.MongoDbContainer(MONGO_IMAGE)
    container.start()
    try:
        url = container.get_connection_url()
        version = mongo_build_info(url).get("version", "?")
    except BaseException:
        container.stop()
        raise
    return Endpoint(
        url=url,
        kind=f"MongoDB {version} (testcontainers {MONGO_IMAGE})",
        _closer=container.stop,
    )


def standin_label() -> str:
    try:
        version = metadata.version("mongoeco")
    except metadata.PackageNotFoundError:
        version = "?"
    return f"mongoeco {version} wire-protocol stand-in (NOT MongoDB)"


def start_mongo_standin(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_path: Path | None = None,
    timeout: float = STANDIN_START_TIMEOUT_S,
) -> Endpoint:
    """Run `python -m devtools.mongo_standin` and wait (bounded) for its JSON line."""
    log = _open_log(log_path)
    command = [sys.executable, "-m", "devtools.mongo_standin", "--host", host, "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--exit-with-parent"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
    )
    try:
        line = read_first_line(process, timeout)
        url = str(json.loads(line)["url"])
    except BaseException as error:
        _terminate(process, STANDIN_STOP_GRACE_S)
        detail = _log_text(log)
        log.close()
        if isinstance(error, Exception):
            raise InfraError(f"the MongoDB stand-in did not start: {error}\n{detail}") from error
        raise

    def close() -> None:
        _terminate(process, STANDIN_STOP_GRACE_S)
        if process.stdout is not None:
            process.stdout.close()
        log.close()

    return Endpoint(url=url, kind=standin_label(), is_standin=True, _closer=close)


def _open_log(log_path: Path | None) -> IO[bytes]:
    if log_path is None:
        return tempfile.TemporaryFile()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return log_path.open("wb")


def _log_text(log: IO[bytes]) -> str:
    with contextlib.suppress(OSError):
        log.flush()
        log.seek(0)
        return log.read()[-4000:].decode(errors="replace")
    return ""


def read_first_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line of the process's stdout, or an error once `timeout` has passed."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no output within {timeout:.0f}s")
            if selector.select(remaining):
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    raise ConnectionError(f"it exited with code {process.wait(timeout=5)}")
                buffer += chunk
    return buffer.split(b"\n", 1)[0].decode()


def _terminate(process: subprocess.Popen[bytes], grace_s: float) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace_s)


# --------------------------------------------------------------------------- helpers


def redact(url: str) -> str:
    """`url` with its password masked, fit for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def _port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_for_port(host: str, port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if _port_open(host, port):
            return True
        time.sleep(0.2)
    return False


def _run(
    command: list[str], *, timeout: float, check: bool = True
) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InfraError(f"`{' '.join(command)}` failed: {error}") from error
    if check and result.returncode != 0:
        raise InfraError(
            f"`{' '.join(command)}` exited with {result.returncode}: {_output(result)}"
        )
    return result


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return (result.stdout + result.stderr).strip()[-2000:]
