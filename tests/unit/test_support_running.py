"""`tests.support.running` ends an app's lifespan as a server does, even when the test body
fails: thrown into the lifespan, the error skipped the services' shutdown and left their
broker connections open (the session then hung at its end)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI

from tests.support import running


async def test_the_lifespan_shuts_down_when_the_body_raises() -> None:
    stopped: list[bool] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        stopped.append(True)  # after the yield, not in a `finally`, as the services' are

    with pytest.raises(ValueError, match="the test failed"):
        async with running(FastAPI(lifespan=lifespan)):
            raise ValueError("the test failed")
    assert stopped == [True]
