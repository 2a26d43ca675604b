"""`python -m devtools.declare_topology`: declare Scorebox's topology on `RABBITMQ_URL` and
exit (0 when declared). Run by `devtools.stack` before it starts the services
(`declare_topology_first`), in a process of its own so that a broker that never answers
costs a bounded wait and a kill, and aio-pika's reconnection noise stays out of the stack's
output."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from faststream.rabbit import RabbitBroker

from shared.topology import declare_topology

STOP_TIMEOUT_S = 5.0


async def declare(rabbitmq_url: str, *, timeout_s: float) -> None:
    # The connect timeout makes a silent broker's attempt fail; without one aio-pika's
    # robust connection retried in the background past any deadline (a review).
    broker = RabbitBroker(rabbitmq_url, timeout=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            await broker.connect()
            await declare_topology(broker)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(broker.stop(), STOP_TIMEOUT_S)


def main() -> int:
    timeout_s = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    try:
        asyncio.run(declare(os.environ["RABBITMQ_URL"], timeout_s=timeout_s))
    except Exception as error:  # noqa: BLE001 - the one line the caller shows
        print(f"{type(error).__name__}: {error}"[:300], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
