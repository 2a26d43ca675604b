"""aiormq drops a `Close-Ok` on a busy connection: `python -m tests.faults.close_ok_dropped`.

The reason `declare_topology` makes the declarations the broker may refuse on a connection
of their own (docs/architecture.md, "What the broker may refuse is probed on a connection
of its own"). On one connection, `--busy` channels declare a queue in a loop while one
channel after another passively declares an absent queue (the broker closes each). aiormq
(7.2.4) queues the `Close-Ok` it owes with `put_nowait` on a write queue of 10 frames and
drops it when the queue is full, freeing the channel's number all the same; the next channel
opened under that number closes the connection ("second 'channel.open' seen"). Prints the
probe at which the connection closed, or that `--probes` went through (an aiormq that waits
for room). On a vhost of its own on `RABBITMQ_URL` (default 127.0.0.1:5672), deleted after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import uuid

import aiormq

from devtools.infra import create_vhost, delete_vhost

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
TIMEOUT_S = 10.0


async def _busy(connection: aiormq.abc.AbstractConnection, n: int, stop: asyncio.Event) -> None:
    channel = await connection.channel(publisher_confirms=False)
    while not stop.is_set():
        await channel.queue_declare(f"close-ok-busy-{n}", auto_delete=True, timeout=TIMEOUT_S)


async def _probed(url: str, *, busy: int, probes: int) -> str:
    async with asyncio.timeout(TIMEOUT_S):
        connection = await aiormq.connect(url)
    stop = asyncio.Event()
    loops = [asyncio.create_task(_busy(connection, n, stop)) for n in range(busy)]
    made = 0
    try:
        while made < probes:
            made += 1
            channel = await connection.channel(timeout=TIMEOUT_S)
            with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
                await channel.queue_declare("close-ok-absent", passive=True, timeout=TIMEOUT_S)
    except aiormq.exceptions.AMQPError as error:
        return f"the connection closed at probe {made} of {probes}: {error!r}"
    finally:
        stop.set()
        await asyncio.gather(*loops, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(connection.close(), TIMEOUT_S)
    return f"{probes} probes beside {busy} busy channels, the connection still open"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=14)
    parser.add_argument("--probes", type=int, default=300)
    args = parser.parse_args()
    broker_url = os.environ.get("RABBITMQ_URL", DEFAULT_URL)
    vhost = f"scorebox-close-ok-{uuid.uuid4().hex[:8]}"
    url = create_vhost(broker_url, vhost)
    try:
        print(asyncio.run(_probed(url, busy=args.busy, probes=args.probes)))
    finally:
        delete_vhost(broker_url, vhost)


if __name__ == "__main__":
    main()
