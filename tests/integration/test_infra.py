"""`devtools.infra` against the real things: the broker, MongoDB (or the labelled stand-in)."""

from __future__ import annotations

import json
import selectors
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import pytest
from pymongo import MongoClient

from devtools import infra
from devtools.infra import (
    Endpoint,
    InfraError,
    amqp_server_version,
    create_vhost,
    delete_vhost,
    docker_available,
    resolve_mongo,
    resolve_rabbitmq,
    start_mongo_standin,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 30.0


def mongo_client(url: str) -> MongoClient[dict[str, Any]]:
    return MongoClient(url, serverSelectionTimeoutMS=5000, socketTimeoutMS=5000)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def read_first_line(process: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(deadline - time.monotonic()):
                return process.stdout.readline().decode()
    raise AssertionError(f"no line on stdout within {timeout_s}s")


@pytest.fixture
def standin_process() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "devtools.mongo_standin", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    yield process
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=TIMEOUT_S)


# ------------------------------------------------------------------------------ MongoDB


def test_resolved_mongo_accepts_writes_and_reads(mongo: Endpoint) -> None:
    database = f"infra_{uuid.uuid4().hex[:8]}"
    client = mongo_client(mongo.url)
    try:
        assert client.admin.command("ping")["ok"] == 1
        client[database].things.insert_one({"_id": "one", "score": 7})
        found = client[database].things.find_one({"_id": "one"})
        assert found == {"_id": "one", "score": 7}
    finally:
        client.drop_database(database)
        client.close()


def test_lookups_of_listed_ids_apply_every_condition(mongo: Endpoint) -> None:
    """`{_id: {$in: [...]}}` (the stand-in answers string ids by key, MongoDB by its index):
    unstored ids are skipped, other conditions still apply, other id types still match."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongo.url, serverSelectionTimeoutMS=10_000)
    database = f"infra_{uuid.uuid4().hex[:8]}"
    try:
        things = client[database].things
        things.insert_many([{"_id": "a", "n": 1}, {"_id": "b", "n": 2}, {"_id": 3, "n": 3}])

        def ids(query: dict[str, Any]) -> set[Any]:
            return {doc["_id"] for doc in things.find(query)}

        assert ids({"_id": {"$in": ["a", "b", "gone", "a"]}}) == {"a", "b"}
        assert ids({"_id": {"$in": ["a", "b"]}, "n": 2}) == {"b"}
        assert ids({"_id": {"$in": ["a", 3]}}) == {"a", 3}
    finally:
        client.drop_database(database)
        client.close()


def test_the_endpoint_says_what_it_is(mongo: Endpoint) -> None:
    if mongo.is_standin:
        assert "NOT MongoDB" in mongo.kind
    else:
        assert mongo.kind.startswith("MongoDB ")


def test_standin_cli_prints_one_json_line_and_stops_on_sigterm(
    standin_process: subprocess.Popen[bytes],
) -> None:
    line = read_first_line(standin_process, TIMEOUT_S)
    url = json.loads(line)["url"]
    assert url.startswith("mongodb://127.0.0.1:")
    assert url.endswith("/?directConnection=true")
    client = mongo_client(url)
    try:
        assert client.admin.command("ping")["ok"] == 1
    finally:
        client.close()

    standin_process.send_signal(signal.SIGTERM)

    assert standin_process.wait(timeout=TIMEOUT_S) == 0


def test_standin_writes_the_cpu_of_its_writes_per_collection_when_it_stops(
    tmp_path: Path,
) -> None:
    costs = tmp_path / "costs.json"
    command = [sys.executable, "-m", "devtools.mongo_standin", "--port", "0"]
    process = subprocess.Popen(
        [*command, "--write-costs", str(costs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        client = mongo_client(json.loads(read_first_line(process, TIMEOUT_S))["url"])
        try:
            client.costs.things.insert_many([{"_id": 1}, {"_id": 2}])
            client.costs.things.update_one({"_id": 1}, {"$set": {"seen": True}})
        finally:
            client.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=TIMEOUT_S)
    report = json.loads(costs.read_text())
    assert report["insert costs.things"]["statements"] == 2
    assert report["update costs.things"]["commands"] == 1
    assert report["update costs.things"]["cpu_s"] > 0


def test_standin_endpoint_close_stops_the_process() -> None:
    endpoint = start_mongo_standin()
    port = int(endpoint.url.split(":")[2].split("/")[0])
    assert endpoint.is_standin
    assert endpoint.started_here  # `make run` gives it a vhost of its own, gone with it

    endpoint.close()

    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_mongo_url_pointing_at_a_standin_is_labelled_as_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with start_mongo_standin() as standin:
        monkeypatch.setenv("MONGO_URL", standin.url)

        endpoint = resolve_mongo()

        assert endpoint.url == standin.url
        assert endpoint.is_standin
        assert not endpoint.started_here  # its data outlives the run: so do its queues
        assert "from MONGO_URL" in endpoint.kind


def test_an_unreachable_mongo_url_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONGO_URL", f"mongodb://127.0.0.1:{free_port()}/?directConnection=true")

    with pytest.raises(InfraError, match=r"MONGO_URL .* does not answer"):
        resolve_mongo()


# ------------------------------------------------------------------------------ RabbitMQ


def test_the_broker_endpoint_names_its_version(rabbitmq: Endpoint) -> None:
    version = amqp_server_version(rabbitmq.url)

    assert version[0].isdigit()
    assert version in rabbitmq.kind


async def test_a_vhost_round_trip(rabbitmq: Endpoint) -> None:
    vhost = f"scorebox-infra-{uuid.uuid4().hex[:8]}"
    url = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    try:
        assert url.endswith(f"/{vhost}")
        connection = await aio_pika.connect(url, timeout=TIMEOUT_S)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue("infra-check", exclusive=True)
            await channel.default_exchange.publish(
                aio_pika.Message(b"hello"), routing_key=queue.name, timeout=TIMEOUT_S
            )
            message = await queue.get(timeout=TIMEOUT_S, fail=True)
            assert message is not None
            assert message.body == b"hello"
            await message.ack()
    finally:
        delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)

    # Not `aio_pika.connect`: the connection it opens is lost when connecting fails, and its
    # `__del__` later leaves an un-awaited `close()` behind, failing whichever test runs then.
    refused = aio_pika.Connection(aio_pika.connection.make_url(url))
    try:
        with pytest.raises(aiormq.exceptions.AMQPError):
            await refused.connect(timeout=TIMEOUT_S)
    finally:
        await refused.close()


def test_creating_and_deleting_vhosts_is_idempotent(rabbitmq: Endpoint) -> None:
    vhost = f"scorebox-infra-{uuid.uuid4().hex[:8]}"
    first = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    second = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)

    assert first == second


def test_an_unreachable_rabbitmq_url_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RABBITMQ_URL", f"amqp://guest:guest@127.0.0.1:{free_port()}/")

    with pytest.raises(InfraError, match=r"RABBITMQ_URL .* does not answer"):
        resolve_rabbitmq()


def test_no_broker_anywhere_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RABBITMQ_URL", raising=False)
    monkeypatch.setenv("SCOREBOX_NO_DOCKER", "1")
    monkeypatch.setattr(infra, "_port_open", lambda *_args, **_kwargs: False)

    with pytest.raises(InfraError, match="no RabbitMQ: RABBITMQ_URL is not set"):
        resolve_rabbitmq(start_local=False)


# ------------------------------------------------------------------------------ Docker


class _FakeDockerPing(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.rfile.readline()
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")


def test_docker_is_detected_by_a_ping_on_its_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "docker.sock"
    with socketserver.UnixStreamServer(str(path), _FakeDockerPing) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
            assert docker_available()
            monkeypatch.setenv("SCOREBOX_NO_DOCKER", "1")
            assert not docker_available()
        finally:
            server.shutdown()
            thread.join(timeout=TIMEOUT_S)


def test_no_docker_engine_means_no_docker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'nothing-here.sock'}")

    assert not docker_available()
