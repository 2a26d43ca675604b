"""How a service's declaration of the topology goes: `python -m tests.faults.topology_starts`.

Prints the seconds it takes through a link that delivers every reply `--latency-ms` late
(a broker far away), first on an empty vhost and then again (a restart), each also as round
trips of that latency (the connection's opening left out); then declares it
`--starts` times straight on the broker, each on a connection of its own, and counts the
starts that failed. On a vhost of its own on `RABBITMQ_URL` (default 127.0.0.1:5672),
deleted afterwards."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid

from devtools.infra import create_vhost, delete_vhost
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import declare_topology
from tests.faults.slow_link import SlowLink

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"


async def _declared(url: str, took: list[float] | None = None) -> str | None:
    """Declare the topology on a broker of its own, connected first: None, or why it
    failed; the declaration's seconds appended to `took`."""
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": url}))
    await broker.connect()
    began = time.monotonic()
    try:
        await declare_topology(broker)
    except Exception as error:  # noqa: BLE001 - counted and named, not raised
        return f"{type(error).__name__}: {error}"
    finally:
        if took is not None:
            took.append(time.monotonic() - began)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(broker.stop(), 10)
    return None


async def _through_a_long_link(url: str, latency_s: float) -> None:
    link = SlowLink.to(url)
    link.latency_s = latency_s
    async with link.running():
        for start in ("first", "again"):
            timed: list[float] = []
            failed = await _declared(link.url_through(url), timed)
            [took] = timed
            print(
                f"{start}: {took:.2f} s at {latency_s * 1000:g} ms a reply, about "
                f"{took / latency_s:.0f} round trips" + (f"; failed: {failed}" if failed else "")
            )


async def _starts(url: str, count: int) -> None:
    failures = [failed for _ in range(count) if (failed := await _declared(url)) is not None]
    print(f"{count} starts, {len(failures)} failed" + (f": {failures[0]}" if failures else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--starts", type=int, default=30)
    args = parser.parse_args()
    broker_url = os.environ.get("RABBITMQ_URL", DEFAULT_URL)
    vhost = f"scorebox-topology-starts-{uuid.uuid4().hex[:8]}"
    url = create_vhost(broker_url, vhost)
    try:
        asyncio.run(_through_a_long_link(url, args.latency_ms / 1000))
        asyncio.run(_starts(url, args.starts))
    finally:
        delete_vhost(broker_url, vhost)


if __name__ == "__main__":
    main()
