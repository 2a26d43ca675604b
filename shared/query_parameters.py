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

from shared.http import documented_paths, refuse_unexpected_query

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]

# What a refused request did not do, by its method: the detail says so.
OUTCOMES: Mapping[str, str] = {
    "DELETE": "nothing was removed",
    "POST": "nothing was done",
    "PUT": "nothing was changed",
    "PATCH": "nothing was changed",
}


def document_before_serving(lifespan: Lifespan) -> Lifespan:
    """`lifespan` with the app's OpenAPI document read first (`documented_paths`): the
    query-parameter check and the 405s read it, and read at the first request it held that
    request's event loop for about 60 ms (the gateway's)."""

    @asynccontextmanager
    async def documented(app: FastAPI) -> AsyncIterator[None]:
        documented_paths(app)
        async with lifespan(app):
            yield

    return documented


def only_known_query_parameters() -> Any:
    """The dependency every route of an app runs first (`FastAPI(dependencies=[...])`): a
    422 problem naming a query parameter the route does not take or one given twice."""

    async def refuse_unknown(request: Request) -> None:
        route: BaseRoute | None = request.scope.get("route")
        path = getattr(route, "path_format", None)
        documented = documented_paths(request.app).get(path) if isinstance(path, str) else None
        expected = None if documented is None else documented.query_parameters.get(request.method)
        if expected is None:
            return  # not in the document: not checked
        outcome = OUTCOMES.get(request.method)
        refuse_unexpected_query(request, expected, outcome=outcome)

    return Depends(refuse_unknown)
