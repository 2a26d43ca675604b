"""Who is calling: the tenant (and API key) behind a request.

Every public route takes a `Caller` through a dependency built by `caller_dependencies`;
handlers only ever see `caller.tenant_id` and `caller.key_id`, never a raw key. The dependency
authenticates `Authorization: Bearer <key>` (401 problem+json with `WWW-Authenticate: Bearer`
when the key is missing, malformed, unknown or revoked) and then counts the request against
the key's rate limit (429); a submission is counted once its body has arrived and admission
control has taken it (`Callers`). Health (`/healthz`, `/readyz`), `/docs` and `/openapi.json` do not
take a `Caller` and stay open.

Keys are looked up by id and cached in-process for `API_KEY_CACHE_TTL_S` seconds (default 5),
unknown ids included: a revoked key keeps working on other gateway replicas for at most that
long (at once on the replica that revoked it). A lookup that finds no key spends the client
address's budget of unknown keys (`services/gateway/unknown_keys.py`); spent, a key id not seen
to exist is answered 429 without a read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Protocol

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials

from services.gateway.admission import Overloaded
from services.gateway.errors import DatabaseUnavailable, database_known_away, refused_for_good
from services.gateway.keys import ApiKey, parse_key, secret_matches
from services.gateway.limits import LimitExceeded, RateLimiter, limit_problem
from services.gateway.unknown_keys import UNKNOWN_ADDRESS, UnknownKeyBudget
from shared.away_gate import AwayGate, found_no_server
from shared.contracts import utcnow
from shared.http import BearerScheme, Problem, bearer_challenge, database_refused

log = logging.getLogger("scorebox.gateway.auth")

# The realm a tenant's API key is challenged for (the operators' keys have their own).
TENANT_REALM = "scorebox"
DEFAULT_CACHE_TTL_S = 5.0
# How long a long-poll or a stream waits for its key's look (`still_valid`) before taking
# the key as still valid, as it does when the database is away.
STILL_VALID_WAIT_S = 1.0
MAX_CACHED_KEYS = 10_000
# Key ids seen to exist, which an address that spent its unknown-key budget may still use.
MAX_KNOWN_KEYS = 100_000


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    key_id: str | None = None


class KeyStore(Protocol):
    async def find(self, key_id: str) -> ApiKey | None: ...
    async def touch(self, key_id: str, *, now: datetime) -> None: ...
    async def active_ids(self, *, limit: int) -> list[str]: ...


@dataclass
class _Read:
    """What one read of a key found; `used` once a request holding its secret has recorded
    the key's use: `last_used_at` is written at most once per read (per cache period)."""

    key: ApiKey | None
    used: bool = False


@dataclass(frozen=True)
class _Loading:
    task: asyncio.Task[_Read]
    started: float


@dataclass(frozen=True)
class _Cached:
    read: _Read
    until: float


class Authenticator:
    """Turns a bearer token into a `Caller`, or None when it opens nothing.

    Lookups are cached for `cache_ttl_s` (0: no cache) on the `monotonic` clock; the cache
    holds at most `max_cached` ids and, when full, drops the one used least recently. So
    made-up key ids cannot grow it without limit, and a flood of them only pushes out what
    nobody used meanwhile: a key in use stays cached (emptying the whole cache when full, as
    it once did, had every legitimate key read again after each 10,000 made-up ids).

    With `unknown_keys`, an address whose lookups found no key too often is refused
    (`LimitExceeded`) before a read, unless the id is one seen to exist (a key in use stays
    usable behind a proxy that shows every client as one address).
    """

    def __init__(
        self,
        keys: KeyStore,
        *,
        cache_ttl_s: float = DEFAULT_CACHE_TTL_S,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], datetime] = utcnow,
        max_cached: int = MAX_CACHED_KEYS,
        unknown_keys: UnknownKeyBudget | None = None,
        gate: AwayGate | None = None,
    ) -> None:
        self._keys = keys
        self._gate = gate or AwayGate(known=lambda: True, refusal=database_known_away)
        self._ttl = cache_ttl_s
        self._monotonic = monotonic
        self._clock = clock
        self._max_cached = max_cached
        self._cache: OrderedDict[str, _Cached] = OrderedDict()  # least recently used first
        self._loading: dict[str, _Loading] = {}
        self._unknown_keys = unknown_keys or UnknownKeyBudget(0)
        self._known: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        # Tokens kept on reads no server took, by key id (`_keep_token`).
        self._kept: OrderedDict[str, list[str]] = OrderedDict()

    async def authenticate(self, token: str, *, address: str | None = None) -> Caller | None:
        """The caller `token` names, or None; `address` (the client's) spends its unknown-key
        budget when the lookup finds no key, and is refused once that is spent."""
        issued = parse_key(token)
        if issued is None:
            return None
        read = await self._lookup(issued.key_id, address)
        key = read.key
        # Whether a key id exists is no secret (ids are listed and logged), so answering an
        # unknown id faster than a wrong secret reveals nothing worth hiding.
        if key is None or not secret_matches(issued.secret, key.secret_sha256):
            return None
        if not key.admits_at(self._clock()):  # revoked or expired
            return None
        await self._record_use(read, key.key_id)
        return Caller(tenant_id=key.tenant_id, key_id=key.key_id)

    async def still_valid(self, caller: Caller) -> bool:
        """Whether `caller`'s key is still active (cached as `authenticate` is): an open
        stream asks at every heartbeat and before each change it sends, a long-poll as its
        wait ends, so a revocation ends them as it ends new requests. A
        database away keeps the stream (it says nothing about the key), and so does one
        slower than `STILL_VALID_WAIT_S`: waiting `MONGO_TIMEOUT_S` for it, a long-poll
        answered seconds past its deadline, and a stream's heartbeats came late (a
        walkthrough; the read and the write are shielded, and go on for the next ask)."""
        if caller.key_id is None:
            return True
        try:
            async with asyncio.timeout(STILL_VALID_WAIT_S):
                read = await self._lookup(caller.key_id)
                if not self._admits(read):
                    return False
                await self._record_use(read, caller.key_id)  # opened with its secret
        except DatabaseUnavailable:
            return True
        except TimeoutError:
            # The last read that came back, however old: over a database slow but up, each
            # look started a read it gave up on, and a key revoked meanwhile never ended
            # the streams opened with it (the re-read).
            cached = self._cache.get(caller.key_id)
            return cached is None or self._admits(cached.read)
        return True

    def _admits(self, read: _Read) -> bool:
        return read.key is not None and read.key.admits_at(self._clock())

    def forget(self, key_id: str) -> None:
        """Drop a key from this replica's cache (after revoking it here)."""
        self._cache.pop(key_id, None)
        self._loading.pop(key_id, None)  # a lookup under way may have read the key before

    async def _lookup(self, key_id: str, address: str | None = None) -> _Read:
        """The key, from the cache or else from the store: requests that miss together share
        one lookup (and one `touch`) started within the cache period, so a popular key's
        expiry costs one read, not one per request in flight (with no cache, every request
        reads its key)."""
        now = self._monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and cached.until > now:
            self._cache.move_to_end(key_id)
            return cached.read
        under_way = self._loading.get(key_id)
        # Joining a read under way costs no read; one older than the cache period may have
        # read the key before a revocation the period is the documented bound of.
        if under_way is not None and under_way.started > now - self._ttl:
            return await asyncio.shield(under_way.task)
        charged = self._charge(key_id, address)
        try:
            # After the charge: a probe of the gate spent on a request refused for its
            # address never reached the database (a review).
            self._gate.check()  # the database known away: the 503 now, not in 5 s
        except DatabaseUnavailable:
            if charged is not None:
                self._unknown_keys.give_back(charged)
            raise
        loading = asyncio.create_task(self._load(key_id))
        self._loading[key_id] = _Loading(loading, now)
        loading.add_done_callback(functools.partial(self._loaded, key_id, now + self._ttl))
        try:
            # Shielded: a request that goes away does not cancel the lookup others wait for.
            read = await asyncio.shield(loading)
        except Exception as error:
            # A failed read says nothing of the key; but one no server took keeps its token,
            # or made-up keys went unlimited while the database was away (a review), until
            # a later read finds the key (`_kept`).
            if charged is not None and found_no_server(error):
                self._keep_token(key_id, charged)
            elif charged is not None:
                self._unknown_keys.give_back(charged)
            raise
        # A request cancelled meanwhile keeps its token: its read went on.
        if read.key is not None and charged is not None:
            self._unknown_keys.give_back(charged)
        if read.key is not None:
            for kept in self._kept.pop(key_id, ()):
                self._unknown_keys.give_back(kept)
        return read

    def _keep_token(self, key_id: str, address: str) -> None:
        """Note the token `address` spent on reading `key_id` when no server took the read:
        given back once a read finds the key (a real key's lookups during an outage left its
        clients' address out of tokens after it; a review). Bounded as the cache is."""
        self._kept.setdefault(key_id, []).append(address)
        self._kept.move_to_end(key_id)
        while len(self._kept) > self._max_cached:
            self._kept.popitem(last=False)

    def _charge(self, key_id: str, address: str | None) -> str | None:
        """Take the token of `address` for reading `key_id` (the address charged, or None
        when nothing was: no address, or an id seen to exist); `LimitExceeded` when spent."""
        if address is None or key_id in self._known:
            return None
        spent = self._unknown_keys.take(address)
        if spent is None:
            return address
        whose = "this gateway's clients" if spent.replica_wide else "this address"
        raise LimitExceeded(
            "unknown_keys",
            f"Too many requests from {whose} named API keys this gateway does not know; "
            f"retry in {spent.retry_after_s} s.",
            maximum=spent.per_minute,
            retry_after_s=spent.retry_after_s,
        )

    async def _load(self, key_id: str) -> _Read:
        try:
            key = await self._keys.find(key_id)
        except DatabaseUnavailable as error:
            self._gate.note(error)
            raise
        self._gate.answered()
        return _Read(key)

    async def _record_use(self, read: _Read, key_id: str) -> None:
        """Write the key's `last_used_at`, once per read: on a request that showed its secret,
        never on a lookup (a wrong secret with a real key id marked the key used)."""
        if read.used:
            return
        read.used = True
        # Shielded: the request going away does not leave the key unmarked for the cache
        # period (the other requests of this read do not touch it).
        await asyncio.shield(self._touch(key_id))

    async def _touch(self, key_id: str) -> None:
        try:
            await self._keys.touch(key_id, now=self._clock())
        except DatabaseUnavailable as error:  # `last_used_at` is best effort
            log.warning("last_used_at of key %s not recorded: %r", key_id, error)

    def _loaded(self, key_id: str, until: float, loading: asyncio.Task[_Read]) -> None:
        # Reading the outcome here marks an error retrieved even when every waiter has gone.
        failed = loading.cancelled() or loading.exception() is not None
        under_way = self._loading.get(key_id)
        if under_way is None or under_way.task is not loading:
            return  # forgotten or overtaken meanwhile: its result may predate a revocation
        del self._loading[key_id]
        if failed:
            return
        if loading.result().key is not None:
            self.remember(key_id)
        if self._ttl <= 0:
            return
        self._cache[key_id] = _Cached(loading.result(), until)
        self._cache.move_to_end(key_id)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)

    def remember(self, key_id: str) -> None:
        """Note that `key_id` exists (read, or created here): it is never refused for the
        unknown-key budget of the address using it."""
        self._known[key_id] = None
        self._known.move_to_end(key_id)
        while len(self._known) > MAX_KNOWN_KEYS:
            self._known.popitem(last=False)

    async def learn_keys(self) -> None:
        """Remember the ids of the newest active keys (start-up), so that a replica just
        started lets keys in use through while an address they share floods made-up ones.
        Best effort: the database away, keys are learnt as they are read."""
        try:
            key_ids = await self._keys.active_ids(limit=MAX_KNOWN_KEYS)
        except DatabaseUnavailable as error:
            log.warning("active key ids not read at start-up: %r", error)
            return
        for key_id in reversed(key_ids):  # newest last: the last to be dropped
            self.remember(key_id)


_bearer = BearerScheme(
    scheme_name="HTTPBearer",  # FastAPI's name for it before: clients generated from it keep it
    auto_error=False,
    bearerFormat="sbx_<key_id>_<secret>",
    description="An API key: `Authorization: Bearer sbx_<key_id>_<secret>`.",
)


def _unauthorized(detail: str, *, invalid: bool) -> Problem:
    challenge = bearer_challenge(TENANT_REALM, True if invalid else None)
    return Problem(401, detail, kind="unauthorized", headers={"WWW-Authenticate": challenge})


def key_ended_while_waiting() -> Problem:
    """The answer to a long-poll whose key was revoked, or expired, while it waited: what a
    new request with the key gets."""
    return _unauthorized(
        "The API key was revoked, or expired, while the request waited.", invalid=True
    )


def _unavailable(error: DatabaseUnavailable, *, what: str = "The key store") -> Problem:
    if refused_for_good(error):
        return database_refused(error)
    return Problem(
        503,
        f"{what} is unavailable; retry shortly.",
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
    )


@dataclass(frozen=True)
class Callers:
    """The dependencies that yield a `Caller`. `authenticated`: the key checked, then the
    request counted in the key's rate window, for every public route but the submissions.
    `identified`: the key checked only, for the submission routes, which read their bodies
    through `read_counted`. Admission control refuses a submission at the end of its body,
    and one it sheds is not counted: counted before, a client that obeyed `Retry-After: 1`
    through an overload spent its key's minute on 503s and was answered 429 once the gateway
    took submissions again, and each shed submission cost a database write when the database
    was what was slow."""

    authenticated: Any
    identified: Any
    count: Callable[[Caller], Awaitable[None]]
    refuse_if_full: Callable[[Caller], None]

    async def read_counted[T](
        self, caller: Caller, read: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        """`read(*args, arrived=...)`, the request counted once its body is in (`arrived`), or
        when its body is refused unread (415, 413, 408: every other refusal counts too), not
        when admission control sheds it. A key whose window this replica has seen full is
        answered 429 before its body is read."""
        self.refuse_if_full(caller)
        counted = False

        async def count() -> None:
            nonlocal counted
            counted = True
            await self.count(caller)

        try:
            return await read(*args, arrived=count)
        except Overloaded:
            raise
        except (Problem, HTTPException):
            if not counted:
                await count()
            raise


def caller_dependencies(authenticator: Authenticator, rate_limiter: RateLimiter) -> Callers:
    return Callers(
        authenticated=caller_dependency(authenticator, rate_limiter),
        identified=caller_dependency(authenticator, rate_limiter, counted=False),
        count=functools.partial(count_request, rate_limiter),
        refuse_if_full=functools.partial(refuse_if_full, rate_limiter),
    )


def caller_dependency(
    authenticator: Authenticator, rate_limiter: RateLimiter, *, counted: bool = True
) -> Any:
    """The FastAPI dependency that authenticates the caller and, when `counted`, counts the
    request."""

    async def resolve_caller(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Caller:
        if credentials is None:
            raise _unauthorized("Send an API key as 'Authorization: Bearer <key>'.", invalid=False)
        address = request.client.host if request.client is not None else UNKNOWN_ADDRESS
        try:
            caller = await authenticator.authenticate(credentials.credentials, address=address)
        except DatabaseUnavailable as error:
            raise _unavailable(error) from error
        except LimitExceeded as error:
            raise limit_problem(error) from error
        if caller is None or caller.key_id is None:
            raise _unauthorized("The API key is malformed, unknown or revoked.", invalid=True)
        if counted:
            await count_request(rate_limiter, caller)
        return caller

    return Depends(resolve_caller)


def refuse_if_full(rate_limiter: RateLimiter, caller: Caller) -> None:
    """429, from memory, for a key whose current window this replica has seen full."""
    if caller.key_id is None:
        return
    try:
        rate_limiter.refuse_if_full(caller.key_id)
    except LimitExceeded as error:
        raise limit_problem(error) from error


async def count_request(rate_limiter: RateLimiter, caller: Caller) -> None:
    """Count the request in its key's rate window: 429 when it is one too many, 503 when the
    counter cannot be reached."""
    if caller.key_id is None:
        return  # not a key's request (none reaches a route): nothing to count it against
    try:
        await rate_limiter.hit(caller.key_id)
    except LimitExceeded as error:
        raise limit_problem(error) from error
    except DatabaseUnavailable as error:
        raise _unavailable(error, what="The request rate counter") from error
