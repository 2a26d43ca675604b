"""Webhook settings of a tenant (`/v1/webhooks/...`), kept by the notifier.

The gateway authenticates the caller and forwards to the notifier's internal API for the
caller's tenant; it never reads the notifier's database.

- `GET  /v1/webhooks/secret`          the signing secret (created on first use)
- `POST /v1/webhooks/secret/rotate`   a new secret; the old one still signs for a grace period
- `GET|PUT|DELETE /v1/webhooks/failure-alert`   the URL that receives every `task.failed`
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.gateway.auth import Caller
from services.gateway.errors import Unavailable, refused_for_good
from services.gateway.settings import GatewaySettings
from shared.bodies import json_body, read_model, refuse_a_body
from shared.contracts import Instant
from shared.head_requests import asked_head_only
from shared.http import (
    PROBLEM_BASE,
    Problem,
    database_refused,
    database_refused_answer,
    log_if_internal_key_refused,
    problem_in,
    problem_responses,
    unreadable,
)
from shared.log_rate import FailedCalls
from shared.webhook_urls import MAX_URL_LENGTH, validate_webhook_url

log = logging.getLogger("scorebox.gateway")

NO_STORE = {"Cache-Control": "no-store"}
ALERT_BODY_LIMIT = 16 * 1024  # a URL of at most MAX_URL_LENGTH characters, as JSON
# The notifier's answer when a tenant has no failure alert: a 404 problem of this type
# (`NO_FAILURE_ALERT` in services/notifier/api.py). A notifier of an earlier build answers
# the generic type with this detail. Any other 404 (a wrong NOTIFIER_URL, a proxy's path
# prefix, another service) says nothing about the tenant's setting.
NO_FAILURE_ALERT_TYPE = PROBLEM_BASE + "no-failure-alert"
_EARLIER_NO_FAILURE_ALERT = (PROBLEM_BASE + "not-found", "No failure-alert URL is registered.")


class NotifierUnavailable(Unavailable):
    """The notifier did not answer (or answered something unexpected). `maybe_applied`: the
    request reached it (no answer in time, or an error answer), so a change may be made."""

    what = "The notifier"

    def __init__(self, message: str, *, maybe_applied: bool) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


class NotifierRefused(NotifierUnavailable):
    """The notifier answered that its database refuses the operation for good (its 500
    `database-refused`): nothing was changed, and retrying meets the same refusal."""

    for_good = True

    def __init__(self, message: str) -> None:
        super().__init__(message, maybe_applied=False)


class SigningSecret(BaseModel):
    """The secret that signs your webhooks (Standard Webhooks: `whsec_` + base64)."""

    secret: str = Field(examples=["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
    created_at: Instant
    previous_valid_until: Instant | None = Field(
        default=None,
        description="After a rotation, webhooks are signed with the old secret as well "
        "(a second `v1,` signature) until then.",
    )


class FailureAlert(BaseModel):
    """An https URL that receives every `task.failed` of your tenant as a signed webhook."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=MAX_URL_LENGTH, examples=["https://example.com/hooks/failures"])

    @field_validator("url")
    @classmethod
    def _url_safe(cls, url: str) -> str:
        return validate_webhook_url(url)


def _says_no_failure_alert(response: httpx.Response) -> bool:
    """Whether a 404 is the notifier's own "no failure alert" problem+json."""
    problem = problem_in(response) if response.status_code == 404 else None
    if problem is None:
        return False
    kind = problem.get("type")
    return kind == NO_FAILURE_ALERT_TYPE or (kind, problem.get("detail")) == (
        _EARLIER_NO_FAILURE_ALERT
    )


def make_notifier_http(settings: GatewaySettings) -> httpx.AsyncClient:
    # The notifier is ours, inside: never reached through an egress proxy of the environment.
    return httpx.AsyncClient(timeout=httpx.Timeout(settings.notifier_timeout_s), trust_env=False)


class NotifierClient:
    """The notifier's internal tenant API, over HTTP."""

    def __init__(self, http: httpx.AsyncClient, *, base_url: str) -> None:
        self._http = http
        self._base_url = base_url.rstrip("/")
        self._failed = FailedCalls("notifier", log)

    @contextlib.contextmanager
    def _unreadable_is_unavailable(self) -> Iterator[None]:
        """An answer of the notifier this gateway cannot read (a proxy's page, a changed
        schema in a rolling upgrade) is a 503 saying a change may have been made, as a lost
        answer is: it was a 500, and a client retrying a rotation after it retired the
        secret its receivers had just been given. Noted for the log, in words that quote
        none of it (its body may hold the signing secret)."""
        try:
            yield
        except (ValidationError, ValueError, KeyError, TypeError) as error:
            unavailable = NotifierUnavailable(
                f"unreadable answer from the notifier: {unreadable(error)}", maybe_applied=True
            )
            self._failed.note(unavailable)
            raise unavailable from error

    async def signing_secret(self, tenant_id: str) -> SigningSecret:
        response = await self._call("GET", tenant_id, "webhook-secret")
        with self._unreadable_is_unavailable():
            return SigningSecret.model_validate_json(response.content)

    async def rotate_signing_secret(self, tenant_id: str) -> SigningSecret:
        response = await self._call("POST", tenant_id, "webhook-secret/rotate")
        with self._unreadable_is_unavailable():
            return SigningSecret.model_validate_json(response.content)

    async def failure_alert(self, tenant_id: str) -> FailureAlert | None:
        response = await self._call("GET", tenant_id, "failure-alert", none_ok=True)
        if response.status_code == 404:
            return None
        # As registered: a URL checked again here would fail a read once a rule is tightened.
        with self._unreadable_is_unavailable():
            return FailureAlert.model_construct(url=str(response.json()["url"]))

    async def register_failure_alert(self, tenant_id: str, alert: FailureAlert) -> None:
        await self._call("PUT", tenant_id, "failure-alert", json=alert.model_dump())

    async def remove_failure_alert(self, tenant_id: str) -> None:
        await self._call("DELETE", tenant_id, "failure-alert")

    async def _call(
        self,
        method: str,
        tenant_id: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        none_ok: bool = False,
    ) -> httpx.Response:
        """The notifier's answer, a success or (`none_ok`) its 404 "no failure alert"; any
        other answer, or none, raises `NotifierUnavailable`, noted for the log."""
        try:
            return await self._answered(method, tenant_id, path, json=json, none_ok=none_ok)
        except NotifierUnavailable as error:
            self._failed.note(error)
            raise

    async def _answered(
        self,
        method: str,
        tenant_id: str,
        path: str,
        *,
        json: dict[str, Any] | None,
        none_ok: bool,
    ) -> httpx.Response:
        url = f"{self._base_url}/internal/v1/tenants/{quote(tenant_id, safe='')}/{path}"
        try:
            # The client's timeout bounds each wait (a connect, a read); this the exchange
            # as a whole: an answer sent a few bytes at a time held the request for as long
            # as it went on.
            async with asyncio.timeout(self._http.timeout.read):
                response = await self._http.request(method, url, json=json)
        except TimeoutError as error:
            raise NotifierUnavailable(
                "notifier did not answer in time", maybe_applied=True
            ) from error
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise NotifierUnavailable(
                f"notifier unreachable: {error!r}", maybe_applied=False
            ) from error
        except httpx.HTTPError as error:
            raise NotifierUnavailable(
                f"notifier did not answer: {error!r}", maybe_applied=True
            ) from error
        if response.is_success or (none_ok and _says_no_failure_alert(response)):
            return response
        if database_refused_answer(response):
            raise NotifierRefused("the notifier's database refused the operation for good")
        log_if_internal_key_refused(response.status_code, "notifier")
        raise NotifierUnavailable(
            f"notifier answered {response.status_code}", maybe_applied=response.status_code >= 500
        )


def _unavailable(error: NotifierUnavailable, *, changes: bool = False) -> Problem:
    """503. For a change the notifier may have made (it got the request, no answer came
    back): say so, with a type of its own, since trying again blindly is not safe for every
    change (a second rotation retires the secret your receivers hold). The notifier's
    database refusing it for good is its 500 instead: a 503 had clients retry for ever, and
    a change be said maybe made (a review)."""
    if refused_for_good(error):
        return database_refused(error)
    headers = {"Retry-After": str(error.retry_after_s)}
    if changes and error.maybe_applied:
        return Problem(
            503,
            "The webhook settings did not confirm the change; it may have been made. Read the "
            "current settings before trying again.",
            kind="change-unconfirmed",
            headers=headers,
        )
    detail = "The webhook settings are unavailable right now; "
    detail += "nothing was changed. Retry shortly." if changes else "retry shortly."
    return Problem(503, detail, kind="unavailable", headers=headers)


async def _read_alert(request: Request, *, limit: int) -> FailureAlert:
    """The body checks of every JSON body of the API (415, 413, 400, 422 unknown fields)."""
    return await read_model(request, FailureAlert, what="failure alert", limit=limit)


def webhook_routes(notifier: NotifierClient, authenticated: Any) -> APIRouter:
    """The tenant's webhook routes; `authenticated` is the dependency that yields a `Caller`."""
    router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

    @router.get(
        "/secret",
        response_model=SigningSecret,
        summary="The secret your webhooks are signed with",
        responses=problem_responses(401, 429, 503),
    )
    async def read_signing_secret(
        request: Request, response: Response, caller: Caller = authenticated
    ) -> SigningSecret | Response:
        response.headers.update(NO_STORE)
        if asked_head_only(request):
            # A HEAD changes nothing: the GET creates the secret at its first read (found
            # in a walkthrough: a HEAD created it).
            return Response(status_code=200, headers=NO_STORE, media_type="application/json")
        try:
            return await notifier.signing_secret(caller.tenant_id)
        except NotifierUnavailable as error:
            raise _unavailable(error) from error

    @router.post(
        "/secret/rotate",
        response_model=SigningSecret,
        summary="Replace the signing secret (the old one keeps signing for a grace period)",
        responses=problem_responses(401, 429, 503),
    )
    async def rotate_signing_secret(
        request: Request, response: Response, caller: Caller = authenticated
    ) -> SigningSecret:
        await refuse_a_body(request, outcome="nothing was changed")
        response.headers.update(NO_STORE)
        try:
            return await notifier.rotate_signing_secret(caller.tenant_id)
        except NotifierUnavailable as error:
            raise _unavailable(error, changes=True) from error

    @router.get(
        "/failure-alert",
        response_model=FailureAlert,
        summary="The URL that receives every failed task",
        responses=problem_responses(401, 404, 429, 503),
    )
    async def read_failure_alert(caller: Caller = authenticated) -> FailureAlert:
        try:
            alert = await notifier.failure_alert(caller.tenant_id)
        except NotifierUnavailable as error:
            raise _unavailable(error) from error
        if alert is None:
            raise Problem(404, "No failure-alert URL is registered.")
        return alert

    @router.put(
        "/failure-alert",
        response_model=FailureAlert,
        summary="Send every failed task (`task.failed`) to this URL",
        openapi_extra=json_body(FailureAlert),
        responses=problem_responses(400, 401, 413, 415, 422, 429, 503),
    )
    async def register_failure_alert(
        request: Request, caller: Caller = authenticated
    ) -> FailureAlert:
        alert = await _read_alert(request, limit=ALERT_BODY_LIMIT)
        try:
            await notifier.register_failure_alert(caller.tenant_id, alert)
        except NotifierUnavailable as error:
            raise _unavailable(error, changes=True) from error
        return alert

    @router.delete(
        "/failure-alert",
        status_code=204,
        summary="Stop sending failure alerts",
        responses=problem_responses(401, 429, 503),
    )
    async def remove_failure_alert(request: Request, caller: Caller = authenticated) -> Response:
        await refuse_a_body(request, outcome="nothing was removed")
        try:
            await notifier.remove_failure_alert(caller.tenant_id)
        except NotifierUnavailable as error:
            raise _unavailable(error, changes=True) from error
        return Response(status_code=204)

    return router
