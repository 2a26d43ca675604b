"""Admission control for submissions: answer what the system cannot absorb at once, with 503.

Without it, an overloaded gateway (a database slower than the arrivals, say) keeps accepting
connections and every submission waits longer and longer: clients time out after many
seconds, retry, and add to the load. Instead each gateway process admits at most `limit`
submissions at a time and answers the others at once with 503 problem+json and
`Retry-After`, so they change nothing.

A submission takes its place once its body has arrived in full, not when it arrives: what the
limit protects is the work done with a body (the database, the broker), not the wait for one.
Had it taken its place before, one client sending `limit` bodies slowly, or stalling halfway,
would hold every place until the body timeout (`REQUEST_BODY_TIMEOUT_S`) and every other
tenant's submissions would be shed; a stalled upload measures nothing either, so the limit
would not adapt. A submission refused at the end of its body is refused before the route does
anything with it: it is authenticated, and nothing else. It is not counted in its key's rate
window, which a submission's route counts once admission has taken it (`Callers` in
`services/gateway/auth.py`): a client obeying `Retry-After` through an overload would
otherwise find its key's minute spent on refusals.

The limit adapts to what the submissions take (AIMD, as TCP's congestion window): a
submission that took longer than `SUBMIT_LATENCY_TARGET_MS` cuts the limit by a fifth, at most
once per target interval, so one slow moment does not collapse it; one that took at most half
the target adds a place, while at least half of the limit is in use (an idle gateway does not
grow a limit it never tested); in between the limit holds. So a gateway finds its level fast
and settles where submissions take between half the target and the target. It stays between
`min_limit` and `max_limit`. The variants measured before this rule are in
docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import IDEMPOTENCY_KEY, nothing_kept
from shared.http import Problem, problem_instance, problem_response
from shared.log_rate import Tally

BACKOFF = 0.8
RETRY_AFTER_S = 1
MIN_LIMIT = 8  # whatever the latency, a gateway process takes on this many at a time
INITIAL_LIMIT = 64
GUARDED = (("POST", "/v1/scores"), ("POST", "/v1/batches"))
REPORT_INTERVAL_S = 10.0  # how often shedding is logged while it lasts

log = logging.getLogger("scorebox.gateway.admission")


@dataclass
class AdaptiveLimit:
    """How many submissions a gateway process takes on at once (see the module's docstring)."""

    target_s: float
    min_limit: int
    max_limit: int
    initial_limit: int
    clock: Callable[[], float] = time.monotonic
    in_flight: int = 0
    limit: float = field(init=False)
    _last_decrease: float = field(init=False, default=-math.inf)

    def __post_init__(self) -> None:
        self.limit = float(min(max(self.initial_limit, self.min_limit), self.max_limit))

    def try_acquire(self) -> bool:
        if self.in_flight >= int(self.limit):
            return False
        self.in_flight += 1
        return True

    def release(self, took_s: float | None, *, accepted: bool = True, tasks: int = 1) -> None:
        """Free a place; `took_s` is how long the submission took, None when it says nothing
        of the load (its body never arrived in full). Only an `accepted` one (a 202: it did
        the work the limit guards) grows the limit when quick: a malformed body refused at
        once, or a replay's 200, grew it place by place during an overload, and let every
        slow submission in again (two reviews); a slow answer of any kind cuts it. A batch
        of `tasks` items cuts it only when slow per item, and grows it only when quick as a
        whole: measured per item for both, slow batches grew it (a review)."""
        self.in_flight -= 1
        if took_s is None:
            return
        if took_s / max(1, tasks) > self.target_s:
            now = self.clock()
            if now - self._last_decrease >= self.target_s:
                self.limit = max(float(self.min_limit), self.limit * BACKOFF)
                self._last_decrease = now
        elif accepted and took_s <= self.target_s / 2 and (self.in_flight + 1) * 2 >= self.limit:
            self.limit = min(float(self.max_limit), self.limit + 1)


class SubmissionAdmission:
    """Pure ASGI middleware: `AdaptiveLimit` over the requests `guarded` names
    (method, path); everything else passes untouched."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: AdaptiveLimit,
        guarded: Collection[tuple[str, str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.limit = limit
        self.guarded = frozenset(guarded)
        self.clock = clock
        self._refusals = Tally(REPORT_INTERVAL_S, clock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], route_path(scope)) not in self.guarded:
            await self.app(scope, receive, send)
            return
        # The place is taken, and the submission timed, from the end of its body: a client
        # that uploads slowly or stalls holds no place (see the module's docstring), and a
        # request answered before its body was read (401, 415, 413, a timeout) takes none.
        taken_at: float | None = None
        started = False
        status: int | None = None

        async def admitting_receive() -> Message:
            nonlocal taken_at
            message = await receive()
            if taken_at is None and _ends_body(message):
                self._admit(scope)
                taken_at = self.clock()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
            await send(message)

        try:
            await self.app(scope, admitting_receive, tracking_send)
        except Overloaded as refused:
            if started:
                raise
            # The application had no handler for it (the gateway's answers it as problem+json).
            await problem_response(refused, problem_instance(scope))(scope, receive, send)
        finally:
            if taken_at is not None:
                accepted = status == HTTPStatus.ACCEPTED or _created(scope, status)
                took_s = self.clock() - taken_at
                self.limit.release(took_s, accepted=accepted, tasks=_tasks_taken(scope))

    def _admit(self, scope: Scope) -> None:
        """Take a place for a submission whose body has arrived, or refuse it: `Overloaded`
        raised inside the application's read of its body, before the route acts on it."""
        if not self.limit.try_acquire():
            self._report_refusal()
            raise overloaded(self.limit, idempotency_key=_idempotency_key(scope))

    def _report_refusal(self) -> None:
        """Tell the operator that submissions are being shed, at most once per interval."""
        if (refused := self._refusals.count()) is None:
            return
        log.warning(
            "shedding submissions: %d refused with 503 since the last report; taking on %d at "
            "a time to finish them in %g s",
            refused,
            int(self.limit.limit),
            self.limit.target_s,
        )


def route_path(scope: Scope) -> str:
    """The path the application routes on: behind a proxy that mounts the gateway under a
    prefix (`root_path`, uvicorn's `--root-path`), ASGI's `path` carries that prefix too."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


def install_admission(app: FastAPI, *, target_ms: float, max_limit: int) -> AdaptiveLimit | None:
    """Guard the submission routes with an `AdaptiveLimit`; none when `target_ms` is 0."""
    if target_ms <= 0:
        return None
    limit = AdaptiveLimit(
        target_s=target_ms / 1000,
        min_limit=min(MIN_LIMIT, max_limit),
        max_limit=max_limit,
        initial_limit=INITIAL_LIMIT,
    )
    app.add_middleware(SubmissionAdmission, limit=limit, guarded=GUARDED)
    return limit


def _idempotency_key(scope: Scope) -> str | None:
    """The request's one well-formed Idempotency-Key, or None: one the route would refuse
    (malformed, sent twice) names no request to retry with."""
    keys = [value for name, value in scope["headers"] if name == b"idempotency-key"]
    if len(keys) != 1:
        return None
    key = str(keys[0].decode("latin-1"))
    return key if IDEMPOTENCY_KEY.match(key) else None


# The key in a request's `state` (`scope["state"]`) under which a submission route tells how
# many tasks it took on: a batch's time is measured per task for a cut (`weigh`).
TASKS_TAKEN = "admission_tasks_taken"
CREATED = "admission_created"


def weigh(request: Request, tasks: int) -> None:
    """Tell admission control that this submission takes on `tasks` tasks (a batch's items):
    its time counts per task when it would cut the limit (`AdaptiveLimit.release`). Measured
    whole, a batch of a thousand items took longer than the 2 s a single submission is
    given, cut the limit of every tenant's submissions by a fifth each time, and one
    tenant's steady large batches left the gateway shedding everyone's single submissions at
    a load it absorbed with room to spare (a review of the limits)."""
    request.scope.setdefault("state", {})[TASKS_TAKEN] = max(1, tasks)


def created(request: Request) -> None:
    """Tell admission control that this submission created a task although its answer is
    not a 202 (a result-cache hit, 200): it did the work the limit guards, so a quick one
    grows the limit. Counted as a replay's 200, the limit cut by a slow spell stayed at its
    floor while the traffic was mostly texts answered from the cache (review of admission)."""
    request.scope.setdefault("state", {})[CREATED] = True


def _tasks_taken(scope: Scope) -> int:
    state = scope.get("state") or {}
    tasks = state.get(TASKS_TAKEN, 1)
    return tasks if isinstance(tasks, int) and tasks > 0 else 1


def _created(scope: Scope, status: int | None) -> bool:
    return status == HTTPStatus.OK and (scope.get("state") or {}).get(CREATED) is True


def _ends_body(message: Message) -> bool:
    return message["type"] == "http.request" and not message.get("more_body", False)


class Overloaded(Problem):
    """A submission refused by admission control: raised inside the application's read of the
    body, so the application's own `Problem` handler answers it (503 problem+json)."""


def overloaded(limit: AdaptiveLimit, *, idempotency_key: str | None = None) -> Overloaded:
    return Overloaded(
        503,
        f"This gateway is taking on as many submissions as it can finish in about "
        f"{limit.target_s:g} s ({int(limit.limit)} at a time); "
        f"{nothing_kept(idempotency_key, when=f'after {RETRY_AFTER_S} s')}",
        kind="overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        limit="admission",
    )
