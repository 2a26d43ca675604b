"""Every route refuses a query parameter it does not take, or one given twice (422): ignored,
a misspelt filter widened the answer (`?tenant=` listed every tenant's keys), a misspelt
cut-off would have had a purge remove every letter, and of two values the last was taken
without a word.

What a route takes is read from the app's own OpenAPI document (its `in: query` parameters),
so the list is the one FastAPI builds from the route's signature and dependencies, never a
second one kept by hand. A route left out of the document (`include_in_schema=False`) is not
checked."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.routing import BaseRoute

from shared.http import refuse_unexpected_query

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]

# What a refused request did not do, by its method: the detail says so.
OUTCOMES: Mapping[str, str] = {
    "DELETE": "nothing was removed",
    "POST": "nothing was done",
    "PUT": "nothing was changed",
    "PATCH": "nothing was changed",
}


class _Taken:
    """The query parameters of each operation of an app, read from its OpenAPI document
    once, at the first request that needs them (building it costs tens of milliseconds)."""

    def __init__(self) -> None:
        self._by_operation: dict[tuple[str, str], frozenset[str]] | None = None

    def of(self, app: FastAPI, path: str, method: str) -> frozenset[str] | None:
        if self._by_operation is None:
            self._by_operation = _query_parameters(app.openapi())
        return self._by_operation.get((path, method.lower()))


def _query_parameters(document: Mapping[str, Any]) -> dict[tuple[str, str], frozenset[str]]:
    taken: dict[tuple[str, str], frozenset[str]] = {}
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            parameters = operation.get("parameters", [])
            names = {each["name"] for each in parameters if each.get("in") == "query"}
            taken[path, method] = frozenset(names)
    return taken


def document_before_serving(lifespan: Lifespan) -> Lifespan:
    """`lifespan` with the app's OpenAPI document built first: the query-parameter check and
    the 405s read it, and built at the first request it held that request's event loop
    for about 60 ms (the gateway's)."""

    @asynccontextmanager
    async def documented(app: FastAPI) -> AsyncIterator[None]:
        app.openapi()
        async with lifespan(app):
            yield

    return documented


def only_known_query_parameters() -> Any:
    """The dependency every route of an app runs first (`FastAPI(dependencies=[...])`): a
    422 problem naming a query parameter the route does not take or one given twice."""
    taken = _Taken()

    async def refuse_unknown(request: Request) -> None:
        route: BaseRoute | None = request.scope.get("route")
        path = getattr(route, "path_format", None)
        if not isinstance(path, str):
            return
        expected = taken.of(request.app, path, request.method)
        if expected is None:
            return  # not in the document: not checked
        outcome = OUTCOMES.get(request.method)
        refuse_unexpected_query(request, expected, outcome=outcome)

    return Depends(refuse_unknown)
