"""API keys without a database: their format, parsing, hashing, and the cached lookup."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import pytest

from services.gateway.auth import Authenticator, Caller
from services.gateway.errors import DatabaseUnavailable
from services.gateway.keys import (
    ApiKey,
    generate_key,
    hash_secret,
    main,
    parse_key,
    secret_matches,
)
from services.gateway.limits import LimitExceeded
from services.gateway.unknown_keys import UnknownKeyBudget
from tests.support import eventually

NOW = datetime(2030, 1, 1, tzinfo=UTC)
TOKEN_SHAPE = re.compile(r"^sbx_[0-9a-f]{16}_[A-Za-z0-9_-]{43}$")


def test_generated_keys_have_the_documented_shape_and_are_unique() -> None:
    keys = [generate_key() for _ in range(200)]
    for key in keys:
        assert TOKEN_SHAPE.match(key.token), key.token
        assert key.token == f"sbx_{key.key_id}_{key.secret}"
    assert len({key.key_id for key in keys}) == len(keys)
    assert len({key.secret for key in keys}) == len(keys)


def test_a_token_parses_back_into_its_id_and_secret() -> None:
    key = generate_key()
    assert parse_key(key.token) == key


def test_a_secret_may_contain_underscores() -> None:
    token = "sbx_0123456789abcdef_" + "_" * 43
    parsed = parse_key(token)
    assert parsed is not None
    assert parsed.key_id == "0123456789abcdef"
    assert parsed.secret == "_" * 43


GOOD = generate_key()


@pytest.mark.parametrize(
    "token",
    [
        "",
        "sbx",
        GOOD.token + "x",
        GOOD.token[:-1],
        GOOD.token.replace("sbx_", "sbk_"),
        GOOD.token.upper(),
        f"sbx_{GOOD.key_id.upper()}_{GOOD.secret}",
        f"sbx_{GOOD.key_id[:-1]}_{GOOD.secret}x",
        f" {GOOD.token}",
        f"{GOOD.token}\n",
        f"sbx_{GOOD.key_id}_{GOOD.secret[:-1]}=",
        f"sbx_{GOOD.key_id}_{GOOD.secret[:-2]}.*",
        '{"$ne": null}',
        "dev-secret",
    ],
)
def test_anything_else_is_not_a_key(token: str) -> None:
    assert parse_key(token) is None


def test_the_secret_is_stored_as_its_sha256() -> None:
    key = generate_key()
    stored = hash_secret(key.secret)
    assert stored == hashlib.sha256(key.secret.encode()).hexdigest()
    assert key.secret not in stored
    assert secret_matches(key.secret, stored)
    assert not secret_matches(generate_key().secret, stored)


def test_the_secret_stays_out_of_repr() -> None:
    key = generate_key()
    assert key.secret not in repr(key)
    assert key.key_id in repr(key)


def test_listings_never_show_the_secret_or_its_hash() -> None:
    issued = generate_key()
    key = ApiKey(
        key_id=issued.key_id,
        tenant_id="acme",
        name="ci",
        secret_sha256=hash_secret(issued.secret),
        created_at=NOW,
    )
    shown = key.public()
    assert shown["key_id"] == issued.key_id
    assert shown["tenant_id"] == "acme"
    assert "secret_sha256" not in shown
    assert issued.secret not in str(shown)
    assert key.secret_sha256 not in str(shown)


def test_the_module_prints_a_fresh_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["new"]) == 0
    printed = capsys.readouterr().out.strip()
    assert parse_key(printed) is not None
    assert main([]) == 2


# --------------------------------------------------------------------------- Authenticator


@dataclass
class FakeKeys:
    """The key store, in memory, counting its lookups."""

    keys: dict[str, ApiKey] = field(default_factory=dict)
    finds: int = 0
    touched: list[str] = field(default_factory=list)

    def add(self, tenant_id: str = "acme") -> str:
        issued = generate_key()
        self.keys[issued.key_id] = ApiKey(
            key_id=issued.key_id,
            tenant_id=tenant_id,
            name="",
            secret_sha256=hash_secret(issued.secret),
            created_at=NOW,
        )
        return issued.token

    def revoke(self, token: str) -> None:
        parsed = parse_key(token)
        assert parsed is not None
        self.keys[parsed.key_id] = replace(self.keys[parsed.key_id], revoked_at=NOW)

    async def find(self, key_id: str) -> ApiKey | None:
        self.finds += 1
        return self.keys.get(key_id)

    async def touch(self, key_id: str, *, now: datetime) -> None:
        self.touched.append(key_id)

    async def active_ids(self, *, limit: int) -> list[str]:
        return [key_id for key_id, key in reversed(self.keys.items()) if key.active][:limit]


class Ticker:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _authenticator(store: FakeKeys, ticker: Ticker, ttl: float = 5.0) -> Authenticator:
    return Authenticator(store, cache_ttl_s=ttl, monotonic=ticker, clock=lambda: NOW)


async def test_a_valid_key_yields_its_tenant_and_key_id() -> None:
    store = FakeKeys()
    token = store.add("acme")
    caller = await _authenticator(store, Ticker()).authenticate(token)
    parsed = parse_key(token)
    assert parsed is not None
    assert caller == Caller(tenant_id="acme", key_id=parsed.key_id)
    assert store.touched == [parsed.key_id]


async def test_wrong_unknown_revoked_and_malformed_keys_yield_nothing() -> None:
    store = FakeKeys()
    token = store.add()
    revoked = store.add()
    store.revoke(revoked)
    authenticator = _authenticator(store, Ticker())
    parsed = parse_key(token)
    assert parsed is not None
    wrong_secret = f"sbx_{parsed.key_id}_{generate_key().secret}"
    assert await authenticator.authenticate(wrong_secret) is None
    assert await authenticator.authenticate(generate_key().token) is None
    assert await authenticator.authenticate(revoked) is None
    finds = store.finds
    assert await authenticator.authenticate("Bearer " + token) is None
    assert await authenticator.authenticate('{"$gt": ""}') is None
    assert store.finds == finds  # malformed keys never reach the store


async def test_only_a_request_with_the_secret_records_the_keys_use() -> None:
    """A real key id with a wrong secret was refused but marked the key used (its
    `last_used_at`, which the admin listing shows): the read that found the key wrote it."""
    store = FakeKeys()
    token = store.add()
    parsed = parse_key(token)
    assert parsed is not None
    ticker = Ticker()
    authenticator = _authenticator(store, ticker, ttl=5.0)
    wrong_secret = f"sbx_{parsed.key_id}_{generate_key().secret}"
    assert await authenticator.authenticate(wrong_secret) is None
    assert store.touched == []

    assert await authenticator.authenticate(token) is not None
    assert await authenticator.authenticate(token) is not None
    assert store.touched == [parsed.key_id]  # once per cache period, as before
    ticker.now += 5.1
    assert await authenticator.authenticate(wrong_secret) is None
    assert store.touched == [parsed.key_id]
    assert await authenticator.authenticate(token) is not None
    assert store.touched == [parsed.key_id] * 2
    assert store.finds == 2


async def test_lookups_are_cached_for_the_ttl_and_revocation_shows_after_it() -> None:
    store = FakeKeys()
    token = store.add()
    ticker = Ticker()
    authenticator = _authenticator(store, ticker, ttl=5.0)
    assert await authenticator.authenticate(token) is not None
    assert await authenticator.authenticate(token) is not None
    assert store.finds == 1

    store.revoke(token)
    ticker.now += 4.9
    assert await authenticator.authenticate(token) is not None  # still cached
    ticker.now += 0.2
    assert await authenticator.authenticate(token) is None
    assert store.finds == 2


async def test_unknown_ids_are_cached_too() -> None:
    store = FakeKeys()
    ticker = Ticker()
    authenticator = _authenticator(store, ticker)
    stranger = generate_key().token
    assert await authenticator.authenticate(stranger) is None
    assert await authenticator.authenticate(stranger) is None
    assert store.finds == 1


async def test_forget_makes_a_revocation_visible_at_once() -> None:
    store = FakeKeys()
    token = store.add()
    authenticator = _authenticator(store, Ticker())
    assert await authenticator.authenticate(token) is not None
    store.revoke(token)
    parsed = parse_key(token)
    assert parsed is not None
    authenticator.forget(parsed.key_id)
    assert await authenticator.authenticate(token) is None


async def test_a_zero_ttl_looks_up_every_time() -> None:
    store = FakeKeys()
    token = store.add()
    authenticator = _authenticator(store, Ticker(), ttl=0)
    for _ in range(3):
        assert await authenticator.authenticate(token) is not None
    assert store.finds == 3


async def test_the_cache_stays_bounded() -> None:
    store = FakeKeys()
    authenticator = Authenticator(store, cache_ttl_s=60, monotonic=Ticker(), max_cached=10)
    for _ in range(25):
        await authenticator.authenticate(generate_key().token)
    assert len(authenticator._cache) <= 10


async def test_a_flood_of_unknown_ids_does_not_push_out_a_key_in_use() -> None:
    """A full cache used to be emptied, so every `max_cached` made-up ids had each
    legitimate key read again; only the least recently used ids leave it now."""
    store = FakeKeys()
    token = store.add()
    authenticator = Authenticator(store, cache_ttl_s=60, monotonic=Ticker(), max_cached=10)
    for _ in range(5):
        assert await authenticator.authenticate(token) is not None
        for _ in range(9):
            assert await authenticator.authenticate(generate_key().token) is None
    assert await authenticator.authenticate(token) is not None
    assert len(store.touched) == 1  # read from the store once
    assert len(authenticator._cache) == 10


class SlowKeys(FakeKeys):
    """A store whose lookups wait until released, so that requests miss together."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.read = asyncio.Event()  # a lookup has read the store
        self.failure: Exception | None = None

    async def find(self, key_id: str) -> ApiKey | None:
        self.finds += 1
        key = self.keys.get(key_id)  # read now, answered when released
        self.read.set()
        await self.release.wait()
        if self.failure is not None:
            raise self.failure
        return key


async def _settled(tasks: list[asyncio.Task[Caller | None]]) -> list[Caller | None]:
    async with asyncio.timeout(5):
        return await asyncio.gather(*tasks)


async def test_requests_that_miss_together_share_one_lookup_and_one_touch() -> None:
    store = SlowKeys()
    token = store.add()
    authenticator = _authenticator(store, Ticker())
    waiting = [asyncio.create_task(authenticator.authenticate(token)) for _ in range(20)]
    gone = asyncio.create_task(authenticator.authenticate(token))
    await asyncio.sleep(0)  # every request is now waiting on the store
    gone.cancel()  # a client that went away does not cancel the others' lookup
    store.release.set()
    callers = await _settled(waiting)
    assert all(caller is not None and caller.tenant_id == "acme" for caller in callers)
    assert store.finds == 1
    assert len(store.touched) == 1
    assert await authenticator.authenticate(token) is not None
    assert store.finds == 1  # cached


async def test_a_failed_shared_lookup_fails_its_requests_and_is_not_cached() -> None:
    store = SlowKeys()
    token = store.add()
    authenticator = _authenticator(store, Ticker())
    store.failure = DatabaseUnavailable("down")
    waiting = [asyncio.create_task(authenticator.authenticate(token)) for _ in range(3)]
    await asyncio.sleep(0)
    store.release.set()
    async with asyncio.timeout(5):
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(outcome, DatabaseUnavailable) for outcome in outcomes)
    assert store.finds == 1
    store.failure = None
    assert await authenticator.authenticate(token) is not None
    assert store.finds == 2


async def test_a_lookup_under_way_when_the_key_is_forgotten_is_not_cached() -> None:
    store = SlowKeys()
    token = store.add()
    parsed = parse_key(token)
    assert parsed is not None
    authenticator = _authenticator(store, Ticker())
    stale = asyncio.create_task(authenticator.authenticate(token))
    await asyncio.sleep(0)
    store.revoke(token)
    authenticator.forget(parsed.key_id)
    store.release.set()
    await _settled([stale])  # it read the key before the revocation; no matter
    assert await authenticator.authenticate(token) is None
    assert store.finds == 2


async def test_a_request_past_the_cache_period_does_not_join_an_older_lookup() -> None:
    """A lookup that read the key before another replica revoked it, answered late (a slow
    database, `MONGO_TIMEOUT_S` above the cache period): a request 20 s after the revocation
    joined it and was let in, past the documented bound (`API_KEY_CACHE_TTL_S`)."""
    store = SlowKeys()
    token = store.add()
    ticker = Ticker()
    authenticator = _authenticator(store, ticker, ttl=5.0)
    early = asyncio.create_task(authenticator.authenticate(token))
    async with asyncio.timeout(5):
        await store.read.wait()
    store.revoke(token)
    ticker.now += 20
    late = asyncio.create_task(authenticator.authenticate(token))
    await asyncio.sleep(0)
    store.release.set()

    assert await _settled([late]) == [None]
    assert store.finds == 2
    assert await _settled([early]) != [None]  # it read the key before the revocation
    assert await authenticator.authenticate(token) is None  # the older answer was not cached


# --------------------------------------------------------------------------- unknown keys


def _budgeted(
    store: FakeKeys, ticker: Ticker, *, per_minute: int, ttl: float = 0.0
) -> Authenticator:
    return Authenticator(
        store,
        cache_ttl_s=ttl,
        monotonic=ticker,
        clock=lambda: NOW,
        unknown_keys=UnknownKeyBudget(per_minute, monotonic=ticker),
    )


async def test_an_address_past_its_unknown_keys_is_refused_without_a_read() -> None:
    store = FakeKeys()
    ticker = Ticker()
    authenticator = _budgeted(store, ticker, per_minute=3)
    for _ in range(3):
        assert await authenticator.authenticate(generate_key().token, address="203.0.113.7") is None
    assert store.finds == 3
    with pytest.raises(LimitExceeded) as refused:
        await authenticator.authenticate(generate_key().token, address="203.0.113.7")
    assert store.finds == 3  # refused before the store
    assert refused.value.limit == "unknown_keys"
    assert refused.value.maximum == 3
    assert refused.value.retry_after_s == 20  # a token back every 60 / 3 s
    # Another address has its own budget; a caller that names none is not counted.
    assert await authenticator.authenticate(generate_key().token, address="198.51.100.1") is None
    assert await authenticator.authenticate(generate_key().token) is None
    assert store.finds == 5
    ticker.now += 20
    assert await authenticator.authenticate(generate_key().token, address="203.0.113.7") is None
    assert store.finds == 6


async def test_requests_sent_together_cannot_outrun_the_budget() -> None:
    """Each takes its token before its read: checked before any read ended, all of them
    passed and read."""
    store = SlowKeys()
    authenticator = _budgeted(store, Ticker(), per_minute=3)
    attempts = [
        asyncio.create_task(authenticator.authenticate(generate_key().token, address="192.0.2.9"))
        for _ in range(50)
    ]
    await asyncio.sleep(0)
    store.release.set()
    async with asyncio.timeout(5):
        answers = await asyncio.gather(*attempts, return_exceptions=True)
    assert store.finds == 3
    assert sum(isinstance(answer, LimitExceeded) for answer in answers) == 47


async def test_keys_seen_to_exist_stay_usable_from_an_address_that_spent_its_budget() -> None:
    """Behind a proxy that hides client addresses every client is one address: a flood of
    made-up keys through it must not lock out the keys in use (no cache here: TTL 0)."""
    store = FakeKeys()
    token = store.add()
    revoked = store.add()
    ticker = Ticker()
    authenticator = _budgeted(store, ticker, per_minute=2)
    proxy = "10.0.0.2"
    assert await authenticator.authenticate(token, address=proxy) is not None
    assert await authenticator.authenticate(revoked, address=proxy) is not None
    store.revoke(revoked)
    for _ in range(2):
        assert await authenticator.authenticate(generate_key().token, address=proxy) is None
    for _ in range(3):
        assert await authenticator.authenticate(token, address=proxy) is not None
    assert await authenticator.authenticate(revoked, address=proxy) is None  # read: revoked
    fresh = store.add()  # a key this replica never saw: refused until the budget refills
    with pytest.raises(LimitExceeded):
        await authenticator.authenticate(fresh, address=proxy)
    parsed = parse_key(fresh)
    assert parsed is not None
    authenticator.remember(parsed.key_id)  # created through this replica
    assert await authenticator.authenticate(fresh, address=proxy) is not None


async def test_a_replica_learns_the_active_keys_at_start() -> None:
    store = FakeKeys()
    token = store.add()
    revoked = store.add()
    store.revoke(revoked)
    authenticator = _budgeted(store, Ticker(), per_minute=1)
    await authenticator.learn_keys()
    assert await authenticator.authenticate(generate_key().token, address="10.0.0.2") is None
    assert await authenticator.authenticate(token, address="10.0.0.2") is not None
    with pytest.raises(LimitExceeded):  # revoked keys are not learnt
        await authenticator.authenticate(revoked, address="10.0.0.2")


async def test_an_unknown_id_answered_from_the_cache_spends_nothing() -> None:
    store = FakeKeys()
    ticker = Ticker()
    authenticator = _budgeted(store, ticker, per_minute=2, ttl=5.0)
    stranger = generate_key().token
    for _ in range(5):
        assert await authenticator.authenticate(stranger, address="203.0.113.7") is None
    assert store.finds == 1
    assert await authenticator.authenticate(generate_key().token, address="203.0.113.7") is None
    assert store.finds == 2  # the second token was still there
    with pytest.raises(LimitExceeded):
        await authenticator.authenticate(generate_key().token, address="203.0.113.7")


async def test_a_failed_lookup_and_a_found_key_spend_nothing() -> None:
    store = SlowKeys()
    store.failure = DatabaseUnavailable("down")
    store.release.set()
    token = store.add()
    authenticator = _budgeted(store, Ticker(), per_minute=1)
    for _ in range(3):
        with pytest.raises(DatabaseUnavailable):
            await authenticator.authenticate(generate_key().token, address="203.0.113.7")
    store.failure = None
    assert await authenticator.authenticate(token, address="203.0.113.7") is not None
    assert await authenticator.authenticate(generate_key().token, address="203.0.113.7") is None
    assert store.finds == 5


async def test_a_request_that_goes_away_keeps_its_token_spent() -> None:
    """Its read goes on for the others: giving the token back would let a client that hangs
    up at once cause reads without bound."""
    store = SlowKeys()
    authenticator = _budgeted(store, Ticker(), per_minute=1)
    gone = asyncio.create_task(
        authenticator.authenticate(generate_key().token, address="203.0.113.7")
    )
    await asyncio.sleep(0)
    gone.cancel()
    store.release.set()
    with pytest.raises(asyncio.CancelledError):
        await gone
    with pytest.raises(LimitExceeded):
        await authenticator.authenticate(generate_key().token, address="203.0.113.7")


class StalledKeys(FakeKeys):
    """A key store whose lookups wait for `answer` (a database stalled)."""

    answer: asyncio.Event

    async def find(self, key_id: str) -> ApiKey | None:
        await self.answer.wait()
        return await super().find(key_id)


async def test_a_key_looked_at_over_a_stalled_database_is_taken_as_still_valid() -> None:
    """Waiting `MONGO_TIMEOUT_S` for the look, a long-poll answered seconds past its
    deadline and a stream's heartbeats came late (a walkthrough, the database stopped)."""
    store = StalledKeys()
    store.answer = asyncio.Event()
    token = store.add("acme")
    ticker = Ticker()
    authenticator = _authenticator(store, ticker)
    store.answer.set()
    caller = await authenticator.authenticate(token)
    assert caller is not None
    store.answer.clear()
    ticker.now += 60  # its cached read is stale: the next look goes to the store
    async with asyncio.timeout(30):  # a hang guard only
        assert await authenticator.still_valid(caller)
    # Revoked meanwhile: the read given up on comes back (slow, not away) and says so; the
    # next look, given up on too, goes by it (a re-read: revoked keys kept their streams).
    store.revoke(token)
    store.answer.set()

    async def read_back() -> bool:
        return store.finds == 2

    await eventually(read_back, what="the slow read back")
    store.answer.clear()
    ticker.now += 60
    async with asyncio.timeout(30):  # a hang guard only
        assert not await authenticator.still_valid(caller)
    store.answer.set()
