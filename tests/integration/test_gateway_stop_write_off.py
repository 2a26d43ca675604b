"""A gateway that stops writes off the requests it refused since its last sweep pass: the
refusals are kept in memory only, and a graceful stop (a restart or a deploy, likely during
the database trouble that left them pending) forgot them like a crash. The record stayed
`accepting`, and any replica's outbox sweep then sent it: a request answered 503 was scored,
twice when its client sent it again without an `Idempotency-Key` (found in review)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import FastAPI

from devtools.infra import Endpoint
from services.gateway.app import build_gateway, gateway_lifespan
from services.gateway.keys import generate_key
from services.gateway.refusals import Refusal
from services.gateway.settings import GatewaySettings
from shared.contracts import ScoreText, new_id, utcnow
from tests.support import eventually, stack_env


async def test_a_gateway_stopping_writes_off_the_requests_it_refused(
    amqp_url: str, mongo: Endpoint, db_prefix: str
) -> None:
    settings = GatewaySettings.model_validate(
        stack_env(
            amqp_url=amqp_url,
            mongo_url=mongo.url,
            db_prefix=db_prefix,
            llm_url="http://127.0.0.1:9/v1",
            api_key=generate_key().token,
            OUTBOX_INTERVAL_S="3600",  # one sweep pass, at start: none writes it off
        )
    )
    gateway = build_gateway(settings)
    # Recent: no sweep would send it before its grace, whatever the timing.
    command = ScoreText(task_id=new_id(), text="Refused with a 503.", submitted_at=utcnow())
    started = Refusal(command.tenant_id, (new_id(),))
    gateway.deps.refusals.note(started)  # written off by the first pass

    async with gateway_lifespan(gateway)(FastAPI()):

        async def first_pass_wrote_off() -> bool:
            return not gateway.deps.refusals.pending()

        await eventually(first_pass_wrote_off, what="the first sweep pass's write-off")
        # What a request refused while the database was slow leaves: its record, and its
        # refusal noted for the next pass.
        await gateway.deps.submissions.insert(
            command,
            request_hash="h",
            idempotency_key=None,
            retention=timedelta(hours=1),
            cache_key="k",
        )
        gateway.deps.refusals.note(Refusal(command.tenant_id, (command.task_id,)))

    assert gateway.deps.refusals.pending() == []
    after = build_gateway(settings)
    try:
        assert (
            await after.deps.submissions.find(command.task_id, tenant_id=command.tenant_id) is None
        )
    finally:
        await after.close_clients()
