"""The notifier's internal HTTP API, called by the gateway on behalf of an authenticated
tenant (the gateway owns the tenant's authentication; these routes are not published, and
admit only the gateway's `INTERNAL_API_KEY` when that is set)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.notifier.errors import UnsafeDestination
from services.notifier.keyring import Keyring, TenantSecret
from services.notifier.registry import FailureAlerts
from services.notifier.ssrf import WebhookGuard
from shared.bodies import json_body, read_model, refuse_a_body
from shared.contracts import Instant
from shared.http import INTERNAL_PROBLEMS, Problem, internal_guard, problem_responses
from shared.webhook_urls import MAX_URL_LENGTH

NO_STORE = {"Cache-Control": "no-store"}
# The problem type of "this tenant has no failure alert": the gateway tells it by this from a
# 404 of anything else (a wrong NOTIFIER_URL, a proxy's prefix), which is no answer at all.
NO_FAILURE_ALERT = "no-failure-alert"
TenantId = Path(pattern=r"^[A-Za-z0-9_.:@-]{1,128}$")
ALERT_BODY_LIMIT = 16 * 1024  # a URL of at most MAX_URL_LENGTH characters, as JSON


class SigningSecret(BaseModel):
    """A tenant's webhook signing secret (Standard Webhooks `whsec_...`)."""

    secret: str
    created_at: Instant
    previous_valid_until: Instant | None = Field(
        default=None, description="Until when deliveries are also signed with the old secret."
    )


class AlertUrl(BaseModel):
    """A failure-alert URL. Unknown fields are refused, as by every body of the gateway: a
    client other than the gateway misspelling a field had it dropped without a word."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=MAX_URL_LENGTH)


def _answer(secret: TenantSecret) -> SigningSecret:
    return SigningSecret(
        secret=secret.secret,
        created_at=secret.created_at,
        previous_valid_until=secret.previous_valid_until,
    )


def tenant_routes(
    *,
    keyring: Keyring,
    alerts: FailureAlerts,
    guard: WebhookGuard,
    clock: Callable[[], datetime],
    rotation_grace: timedelta,
    internal_key: SecretStr | None,
) -> APIRouter:
    router = APIRouter(
        prefix="/internal/v1/tenants/{tenant_id}",
        tags=["webhooks"],
        dependencies=[internal_guard(internal_key)],
        responses=INTERNAL_PROBLEMS,
    )

    @router.get("/webhook-secret", response_model=SigningSecret)
    async def read_signing_secret(response: Response, tenant_id: str = TenantId) -> SigningSecret:
        response.headers.update(NO_STORE)
        return _answer(await keyring.current(tenant_id, now=clock()))

    @router.post("/webhook-secret/rotate", response_model=SigningSecret)
    async def rotate_signing_secret(
        request: Request, response: Response, tenant_id: str = TenantId
    ) -> SigningSecret:
        await refuse_a_body(request, outcome="nothing was changed")
        response.headers.update(NO_STORE)
        return _answer(await keyring.rotate(tenant_id, now=clock(), grace=rotation_grace))

    @router.get("/failure-alert", response_model=AlertUrl)
    async def read_failure_alert(tenant_id: str = TenantId) -> AlertUrl:
        url = await alerts.url_of(tenant_id)
        if url is None:
            raise Problem(404, "No failure-alert URL is registered.", kind=NO_FAILURE_ALERT)
        return AlertUrl(url=url)

    @router.put(
        "/failure-alert",
        response_model=AlertUrl,
        openapi_extra=json_body(AlertUrl),
        responses=problem_responses(400, 413, 415, 422),
    )
    async def register_failure_alert(request: Request, tenant_id: str = TenantId) -> AlertUrl:
        alert = await read_model(
            request, AlertUrl, what="failure-alert URL", limit=ALERT_BODY_LIMIT
        )
        try:
            guard.check(alert.url)
        except UnsafeDestination as error:
            errors = [{"field": "url", "message": error.reason}]
            raise Problem(
                422, f"url: {error.reason}", kind="invalid-fields", errors=errors
            ) from error
        await alerts.register(tenant_id, alert.url, now=clock())
        return alert

    @router.delete("/failure-alert", status_code=204)
    async def remove_failure_alert(request: Request, tenant_id: str = TenantId) -> Response:
        await refuse_a_body(request, outcome="nothing was removed")
        await alerts.remove(tenant_id)
        return Response(status_code=204)

    return router
