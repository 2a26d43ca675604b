"""The gateway's database known away: key lookups and rate counts answer 503 at once, one a
second going through to find it back, rather than each waiting the whole server selection
(5 s) for the same 503 (a walkthrough and a review)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure, ServerSelectionTimeoutError

from services.gateway.auth import Authenticator, KeyStore
from services.gateway.errors import DatabaseUnavailable, database_known_away
from services.gateway.keys import ApiKey, generate_key
from services.gateway.limits import LimitExceeded, RateLimiter
from services.gateway.unknown_keys import UnknownKeyBudget
from shared.away_gate import AwayGate
from tests.unit.test_auth_keys import FakeKeys, Ticker

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _no_server() -> DatabaseUnavailable:
    """As the stores raise it: the PyMongo error its cause."""
    error = ServerSelectionTimeoutError("127.0.0.1:27017: [Errno 111] Connection refused")
    unavailable = DatabaseUnavailable(str(error))
    unavailable.__cause__ = error
    return unavailable


@dataclass
class Known:
    server: bool = False

    def __call__(self) -> bool:
        return self.server


def test_once_no_server_was_found_it_refuses_at_once_but_one_a_second() -> None:
    ticker, known = Ticker(), Known()
    gate = AwayGate(known=known, refusal=database_known_away, clock=ticker)
    gate.check()  # nothing known against the database yet
    gate.note(_no_server())
    with pytest.raises(DatabaseUnavailable):
        gate.check()
    ticker.now += 1.0
    gate.check()  # the second's probe
    with pytest.raises(DatabaseUnavailable):
        gate.check()
    known.server = True  # the driver found a server: everyone goes
    gate.check()
    gate.check()


def test_an_error_that_is_not_a_missing_server_closes_nothing() -> None:
    gate = AwayGate(known=Known(), refusal=database_known_away, clock=Ticker())
    gate.note(DatabaseUnavailable("refused"))
    gate.note(OperationFailure("not authorized", code=13))
    gate.check()


@dataclass
class AwayKeys:
    """A key store whose database no server answers, counting its reads."""

    finds: int = 0

    async def find(self, key_id: str) -> ApiKey | None:
        self.finds += 1
        raise _no_server()


async def test_a_lookup_while_the_database_is_known_away_is_refused_without_a_read() -> None:
    ticker, store = Ticker(), AwayKeys()
    authenticator = Authenticator(
        cast(KeyStore, store),
        monotonic=ticker,
        unknown_keys=UnknownKeyBudget(1, monotonic=ticker),
        gate=AwayGate(known=Known(), refusal=database_known_away, clock=ticker),
    )
    for address in ("203.0.113.1", "203.0.113.2", "203.0.113.3"):
        with pytest.raises(DatabaseUnavailable):
            await authenticator.authenticate(generate_key().token, address=address)
    assert store.finds == 1
    ticker.now += 1.0
    # The token of the read no server took was kept: made-up keys went unlimited while the
    # database was away. Refused for its address, the request spends no probe (it took the
    # second's probe and never reached the database: a review); the next one reads.
    with pytest.raises(LimitExceeded):
        await authenticator.authenticate(generate_key().token, address="203.0.113.1")
    with pytest.raises(DatabaseUnavailable):
        await authenticator.authenticate(generate_key().token, address="203.0.113.4")
    assert store.finds == 2


@dataclass
class BackKeys(FakeKeys):
    """The key store, its database answered by no server until `back`."""

    back: bool = False

    async def find(self, key_id: str) -> ApiKey | None:
        if not self.back:
            raise _no_server()
        return await super().find(key_id)


async def test_a_real_keys_tokens_kept_in_an_outage_are_given_back_once_it_is_found() -> None:
    """Its lookups during the outage left its clients' address without tokens after it,
    refused as an address naming unknown keys (a review)."""
    ticker, store = Ticker(), BackKeys()
    token = store.add()
    authenticator = Authenticator(
        cast(KeyStore, store),
        monotonic=ticker,
        unknown_keys=UnknownKeyBudget(2, monotonic=ticker),
        gate=AwayGate(known=Known(), refusal=database_known_away, clock=ticker),
    )
    proxy = "198.51.100.9"  # every client behind one address
    with pytest.raises(DatabaseUnavailable):
        await authenticator.authenticate(token, address=proxy)
    ticker.now += 1.0
    store.back = True
    assert await authenticator.authenticate(token, address=proxy) is not None
    # Both tokens back: two made-up keys of this minute are still read, not refused.
    for _ in range(2):
        assert await authenticator.authenticate(generate_key().token, address=proxy) is None


async def test_a_rate_count_while_the_database_is_known_away_is_refused_without_a_write() -> None:
    """Its client would wait a minute to select a server that is not there: the gate
    answers first, and the count never reaches the driver."""
    ticker = Ticker()
    gate = AwayGate(known=Known(), refusal=database_known_away, clock=ticker)
    gate.note(_no_server())
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=60000", connect=False
    )
    limiter = RateLimiter(client, "gate", per_minute=10, clock=lambda: NOW, gate=gate)
    try:
        async with asyncio.timeout(30):  # far inside the client's own minute
            with pytest.raises(DatabaseUnavailable, match="did not answer a moment ago"):
                await limiter.hit("k1")
    finally:
        await client.close()
