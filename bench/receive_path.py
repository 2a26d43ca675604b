"""How much of PyMongo's client CPU per round trip is its way of awaiting a reply.

PyMongo's async driver (4.20) receives every reply through `async_receive_message`, which
starts two tasks (the read, and one polling the connection's cancellation flag) and
`asyncio.wait`s for the first to finish. This measures `update_one`, one caller at a time,
as shipped and with the read awaited directly under a timeout: what that pattern costs
per round trip. A measurement of the library, never a change to the services, which run
PyMongo as shipped. Where PyMongo's internals have moved, it says so and measures nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pymongo.asynchronous.pool
import pymongo.network_layer
from pymongo.asynchronous.collection import AsyncCollection

WRITES = 2_000
ROUNDS = 5

Document = dict[str, Any]
# PyMongo's internals, which its type hints do not export.
pool: Any = pymongo.asynchronous.pool
network_layer: Any = pymongo.network_layer


async def _read_directly(conn: Any, request_id: int | None, max_message_size: int) -> Any:
    async with asyncio.timeout(conn.conn.gettimeout):
        data, op_code = await conn.conn.get_conn.read(request_id, max_message_size)
    return network_layer._UNPACK_REPLY[op_code](data)


@contextlib.contextmanager
def _replies_read_directly() -> Iterator[None]:
    shipped = pool.async_receive_message
    pool.async_receive_message = _read_directly
    try:
        yield
    finally:
        pool.async_receive_message = shipped


async def _cpu_us_per_update(collection: AsyncCollection[Document]) -> float:
    started = time.process_time()
    for i in range(WRITES):
        await collection.update_one({"_id": "receive-path"}, {"$set": {"n": i}}, upsert=True)
    return (time.process_time() - started) / WRITES * 1e6


async def receive_path(collection: AsyncCollection[Document]) -> None:
    if not hasattr(pool, "async_receive_message") or not hasattr(network_layer, "_UNPACK_REPLY"):
        print("PyMongo's receive path: not measured (its internals have changed)")
        return
    await _cpu_us_per_update(collection)  # warm: connection made, code paths loaded
    shipped, direct = [], []
    for _ in range(ROUNDS):
        shipped.append(await _cpu_us_per_update(collection))
        with _replies_read_directly():
            direct.append(await _cpu_us_per_update(collection))
    as_shipped, read_directly = statistics.median(shipped), statistics.median(direct)
    print(
        f"client CPU per update_one, one at a time (median of {ROUNDS}): PyMongo as shipped "
        f"{as_shipped:.0f} µs, its reply read directly {read_directly:.0f} µs "
        f"({(as_shipped - read_directly) / as_shipped:.0%} of it is the two-task wait)"
    )
