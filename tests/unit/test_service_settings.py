"""Settings a service cannot work with are refused at start-up, with the variable named."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.settings import GatewaySettings
from services.scheduler.settings import SchedulerSettings
from services.scorer.model.heuristic import HEURISTIC_MODEL_NAME
from services.scorer.model.prompt import PROMPT_VERSION
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.settings import StatusSettings
from shared.contracts import PROMPT_VERSIONS


@pytest.mark.parametrize("variable", ["STATUS_URL", "NOTIFIER_URL", "SCHEDULER_URL"])
@pytest.mark.parametrize(
    "url", ["127.0.0.1:8001", "status:8001", "", "ftp://status", "http://[::1"]
)
def test_a_service_url_that_is_no_http_url_is_refused(variable: str, url: str) -> None:
    """It was accepted, and every poll (webhook, usage) then answered 503."""
    with pytest.raises(ValidationError, match=variable):
        GatewaySettings.model_validate({variable: url})


def test_a_service_url_with_a_host_is_taken() -> None:
    settings = GatewaySettings.model_validate({"STATUS_URL": "http://status:8001"})
    assert settings.status_url == "http://status:8001"


@pytest.mark.parametrize("port", ["-1", "65536", "70000"])
def test_a_port_out_of_range_is_refused(port: str) -> None:
    """`make run` died with an OverflowError traceback at its free-port check."""
    with pytest.raises(ValidationError, match="GATEWAY_PORT"):
        GatewaySettings.model_validate({"GATEWAY_PORT": port})
    with pytest.raises(ValidationError, match="STATUS_PORT"):
        StatusSettings.model_validate({"STATUS_PORT": port})


@pytest.mark.parametrize(
    ("given", "level"), [("warn", "WARNING"), ("fatal", "CRITICAL"), ("info", "INFO")]
)
def test_log_levels_are_read_in_the_spellings_operators_write(given: str, level: str) -> None:
    assert StatusSettings.model_validate({"LOG_LEVEL": given}).log_level == level


@pytest.mark.parametrize("level", ["trace", "verbose", ""])
def test_an_unknown_log_level_is_refused(level: str) -> None:
    """`warn` crashed uvicorn and `trace` crashed `logging`, after start-up had begun."""
    with pytest.raises(ValidationError, match="LOG_LEVEL"):
        StatusSettings.model_validate({"LOG_LEVEL": level})


@pytest.mark.parametrize(
    ("settings", "variable"),
    [
        (StatusSettings, "PROJECTION_PREFETCH"),
        (SchedulerSettings, "USAGE_METER_PREFETCH"),
        (SchedulerSettings, "SCHEDULER_JOB_CONCURRENCY"),
        (ScorerSettings, "SCORER_PREFETCH"),
    ],
)
def test_a_prefetch_amqp_cannot_carry_is_refused(settings: Any, variable: str) -> None:
    """Above 65,535 the consumer's channel failed at start with a TypeError."""
    with pytest.raises(ValidationError, match=variable):
        settings.model_validate({variable: "70000"})


@pytest.mark.parametrize("timeout", ["inf", "2000"])
def test_a_model_timeout_beyond_what_claims_and_the_broker_allow_is_refused(timeout: str) -> None:
    """`inf` crashed the scorer at start; beyond the broker's consumer timeout a held
    delivery's channel is closed under it."""
    with pytest.raises(ValidationError, match="LLM_TIMEOUT_S"):
        ModelSettings.model_validate({"LLM_TIMEOUT_S": timeout})


@pytest.mark.parametrize("settings", [GatewaySettings, SchedulerSettings])
def test_a_rubric_version_no_result_carries_is_refused(settings: Any) -> None:
    """`v2` matched no result: the cache served nothing and the fan-out re-scored everything."""
    with pytest.raises(ValidationError, match="RUBRIC_VERSION"):
        settings.model_validate({"RUBRIC_VERSION": "v2"})
    assert settings.model_validate({"RUBRIC_VERSION": ""}).rubric_version is None
    for version in PROMPT_VERSIONS:
        assert settings.model_validate({"RUBRIC_VERSION": version}).rubric_version == version


def test_the_scorers_versions_are_the_ones_settings_accept() -> None:
    assert {PROMPT_VERSION, HEURISTIC_MODEL_NAME} == PROMPT_VERSIONS


def test_a_full_batch_that_could_never_fit_in_flight_is_refused() -> None:
    """Every batch above the in-flight limit was answered 429 "retry later", for ever."""
    with pytest.raises(ValidationError, match="MAX_BATCH_ITEMS"):
        GatewaySettings.model_validate({"MAX_IN_FLIGHT_PER_TENANT": "500"})
    fits = {"MAX_IN_FLIGHT_PER_TENANT": "500", "MAX_BATCH_ITEMS": "500"}
    assert GatewaySettings.model_validate(fits).max_batch_items == 500
    assert (
        GatewaySettings.model_validate({"MAX_IN_FLIGHT_PER_TENANT": "0"}).max_in_flight_per_tenant
        == 0
    )


def test_a_scorer_holds_twice_its_model_slots_unless_told() -> None:
    assert ScorerSettings.model_validate({"SCORER_CONCURRENCY": "8"}).deliveries_in_hand == 16
    told = ScorerSettings.model_validate({"SCORER_CONCURRENCY": "8", "SCORER_PREFETCH": "9"})
    assert told.deliveries_in_hand == 9


def test_fewer_deliveries_in_hand_than_model_slots_are_refused() -> None:
    """Slots beyond the deliveries in hand could never be used."""
    with pytest.raises(ValidationError, match="SCORER_PREFETCH"):
        ScorerSettings.model_validate({"SCORER_CONCURRENCY": "8", "SCORER_PREFETCH": "7"})


@pytest.mark.parametrize(
    ("given", "variable"),
    [
        ({"SCHEDULER_GRACE_S": "0"}, "SCHEDULER_GRACE_S"),
        ({"SCHEDULER_TICK_S": "40"}, "SCHEDULER_GRACE_S"),
        ({"SCHEDULER_REDISPATCH_S": "60"}, "SCHEDULER_REDISPATCH_S"),
        ({"SCHEDULER_GRACE_S": "20"}, "SCHEDULER_REDISPATCH_S"),
    ],
)
def test_a_grace_the_clock_loop_cannot_keep_is_refused(
    given: dict[str, str], variable: str
) -> None:
    """With a grace below the tick, new jobs and `skip` jobs never fired; with a redispatch
    delay beyond it, a `skip` job's firing whose publish failed was dropped."""
    with pytest.raises(ValidationError, match=variable):
        SchedulerSettings.model_validate(given)
    assert SchedulerSettings.model_validate({"SCHEDULER_TICK_S": "30"}).grace_s == 60
