"""How long one tenant's healthy texts wait behind another tenant's batch of texts that each
fail on their own (docs/architecture.md, "Texts failing on their own").

Against a running stack whose model is the fake one, started as:

    python -m devtools.fake_llm --port 8090 --latency-ms 200 &
    LLM_PROVIDER=openai LLM_BASE_URL=http://127.0.0.1:8090/v1 LLM_API_KEY=x make run

then, with the variables `make run` prints exported (`SCOREBOX_URL`, `SCOREBOX_API_KEY`,
`SCOREBOX_ADMIN_KEY`):

    python -m devtools.poison_batch

The default tenant submits a batch of texts the fake model answers 500 every time
(`[[fake:500]]`); a second later a tenant of its own (a key made with the admin key)
submits healthy texts. Prints the seconds until each batch's first and last items were
finished (the failing ones dead-lettered), counted from its own submission; `--healthy 0`
submits the failing batch alone.

The other tenant has one text scored just before the failing batch, as a tenant already
using the system has: the scorer gives way to tenants it saw lately (`_gives_way` in
`services/scorer/throttle.py`). `--other-tenant-new` leaves that out: a tenant the scorer
has not seen waits behind the failing batch's deliveries.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from typing import Any

import httpx

FINISHED = frozenset({"completed", "failed", "expired"})
POLL_S = 1.0
TIMEOUT_S = 600.0


def finished(counts: dict[str, int]) -> int:
    return sum(count for status, count in counts.items() if status in FINISHED)


async def _batch(api: httpx.AsyncClient, key: str, texts: list[str]) -> str:
    answer = await api.post(
        "/v1/batches",
        json={"items": [{"text": text} for text in texts]},
        headers={"Authorization": f"Bearer {key}"},
    )
    answer.raise_for_status()
    batch_id: str = answer.json()["batch_id"]
    return batch_id


async def _counts(api: httpx.AsyncClient, key: str, batch_id: str) -> dict[str, int]:
    answer = await api.get(
        f"/v1/batches/{batch_id}", params={"limit": 1}, headers={"Authorization": f"Bearer {key}"}
    )
    answer.raise_for_status()
    counts: dict[str, int] = answer.json()["counts"]
    return counts


async def _finished_batch(api: httpx.AsyncClient, key: str, texts: list[str]) -> None:
    batch_id = await _batch(api, key, texts)
    await _finished_after(api, key, batch_id, len(texts), time.monotonic())


async def _finished_after(
    api: httpx.AsyncClient, key: str, batch_id: str, size: int, started: float
) -> dict[str, Any]:
    """Seconds from `started` until the batch's first and last items were finished."""
    first: float | None = None
    while (elapsed := time.monotonic() - started) < TIMEOUT_S:
        done = finished(await _counts(api, key, batch_id))
        if done and first is None:
            first = elapsed
        if done >= size:
            return {"first_done_s": round(first or elapsed, 1), "all_done_s": round(elapsed, 1)}
        await asyncio.sleep(POLL_S)  # polling a client's way, not synchronising a test
    return {"first_done_s": first, "all_done_s": None, "timed_out_s": TIMEOUT_S}


async def measure(
    api: httpx.AsyncClient,
    *,
    tenant_key: str,
    admin_key: str,
    failing: int,
    healthy: int,
    other_tenant_new: bool = False,
) -> dict[str, Any]:
    """Seconds until the other tenant's first and last healthy items were finished, counted
    from their batch's submission, and until the failing batch's were (dead-lettered),
    from its own; with `healthy` 0, the failing batch alone."""
    run = uuid.uuid4().hex[:8]
    other_key = await _other_tenants_key(api, admin_key, run) if healthy else None
    if other_key is not None and not other_tenant_new:
        await _finished_batch(api, other_key, [f"{run}: the other tenant's earlier text."])
    started = time.monotonic()
    failing_id = await _batch(
        api, tenant_key, [f"[[fake:500]] {run} failing text {i}." for i in range(failing)]
    )
    waits = [_finished_after(api, tenant_key, failing_id, failing, started)]
    if other_key is not None:
        await asyncio.sleep(1.0)  # the scenario's own gap, as a client would leave it
        texts = [f"{run}: healthy text {i}." for i in range(healthy)]
        healthy_started = time.monotonic()
        healthy_id = await _batch(api, other_key, texts)
        waits.append(_finished_after(api, other_key, healthy_id, healthy, healthy_started))
    failing_done, *healthy_done = await asyncio.gather(*waits)
    return {"failing": failing_done, **({"healthy": healthy_done[0]} if healthy_done else {})}


async def _other_tenants_key(api: httpx.AsyncClient, admin_key: str, run: str) -> str:
    made = await api.post(
        "/admin/v1/keys",
        json={"tenant_id": f"other-{run}"},
        headers={"Authorization": f"Bearer {admin_key}"},
    )
    made.raise_for_status()
    key: str = made.json()["key"]
    return key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failing", type=int, default=60, help="texts failing on their own")
    parser.add_argument(
        "--healthy", type=int, default=100, help="the other tenant's texts (0: none, no tenant)"
    )
    parser.add_argument(
        "--other-tenant-new",
        action="store_true",
        help="no text of the other tenant scored before the failing batch",
    )
    args = parser.parse_args(argv)
    url = os.environ.get("SCOREBOX_URL", "http://127.0.0.1:8000")

    async def run() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as api:
            return await measure(
                api,
                tenant_key=os.environ["SCOREBOX_API_KEY"],
                admin_key=os.environ["SCOREBOX_ADMIN_KEY"],
                failing=args.failing,
                healthy=args.healthy,
                other_tenant_new=args.other_tenant_new,
            )

    print(asyncio.run(run()))


if __name__ == "__main__":
    main()
