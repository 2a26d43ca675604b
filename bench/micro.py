"""`python -m bench.micro`: the small measurements `docs/architecture.md` ("Performance") cites.

1. Client CPU per write: 64 concurrent `update_one`s against the same writes through
   `shared.group_writes.GroupWriter`, and `update_one`s one at a time; and per point read:
   `find_one` by `_id` against `shared.group_reads.GroupReader`.
2. The MongoDB stand-in's cost per write as a collection grows (inserts and upserts of new
   string `_id`s, 4,000 documents at a time).
3. Consumer CPU per delivery through FastStream's subscriber, `shared.consumers` and bare
   aio-pika (`bench.delivery_cost`), on `RABBITMQ_URL` (default: the local broker, guest/guest).
4. Publisher CPU per confirmed message through FastStream against bare aio-pika
   (`bench.publish_cost`), on the same broker.
5. The scorer's text preparation (`prepare_text`, with `detect_instructions` in it) and the
   gateway's result-cache key (`cache_key`), on a benchmark essay and on ten as one text.
6. Client CPU per model call against the fake model: the scorer's adapter, its HTTP client
   alone, httpx's API over aiohttp's pool, httpx's own pool and bare aiohttp
   (`bench.model_call_cost`).
7. The stand-in's (or MongoDB's) cost per update on documents of three sizes.
8. How much of PyMongo's client CPU per round trip is its way of awaiting a reply
   (`bench.receive_path`).
9. The gateway's repeated-key check of a JSON body against orjson's reading of it, on a
   submission, batches and bodies of 16 MiB and 1,000 levels (`body_checks`).

Everything runs on uvloop, as the services do.

Against `MONGO_URL` when set, else a fresh stand-in (labelled). Prints the figures; no files.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import timeit
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import orjson
import uvloop
from pymongo import AsyncMongoClient, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection

from bench.delivery_cost import delivery_cost
from bench.infra import local_broker_pid
from bench.load import essay, submission_body
from bench.model_call_cost import model_call_cost
from bench.publish_cost import publish_cost
from bench.receive_path import receive_path
from bench.stats import cpu_us_each
from devtools.infra import read_first_line
from services.gateway.cache import cache_key
from services.scorer.model.preparation import prepare_text
from services.scorer.model.prompt import detect_instructions
from shared.bodies import _refuse_repeated_keys
from shared.group_reads import GroupReader
from shared.group_writes import GroupWriter
from shared.http import Problem

Document = dict[str, Any]
WRITES = 4_000
WRITES_ALONE = 1_000
CONCURRENCY = 64
GROWTH_BLOCKS = 5
DOCUMENT_TEXT_SIZES = (0, 300, 3_000)
SIZED_DOCUMENTS = 500
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


Op = Callable[[int], Awaitable[None]]


async def compare(what: str, direct: tuple[str, Op], grouped: tuple[str, Op]) -> None:
    """Client CPU per operation, `CONCURRENCY` callers at a time, one by one and grouped."""
    (direct_name, direct_op), (grouped_name, grouped_op) = direct, grouped
    one_by_one = await cpu_us_each(WRITES, CONCURRENCY, direct_op)
    in_groups = await cpu_us_each(WRITES, CONCURRENCY, grouped_op)
    print(
        f"client CPU per {what}, {CONCURRENCY} callers: {direct_name} {one_by_one:.0f} µs, "
        f"{grouped_name} {in_groups:.0f} µs ({one_by_one / in_groups:.1f}x less)"
    )


async def group_commit(collection: AsyncCollection[Document]) -> None:
    writer = GroupWriter(collection)

    async def direct(i: int) -> None:
        await collection.update_one({"_id": f"d{i}"}, {"$set": {"n": i}}, upsert=True)

    async def grouped(i: int) -> None:
        await writer.update_one({"_id": f"g{i}"}, {"$set": {"n": i}}, upsert=True)

    await compare("write", ("update_one", direct), ("GroupWriter", grouped))
    # What a write costs when nothing shares its round trip (a lightly loaded service).
    alone = await cpu_us_each(WRITES_ALONE, 1, direct)
    print(f"client CPU per write, one caller at a time: update_one {alone:.0f} µs")


async def group_reads(collection: AsyncCollection[Document]) -> None:
    reader = GroupReader(collection)

    async def direct(i: int) -> None:
        await collection.find_one({"_id": f"g{i}"})

    async def grouped(i: int) -> None:
        await reader.find_by_id(f"g{i}")

    await compare("point read", ("find_one", direct), ("GroupReader", grouped))


async def growth(collection: AsyncCollection[Document]) -> None:
    for block in range(GROWTH_BLOCKS):
        started = time.perf_counter()
        for i in range(WRITES // 2):
            await collection.insert_one({"_id": f"i{block}-{i}", "n": i})
        inserted = time.perf_counter()
        for i in range(WRITES // 2):
            await collection.update_one({"_id": f"u{block}-{i}"}, {"$set": {"n": i}}, upsert=True)
        upserted = time.perf_counter()
        per_insert = (inserted - started) / (WRITES // 2) * 1e6
        per_upsert = (upserted - inserted) / (WRITES // 2) * 1e6
        print(
            f"after {(block + 1) * WRITES:,} documents: insert {per_insert:.0f} µs, "
            f"upsert {per_upsert:.0f} µs (round trip, one at a time)"
        )


async def document_size(collection: AsyncCollection[Document]) -> None:
    """Server round trip per `$set` of one field, in bulks of 50, on documents holding a text
    of each size: whether a write's cost follows the size of the document it changes."""
    for size in DOCUMENT_TEXT_SIZES:
        await collection.drop()
        ids = [f"s{i}" for i in range(SIZED_DOCUMENTS)]
        text = "x" * size
        await collection.insert_many(
            [{"_id": i, "state": "accepting", "command": {"text": text}} for i in ids]
        )
        updates = [UpdateOne({"_id": i}, {"$set": {"state": "accepted"}}) for i in ids]
        started = time.perf_counter()
        for first in range(0, len(updates), 50):
            await collection.bulk_write(updates[first : first + 50], ordered=False)
        per_update = (time.perf_counter() - started) / len(updates) * 1e6
        print(f"documents holding {size:,} characters: {per_update:.0f} µs per $set (bulks of 50)")


async def measure(url: str) -> None:
    client: AsyncMongoClient[Document] = AsyncMongoClient(url, serverSelectionTimeoutMS=10_000)
    try:
        await group_commit(client["bench_micro"]["group_commit"])
        await group_reads(client["bench_micro"]["group_commit"])
        await growth(client["bench_micro"]["growth"])
        await document_size(client["bench_micro"]["sized"])
        await receive_path(client["bench_micro"]["receive_path"])
    finally:
        await client.drop_database("bench_micro")
        await client.close()


def text_preparation(texts: int = 500) -> None:
    """The CPU a text costs before its model call, on a benchmark essay and on ten of them as
    one text (the size of a school essay): the scorer's preparation, of which the cue
    search, and the gateway's result-cache key."""
    for paragraphs in (1, 10):
        essays = [
            "\n\n".join(essay("micro", index * paragraphs + part) for part in range(paragraphs))
            for index in range(texts)
        ]
        timings = []
        steps: tuple[Callable[[str], object], ...] = (
            detect_instructions,
            lambda text: prepare_text(text, max_chars=20_000),
            lambda text: cache_key(text, None, "bench"),
        )
        for step in steps:
            started = time.process_time()
            for text in essays:
                step(text)
            timings.append((time.process_time() - started) / texts * 1e6)
        print(
            f"CPU per essay of about {len(essays[0]):,} characters: detect_instructions "
            f"{timings[0]:.0f} µs, prepare_text {timings[1]:.0f} µs; the gateway's cache_key "
            f"{timings[2]:.0f} µs"
        )


def _bodies() -> list[tuple[str, bytes]]:
    deep = b'{"a":' * 1000 + b"{" + b",".join(b'"k%d":0' % i for i in range(100_000)) + b"}"
    items = [{"text": essay("micro", index), "use_cache": False} for index in range(50)]
    noted = [{"text": "Note: " + essay("micro", index)} for index in range(50)]
    empties = b",".join([b"{}"] * (16 * 1024 * 1024 // 3))
    return [
        ("a submission", submission_body(essay("micro", 0))),
        ("a batch of 50", orjson.dumps({"items": items})),
        ("a batch of 50, a colon in each text", orjson.dumps({"items": noted})),
        ("16 MiB of {} items", b'{"items":[' + empties + b"]}"),
        (
            "16 MiB of {} items, a key repeated at the end (refused)",
            b'{"items":[' + empties + b'],"z":{"d":1,"d":2}}',
        ),
        (
            "1 MiB, 1,000 levels deep, a key repeated after (refused)",
            deep + b"}" * 999 + b',"b":{"x":1,"x":2}}',
        ),
    ]


def body_checks(bodies: list[tuple[str, bytes]] | None = None) -> None:
    """The repeated-key check of every JSON body (`shared.bodies._refuse_repeated_keys`)
    against orjson's reading of the same body, best of three runs each."""
    for label, body in bodies or _bodies():
        payload = orjson.loads(body)
        number = 10_000 if len(body) < 100_000 else 1

        def check(body: bytes = body, payload: Any = payload) -> None:
            with contextlib.suppress(Problem):  # the refused bodies: the refusal is measured
                _refuse_repeated_keys(body, payload)

        def read(body: bytes = body) -> None:
            orjson.loads(body)

        reading = min(timeit.repeat(read, number=number, repeat=3))
        checking = min(timeit.repeat(check, number=number, repeat=3))
        print(
            f"{label} ({len(body):,} bytes): orjson reads it in {_us(reading / number)}, "
            f"the repeated-key check takes {_us(checking / number)}"
        )


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 0.01 else f"{seconds * 1e3:,.0f} ms"


@contextlib.contextmanager
def announced_url(module: str, *args: str) -> Iterator[str]:
    """Start one of our dev servers (`devtools.<module>`) and give the URL it announces."""
    command = [sys.executable, "-m", module, "--port", "0", *args, "--exit-with-parent"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE)  # noqa: S603 - our own module
    try:
        yield str(json.loads(read_first_line(server, timeout=30.0))["url"])
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> int:
    text_preparation()
    body_checks()
    with announced_url("devtools.fake_llm", "--latency-ms", "20", "--jitter-ms", "0") as model:
        print("Model: devtools.fake_llm, 20 ms per call")
        uvloop.run(model_call_cost(model))
    amqp_url = os.environ.get("RABBITMQ_URL", DEFAULT_AMQP_URL)
    print(f"Broker: {amqp_url.split('@')[-1]}")
    local = urlsplit(amqp_url).hostname in {"127.0.0.1", "localhost"}
    uvloop.run(delivery_cost(amqp_url, local_broker_pid() if local else None))
    uvloop.run(publish_cost(amqp_url))
    mongo_url = os.environ.get("MONGO_URL")
    if mongo_url:
        print(f"Database: MONGO_URL ({mongo_url.split('@')[-1]})")
        uvloop.run(measure(mongo_url))
        return 0
    with announced_url("devtools.mongo_standin") as standin:
        print("Database: mongoeco wire-protocol stand-in (NOT MongoDB)")
        uvloop.run(measure(standin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
