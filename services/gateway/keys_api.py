"""Admin routes for API keys (`/admin/v1/keys`), guarded by `ADMIN_API_KEY`.

POST   /admin/v1/keys             {"tenant_id", "name"} -> 201, the key (shown only here)
GET    /admin/v1/keys?tenant_id=  the keys, never a secret or a hash
DELETE /admin/v1/keys/{key_id}    revoke (other replicas see it within the key cache TTL)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictInt, field_validator

from services.gateway.errors import DatabaseUnavailable, refused_for_good
from services.gateway.keys import (
    BOOTSTRAP_KEY_NAME,
    KEY_ID,
    TENANT_ID_PATTERN,
    ApiKeys,
    KeyNotIssued,
)
from shared.bodies import json_body, read_model, refuse_a_body
from shared.contracts import to_millis
from shared.http import (
    ADMIN_PROBLEMS,
    Problem,
    admin_guard,
    database_refused,
    problem_responses,
    quoted,
)

MAX_LISTED = 10_000  # keys one listing shows
MAX_KEY_DAYS = 3650  # ten years, as every duration that ends up in a date
# An admin body is small (a replay's 10,000 ids fit in well under this).
ADMIN_BODY_LIMIT = 1024 * 1024


class KeyRequest(BaseModel):
    """`POST /admin/v1/keys`: a new key for a tenant."""

    model_config = ConfigDict(extra="forbid")

    tenant_id: str = Field(pattern=TENANT_ID_PATTERN, description="1-64 of A-Z a-z 0-9 _ -.")
    name: str = Field(
        default="",
        max_length=200,
        description=f"What the key is for; not `{BOOTSTRAP_KEY_NAME}`, which names the keys "
        "`BOOTSTRAP_API_KEY` registers (a new one revokes those before it).",
    )
    expires_in_days: StrictInt | None = Field(
        default=None,
        ge=1,
        le=MAX_KEY_DAYS,
        description="The key stops opening requests this many days after its creation "
        "(401, as a revoked key); without it, it lasts until revoked.",
    )

    @field_validator("name")
    @classmethod
    def _not_a_bootstrap_keys(cls, name: str) -> str:
        """A key of that name would be revoked by the next `BOOTSTRAP_API_KEY` (a review)."""
        if name.strip().casefold() == BOOTSTRAP_KEY_NAME:
            raise ValueError(
                f"{BOOTSTRAP_KEY_NAME!r} names the keys BOOTSTRAP_API_KEY registers: "
                "choose another name"
            )
        return name


def _unavailable(error: DatabaseUnavailable) -> Problem:
    if refused_for_good(error):
        return database_refused(error)
    return Problem(
        503,
        "The key store is unavailable; nothing was changed; retry shortly.",
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def _not_issued(error: KeyNotIssued) -> Problem:
    """The store did not answer a creation: its insert may have landed all the same. Its
    token was never shown, so the attempt's key was revoked; when that failed too, the answer
    names the key, which the listing may show active, for the admin to revoke."""
    if error.withdrawn:
        detail = (
            "The key store did not answer; no key was issued. The attempt's key "
            f"({error.key_id}) is revoked if it was stored at all (a listing may show it, "
            "revoked); retry shortly."
        )
    else:
        detail = (
            f"The key store did not answer; a key ({error.key_id}) may have been created, "
            "though nobody was shown it (no one can use it), and revoking it failed too. "
            f"Once the store is back, list the tenant's keys and revoke {error.key_id} "
            f"(DELETE /admin/v1/keys/{error.key_id}) if it shows; then retry."
        )
    return Problem(
        503,
        detail,
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
        key_id=error.key_id,
    )


def key_admin_routes(
    keys: ApiKeys,
    admin_key: SecretStr | None,
    *,
    clock: Callable[[], datetime],
    forget: Callable[[str], None],
    remember: Callable[[str], None],
) -> APIRouter:
    """`forget(key_id)` drops a revoked key from this replica's cache at once; `remember`
    notes a key created here as one that exists (`Authenticator.remember`)."""
    router = APIRouter(
        prefix="/admin/v1",
        tags=["admin"],
        dependencies=[admin_guard(admin_key)],
        responses={**ADMIN_PROBLEMS, **problem_responses(503)},
    )

    @router.post(
        "/keys",
        status_code=201,
        summary="Create an API key (shown only this once)",
        openapi_extra=json_body(KeyRequest),
        responses=problem_responses(400, 413, 415, 422),
    )
    async def create_key(request: Request) -> JSONResponse:
        wanted = await read_model(request, KeyRequest, what="key request", limit=ADMIN_BODY_LIMIT)
        try:
            now = to_millis(clock())  # as stored: the answer and later listings agree
            expires_at = (
                None
                if wanted.expires_in_days is None
                else now + timedelta(days=wanted.expires_in_days)
            )
            key, token = await keys.create(
                tenant_id=wanted.tenant_id, name=wanted.name, now=now, expires_at=expires_at
            )
        except KeyNotIssued as error:
            if refused_for_good(error.__cause__ or error):
                raise database_refused(error) from error
            raise _not_issued(error) from error
        except DatabaseUnavailable as error:
            raise _unavailable(error) from error
        remember(key.key_id)
        # The only answer that holds the key: no cache along the way keeps it.
        return JSONResponse(
            {**key.public(), "key": token}, status_code=201, headers={"Cache-Control": "no-store"}
        )

    @router.get(
        "/keys",
        summary="List API keys, of one tenant or all",
        description="Any query parameter but `tenant_id`, or `tenant_id` given twice, is "
        "refused (422): a misspelt filter would list every tenant's keys.",
    )
    async def list_keys(
        tenant_id: Annotated[str | None, Query(pattern=TENANT_ID_PATTERN)] = None,
    ) -> dict[str, Any]:
        try:
            found = await keys.find_all(tenant_id=tenant_id, limit=MAX_LISTED + 1)
        except DatabaseUnavailable as error:
            raise _unavailable(error) from error
        listed = found[:MAX_LISTED]
        return {
            "count": len(listed),
            # Oldest first: past the limit, the newest keys are not listed; ask per tenant.
            "truncated": len(found) > MAX_LISTED,
            "items": [key.public() for key in listed],
        }

    @router.delete("/keys/{key_id}", summary="Revoke an API key", responses=problem_responses(404))
    async def revoke_key(key_id: str, request: Request) -> dict[str, Any]:
        await refuse_a_body(request, outcome="nothing was revoked")
        if not KEY_ID.fullmatch(key_id):
            raise Problem(404, f"No API key {quoted(key_id)}.")
        try:
            key = await keys.revoke(key_id, now=clock())
        except DatabaseUnavailable as error:
            # The revocation may have landed: this replica asks the database at the key's
            # next use rather than trusting its cache for `API_KEY_CACHE_TTL_S` more.
            forget(key_id)
            if refused_for_good(error):
                raise database_refused(error) from error
            raise Problem(
                503,
                "The key store did not answer; the key may or may not be revoked: "
                "revoke it again shortly.",
                kind="unavailable",
                headers={"Retry-After": str(error.retry_after_s)},
            ) from error
        if key is None:
            raise Problem(404, f"No API key {quoted(key_id)}.")
        forget(key_id)
        return key.public()

    return router
