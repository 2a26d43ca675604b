"""HTTP conventions of every service: RFC 9457 problem+json errors, health endpoints, the
bearer-key guards (admin, metrics, internal) and reading `Retry-After`."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from email.utils import parsedate_to_datetime
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, SecretStr, ValidationError
from pymongo.errors import PyMongoError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.routing import compile_path

from shared.database_errors import transient_database_error
from shared.runtime import READINESS_DEADLINE_S, Check

PROBLEM_JSON = "application/problem+json"
PROBLEM_BASE = "https://scorebox.dev/problems/"
# The status service's 404 for a task it does not know (or no longer keeps); its readers
# tell it from any other 404 (a proxy's page, a wrong path) by this type.
TASK_UNKNOWN = "task-unknown"

log = logging.getLogger("scorebox.http")

_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class Problem(Exception):
    """An error answered as problem+json; raise it from routes and adapters."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        kind: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.kind = kind or _TITLES.get(status, "error").lower().replace(" ", "-")
        self.headers = dict(headers or {})
        self.extensions = extensions


# An `instance` longer than this is left out: a path of thousands of characters echoed whole.
MAX_INSTANCE_CHARS = 2_048


def problem_instance(scope: Mapping[str, Any]) -> str | None:
    """The problem's `instance`: the request's path as it was sent, percent-encoded (a URI
    reference, as RFC 9457 has it), None when over `MAX_INSTANCE_CHARS`. The decoded path
    echoed a NUL or a right-to-left override as the characters themselves, and a 5,000-
    character id whole (a walkthrough)."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else quote(str(scope.get("path", "")))
    return path if len(path) <= MAX_INSTANCE_CHARS else None


def problem_response(problem: Problem, instance: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + problem.kind,
        "title": _TITLES.get(problem.status, "Error"),
        "status": problem.status,
        "detail": problem.detail,
        **problem.extensions,
    }
    if instance:
        body["instance"] = instance
    return JSONResponse(
        body, status_code=problem.status, media_type=PROBLEM_JSON, headers=problem.headers
    )


# How pydantic words a validator's own message ahead of it: noise to a client.
VALIDATOR_PREFIXES = ("Value error, ", "Assertion failed, ")


def validation_message(error: Mapping[str, Any]) -> str:
    """A validation error's message as a client reads it: without pydantic's "Value error, "
    ahead of the validator's own words (found in a walkthrough)."""
    message = str(error.get("msg", "invalid"))
    for prefix in VALIDATOR_PREFIXES:
        message = message.removeprefix(prefix)
    return message


# A 422 names at most this many of a body's errors and counts the rest: a batch of 15 MiB
# of unknown keys was 1.3 million errors, which took the gateway's loop for 10 s and 2.3 GB
# to describe in a 156 MiB answer (review of batches).
MAX_ERRORS_SHOWN = 50


def described_errors(
    errors: Sequence[Mapping[str, Any]], field_of: Callable[[Mapping[str, Any]], str]
) -> tuple[str, list[dict[str, str]]]:
    """(detail, errors as a 422 lists them): at most `MAX_ERRORS_SHOWN` of `errors`, each
    with its field as `field_of` names it, the rest counted in the detail."""
    shown = [
        {"field": field_of(error), "message": validation_message(error)}
        for error in errors[:MAX_ERRORS_SHOWN]
    ]
    detail = "; ".join(f"{each['field'] or 'body'}: {each['message']}" for each in shown)
    if len(errors) > MAX_ERRORS_SHOWN:
        detail += f"; and {len(errors) - MAX_ERRORS_SHOWN} more errors, not listed"
    return detail, shown


def _describe(errors: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, str]]]:
    return described_errors(
        errors, lambda error: ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    )


def database_unavailable(method: str) -> Problem:
    """503 for a request the service's database did not answer (down, or over its timeout)."""
    detail = "The service's database did not answer; try again shortly."
    if method not in ("GET", "HEAD"):
        detail += " The request may have taken effect: check before repeating it."
    return Problem(503, detail, kind="database-unavailable", headers={"Retry-After": "5"})


def database_refused(error: BaseException) -> Problem:
    """500 for an operation the service's database refuses for good (a failed validation, a
    document over 16 MiB, a missing privilege): unlike an outage, retrying meets it again, so
    no Retry-After; what the database said goes to the log, not to the client."""
    log.error("the database refused a request's operation for good", exc_info=error)
    return Problem(
        500,
        "The database refused this operation for good (the service's log says why); "
        "retrying it unchanged meets the same refusal.",
        kind="database-refused",
    )


def _routing_detail(
    request: Request, status: int, given: object, headers: Mapping[str, str] | None
) -> str | None:
    """What the router's own 404 and 405 say, in words a person can act on (they said only
    "Not Found" and "Method Not Allowed"); None for any other error, or one a route raised
    with words of its own."""
    if given != HTTPStatus(status).phrase:
        return None
    if status == HTTPStatus.NOT_FOUND:
        where = f"{request.method} {request.url.path}"
        return f"No route answers {where}; the routes are listed at /docs and /openapi.json."
    if status == HTTPStatus.METHOD_NOT_ALLOWED:
        allowed = (headers or {}).get("Allow", "")
        return f"{request.method} is not allowed on {request.url.path}; it takes {allowed}."
    return None


def _allowed(request: Request, headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """A 405's `Allow`: the methods of every documented operation of the path, HEAD wherever
    GET is (every app answers HEAD there: `shared.head_requests`). Starlette names the first
    route's alone: `POST /v1/webhooks/failure-alert` was told "GET" where PUT and DELETE are
    taken too (found in review). Read from the app's OpenAPI document, whose paths are the
    routes' templates (FastAPI keeps included routers as nodes of its own, not routes)."""
    if headers is None or "Allow" not in headers:
        return headers
    path = _route_path(request.scope)
    methods = {
        method
        for documented in documented_paths(request.app).values()
        if documented.pattern.fullmatch(path)
        for method in documented.query_parameters
    }
    if not methods:  # a route left out of the document: Starlette's, HEAD added
        methods = {method.strip() for method in headers["Allow"].split(",")}
    if "GET" in methods:
        methods.add("HEAD")
    return {**headers, "Allow": ", ".join(sorted(methods))}


def _route_path(scope: Mapping[str, Any]) -> str:
    """The request's path as the routes' templates read it: without the app's root path
    (which the server's `path` includes)."""
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    return path[len(root) :] if root and path.startswith(root) else path


@dataclass(frozen=True)
class DocumentedPath:
    """A path template of an app's OpenAPI document: its pattern, and the query parameters
    of each of its operations by method (upper case)."""

    pattern: re.Pattern[str]
    query_parameters: Mapping[str, frozenset[str]]


@functools.lru_cache(maxsize=16)
def documented_paths(app: FastAPI) -> Mapping[str, DocumentedPath]:
    """The paths of `app`'s OpenAPI document by template, read once per app: the one list of
    what its routes take, which FastAPI builds from their signatures (the 405s' `Allow` and
    `shared.query_parameters` read it)."""
    documented: dict[str, DocumentedPath] = {}
    for path, operations in app.openapi().get("paths", {}).items():
        parameters = {
            method.upper(): _query_names(operation) for method, operation in operations.items()
        }
        documented[path] = DocumentedPath(compile_path(path)[0], parameters)
    return documented


def _query_names(operation: Mapping[str, Any]) -> frozenset[str]:
    parameters = operation.get("parameters", [])
    return frozenset(each["name"] for each in parameters if each.get("in") == "query")


def install_problem_handlers(app: FastAPI) -> None:
    """Make every error of `app` a problem+json answer."""

    async def on_problem(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Problem)
        return problem_response(exc, problem_instance(request.scope))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        detail, errors = _describe(list(exc.errors()))
        problem = Problem(422, detail, kind="invalid-fields", errors=errors)
        return problem_response(problem, problem_instance(request.scope))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = _allowed(request, exc.headers)
        detail = _routing_detail(request, exc.status_code, exc.detail, headers)
        problem = Problem(exc.status_code, detail or str(exc.detail), headers=headers)
        return problem_response(problem, problem_instance(request.scope))

    async def on_client_gone(request: Request, exc: Exception) -> JSONResponse:
        # The client hung up before its body was read (it timed out waiting): nothing was
        # done, and nobody will read an answer.
        log.info("client disconnected before %s %s was read", request.method, request.url.path)
        problem = Problem(400, "The client disconnected before its request was read.")
        return problem_response(problem, problem_instance(request.scope))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        problem = Problem(500, "An unexpected error occurred; it has been logged.")
        return problem_response(problem, problem_instance(request.scope))

    async def on_database_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PyMongoError)
        if not transient_database_error(exc):
            return problem_response(database_refused(exc), problem_instance(request.scope))
        log.warning("database unavailable on %s %s: %r", request.method, request.url.path, exc)
        return problem_response(
            database_unavailable(request.method), problem_instance(request.scope)
        )

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(PyMongoError, on_database_error)
    app.add_exception_handler(Exception, on_unexpected)
    _document_validation_problems(app)


def _document_validation_problems(app: FastAPI) -> None:
    """The OpenAPI document shows the 422 the service sends: FastAPI documents its own
    `HTTPValidationError` (`detail: [{loc, msg, type}]`, `application/json`), which no route
    answers here (`on_validation` makes it problem+json with `errors: [{field, message}]`),
    and only on a route that has parameters, though every route refuses a query parameter
    it does not take (`shared.query_parameters`). And every operation documents the 500
    every route may answer (`SERVER_PROBLEM`), unless it documents its own."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if "HTTPValidationError" in str(responses.get("422", "")):
                    responses["422"] = VALIDATION_PROBLEM
                responses.setdefault("422", VALIDATION_PROBLEM)
                responses.setdefault("500", SERVER_PROBLEM)
        schemas = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
    },
}
# The 422 every service answers for invalid fields: a problem naming each of them.
VALIDATION_PROBLEM: dict[str, Any] = {
    "description": "Invalid fields, each named (RFC 9457 problem details).",
    "content": {
        PROBLEM_JSON: {
            "schema": {
                **PROBLEM_SCHEMA,
                "properties": {
                    **PROBLEM_SCHEMA["properties"],
                    "errors": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string"},
                                "message": {"type": "string"},
                            },
                        },
                    },
                },
            }
        }
    },
}
RETRY_AFTER_HEADER: dict[str, Any] = {
    "description": "Seconds to wait before trying again.",
    "schema": {"type": "integer", "minimum": 0},
}
# The answers that say when to come back (`Retry-After`).
_RETRY_LATER = frozenset({429, 503})


def problem(
    status: int,
    description: str | None = None,
    *,
    retry_after: bool | None = None,
    headers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The OpenAPI response of a problem+json answer of `status`, with its `Retry-After`
    header when it may have one (429 and 503 unless `retry_after` says otherwise) and any
    other `headers` it may carry."""
    if status == 422:
        return VALIDATION_PROBLEM
    documented: dict[str, Any] = {
        "description": description or f"{_TITLES.get(status, 'Error')} (RFC 9457 problem details).",
        "content": {PROBLEM_JSON: {"schema": PROBLEM_SCHEMA}},
    }
    declared = dict(headers or {})
    if status in _RETRY_LATER if retry_after is None else retry_after:
        declared["Retry-After"] = RETRY_AFTER_HEADER
    if declared:
        documented["headers"] = declared
    return documented


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route (or router) for the problem+json answers of `statuses`."""
    return {status: problem(status) for status in statuses}


# The 500 any route may answer: an error of ours, or the database refusing an operation for
# good (`database_refused`; a read, or the lookup of a key, may meet it too).
SERVER_PROBLEM = problem(
    500,
    "An unexpected error (`internal-server-error`, logged), or `database-refused`: the "
    "database refused an operation for good (a missing privilege, say); no Retry-After.",
)

# The 500 of `database_refused`, for the `responses` of a route whose write the database may
# refuse for good (no `Retry-After`: retrying meets the same refusal).
DATABASE_REFUSED_PROBLEM = problem(
    500,
    "`database-refused`: the database refused the operation for good (a failed validation, "
    "a document over 16 MiB, a missing privilege); retrying it unchanged meets the same "
    "refusal, so no Retry-After.",
)


class Readiness(BaseModel):
    """What `/readyz` answers: 200 when every dependency answered its check, else 503."""

    status: Literal["ready", "unavailable"]
    checks: dict[str, bool] = Field(description="Each dependency: whether it answered in time.")


READINESS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Readiness, "description": "Every dependency answered its check."},
    503: {
        "model": Readiness,
        "description": "A dependency did not answer its check in time (`status: unavailable`; "
        "`checks` says which).",
    },
}


def health_router(checks: Mapping[str, Check]) -> APIRouter:
    """`/healthz` (the process answers) and `/readyz` (every dependency answers, each within
    `READINESS_DEADLINE_S`, all at once). HEAD is answered by the app's `HeadAsGet`
    (`shared.head_requests`): load balancers that probe with HEAD got 405 and took every
    replica out."""
    router = APIRouter(tags=["health"])

    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    async def readyz() -> JSONResponse:
        results = await _all_checked(checks)
        ready = all(results.values())
        body = {"status": "ready" if ready else "unavailable", "checks": results}
        return JSONResponse(body, status_code=200 if ready else 503)

    router.add_api_route("/healthz", healthz, methods=["GET"])
    router.add_api_route(
        "/readyz", readyz, methods=["GET"], response_model=None, responses=READINESS_RESPONSES
    )
    return router


async def _all_checked(checks: Mapping[str, Check]) -> dict[str, bool]:
    """Each check's answer, all asked at once: `/readyz` answers within one
    `READINESS_DEADLINE_S` whatever is away (one after another, they took 15 s to say 503)."""
    names = list(checks)
    answers = await asyncio.gather(*(_within_deadline(checks[name]) for name in names))
    return dict(zip(names, answers, strict=True))


async def _within_deadline(check: Check) -> bool:
    """`check`'s answer, "not ready" once `READINESS_DEADLINE_S` passed without one."""
    try:
        async with asyncio.timeout(READINESS_DEADLINE_S):
            return await check()
    except TimeoutError:
        return False


# `Authorization: Bearer <token>`: the scheme in any case (RFC 9110 §11.1), then one or more
# spaces (tabs tolerated) before the token; blanks around the whole value are the server's
# to strip.
_BEARER_CREDENTIALS = re.compile(r"bearer[ \t]+(.+)", re.IGNORECASE)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without the header, for
    another scheme, or without a token."""
    if authorization is None:
        return None
    credentials = _BEARER_CREDENTIALS.fullmatch(authorization.strip(" \t"))
    return None if credentials is None else credentials[1]


def one_header(request: HTTPConnection, name: str) -> str | None:
    """The value of header `name`, which the request must send at most once: 400 when it
    sends it again. Of two, the first was taken without a word, and an intermediary taking
    the last (or joining them) reads another request: for `Authorization`, another tenant
    (found in a walkthrough), as a repeated `Idempotency-Key` was another task."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise Problem(400, f"{name} was sent more than once: send one.")
    return values[0] if values else None


class BearerScheme(HTTPBearer):
    """FastAPI's bearer scheme (the OpenAPI security scheme it declares) reading the header
    with `bearer_token`, the one reading of every key guard and the public routes: FastAPI's
    took the scheme in any case, but not a tab before the token. A request that sends the
    header twice is refused (400, `one_header`) before any key is looked at."""

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        token = bearer_token(one_header(request, "Authorization"))
        if token is None:
            if self.auto_error:
                raise self.make_not_authenticated_error()
            return None
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)


ADMIN_KEY_SCHEME = BearerScheme(
    scheme_name="AdminKey",
    description="The admin key: `Authorization: Bearer <ADMIN_API_KEY>`.",
    auto_error=False,
)
METRICS_KEY_SCHEME = BearerScheme(
    scheme_name="MetricsKey",
    description="`Authorization: Bearer <METRICS_API_KEY>` (or the admin key).",
    auto_error=False,
)
# The same scheme where no admin key is held (the status service, the scorer, the notifier).
METRICS_ONLY_KEY_SCHEME = BearerScheme(
    scheme_name="MetricsKey",
    description="`Authorization: Bearer <METRICS_API_KEY>`.",
    auto_error=False,
)
INTERNAL_KEY_SCHEME = BearerScheme(
    scheme_name="InternalKey",
    description="The services' internal key, which the gateway sends: "
    "`Authorization: Bearer <INTERNAL_API_KEY>`.",
    auto_error=False,
)
# The admin guard's answers, for the `responses` of every admin router.
ADMIN_PROBLEMS: dict[int | str, dict[str, Any]] = {
    401: problem(401, "No admin key, or not this one (`Authorization: Bearer <ADMIN_API_KEY>`)."),
    403: problem(403, "The admin API is disabled: ADMIN_API_KEY is not set."),
}
# The metrics guards' answers, for the `responses` of a guarded `/metrics`.
METRICS_PROBLEMS: dict[int | str, dict[str, Any]] = {
    401: problem(
        401,
        "No metrics key (or admin key, where the service takes one), or not this one "
        "(`Authorization: Bearer <METRICS_API_KEY>`).",
    ),
}
GATEWAY_METRICS_PROBLEMS: dict[int | str, dict[str, Any]] = {
    **METRICS_PROBLEMS,
    403: problem(403, "Metrics are disabled: neither METRICS_API_KEY nor ADMIN_API_KEY is set."),
}
# The internal guard's answer, for the `responses` of every internal router.
INTERNAL_PROBLEMS: dict[int | str, dict[str, Any]] = {
    401: problem(
        401,
        "INTERNAL_API_KEY is set and the request does not carry it "
        "(`Authorization: Bearer <INTERNAL_API_KEY>`).",
    ),
}


def admin_guard(admin_key: SecretStr | None) -> Any:
    """A dependency that admits only `Authorization: Bearer <ADMIN_API_KEY>`.

    Without a configured key the admin routes are disabled (403), never open.
    """
    return _bearer_guard(
        [admin_key],
        scheme=ADMIN_KEY_SCHEME,
        disabled="The admin API is disabled: set ADMIN_API_KEY to enable it.",
        hint="Send the admin key as 'Authorization: Bearer <ADMIN_API_KEY>'.",
        realm=ADMIN_REALM,
    )


_METRICS_HINT = "Send 'Authorization: Bearer <METRICS_API_KEY>'"


def metrics_guard(metrics_key: SecretStr | None, admin_key: SecretStr | None) -> Any:
    """The gateway's `/metrics`, for a scraper holding `METRICS_API_KEY` (read-only: it opens
    nothing else), or the admin key; disabled (403) when neither is configured."""
    return _bearer_guard(
        [metrics_key, admin_key],
        scheme=METRICS_KEY_SCHEME,
        disabled="Metrics are disabled: set METRICS_API_KEY (or ADMIN_API_KEY).",
        hint=f"{_METRICS_HINT} (or the admin key).",
        realm=METRICS_REALM,
    )


def internal_metrics_guard(
    metrics_key: SecretStr | None, service: str, *, admin_key: SecretStr | None = None
) -> Any:
    """The guard of `/metrics` on a service other than the gateway, or None (open).

    With `METRICS_API_KEY` set it admits that key, or the admin key of a service that holds
    one (as the gateway's does), and answers anything else 401. Unset, `/metrics` answers
    anyone, as before the key existed, and one warning says so: a service builds its app
    once, at start (the guard is built with it, so the warning cannot wait for its lifespan).
    """
    if not _configured([metrics_key]):
        log.warning(
            "METRICS_API_KEY is not set: the %s's /metrics answers anyone who reaches its "
            "port, and only the network protects it",
            service,
        )
        return None
    if _configured([admin_key]):
        return metrics_guard(metrics_key, admin_key)
    return _bearer_guard(
        [metrics_key],
        scheme=METRICS_ONLY_KEY_SCHEME,
        disabled="",  # never said: the key is configured
        hint=f"{_METRICS_HINT}.",
        realm=METRICS_REALM,
    )


def internal_guard(internal_key: SecretStr | None) -> Any:
    """A dependency of the internal routes (`/internal/...`, the gateway's calls) that admits
    only `Authorization: Bearer <INTERNAL_API_KEY>`: no other key opens them, the admin key
    included.

    Without a configured key the routes are open, as they were before the key existed: the
    network is then their only protection (`warn_if_internal_routes_open` says so).
    """
    if not _configured([internal_key]):
        return Depends(_admit_anyone)
    return _bearer_guard(
        [internal_key],
        scheme=INTERNAL_KEY_SCHEME,
        disabled="",  # never said: the key is configured
        hint="Send the internal key as 'Authorization: Bearer <INTERNAL_API_KEY>'.",
        realm=INTERNAL_REALM,
    )


async def _admit_anyone() -> None:
    return None


def warn_if_internal_routes_open(internal_key: SecretStr | None, service: str) -> None:
    """One warning, at start, from a service whose internal routes answer anyone."""
    if not _configured([internal_key]):
        log.warning(
            "INTERNAL_API_KEY is not set: the %s's internal routes (/internal/...) answer "
            "anyone who reaches its port, and only the network protects them",
            service,
        )


def internal_key_headers(internal_key: SecretStr | None) -> dict[str, str]:
    """The headers a caller of the internal routes sends: none without a configured key."""
    configured = _configured([internal_key])
    return {"Authorization": f"Bearer {configured[0].decode()}"} if configured else {}


def log_if_internal_key_refused(status_code: int, service: str) -> None:
    """The caller's side of a 401 from an internal route: its INTERNAL_API_KEY is not the
    service's, and every call will fail alike (a 503 to the client) until they agree."""
    if status_code == 401:
        log.error(
            "the %s refused this service's internal key (401): both need the same INTERNAL_API_KEY",
            service,
        )


def unreadable(error: Exception) -> str:
    """Why a service's answer could not be read, in words that quote none of it: a
    ValidationError's text quotes the input (a signing secret, a task's text), and a
    failed call is logged (`shared.log_rate.FailedCalls`; a review)."""
    if not isinstance(error, ValidationError):
        return type(error).__name__
    found = error.errors(include_input=False, include_url=False)
    return "; ".join(
        f"{'.'.join(str(part) for part in found_error['loc']) or 'body'}: {found_error['msg']}"
        for found_error in found[:3]
    )


def database_refused_answer(response: httpx.Response) -> bool:
    """Whether a service of ours answered `database_refused`'s 500: its database refuses the
    operation for good, and a caller passing it on as a 503 "retry shortly" had clients
    retry for ever (a review)."""
    if response.status_code != 500:
        return False
    problem = problem_in(response) or {}
    return problem.get("type") == PROBLEM_BASE + "database-refused"


def problem_in(response: httpx.Response) -> dict[str, Any] | None:
    """The problem+json object a service answered with; None for any other body (a proxy's
    page, a wrong port's answer)."""
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != PROBLEM_JSON:
        return None
    try:
        problem = response.json()
    except ValueError:
        return None
    return problem if isinstance(problem, dict) else None


def _configured(keys: Sequence[SecretStr | None]) -> list[bytes]:
    """Each configured key, as bytes; an empty key is no key."""
    return [
        key.get_secret_value().encode()
        for key in keys
        if key is not None and key.get_secret_value()
    ]


# The realms of the operators' keys: a tenant's API key is challenged for "scorebox"
# (`services/gateway/auth.py`), so a client sending one where another key is due is told.
ADMIN_REALM = "scorebox-admin"
METRICS_REALM = "scorebox-metrics"
INTERNAL_REALM = "scorebox-internal"


def bearer_challenge(realm: str, sent: object | None) -> str:
    """`WWW-Authenticate` for a bearer token refused: `error="invalid_token"` when one was
    sent (none sent: the challenge alone, as RFC 6750 section 3.1 asks)."""
    challenge = f'Bearer realm="{realm}"'
    return challenge if sent is None else f'{challenge}, error="invalid_token"'


def _bearer_guard(
    keys: Sequence[SecretStr | None],
    *,
    scheme: BearerScheme,
    disabled: str,
    hint: str,
    realm: str,
) -> Any:
    """A dependency admitting a request whose bearer token (as `scheme` reads it, which also
    documents the guard) is one of `keys`; a 401 challenges for `realm` (RFC 6750), with
    `error="invalid_token"` when a token was sent."""
    configured = _configured(keys)

    # A default, not `Annotated`: with postponed annotations FastAPI reads an annotation in
    # the module's globals, where `scheme` is not.
    read_token = Depends(scheme)

    async def require_key(credentials: HTTPAuthorizationCredentials | None = read_token) -> None:
        if not configured:
            raise Problem(403, disabled)
        # As bytes: the server decodes header bytes as Latin-1, and `compare_digest` refuses
        # strings with other than ASCII in them (a TypeError: a 500 instead of a 401).
        sent = None if credentials is None else credentials.credentials.encode("latin-1")
        # Every key compared, whichever matches: the time taken tells nothing.
        matched = [sent is not None and hmac.compare_digest(sent, key) for key in configured]
        if not any(matched):
            raise Problem(401, hint, headers={"WWW-Authenticate": bearer_challenge(realm, sent)})

    return Depends(require_key)


# `date.fromisoformat` also takes ISO 8601's other forms (2025-W01-1, 20250101).
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
# How much of a refused value a problem quotes: a query string may hold tens of kilobytes.
_QUOTED_CHARS = 40


def parse_day(value: str, name: str) -> date:
    """A query parameter `name` as a YYYY-MM-DD date; a 422 problem otherwise."""
    if _DAY.fullmatch(value):
        try:
            return date.fromisoformat(value)
        except ValueError:  # 2025-02-30
            pass
    message = f"must be a date as YYYY-MM-DD, not {quoted(value)}"
    raise Problem(
        422,
        f"`{name}` {message}.",
        kind="invalid-fields",
        errors=[{"field": f"query.{name}", "message": message}],
    )


def quoted(value: str) -> str:
    """`value` as a detail quotes it: its repr, cut after `_QUOTED_CHARS` characters."""
    if len(value) <= _QUOTED_CHARS:
        return repr(value)
    return f"{value[:_QUOTED_CHARS]!r}… ({len(value):,} characters)"


def invalid_query(name: str, message: str, *, outcome: str | None = None) -> Problem:
    """A 422 naming query parameter `name`, as the services answer invalid fields
    (`install_problem_handlers`); `outcome` (such as "nothing was removed") ends the detail."""
    field = f"query.{name[:100]}"
    detail = f"{field}: {message}" + (f"; {outcome}." if outcome else ".")
    return Problem(
        422, detail, kind="invalid-fields", errors=[{"field": field, "message": message}]
    )


def refuse_unexpected_query(
    request: Request, expected: Collection[str], *, outcome: str | None = None
) -> None:
    """A 422 (`invalid_query`) for a query parameter the route does not take, or one given
    more than once: ignored, a misspelt filter widened the answer (`?tenant=` listed every
    tenant's keys) and of two values the last was taken without a word."""
    unknown = sorted(set(request.query_params) - set(expected))
    if unknown:
        taken = ", ".join(f"`{name}`" for name in sorted(expected))
        message = "is not a parameter of this route " + (
            f"(only {taken})" if taken else "(it takes none)"
        )
        raise invalid_query(unknown[0], message, outcome=outcome)
    for name in sorted(expected):
        if len(request.query_params.getlist(name)) > 1:
            raise invalid_query(name, "must be given once", outcome=outcome)


def parse_seconds(value: str | None) -> float | None:
    """A header's number of seconds (fractions tolerated); None if absent, negative or not one."""
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if number >= 0 and math.isfinite(number) else None


def parse_retry_after(value: str | None, *, now: datetime) -> float | None:
    """`Retry-After` as seconds from `now`: delta-seconds or an HTTP-date (always GMT, so a
    date without a zone is read as UTC); None if absent or unreadable."""
    seconds = parse_seconds(value)
    if seconds is not None or value is None:
        return seconds
    try:
        moment = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):  # a year past datetime's
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, (moment - now).total_seconds())
