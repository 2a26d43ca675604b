"""Per-tenant signing secrets, created on first use, rotated on request.

One document per tenant in the notifier's database: the current secret and, for a grace
period after a rotation, the previous one (deliveries are signed with both meanwhile, so a
receiver can switch without dropping webhooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pymongo import AsyncMongoClient, ReturnDocument
from pymongo.errors import DuplicateKeyError

from services.notifier.signing import new_secret
from shared.contracts import to_millis

Document = dict[str, Any]


@dataclass(frozen=True)
class TenantSecret:
    """A tenant's current signing secret (kept out of reprs and logs)."""

    secret: str = field(repr=False)
    created_at: datetime
    previous_valid_until: datetime | None = None


def _secret_of(document: Document) -> TenantSecret:
    return TenantSecret(
        secret=document["current"],
        created_at=document["created_at"],
        previous_valid_until=document.get("previous_valid_until"),
    )


class Keyring:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._secrets = client[database]["signing_secrets"]

    async def current(self, tenant_id: str, *, now: datetime) -> TenantSecret:
        """The tenant's secret, generated and stored on first use."""
        return _secret_of(await self._document(tenant_id, now=now))

    async def rotate(self, tenant_id: str, *, now: datetime, grace: timedelta) -> TenantSecret:
        """Replace the secret; the old one still signs (alongside) until `now + grace`."""
        before = await self._document(tenant_id, now=now)
        document = await self._secrets.find_one_and_update(
            {"_id": tenant_id, "current": before["current"]},
            {
                "$set": {
                    "current": new_secret(),
                    "created_at": now,
                    "previous": before["current"],
                    "previous_valid_until": now + grace,
                }
            },
            return_document=ReturnDocument.AFTER,
        )
        # None: a concurrent rotation won; its secret is the tenant's now.
        return _secret_of(document or await self._document(tenant_id, now=now))

    async def in_force(self, tenant_id: str, *, now: datetime) -> list[str]:
        """The secrets a delivery is signed with now: the current one, and a recent previous."""
        document = await self._document(tenant_id, now=now)
        previous, until = document.get("previous"), document.get("previous_valid_until")
        if previous and until is not None and until > now:
            return [document["current"], previous]
        return [document["current"]]

    async def _document(self, tenant_id: str, *, now: datetime) -> Document:
        document = await self._secrets.find_one({"_id": tenant_id})
        if document is not None:
            return document
        # At the database's precision: answered as stored, as every later read answers it.
        fresh = {"_id": tenant_id, "current": new_secret(), "created_at": to_millis(now)}
        try:
            await self._secrets.insert_one(fresh)
        except DuplicateKeyError:  # another request created it first: theirs stands
            document = await self._secrets.find_one({"_id": tenant_id})
            assert document is not None
            return document
        return fresh
