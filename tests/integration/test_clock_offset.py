"""A service whose clock is far from its database server's does not start: replicas judge
each other's records by their clocks (a review: a replica 90 s behind had the requests it
was refusing swept and scored by another). On the real database's `hello`."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from pymongo import AsyncMongoClient

from services.gateway.app import build_gateway, gateway_lifespan
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared import clock_offset
from shared.clock_offset import ClockOffsetTooLarge, DatabaseClock, clock_offset_s
from shared.runtime import DependencyUnreachable
from tests.support import closed_port, eventually, metric_sum, running


async def test_the_offset_is_measured_against_the_servers_clock(mongo: Any) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        in_step = await clock_offset_s(client)
        behind = await clock_offset_s(client, now=lambda: datetime.now(UTC) - timedelta(seconds=90))
    finally:
        await client.close()
    assert abs(in_step) < 5  # one machine
    assert 85 < behind < 95


async def test_a_service_whose_clock_is_behind_does_not_start(
    mongo: Any, amqp_url: str, db_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    behind = lambda: datetime.now(UTC) - timedelta(seconds=90)  # noqa: E731
    monkeypatch.setattr(clock_offset, "wall_clock", behind)
    env = {"RABBITMQ_URL": amqp_url, "MONGO_URL": mongo.url, "MONGO_DB_PREFIX": db_prefix}
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        status = create_status(StatusSettings.model_validate(env), mongo=client)
        with pytest.raises(ClockOffsetTooLarge, match=r"status's clock is 9\d\.\d s behind"):
            async with running(status):
                pass
        allowed = StatusSettings.model_validate({**env, "MAX_CLOCK_OFFSET_S": "120"})
        async with running(create_status(allowed, mongo=client)) as api:
            assert (await api.get("/healthz")).status_code == 200
    finally:
        await client.close()


async def test_a_clock_that_drifts_while_the_service_runs_is_exported_and_logged(
    mongo: Any,
    amqp_url: str,
    db_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Checked at start-up only, a clock that drifted afterwards (NTP stopped, a machine
    resumed) went unseen for as long as the service ran. The service goes on: measured
    against one server, a database host whose clock alone drifted would stop them all."""
    monkeypatch.setattr(clock_offset, "CLOCK_RECHECK_S", 0.05)
    env = {"RABBITMQ_URL": amqp_url, "MONGO_URL": mongo.url, "MONGO_DB_PREFIX": db_prefix}
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        status = create_status(StatusSettings.model_validate(env), mongo=client)
        with caplog.at_level(logging.WARNING, logger="scorebox.clock"):
            async with running(status) as api:
                behind = lambda: datetime.now(UTC) - timedelta(seconds=90)  # noqa: E731
                monkeypatch.setattr(clock_offset, "wall_clock", behind)

                async def offset_exported() -> float | None:
                    answer = await api.get("/metrics")
                    offset = metric_sum(answer.text, "scorebox_clock_offset_seconds")
                    return offset if offset > 60 else None

                assert 85 < await eventually(offset_exported, what="the offset exported") < 95
                assert (await api.get("/healthz")).status_code == 200
    finally:
        await client.close()
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 1  # once, not at every measure
    assert "status's clock is 9" in errors[0]
    assert "s behind the database server's" in errors[0]


async def test_a_start_that_fails_after_the_clock_check_leaves_no_watch_running(
    mongo: Any, db_prefix: str
) -> None:
    """Started with the database's check, the watch outlived a start that then failed on the
    broker, measuring every minute for the life of the loop, and a second start of the same
    app registered its gauge twice (a review). It starts once the service is up."""
    env = {
        "RABBITMQ_URL": f"amqp://guest:guest@127.0.0.1:{closed_port()}/",
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "STARTUP_TIMEOUT_S": "1",
    }
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        status = create_status(StatusSettings.model_validate(env), mongo=client)
        for _ in range(2):
            with pytest.raises(DependencyUnreachable, match="RabbitMQ at"):
                async with running(status):
                    pass
            assert not [
                task for task in asyncio.all_tasks() if "_keep_measuring" in repr(task.get_coro())
            ]
    finally:
        await client.close()


async def test_a_service_keeps_time_by_the_databases_clock(
    mongo: Any, amqp_url: str, db_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built without a clock, a service judges its records by the database's time, as its
    watch measures it (`DatabaseClock`): a scorer whose wall clock stepped ahead while it ran
    took over another replica's live claim (`test_scorer_clock_step.py`). Here this
    machine's wall clock is half an hour ahead (`MAX_CLOCK_OFFSET_S` an hour: not
    refused)."""
    half_an_hour_ahead = lambda: datetime.now(UTC) + timedelta(minutes=30)  # noqa: E731
    monkeypatch.setattr(clock_offset, "wall_clock", half_an_hour_ahead)
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "MAX_CLOCK_OFFSET_S": "3600",
    }
    gateway = build_gateway(GatewaySettings.model_validate(env))
    clock = gateway.deps.clock
    assert isinstance(clock, DatabaseClock)
    assert clock() - datetime.now(UTC) > timedelta(minutes=29)  # not measured yet: the wall's
    async with running(FastAPI(lifespan=gateway_lifespan(gateway))):

        async def measured() -> bool:
            return abs(clock() - datetime.now(UTC)) < timedelta(seconds=5)

        await eventually(measured, what="the gateway's clock on the database's time")
