"""The load side of a run: HTTP submissions and reads, and completions seen as events.

Submissions go to the gateway over HTTP (aiohttp, in this process). Completions are not
polled: a `CompletionListener` binds an exclusive queue of its own to `scorebox.events`
(`task.completed`, `task.failed`) in the scenario's vhost and timestamps each event as it
arrives, which gives end-to-end latency per task without adding read load to the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import aio_pika
import aiohttp
import orjson
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractRobustConnection,
)

from shared.event_batches import UnreadableBatch, is_batch, split_batch
from shared.http import parse_retry_after

EVENTS_EXCHANGE = "scorebox.events"
REQUEST_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
MAX_REFUSALS = 100  # 503s with Retry-After a burst's submission waits out before giving up
AMQP_TIMEOUT_S = 10.0
JSON_HEADERS = {"Content-Type": "application/json"}

_SENTENCES = (
    "Queues turn a slow synchronous call into a task the client can poll later.",
    "A bounded pool of model calls keeps the provider's rate limits honest.",
    "Idempotent consumers make redelivery harmless, which at-least-once requires.",
    "The projection answers polls without touching the model or the work queue.",
)


def essay(tag: str, index: int) -> str:
    """A distinct text per task (no result-cache hits), about 300 characters long."""
    body = " ".join(_SENTENCES[(index + k) % len(_SENTENCES)] for k in range(4))
    return f"Essay {tag}-{index}. {body}"


def submission_body(text: str) -> bytes:
    return orjson.dumps({"text": text, "use_cache": False})


# --------------------------------------------------------------------------- HTTP


def http_session(limit: int, api_key: str | None = None) -> aiohttp.ClientSession:
    """A client session with `limit` connections (0: unbounded), bounded timeouts, and the
    API key (`Authorization: Bearer`) when one is given."""
    return aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        json_serialize=lambda value: orjson.dumps(value).decode(),
    )


@dataclass
class Posted:
    """One `POST /v1/scores`: when it was due, sent and answered, and what came back."""

    index: int
    due_at: float
    sent_at: float = 0.0
    answered_at: float = 0.0
    status: int = 0  # 0: no HTTP answer (timeout, connection error)
    task_id: str | None = None
    error: str | None = None
    retry_after_s: float | None = None
    refusals: int = 0  # 503s with `Retry-After` answered before this one (burst only)

    @property
    def latency_s(self) -> float:
        """From when it was due (open loop: no coordinated omission) to the answer."""
        return self.answered_at - self.due_at


async def post_score(
    session: aiohttp.ClientSession, gateway_url: str, text: str, posted: Posted
) -> Posted:
    posted.sent_at = time.monotonic()
    try:
        async with session.post(
            f"{gateway_url}/v1/scores", data=submission_body(text), headers=JSON_HEADERS
        ) as response:
            payload = await response.read()
            posted.status = response.status
            posted.retry_after_s = parse_retry_after(
                response.headers.get("Retry-After"), now=datetime.now(UTC)
            )
            if response.status in (200, 202):
                posted.task_id = str(orjson.loads(payload)["task_id"])
            else:
                posted.error = payload[:300].decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
        posted.error = f"{type(error).__name__}: {error}"[:300]
    posted.answered_at = time.monotonic()
    return posted


async def post_until_admitted(
    session: aiohttp.ClientSession, gateway_url: str, text: str, index: int
) -> Posted:
    """`post_score`, again after `Retry-After` (plus up to as much again of jitter) while the
    answer is a 503 that gives one (the gateway sheds what it cannot take on: nothing was
    kept), as a well-behaved client does.
    Its latency runs from the first try."""
    posted = Posted(index, 0.0)
    while True:
        await post_score(session, gateway_url, text, posted)
        if posted.refusals == 0:
            posted.due_at = posted.sent_at
        if posted.status != 503 or posted.retry_after_s is None:
            return posted
        if posted.refusals >= MAX_REFUSALS:
            return posted
        posted.refusals += 1
        posted.error = None
        # Jittered, so refused clients do not all come back in the same instant.
        await asyncio.sleep(posted.retry_after_s * (1 + random.random()))  # noqa: S311


async def submit_burst(
    session: aiohttp.ClientSession,
    gateway_url: str,
    texts: Sequence[str],
    *,
    concurrency: int,
    on_accepted: Callable[[str], None],
) -> list[Posted]:
    """Submit every text as fast as `concurrency` requests in flight allow."""
    results: list[Posted] = []
    indices = iter(range(len(texts)))

    async def worker() -> None:
        for index in indices:
            posted = await post_until_admitted(session, gateway_url, texts[index], index)
            if posted.task_id is not None:
                on_accepted(posted.task_id)
            results.append(posted)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(texts)))))
    return sorted(results, key=lambda p: p.index)


async def submit_open_loop(
    session: aiohttp.ClientSession,
    gateway_url: str,
    *,
    rate: float,
    duration_s: float,
    tag: str,
    on_accepted: Callable[[str], None],
) -> list[Posted]:
    """Arrivals at a fixed `rate` for `duration_s`, whatever the answers take (open loop)."""
    total = int(rate * duration_s)
    started = time.monotonic() + 0.05
    pending: list[asyncio.Task[Posted]] = []

    async def one(index: int, due: float) -> Posted:
        posted = await post_score(session, gateway_url, essay(tag, index), Posted(index, due))
        if posted.task_id is not None:
            on_accepted(posted.task_id)
        return posted

    for index in range(total):
        due = started + index / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append(asyncio.create_task(one(index, due)))
    return list(await asyncio.gather(*pending))


async def read_latencies(
    session: aiohttp.ClientSession,
    gateway_url: str,
    task_ids: Sequence[str],
    *,
    concurrency: int,
) -> tuple[list[float], dict[str, int]]:
    """`GET /v1/scores/{id}` for each id, `concurrency` at a time: latencies and statuses."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    ids = iter(task_ids)

    async def worker() -> None:
        for task_id in ids:
            started = time.monotonic()
            try:
                async with session.get(f"{gateway_url}/v1/scores/{task_id}") as response:
                    body = await response.read()
                    key = str(response.status)
                    if response.status == 200:
                        key = f"200 {orjson.loads(body).get('status')}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                key = type(error).__name__
            latencies.append(time.monotonic() - started)
            statuses[key] = statuses.get(key, 0) + 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, statuses


# --------------------------------------------------------------------------- completions


@dataclass(frozen=True)
class Completion:
    at: float  # time.monotonic() when the event arrived here
    status: str  # "completed" | "failed"
    model_ms: float | None  # the scorer's model-call time (`result.latency_ms`)


@dataclass
class CompletionListener:
    """Timestamps `task.completed` / `task.failed` events of the tracked tasks.

    Events may arrive before the POST that created the task has answered, so every event is
    kept and matched when the task is tracked.
    """

    amqp_url: str
    seen: dict[str, Completion] = field(default_factory=dict)
    tracked: set[str] = field(default_factory=set)
    duplicates: int = 0
    _done: int = 0
    _target: int | None = None
    _reached: asyncio.Event = field(default_factory=asyncio.Event)
    _connection: AbstractRobustConnection | None = None
    _channel: AbstractChannel | None = None

    async def __aenter__(self) -> CompletionListener:
        self._connection = await aio_pika.connect_robust(self.amqp_url, timeout=AMQP_TIMEOUT_S)
        self._channel = await self._connection.channel()
        exchange = await self._channel.declare_exchange(
            EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True, timeout=AMQP_TIMEOUT_S
        )
        queue = await self._channel.declare_queue(
            exclusive=True, auto_delete=True, timeout=AMQP_TIMEOUT_S
        )
        for key in ("task.completed", "task.failed"):
            await queue.bind(exchange, routing_key=key, timeout=AMQP_TIMEOUT_S)
        await queue.consume(self._on_event, no_ack=True, timeout=AMQP_TIMEOUT_S)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(AMQP_TIMEOUT_S):
                    await self._connection.close()

    async def _on_event(self, message: AbstractIncomingMessage) -> None:
        arrived = time.monotonic()
        headers = dict(message.headers)
        if not is_batch(headers):
            self._on_one(message.body, message.routing_key, arrived)
            return
        # Completions that finished together, in one message (`shared.event_batches`).
        with contextlib.suppress(UnreadableBatch):
            for part in split_batch(message.body, headers):
                self._on_one(part.body, message.routing_key, arrived)

    def _on_one(self, body: bytes, routing_key: str | None, arrived: float) -> None:
        try:
            event: dict[str, Any] = orjson.loads(body)
            task_id = str(event["task_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        if task_id in self.seen:
            self.duplicates += 1
            return
        status = "completed" if routing_key == "task.completed" else "failed"
        result = event.get("result") or {}
        model_ms = result.get("latency_ms") if isinstance(result, dict) else None
        self.seen[task_id] = Completion(arrived, status, model_ms)
        if task_id in self.tracked:
            self._count_one()

    def track(self, task_id: str) -> None:
        if task_id in self.tracked:
            return
        self.tracked.add(task_id)
        if task_id in self.seen:
            self._count_one()

    def track_all(self, task_ids: Iterable[str]) -> None:
        for task_id in task_ids:
            self.track(task_id)

    def _count_one(self) -> None:
        self._done += 1
        if self._target is not None and self._done >= self._target:
            self._reached.set()

    @property
    def done(self) -> int:
        return self._done

    async def wait_for(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` tracked tasks have finished; False when `timeout_s` passed."""
        self._target = count
        if self._done >= count:
            return True
        self._reached.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._reached.wait()
        except TimeoutError:
            return False
        return True

    def finished(self, task_ids: Iterable[str]) -> dict[str, Completion]:
        return {t: c for t in task_ids if (c := self.seen.get(t)) is not None}


async def queue_counts(amqp_url: str, queue: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of `queue`, or None when it does not exist."""
    connection = await aio_pika.connect(amqp_url, timeout=AMQP_TIMEOUT_S)
    try:
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True, timeout=AMQP_TIMEOUT_S)
        except aio_pika.exceptions.ChannelClosed:
            return None
        result = declared.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)
    finally:
        async with asyncio.timeout(AMQP_TIMEOUT_S):
            await connection.close()


async def wait_for_queue(
    amqp_url: str,
    queue: str,
    *,
    ready: Callable[[tuple[int, int] | None], bool],
    timeout_s: float,
    interval_s: float = 0.25,
) -> tuple[int, int] | None:
    """Poll `queue_counts` until `ready` accepts it; raise TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        for _ in itertools.count():
            counts = await queue_counts(amqp_url, queue)
            if ready(counts):
                return counts
            await asyncio.sleep(interval_s)
    return None  # pragma: no cover - the loop only ends by returning or timing out
