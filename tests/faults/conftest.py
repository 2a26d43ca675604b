"""Fixtures of the fault tests: the figures of the session and the fake model of each module.

Tests marked `slow` (over a minute each) run only when pytest is pointed at tests/faults
(`make test-faults`) or `SCOREBOX_SLOW_TESTS=1` is set; a plain `make test` skips them with
that reason.
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from devtools.infra import Endpoint
from tests.faults.harness import REPO, RESULTS_PATH, BoxParts, Figures, make_target
from tests.faults.slow_link import SlowLink

SLOW_ENV = "SCOREBOX_SLOW_TESTS"
LOG_ROOT = REPO / ".run" / "logs" / "faults"
LOG_RETENTION_S = 24 * 3600


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"slow: over a minute; runs with `make test-faults` or {SLOW_ENV}=1"
    )


def _slow_tests_wanted(config: pytest.Config) -> bool:
    if os.environ.get(SLOW_ENV, "").lower() in {"1", "true", "yes"}:
        return True
    return make_target(config.args, config.invocation_params.dir) == "make test-faults"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _slow_tests_wanted(config):
        return
    skip = pytest.mark.skip(reason=f"slow fault test: runs with `make test-faults` or {SLOW_ENV}=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def figures(pytestconfig: pytest.Config) -> Iterator[Figures]:
    """The outcomes of this session's fault tests, written to `.run/results/faults.json`."""
    params = pytestconfig.invocation_params
    collected = Figures(
        path=RESULTS_PATH,
        command=make_target(pytestconfig.args, params.dir),
        invocation=shlex.join(["pytest", *params.args]),
    )
    yield collected
    collected.write()


@pytest.fixture(scope="module")
async def llm() -> AsyncIterator[FakeLLM]:
    server = await start_fake_llm(FakeLLMConfig(seed=7))
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def log_dir(request: pytest.FixtureRequest) -> Path:
    """`.run/logs/faults/<module>-<id>/`: the services' logs and the stand-ins' files.

    Not pytest's tmp_path: concurrent pytest sessions on this machine prune each other's
    temporary directories, which would take logs and a stand-in's database file away.
    """
    LOG_ROOT.mkdir(parents=True, exist_ok=True)
    stale = time.time() - LOG_RETENTION_S
    for old in LOG_ROOT.iterdir():
        if old.is_dir() and old.stat().st_mtime < stale:
            shutil.rmtree(old, ignore_errors=True)
    module = request.module.__name__.rsplit(".", 1)[-1]
    path = LOG_ROOT / f"{module}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def box_parts(
    amqp_url: str, mongo: Endpoint, db_prefix: str, llm: FakeLLM, log_dir: Path
) -> BoxParts:
    """What the module's `box` starts its stack from (`running_scorebox`)."""
    return BoxParts(amqp_url, mongo.url, db_prefix, llm, log_dir)


@pytest.fixture(scope="session")
def labels(rabbitmq: Endpoint, mongo: Endpoint) -> tuple[str, str]:
    """(broker, database) as the figures name them."""
    return rabbitmq.kind, mongo.kind


@pytest.fixture(scope="module")
async def link(mongo: Endpoint) -> AsyncIterator[SlowLink]:
    """A TCP proxy to the test database that can hold its replies back (`SlowLink`)."""
    proxy = SlowLink.to_mongo(mongo.url)
    await proxy.start()
    yield proxy
    await proxy.stop()
