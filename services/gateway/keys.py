"""API keys: issued once, stored only as hashes, looked up by their id.

A key reads `sbx_<key_id>_<secret>`: `key_id` is 16 hex characters (8 random bytes) and names
the key in listings, logs and usage records; `secret` is 43 URL-safe characters (32 random
bytes). The gateway keeps `sha256(secret)` with the key's tenant, name and dates, and shows the
whole key exactly once, when it is created. Keys of any other shape are refused, which is what
makes a plain SHA-256 enough (see `hash_secret`).

`python -m services.gateway.keys new` prints a fresh, well-formed key without touching any
database (for a development key, as `make run` needs one); a gateway started with it as
`BOOTSTRAP_API_KEY` registers it for the default tenant, idempotently (`bootstrap_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo import ASCENDING, DESCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError, PyMongoError

from services.gateway.errors import DatabaseUnavailable
from services.gateway.refusals import may_have_been_written
from shared.contracts import rfc3339

log = logging.getLogger("scorebox.gateway.keys")

Document = dict[str, Any]

KEY_PREFIX = "sbx"
KEY_ID_BYTES = 8
SECRET_BYTES = 32
KEY_ID = re.compile(r"^[0-9a-f]{16}$")
TENANT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KEY = re.compile(r"^sbx_(?P<key_id>[0-9a-f]{16})_(?P<secret>[A-Za-z0-9_-]{43})$")
TENANT_ID_PATTERN = TENANT_ID.pattern


@dataclass(frozen=True)
class IssuedKey:
    """A key in clear: only ever in memory, on its way to the client who asked for it."""

    key_id: str
    secret: str

    @property
    def token(self) -> str:
        """What the client sends as `Authorization: Bearer <token>`."""
        return f"{KEY_PREFIX}_{self.key_id}_{self.secret}"

    def __repr__(self) -> str:  # keep the secret out of logs and tracebacks
        return f"IssuedKey(key_id={self.key_id!r}, secret='***')"


def generate_key() -> IssuedKey:
    return IssuedKey(
        key_id=secrets.token_hex(KEY_ID_BYTES), secret=secrets.token_urlsafe(SECRET_BYTES)
    )


def parse_key(token: str) -> IssuedKey | None:
    """The key in `token`, or None when it is not shaped like one of ours."""
    match = _KEY.fullmatch(token)
    if match is None:
        return None
    return IssuedKey(key_id=match["key_id"], secret=match["secret"])


def hash_secret(secret: str) -> str:
    """SHA-256 of a key's secret, hex.

    No slow, salted password hash (bcrypt, scrypt, argon2) is needed: those protect secrets a
    person chose, which are few enough to guess. A key secret is 256 random bits, so even with
    the stored hash in hand, finding a matching secret means searching 2**256 candidates; a
    fast hash keeps every request's check cheap without making that any easier.
    """
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


@dataclass(frozen=True)
class ApiKey:
    """A stored key: everything but the secret, which is only ever known as its hash."""

    key_id: str
    tenant_id: str
    name: str
    secret_sha256: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    expires_at: datetime | None = None  # None: until revoked

    @property
    def active(self) -> bool:
        """Not revoked (an expired key is not revoked: `admits_at` says whether it opens)."""
        return self.revoked_at is None

    def admits_at(self, now: datetime) -> bool:
        """Whether the key opens requests at `now`: not revoked, not expired."""
        return self.active and (self.expires_at is None or now < self.expires_at)

    def public(self) -> dict[str, Any]:
        """What listings show: never the secret, never its hash."""
        return {
            "key_id": self.key_id,
            "tenant_id": self.tenant_id,
            "name": self.name,
            "created_at": rfc3339(self.created_at),
            "revoked_at": rfc3339(self.revoked_at) if self.revoked_at else None,
            "last_used_at": rfc3339(self.last_used_at) if self.last_used_at else None,
            "expires_at": rfc3339(self.expires_at) if self.expires_at else None,
        }


class KeyConflict(Exception):
    """A key with this id exists already, for another secret or another tenant."""


class KeyNotIssued(DatabaseUnavailable):
    """Creating a key failed with the database's answer lost, so its insert may have landed.

    Nobody was shown the key's token, so a stored copy could never be used: `create` revokes
    the attempt's key id (`withdrawn`), which also blocks an insert landing later. When that
    failed too, a key nobody can use may be stored, active, under `key_id`.
    """

    def __init__(self, reason: str, *, key_id: str, withdrawn: bool) -> None:
        super().__init__(reason)
        self.key_id = key_id
        self.withdrawn = withdrawn


class ApiKeys:
    """Repository of API keys (`api_keys` in the gateway's database).

    Every database failure surfaces as `DatabaseUnavailable`. Callers validate ids before they
    reach a query (`KEY_ID`, `TENANT_ID`); the repository never builds a query from anything
    else.
    """

    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["api_keys"]

    async def ensure_indexes(self) -> None:
        await self._collection.create_index(
            [("tenant_id", ASCENDING), ("created_at", ASCENDING)], name="keys_per_tenant"
        )

    async def create(
        self, *, tenant_id: str, name: str, now: datetime, expires_at: datetime | None = None
    ) -> tuple[ApiKey, str]:
        """A new key for `tenant_id`: (the stored key, the token to show once).

        Raises `KeyNotIssued` when the database failed (an insert that timed out may have
        landed all the same), after revoking whatever the attempt may have stored;
        `DatabaseUnavailable` when the insert was never sent (no server selected): the answer
        then told the admin a key might exist, and to revoke it."""
        issued = generate_key()
        key = _new_key(issued, tenant_id=tenant_id, name=name, now=now, expires_at=expires_at)
        try:
            await self._insert(key)
        except DatabaseUnavailable as error:
            if not may_have_been_written(error):
                raise  # never sent: nothing stored, nothing to revoke
            withdrawn = await self._withdraw(key, now=now)
            raise KeyNotIssued(str(error), key_id=key.key_id, withdrawn=withdrawn) from error
        return key, issued.token

    async def register(
        self, issued: IssuedKey, *, tenant_id: str, name: str, now: datetime
    ) -> ApiKey:
        """Store a key made elsewhere; registering the same key again changes nothing."""
        key = _new_key(issued, tenant_id=tenant_id, name=name, now=now)
        try:
            await self._insert(key)
        except KeyConflict:
            existing = await self.find(issued.key_id)
            if (
                existing is None
                or existing.tenant_id != tenant_id
                or not secret_matches(issued.secret, existing.secret_sha256)
            ):
                raise
            return existing
        return key

    async def find(self, key_id: str) -> ApiKey | None:
        try:
            document = await self._collection.find_one({"_id": key_id})
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return None if document is None else _key_of(document)

    async def find_all(self, *, tenant_id: str | None = None, limit: int = 10_000) -> list[ApiKey]:
        query: Document = {} if tenant_id is None else {"tenant_id": tenant_id}
        try:
            cursor = self._collection.find(query).sort("created_at", ASCENDING).limit(limit)
            return [_key_of(document) async for document in cursor]
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def active_ids(self, *, limit: int) -> list[str]:
        """The ids of the newest `limit` keys not revoked, newest first."""
        try:
            cursor = (
                self._collection.find({"revoked_at": None}, projection={"_id": True})
                .sort("created_at", DESCENDING)
                .limit(limit)
            )
            return [str(document["_id"]) async for document in cursor]
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def revoke(self, key_id: str, *, now: datetime) -> ApiKey | None:
        """Revoke a key (revoking it again keeps the first date); None when unknown."""
        try:
            await self._collection.update_one(
                {"_id": key_id, "revoked_at": None}, {"$set": {"revoked_at": now}}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return await self.find(key_id)

    async def revoke_named_before(
        self, *, tenant_id: str, name: str, created_before: datetime, now: datetime
    ) -> list[str]:
        """Revoke the active keys of `tenant_id` named `name` created before
        `created_before`; their ids (those this call revoked, or another replica's at the
        same moment)."""
        earlier: Document = {
            "tenant_id": tenant_id,
            "name": name,
            "revoked_at": None,
            "created_at": {"$lt": created_before},
        }
        try:
            found = self._collection.find(earlier, projection={"_id": True})
            ids = [str(document["_id"]) async for document in found]
            if ids:
                await self._collection.update_many(
                    {"_id": {"$in": ids}, "revoked_at": None}, {"$set": {"revoked_at": now}}
                )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return ids

    async def touch(self, key_id: str, *, now: datetime) -> None:
        """Record that the key was used (as often as the key cache reloads it)."""
        try:
            await self._collection.update_one({"_id": key_id}, {"$set": {"last_used_at": now}})
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def _withdraw(self, key: ApiKey, *, now: datetime) -> bool:
        """Revoke a key whose creation failed, stored or not; False when that failed too.

        An upsert: it revokes the key if its insert landed, and otherwise stores it revoked,
        so that an insert still on its way fails on the key's id instead of landing active
        (a delete would run before such an insert and leave it be)."""
        revoked = {"$set": {"revoked_at": now}}
        the_rest = _document_of(key)  # `_id` from the filter, `revoked_at` from `$set`
        del the_rest["_id"], the_rest["revoked_at"]
        try:
            try:
                await self._collection.update_one(
                    {"_id": key.key_id}, {**revoked, "$setOnInsert": the_rest}, upsert=True
                )
            except DuplicateKeyError:  # the insert landed between the upsert's two steps
                await self._collection.update_one({"_id": key.key_id}, revoked)
        except PyMongoError as error:
            log.warning(
                "key %s may be stored, unrevoked (nobody has its token): %r", key.key_id, error
            )
            return False
        return True

    async def _insert(self, key: ApiKey) -> None:
        try:
            await self._collection.insert_one(_document_of(key))
        except DuplicateKeyError as error:
            raise KeyConflict(f"a key with id {key.key_id} exists already") from error
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error


def _new_key(
    issued: IssuedKey,
    *,
    tenant_id: str,
    name: str,
    now: datetime,
    expires_at: datetime | None = None,
) -> ApiKey:
    return ApiKey(
        key_id=issued.key_id,
        tenant_id=tenant_id,
        name=name,
        secret_sha256=hash_secret(issued.secret),
        created_at=now,
        expires_at=expires_at,
    )


def _document_of(key: ApiKey) -> Document:
    return {
        "_id": key.key_id,
        "tenant_id": key.tenant_id,
        "name": key.name,
        "secret_sha256": key.secret_sha256,
        "created_at": key.created_at,
        "revoked_at": key.revoked_at,
        "last_used_at": key.last_used_at,
        "expires_at": key.expires_at,
    }


def _key_of(document: Document) -> ApiKey:
    return ApiKey(
        key_id=document["_id"],
        tenant_id=document["tenant_id"],
        name=document.get("name", ""),
        secret_sha256=document["secret_sha256"],
        created_at=document["created_at"],
        revoked_at=document.get("revoked_at"),
        last_used_at=document.get("last_used_at"),
        expires_at=document.get("expires_at"),
    )


BOOTSTRAP_KEY_NAME = "bootstrap"


async def bootstrap_key(keys: ApiKeys, token: str, *, tenant_id: str, now: datetime) -> ApiKey:
    """Register `token` (BOOTSTRAP_API_KEY) for `tenant_id`; idempotent across restarts and
    replicas. A key revoked since stays revoked: revocation is the operator's last word.

    Raises `ValueError` for a token not shaped like a key and `KeyConflict` when its id is
    taken by another key.
    """
    issued = parse_key(token)
    if issued is None:
        raise ValueError(
            "BOOTSTRAP_API_KEY is not a Scorebox key (sbx_<16 hex>_<43 URL-safe characters>); "
            "make one with `python -m services.gateway.keys new`"
        )
    key = await keys.register(issued, tenant_id=tenant_id, name=BOOTSTRAP_KEY_NAME, now=now)
    if not key.active:
        log.warning("BOOTSTRAP_API_KEY %s was revoked; it stays revoked", key.key_id)
    return key


async def retire_replaced_bootstrap_keys(keys: ApiKeys, key: ApiKey, *, now: datetime) -> None:
    """Revoke the bootstrap keys of `key`'s tenant registered before it: a new
    `BOOTSTRAP_API_KEY` replaces the earlier value, whose key stayed active for good on a
    database that outlives the gateway (compose's volume; found in review). Only earlier
    ones, so that a replica still started with the old value (a rolling change) revokes
    nothing of the new one, and registering a revoked key does not revive it: the change
    goes one way. A key made for the tenant by the admin API has another name and stays."""
    if not key.active:
        return
    retired = await keys.revoke_named_before(
        tenant_id=key.tenant_id,
        name=BOOTSTRAP_KEY_NAME,
        created_before=key.created_at,
        now=now,
    )
    if retired:
        log.warning(
            "BOOTSTRAP_API_KEY %s replaced the earlier bootstrap key(s) %s of tenant %s: revoked",
            key.key_id,
            ", ".join(retired),
            key.tenant_id,
        )


def main(argv: list[str]) -> int:
    """`python -m services.gateway.keys new`: print a fresh key (nothing is stored)."""
    if argv != ["new"]:
        print("usage: python -m services.gateway.keys new", file=sys.stderr)
        return 2
    print(generate_key().token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
