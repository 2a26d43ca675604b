"""Webhooks end to end, in-process on the real broker and database: gateway, scorer (fake
model), status and notifier, delivering to an https receiver with a test CA.

The receiver listens on 127.0.0.1 under the name `receiver.scorebox.test`: the gateway
accepts the name (it resolves nothing), the notifier resolves it through a table (no DNS
here) and, as `WEBHOOK_ALLOWED_TEST_HOSTS=127.0.0.1` allows, connects to 127.0.0.1 with that
name for SNI and certificate checks (`WEBHOOK_CA_FILE` trusts the test CA).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import orjson
import pytest
import trustme
from aiohttp import web
from fastapi import Depends, FastAPI
from prometheus_client.parser import text_string_to_metric_families
from pymongo import AsyncMongoClient
from standardwebhooks import Webhook

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.gateway.app import create_app as create_gateway
from services.gateway.auth import Caller
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.gateway.webhooks_api import NotifierClient, webhook_routes
from services.notifier.app import create_app as create_notifier
from services.notifier.errors import NoSuchHost
from services.notifier.settings import NotifierSettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.contracts import (
    DeliverWebhook,
    Phase,
    ScoreResult,
    TaskAccepted,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    event_sequence,
    new_id,
    utcnow,
)
from shared.http import install_problem_handlers
from shared.runtime import make_broker
from shared.topology import ERROR_HEADER, EVENTS, NOTIFICATIONS, WEBHOOK_DELIVERIES
from shared.webhook_urls import IPAddress
from tests.support import closed_port, eventually, running, stack_env

API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
ADMIN_KEY = generate_key().token  # the services' ADMIN_API_KEY
RECEIVER_HOST = "receiver.scorebox.test"
INTRANET_HOST = "intranet.scorebox.test"  # resolves to a private address: always refused
Document = dict[str, Any]
Answer = tuple[int, dict[str, str]]


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Receiver:
    """An https webhook receiver: answers each path from a script of statuses, records all."""

    port: int = 0
    scripts: dict[str, list[Answer]] = field(default_factory=dict)
    latencies: dict[str, float] = field(default_factory=dict)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    received: dict[str, list[Received]] = field(default_factory=lambda: defaultdict(list))

    def endpoint(self, *answers: int | Answer, latency_s: float = 0.0) -> str:
        """A fresh URL giving `answers` (status, or status and headers) in turn, each
        `latency_s` after the request is recorded; the last one repeats."""
        name = uuid.uuid4().hex[:12]
        self.scripts[name] = [a if isinstance(a, tuple) else (a, {}) for a in answers]
        self.latencies[name] = latency_s
        return f"https://{RECEIVER_HOST}:{self.port}/hooks/{name}"

    def held_endpoint(self, *answers: int | Answer) -> tuple[str, asyncio.Event]:
        """`endpoint`, each answer held back (after the request is recorded) until the
        returned event is set: a request in flight for as long as the test needs."""
        url = self.endpoint(*answers)
        gate = self.gates[url.rsplit("/", 1)[1]] = asyncio.Event()
        return url, gate

    def requests(self, url: str) -> list[Received]:
        return self.received[url.rsplit("/", 1)[1]]

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        calls = self.received[name]
        calls.append(
            Received({k.lower(): v for k, v in request.headers.items()}, await request.read())
        )
        script = self.scripts.get(name) or [(404, {})]
        status, headers = script[min(len(calls), len(script)) - 1]
        await asyncio.sleep(self.latencies.get(name, 0.0))  # a receiver slow to answer
        if (gate := self.gates.get(name)) is not None:
            await gate.wait()
        return web.Response(status=status, text=f"scripted {status}", headers=headers)


class TableResolver:
    """DNS for the test: a fixed table (the SSRF guard still checks every answer)."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self._table = table

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        if host.endswith(".nx"):  # as a name server answers for a name that does not exist
            raise NoSuchHost(f"{host} does not exist: Domain name not found")
        if host.endswith(".nodata"):  # a name that exists without an address (MX only)
            return []
        return [ipaddress.ip_address(a) for a in self._table.get(host, [])]


@dataclass
class Flow:
    api: httpx.AsyncClient
    notifier: httpx.AsyncClient  # its internal API, as the gateway calls it
    receiver: Receiver
    amqp_url: str
    notifier_db: Any
    dead_letters: list[aio_pika.abc.AbstractIncomingMessage]

    async def submit(self, text: str, callback_url: str | None = None) -> str:
        body: Document = {"text": text, "use_cache": False}
        if callback_url is not None:
            body["callback_url"] = callback_url
        response = await self.api.post("/v1/scores", json=body)
        assert response.status_code == 202, response.text
        task_id: str = response.json()["task_id"]
        return task_id

    async def secret(self) -> str:
        response = await self.api.get("/v1/webhooks/secret")
        assert response.status_code == 200, response.text
        assert response.headers["cache-control"] == "no-store"
        secret: str = response.json()["secret"]
        return secret

    @contextlib.asynccontextmanager
    async def legacy_accepted_binding(self) -> AsyncIterator[None]:
        """`task.accepted` routed to the notifier, as in a deployment from an earlier version."""
        connection = await aio_pika.connect(self.amqp_url, timeout=10)
        try:
            channel = await connection.channel()
            queue = await channel.get_queue(NOTIFICATIONS.name, ensure=False)
            await queue.bind(EVENTS.name, routing_key="task.accepted", timeout=10)
            try:
                yield
            finally:
                await queue.unbind(EVENTS.name, routing_key="task.accepted", timeout=10)
        finally:
            await connection.close()

    async def publish(self, *events: TaskEvent) -> None:
        broker = make_broker(NotifierSettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            for event in events:
                await publish_event(broker, event, timeout=10)

    async def delivery(self, **query: Any) -> Document | None:
        found: Document | None = await self.notifier_db["deliveries"].find_one(query)
        return found

    async def settled(self, task_id: str, state: str, **extra: Any) -> Document:
        async def there() -> Document | None:
            return await self.delivery(task_id=task_id, state=state, **extra)

        return await eventually(there, what=f"a {state} delivery for {task_id}")

    async def dead_letter_of(self, delivery_id: str) -> aio_pika.abc.AbstractIncomingMessage:
        async def found() -> aio_pika.abc.AbstractIncomingMessage | None:
            await self._drain_dead_letters()
            for message in self.dead_letters:
                if DeliverWebhook.model_validate_json(message.body).delivery_id == delivery_id:
                    return message
            return None

        return await eventually(found, what=f"dead letter of {delivery_id}")

    async def _drain_dead_letters(self) -> None:
        connection = await aio_pika.connect(self.amqp_url, timeout=10)
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(WEBHOOK_DELIVERIES.dead_letter_routing_key)
            while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
                self.dead_letters.append(message)


async def _start_receiver(tls: ssl.SSLContext) -> tuple[Receiver, web.AppRunner]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hooks/{name}", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    receiver.port = runner.addresses[0][1]
    return receiver, runner


def _tls(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    """A test CA, a server certificate for the receiver's name, and the CA as a PEM file."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(RECEIVER_HOST).configure_cert(server)
    ca_file = tmp_path / "webhook-test-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return server, ca_file


@pytest.fixture(scope="module")
async def flow(
    amqp_url: str, mongo: Any, db_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Flow]:
    server_tls, ca_file = _tls(tmp_path_factory.mktemp("webhooks"))
    receiver, receiver_runner = await _start_receiver(server_tls)
    llm: FakeLLM = await start_fake_llm(FakeLLMConfig())
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url=llm.url,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        WEBHOOK_ALLOWED_TEST_HOSTS="127.0.0.1",
        WEBHOOK_CA_FILE=str(ca_file),
        WEBHOOK_RETRY_BASE_S="0.01",  # retries go out at once (below the 1 s wait tier)
        WEBHOOK_MAX_ATTEMPTS="4",
    )
    resolver = TableResolver({RECEIVER_HOST: ["127.0.0.1"], INTRANET_HOST: ["10.0.0.7"]})
    notifier = create_notifier(NotifierSettings.model_validate(env), resolver=resolver)
    scorer = create_scorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))
    status = create_status(StatusSettings.model_validate(env))
    database: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        async with (
            running(status) as status_client,
            running(notifier) as notifier_client,
            running(scorer),
        ):
            gateway = create_gateway(
                GatewaySettings.model_validate(env),
                status_http=status_client,
                notifier_http=notifier_client,
            )
            async with running(gateway) as api:
                api.headers["Authorization"] = f"Bearer {API_KEY}"
                yield Flow(
                    api,
                    notifier_client,
                    receiver,
                    amqp_url,
                    database[f"{db_prefix}_notifier"],
                    [],
                )
    finally:
        await database.close()
        await llm.stop()
        await receiver_runner.cleanup()


def _marker() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _accepted(task_id: str, callback_url: str | None, tenant_id: str = "default") -> TaskAccepted:
    now = utcnow()
    return TaskAccepted(
        task_id=task_id,
        tenant_id=tenant_id,
        sequence=event_sequence(generation=0, attempt=0, phase=Phase.ACCEPTED),
        submitted_at=now,
        occurred_at=now,
        callback_url=callback_url,
    )


def _completed(task_id: str, callback_url: str | None = None) -> TaskCompleted:
    """An outcome as the scorer sends it (with its callback URL); without a URL, as an older
    producer did (`has_callback` unsaid)."""
    return TaskCompleted(
        task_id=task_id,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        attempt=1,
        submitted_at=utcnow(),
        result=ScoreResult(score=6.5, comment="fine", model="fake-judge-1"),
        has_callback=True if callback_url else None,
        callback_url=callback_url,
    )


def _verified(request: Received, secret: str) -> Document:
    payload: Document = Webhook(secret).verify(request.body, request.headers)
    return payload


async def test_a_callback_gets_one_signed_post_with_the_outcome(flow: Flow) -> None:
    url = flow.receiver.endpoint(200)
    task_id = await flow.submit(f"Call me back [[id:{_marker()}]]", callback_url=url)

    record = await flow.settled(task_id, "delivered")

    requests = flow.receiver.requests(url)
    assert len(requests) == 1
    request = requests[0]
    assert request.headers["content-type"] == "application/json"
    assert request.headers["webhook-id"] == record["_id"]
    assert request.headers["webhook-signature"].startswith("v1,")
    payload = _verified(request, await flow.secret())
    assert payload["type"] == "task.completed"
    assert payload["data"]["task_id"] == task_id
    assert payload["data"]["status"] == "completed"
    assert payload["data"]["purpose"] == "callback"
    assert 0 <= payload["data"]["result"]["score"] <= 10
    assert record["attempt"] == 1
    assert record["last_status"] == 200


async def test_server_errors_are_retried_and_delivered_once(flow: Flow) -> None:
    url = flow.receiver.endpoint(500, 500, 200)
    task_id = new_id()
    await flow.publish(_completed(task_id, url))

    record = await flow.settled(task_id, "delivered")

    requests = flow.receiver.requests(url)
    assert len(requests) == 3
    assert {r.headers["webhook-id"] for r in requests} == {record["_id"]}
    secret = await flow.secret()
    assert all(_verified(r, secret)["data"]["task_id"] == task_id for r in requests)
    assert record["attempt"] == 3


async def test_webhook_attempts_are_counted_in_the_notifiers_metrics(flow: Flow) -> None:
    async def attempts(outcome: str) -> float:
        exposition = (await flow.notifier.get("/metrics")).text
        wanted = {"purpose": "callback", "outcome": outcome}
        return sum(
            sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples
            if sample.name == "scorebox_webhook_attempts_total" and sample.labels == wanted
        )

    before = {outcome: await attempts(outcome) for outcome in ("delivered", "unavailable")}
    url = flow.receiver.endpoint(503, 200)
    task_id = new_id()
    await flow.publish(_completed(task_id, url))

    await flow.settled(task_id, "delivered")

    after = {outcome: await attempts(outcome) for outcome in ("delivered", "unavailable")}
    assert {key: after[key] - before[key] for key in after} == {"delivered": 1, "unavailable": 1}


async def test_a_gone_receiver_is_recorded_failed_with_the_reason(flow: Flow) -> None:
    """Not dead-lettered: a receiver's refusal is its tenant's business, not an operator's
    alert (`test_notifier_delivery_limit.py` checks that nothing reaches the DLQ). Counted
    as a delivery given up: the attempts' counter alone showed no failed delivery."""
    url = flow.receiver.endpoint(410)
    task_id = new_id()
    given_up = {"purpose": "callback", "reason": "rejected"}
    before = await _sample(flow, "scorebox_webhook_deliveries_failed_total", given_up)
    await flow.publish(_completed(task_id, url))

    record = await flow.settled(task_id, "failed")

    after = await _sample(flow, "scorebox_webhook_deliveries_failed_total", given_up)
    assert after - before == 1

    assert "410" in record["last_error"]
    assert record["last_status"] == 410
    assert record["dead_letter"] is False
    assert len(flow.receiver.requests(url)) == 1


async def test_a_receiver_that_keeps_failing_is_given_up_after_the_last_attempt_unlettered(
    flow: Flow,
) -> None:
    """It answered 503 to every attempt: the tenant's doing, as a refusal is. Dead-lettered,
    one tenant's broken receiver kept the operators' DLQ alert on and the DLQ growing."""
    url = flow.receiver.endpoint(503)
    task_id = new_id()
    given_up = {"purpose": "callback", "reason": "receiver_failing"}
    before = await _sample(flow, "scorebox_webhook_deliveries_failed_total", given_up)
    await flow.publish(_completed(task_id, url))

    record = await flow.settled(task_id, "failed")

    assert "gave up after 4 attempt(s)" in record["last_error"]
    assert (record["last_status"], record["dead_letter"]) == (503, False)
    assert len(flow.receiver.requests(url)) == 4
    after = await _sample(flow, "scorebox_webhook_deliveries_failed_total", given_up)
    assert after - before == 1
    await flow._drain_dead_letters()
    lettered = [DeliverWebhook.model_validate_json(m.body) for m in flow.dead_letters]
    assert record["_id"] not in {letter.delivery_id for letter in lettered}


async def test_a_receiver_never_reached_is_dead_lettered_after_the_last_attempt(
    flow: Flow,
) -> None:
    """No answer at all (here a refused connection) may be ours, an egress or resolver
    outage: the operators' DLQ keeps it."""
    url = f"https://{RECEIVER_HOST}:{closed_port()}/hooks/{new_id()}"
    task_id = new_id()
    await flow.publish(_completed(task_id, url))

    record = await flow.settled(task_id, "failed")
    dead = await flow.dead_letter_of(record["_id"])

    assert "gave up after 4 attempt(s)" in str(dead.headers[ERROR_HEADER])
    assert record["dead_letter"] is True


@pytest.mark.parametrize(
    ("url", "answer"),
    [
        pytest.param("https://hooks.misspelt.nx/hook", "does not exist", id="nxdomain"),
        pytest.param("https://mx-only.example.nodata/hook", "has no address", id="nodata"),
    ],
)
async def test_a_callback_host_that_does_not_exist_is_given_up_unlettered(
    flow: Flow, url: str, answer: str
) -> None:
    """DNS answered that the name does not exist (a misspelt domain) or has no address (an
    apex with only MX records): the URL's doing, as a refusal is. Dead-lettered, one tenant's
    typo put a letter per task in the operators' DLQ and kept its alert on. Retried all the
    same: a new domain or record may not have spread yet."""
    task_id = new_id()
    await flow.publish(_completed(task_id, url))

    record = await flow.settled(task_id, "failed")

    assert "gave up after 4 attempt(s)" in record["last_error"]
    assert answer in record["last_error"]
    assert record["dead_letter"] is False
    await flow._drain_dead_letters()
    lettered = [DeliverWebhook.model_validate_json(m.body) for m in flow.dead_letters]
    assert record["_id"] not in {letter.delivery_id for letter in lettered}


async def test_a_name_resolving_to_a_private_address_is_never_contacted(flow: Flow) -> None:
    url = f"https://{INTRANET_HOST}:{flow.receiver.port}/hooks/never"
    task_id = await flow.submit(f"Sneaky [[id:{_marker()}]]", callback_url=url)

    record = await flow.settled(task_id, "failed")

    assert "non-public" in record["last_error"]
    assert "10.0.0.7" in record["last_error"]
    assert record["dead_letter"] is False
    assert flow.receiver.requests(url) == []


async def test_the_failure_alert_receives_every_failed_task(flow: Flow) -> None:
    alert_url = flow.receiver.endpoint(204)
    registered = await flow.api.put("/v1/webhooks/failure-alert", json={"url": alert_url})
    assert registered.status_code == 200, registered.text
    assert (await flow.api.get("/v1/webhooks/failure-alert")).json() == {"url": alert_url}
    other_url = flow.receiver.endpoint(204)
    other_tenant = await flow.notifier.put(
        "/internal/v1/tenants/someone-else/failure-alert", json={"url": other_url}
    )
    assert other_tenant.status_code == 200, other_tenant.text
    try:
        task_id = await flow.submit(f"Refused text [[id:{_marker()}]] [[fake:reject]]")
        record = await flow.settled(task_id, "delivered", purpose="failure_alert")
        # Another tenant's failure goes to that tenant's URL only.
        other = TaskFailed.model_validate(
            {
                "task_id": new_id(),
                "tenant_id": "someone-else",
                "sequence": 190,
                "attempt": 1,
                "submitted_at": utcnow(),
                "error": {"code": "input_rejected", "message": "no", "retryable": False},
                "dead_lettered": False,
            }
        )
        await flow.publish(other)
        await flow.settled(other.task_id, "delivered", purpose="failure_alert")
    finally:
        removed = await flow.api.delete("/v1/webhooks/failure-alert")
    assert removed.status_code == 204
    assert (await flow.api.get("/v1/webhooks/failure-alert")).status_code == 404

    requests = flow.receiver.requests(alert_url)
    assert len(requests) == 1
    payload = _verified(requests[0], await flow.secret())
    assert requests[0].headers["webhook-id"] == record["_id"]
    assert payload["type"] == "task.failed"
    assert payload["data"]["task_id"] == task_id
    assert payload["data"]["purpose"] == "failure_alert"
    assert payload["data"]["error"]["code"] == "input_rejected"
    assert len(flow.receiver.requests(other_url)) == 1


async def test_retry_after_is_honoured_through_the_wait_ladder(flow: Flow) -> None:
    """With retries due at once here (WEBHOOK_RETRY_BASE_S=0.01), this passed as well when
    the receiver's Retry-After was dropped on its way to the retry: the retry must be
    scheduled at least the hinted second after the receiver answered."""
    url, answer = flow.receiver.held_endpoint((429, {"Retry-After": "1"}), 200)
    task_id = new_id()
    await flow.publish(_completed(task_id, url))
    try:
        await _first_request_at(flow, url)
        answered_at = utcnow()
    finally:
        answer.set()  # the 429 goes out only now

    record = await flow.settled(task_id, "delivered")

    assert len(flow.receiver.requests(url)) == 2
    assert record["attempt"] == 2
    # The database keeps milliseconds: the retry's due time may lose up to one.
    assert record["next_attempt_at"] - answered_at >= timedelta(seconds=1, milliseconds=-1)


async def test_a_duplicate_terminal_event_is_delivered_once(flow: Flow) -> None:
    url = flow.receiver.endpoint(200)
    task_id = new_id()
    completed = _completed(task_id, url)
    again = completed.model_copy(update={"message_id": new_id()})
    await flow.publish(completed, again)

    record = await flow.settled(task_id, "delivered", triggers=2)

    assert len(flow.receiver.requests(url)) == 1
    assert record["attempt"] == 1


async def test_an_older_producers_outcome_waits_for_its_acceptance_and_is_delivered_once(
    flow: Flow,
) -> None:
    """Outcomes without `has_callback` (older producers) take the URL from `task.accepted`,
    routed to the notifier where a deployment kept that binding from an earlier version."""
    url = flow.receiver.endpoint(200)
    task_id = new_id()
    async with flow.legacy_accepted_binding():
        # As a version-1 producer sent it: neither `has_callback` nor the callback header.
        await flow.publish(_completed(task_id).model_copy(update={"schema_version": 1}))

        async def outcome_kept() -> Document | None:
            found: Document | None = await flow.notifier_db["task_callbacks"].find_one(
                {"_id": task_id, "outcomes": {"$exists": True}}
            )
            return found

        await eventually(outcome_kept, what="the early outcome kept")
        assert await flow.delivery(task_id=task_id) is None
        await flow.publish(_accepted(task_id, url))

        await flow.settled(task_id, "delivered")
    assert len(flow.receiver.requests(url)) == 1


async def test_an_outcome_carrying_its_callback_needs_no_acceptance(flow: Flow) -> None:
    url = flow.receiver.endpoint(200)
    task_id = new_id()
    await flow.publish(_completed(task_id, url))

    await flow.settled(task_id, "delivered")

    assert len(flow.receiver.requests(url)) == 1
    assert await flow.notifier_db["task_callbacks"].find_one({"_id": task_id}) is None


async def test_a_head_of_the_secret_creates_none_as_its_get_does(flow: Flow) -> None:
    """HEAD is a safe method: run as the GET, it created the tenant's secret at its first
    read (found in a walkthrough)."""
    secrets = flow.notifier_db["signing_secrets"]
    await secrets.delete_many({})  # as for a tenant that never read it

    head = await flow.api.head("/v1/webhooks/secret")

    assert head.status_code == 200, head.text
    assert head.headers["cache-control"] == "no-store"
    assert head.content == b""
    assert await secrets.count_documents({}) == 0
    first = await flow.api.get("/v1/webhooks/secret")  # the GET creates it
    assert await secrets.count_documents({}) == 1
    again = await flow.api.get("/v1/webhooks/secret")
    # As stored, to the millisecond: the first answer said the microseconds of its clock.
    assert first.json()["created_at"] == again.json()["created_at"]


async def test_a_rotated_secret_signs_alongside_the_previous_one(flow: Flow) -> None:
    before = await flow.secret()
    # A body, which the rotation does not take: refused, nothing rotated.
    with_body = await flow.api.post(
        "/v1/webhooks/secret/rotate", content=b"{bad", headers={"Content-Type": "application/json"}
    )
    assert with_body.status_code == 422, with_body.text
    assert with_body.json()["detail"].endswith("; nothing was changed.")
    assert await flow.secret() == before
    rotated = await flow.api.post("/v1/webhooks/secret/rotate")
    assert rotated.status_code == 200, rotated.text
    after = rotated.json()["secret"]
    assert after != before
    assert after.startswith("whsec_")
    assert rotated.json()["previous_valid_until"] is not None
    assert await flow.secret() == after

    url = flow.receiver.endpoint(200)
    task_id = new_id()
    await flow.publish(_completed(task_id, url))
    await flow.settled(task_id, "delivered")

    request = flow.receiver.requests(url)[0]
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    assert _verified(request, before)["data"]["task_id"] == task_id
    assert _verified(request, after)["data"]["task_id"] == task_id


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/hook",
        "https://127.0.0.1/hook",
        "https://localhost/hook",
        "https://[::ffff:169.254.169.254]/",
        "https://2130706433/",
        "https://user:secret@example.com/hook",
    ],
)
async def test_an_unsafe_callback_url_is_refused_at_submit(flow: Flow, url: str) -> None:
    response = await flow.api.post("/v1/scores", json={"text": "hello", "callback_url": url})

    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert [error["field"] for error in response.json()["errors"]] == ["callback_url"]


async def test_an_unsafe_failure_alert_url_is_refused(flow: Flow) -> None:
    response = await flow.api.put(
        "/v1/webhooks/failure-alert", json={"url": "https://169.254.169.254/latest"}
    )

    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert "url" in response.json()["detail"]


@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b'{"url": "https://example.com/hook"}', "text/plain", 415),
        (b'{"url":', "application/json", 400),
        (
            b'{"url": "https://example.com/hook", "pad": "' + b"x" * 20_000 + b'"}',
            "application/json",
            413,
        ),
        (b'{"url": "https://example.com/hook", "colour": "red"}', "application/json", 422),
    ],
)
async def test_a_bad_failure_alert_body_is_refused_like_every_body(
    flow: Flow, content: bytes, content_type: str, status: int
) -> None:
    """FastAPI's own body parsing read any size, took unknown fields, and answered 422 where
    every other body of the API answers 415 or 400."""
    response = await flow.api.put(
        "/v1/webhooks/failure-alert", content=content, headers={"Content-Type": content_type}
    )

    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert (await flow.api.get("/v1/webhooks/failure-alert")).status_code == 404


async def test_the_notifier_refuses_a_failure_alert_body_with_an_unknown_field(
    flow: Flow,
) -> None:
    """It dropped the field without a word, unlike every body of the gateway."""
    tenant_id = f"unknown-field-{_marker()}"
    path = f"/internal/v1/tenants/{tenant_id}/failure-alert"
    body = {"url": flow.receiver.endpoint(204), "colour": "red"}
    response = await flow.notifier.put(path, json=body)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert (await flow.notifier.get(path)).status_code == 404


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("https://[example.com]/", id="bracketed-name"),
        pytest.param("https://[::1/", id="unclosed-bracket"),
        pytest.param("https://example.com:443\uff03@evil/", id="netloc-changed-by-nfkc"),
    ],
)
async def test_the_notifier_refuses_a_failure_alert_url_it_cannot_parse(
    flow: Flow, url: str
) -> None:
    """urlsplit refuses these with a plain ValueError, which the URL check let through: the
    internal API answered 500 where any other refused URL gets 422 naming the field."""
    tenant_id = f"unparsable-{_marker()}"
    path = f"/internal/v1/tenants/{tenant_id}/failure-alert"

    response = await flow.notifier.put(path, json={"url": url})

    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["type"].endswith("/invalid-fields")
    assert [error["field"] for error in problem["errors"]] == ["url"]
    assert "cannot be parsed" in problem["errors"][0]["message"]
    assert (await flow.notifier.get(path)).status_code == 404


async def test_a_failure_alert_registered_under_older_rules_can_still_be_read(flow: Flow) -> None:
    """Checked again on the way out, a URL that a later rule refuses made the read a 500."""
    tenant_id = f"older-rules-{_marker()}"
    older = "https://169.254.169.254/latest"  # refused now
    await flow.notifier_db["failure_alerts"].insert_one({"_id": tenant_id, "url": older})
    app = _webhook_api(tenant_id, ForwardTo(flow.notifier))
    async with running(app) as api:
        response = await api.get("/v1/webhooks/failure-alert")
    assert response.status_code == 200, response.text
    assert response.json() == {"url": older}


class ForwardTo(httpx.AsyncBaseTransport):
    """Hands each request to the notifier (in-process) and gives back its answer."""

    def __init__(self, notifier: httpx.AsyncClient) -> None:
        self._notifier = notifier

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        content_type = {"Content-Type": request.headers.get("Content-Type", "")}
        answer = await self._notifier.request(
            request.method, request.url.path, content=await request.aread(), headers=content_type
        )
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)


class AnswerLost(ForwardTo):
    """Hands each request to the notifier, then loses its answer (a read timeout)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await super().handle_async_request(request)
        raise httpx.ReadTimeout("no answer in time", request=request)


class Unreachable(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)


def _webhook_api(tenant_id: str, transport: httpx.AsyncBaseTransport) -> FastAPI:
    """The gateway's webhook routes for `tenant_id`, reaching the notifier through `transport`."""
    http = httpx.AsyncClient(transport=transport)
    app = FastAPI()
    install_problem_handlers(app)
    caller = Caller(tenant_id=tenant_id)
    app.include_router(
        webhook_routes(
            NotifierClient(http, base_url="http://scorebox.test"), Depends(lambda: caller)
        )
    )
    return app


async def test_a_rotation_whose_answer_was_lost_is_not_called_unchanged(flow: Flow) -> None:
    """Told "nothing was changed. Retry", a client rotated again and the secret its receivers
    held stopped signing at once (a rotation keeps one previous secret)."""
    tenant_id = f"rotation-{_marker()}"
    secret_url = f"/internal/v1/tenants/{tenant_id}/webhook-secret"
    first = (await flow.notifier.get(secret_url)).json()["secret"]

    async with running(_webhook_api(tenant_id, AnswerLost(flow.notifier))) as api:
        lost = await api.post("/v1/webhooks/secret/rotate")
    assert lost.status_code == 503
    assert lost.json()["type"].endswith("/change-unconfirmed")
    assert "may have been made" in lost.json()["detail"]
    assert (await flow.notifier.get(secret_url)).json()["secret"] != first  # it was made

    async with running(_webhook_api(tenant_id, Unreachable())) as api:
        refused = await api.post("/v1/webhooks/secret/rotate")
    assert refused.status_code == 503
    assert refused.json()["type"].endswith("/unavailable")
    assert "nothing was changed" in refused.json()["detail"]


async def test_an_outcome_without_a_callback_is_not_kept(flow: Flow) -> None:
    """`has_callback: false` (the scorer knows the command): nothing to remember for a later
    `task.accepted`. The failure alert the same handler sends marks when it is done."""
    alert_url = flow.receiver.endpoint(204)
    tenant_id = f"no-callback-{_marker()}"
    registered = await flow.notifier.put(
        f"/internal/v1/tenants/{tenant_id}/failure-alert", json={"url": alert_url}
    )
    assert registered.status_code == 200, registered.text
    without, unsaid = new_id(), new_id()
    for task_id, has_callback in ((without, False), (unsaid, None)):
        await flow.publish(_failed(tenant_id, task_id=task_id, has_callback=has_callback))
        await flow.settled(task_id, "delivered", purpose="failure_alert")

    callbacks = flow.notifier_db["task_callbacks"]
    assert await callbacks.find_one({"_id": without}) is None
    assert await callbacks.find_one({"_id": unsaid}) is not None


def _failed(
    tenant_id: str, *, task_id: str | None = None, has_callback: bool | None = None
) -> TaskFailed:
    return TaskFailed.model_validate(
        {
            "task_id": task_id or new_id(),
            "tenant_id": tenant_id,
            "sequence": 190,
            "attempt": 1,
            "submitted_at": utcnow(),
            "error": {"code": "input_rejected", "message": "no", "retryable": False},
            "dead_lettered": False,
            "has_callback": has_callback,
        }
    )


async def _first_request_at(flow: Flow, url: str) -> Received:
    async def arrived() -> Received | None:
        requests = flow.receiver.requests(url)
        return requests[0] if requests else None

    return await eventually(arrived, what=f"a request at {url}")


async def test_a_failure_alert_removed_while_its_delivery_is_retried_gets_no_more_posts(
    flow: Flow,
) -> None:
    """The alert's URL travelled in the delivery command, so its retries went on to the
    removed URL until the last attempt. Now the next attempt finds it removed and stops."""
    tenant_id = f"alert-removed-{_marker()}"
    alert_url, answer = flow.receiver.held_endpoint(503)
    failed = _failed(tenant_id)
    async with running(_webhook_api(tenant_id, ForwardTo(flow.notifier))) as api:
        registered = await api.put("/v1/webhooks/failure-alert", json={"url": alert_url})
        assert registered.status_code == 200, registered.text
        await flow.publish(failed)
        try:
            await _first_request_at(flow, alert_url)  # the first attempt is in flight
            assert (await api.delete("/v1/webhooks/failure-alert")).status_code == 204
        finally:
            answer.set()  # it fails (503): a retry follows

    record = await flow.settled(failed.task_id, "cancelled", purpose="failure_alert")

    assert record["attempt"] == 2
    assert len(flow.receiver.requests(alert_url)) == 1


async def test_a_failure_alert_changed_while_its_delivery_is_retried_goes_to_the_new_url(
    flow: Flow,
) -> None:
    """The retries went on to the old URL; now the next attempt goes to the URL registered
    then, as the same delivery (its `webhook-id`), signed with the tenant's secret."""
    tenant_id = f"alert-changed-{_marker()}"
    old_url, answer = flow.receiver.held_endpoint(503)
    new_url = flow.receiver.endpoint(200)
    failed = _failed(tenant_id)
    async with running(_webhook_api(tenant_id, ForwardTo(flow.notifier))) as api:
        registered = await api.put("/v1/webhooks/failure-alert", json={"url": old_url})
        assert registered.status_code == 200, registered.text
        await flow.publish(failed)
        try:
            first = await _first_request_at(flow, old_url)
            changed = await api.put("/v1/webhooks/failure-alert", json={"url": new_url})
            assert changed.status_code == 200, changed.text
        finally:
            answer.set()
        secret = (await api.get("/v1/webhooks/secret")).json()["secret"]

    record = await flow.settled(failed.task_id, "delivered", purpose="failure_alert")

    assert len(flow.receiver.requests(old_url)) == 1
    [request] = flow.receiver.requests(new_url)
    assert request.headers["webhook-id"] == first.headers["webhook-id"] == record["_id"]
    assert _verified(request, secret)["data"]["task_id"] == failed.task_id
    assert (record["attempt"], record["url"]) == (2, new_url)


async def _sample(flow: Flow, name: str, labels: dict[str, str]) -> float:
    exposition = (await flow.notifier.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and sample.labels == labels
    )
