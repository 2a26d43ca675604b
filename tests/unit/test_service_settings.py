"""Settings a service cannot work with are refused at start-up, with the variable named."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from services.gateway.settings import GatewaySettings
from services.notifier.settings import NotifierSettings
from services.scheduler.settings import SchedulerSettings
from services.scorer.model.heuristic import HEURISTIC_MODEL_NAME
from services.scorer.model.prompt import PROMPT_VERSION
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.projection import _fields_of
from services.status.settings import StatusSettings
from shared.contracts import (
    PROMPT_VERSIONS,
    PROVIDER_PROMPT_VERSIONS,
    Phase,
    ScoreResult,
    StateChange,
    TaskCompleted,
    event_sequence,
    new_id,
    utcnow,
)
from shared.settings import (
    MAX_DURATION_S,
    READ_YOUR_WRITES_MAX_S,
    ServiceSettings,
    refused_settings,
)

SETTINGS_CLASSES: list[type[BaseSettings]] = [
    GatewaySettings,
    StatusSettings,
    ScorerSettings,
    ModelSettings,
    SchedulerSettings,
    NotifierSettings,
]
# Each setting some handler adds to (or takes from) the time of an event.
DURATIONS_ADDED_TO_A_DATE = [
    (StatusSettings, "FINISHED_TASK_TTL_S"),
    (GatewaySettings, "RESULT_CACHE_TTL_S"),
    (GatewaySettings, "IDEMPOTENCY_TTL_S"),
    (GatewaySettings, "READ_YOUR_WRITES_WINDOW_S"),
    (GatewaySettings, "OUTBOX_GRACE_S"),
    (ScorerSettings, "RETRY_BASE_S"),
    (ScorerSettings, "RETRY_CAP_S"),
    (ScorerSettings, "SCORER_STARTED_AFTER_S"),
    (ScorerSettings, "LEASE_MARGIN_S"),
    (ScorerSettings, "ATTEMPTS_RETENTION_S"),
    (SchedulerSettings, "SCHEDULER_GRACE_S"),
    (SchedulerSettings, "SCHEDULER_REDISPATCH_S"),
    (SchedulerSettings, "SCHEDULER_RETRY_BASE_S"),
    (SchedulerSettings, "SCHEDULER_RETRY_CAP_S"),
    (SchedulerSettings, "USAGE_METER_RETRY_S"),
    (SchedulerSettings, "FANOUT_HORIZON_S"),
    (NotifierSettings, "WEBHOOK_RETRY_BASE_S"),
    (NotifierSettings, "WEBHOOK_RETRY_CAP_S"),
    (NotifierSettings, "WEBHOOK_SECRET_ROTATION_GRACE_S"),
    (NotifierSettings, "WEBHOOK_CALLBACK_RETENTION_S"),
    (NotifierSettings, "WEBHOOK_UNCLAIMED_OUTCOME_TTL_S"),
    (NotifierSettings, "WEBHOOK_DELIVERY_RETENTION_S"),
    (NotifierSettings, "WEBHOOK_DNS_TIMEOUT_S"),  # in the lease and the POST time
    (NotifierSettings, "WEBHOOK_TIMEOUT_S"),
]
# Past ~2.5e11 s from now a date overflows (`datetime` ends in the year 9999).
OVERFLOWING_S = str(10**12)
LONGER_STILL = {
    "OUTBOX_GRACE_S": {"IDEMPOTENCY_TTL_S": str(10**13)},
    "SCHEDULER_REDISPATCH_S": {"SCHEDULER_GRACE_S": str(10**13)},
}


def _float_settings(settings: type[BaseSettings]) -> list[str]:
    return [
        str(field.validation_alias)
        for field in settings.model_fields.values()
        if field.annotation in (float, float | None)
    ]


FLOAT_SETTINGS = sorted(
    {
        (settings, variable)
        for settings in SETTINGS_CLASSES
        for variable in _float_settings(settings)
    },
    key=lambda pair: (pair[0].__name__, pair[1]),
)


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


@pytest.mark.parametrize(
    ("variable", "over"),
    [("USAGE_METER_MAX_ATTEMPTS", "21"), ("FANOUT_PAGES_PER_DELIVERY", "1001")],
)
def test_counts_of_the_scheduler_past_their_bound_are_refused(variable: str, over: str) -> None:
    """Unbounded where every other count is bounded (a review): any number was taken."""
    with pytest.raises(ValidationError, match=variable):
        SchedulerSettings.model_validate({variable: over})


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


def _model(**values: str) -> ModelSettings:
    return ModelSettings.model_validate({"LLM_BASE_URL": "https://llm.test/v1", **values})


def test_a_rubric_version_the_scorers_provider_never_scores_under_is_refused() -> None:
    """`heuristic-v1` with `LLM_PROVIDER=openai` started: every result stale, the cache off,
    and each fan-out run called the model again for every task (a walkthrough). The scorer
    refuses it, the one service that knows its provider for certain."""
    with pytest.raises(ValidationError, match=r"LLM_PROVIDER=openai scores under \(judge-2025-1\)"):
        _model(RUBRIC_VERSION="heuristic-v1", LLM_PROVIDER="openai")
    with pytest.raises(ValidationError, match="RUBRIC_VERSION=judge-2025-1 is not what"):
        _model(RUBRIC_VERSION="judge-2025-1", LLM_PROVIDER="heuristic")
    for provider, version in PROVIDER_PROMPT_VERSIONS.items():
        told = _model(RUBRIC_VERSION=version, LLM_PROVIDER=provider)
        assert told.rubric_version == version
    assert _model(LLM_PROVIDER="openai").rubric_version is None


@pytest.mark.parametrize("settings", [GatewaySettings, SchedulerSettings])
def test_the_gateway_and_the_scheduler_do_not_judge_the_scorers_provider(settings: Any) -> None:
    """Given every service's `LLM_PROVIDER` by compose, with the scorer's alone overridden,
    they refused the version the scorer makes (a review): theirs is not the scorer's."""
    given = {"RUBRIC_VERSION": "judge-2025-1", "LLM_PROVIDER": "heuristic"}
    assert settings.model_validate(given).rubric_version == "judge-2025-1"


def test_the_gateway_caches_this_builds_prompts_unless_told_a_rubric_version() -> None:
    """Unset, the cache served results of any prompt, an earlier deploy's among them; and not
    only its own `LLM_PROVIDER`'s: a scorer's override alone would have kept every result out."""
    for provider in (*PROVIDER_PROMPT_VERSIONS, "another"):
        given = GatewaySettings.model_validate({"LLM_PROVIDER": provider})
        assert given.cached_prompt_versions == PROMPT_VERSIONS
    told = {"LLM_PROVIDER": "heuristic", "RUBRIC_VERSION": "judge-2025-1"}
    assert GatewaySettings.model_validate(told).cached_prompt_versions == {"judge-2025-1"}


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
        # Claimed a tick late, seen stale a tick late: 59.5 s left no room (a review).
        ({"SCHEDULER_REDISPATCH_S": "59.5"}, "SCHEDULER_REDISPATCH_S"),
        ({"SCHEDULER_REDISPATCH_S": "55", "SCHEDULER_TICK_S": "2"}, "SCHEDULER_TICK_S"),
    ],
)
def test_a_grace_the_clock_loop_cannot_keep_is_refused(
    given: dict[str, str], variable: str
) -> None:
    """With a grace below the tick, new jobs and `skip` jobs never fired; with a redispatch
    delay beyond it, a `skip` job's firing whose publish failed was dropped."""
    with pytest.raises(ValidationError, match=variable):
        SchedulerSettings.model_validate(given)
    assert SchedulerSettings.model_validate({"SCHEDULER_TICK_S": "10"}).grace_s == 60  # 30 + 3 x 10


@pytest.mark.parametrize(("settings", "variable"), DURATIONS_ADDED_TO_A_DATE)
def test_a_duration_whose_date_would_overflow_is_refused(
    settings: type[BaseSettings], variable: str
) -> None:
    """FINISHED_TASK_TTL_S=10**12 was accepted, and then every terminal event raised an
    OverflowError in the projection (not retried: its deliveries held, the projection
    stalled); each retention, grace and back-off added to a date had the same flaw."""
    # With what must exceed it raised too, so no cross-check refuses it by the way.
    given = {variable: OVERFLOWING_S} | LONGER_STILL.get(variable, {})
    with pytest.raises(ValidationError, match=variable):
        settings.model_validate(given)


def test_a_finished_task_at_the_longest_ttl_still_gets_its_expiry() -> None:
    settings = StatusSettings.model_validate({"FINISHED_TASK_TTL_S": MAX_DURATION_S})
    now = utcnow()
    event = TaskCompleted(
        task_id=new_id(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        attempt=1,
        submitted_at=now,
        occurred_at=now,
        result=ScoreResult(score=5, comment="ok", model="m"),
    )
    ttl = timedelta(seconds=settings.finished_task_ttl_s)

    fields = _fields_of(event, StateChange.of_event(event), finished_ttl=ttl, applied_at=now)

    assert fields["expires_at"] == now + ttl


@pytest.mark.parametrize(("settings", "variable"), FLOAT_SETTINGS)
def test_no_float_setting_takes_infinity(settings: type[BaseSettings], variable: str) -> None:
    """`inf` passed `gt=0`: BROKER_TIMEOUT_S=inf unbounded every publish confirm and the
    whole stop, MONGO_TIMEOUT_S=inf crashed the client (`int(inf)`). (`nan` fails any bound.)"""
    with pytest.raises(ValidationError, match=variable):
        settings.model_validate({variable: "inf"})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("BROKER_TIMEOUT_S", "1e-9"),  # no publish is ever confirmed in time
        ("BROKER_TIMEOUT_S", "301"),
        ("MONGO_TIMEOUT_S", "0.0004"),  # timeoutMS=0: PyMongo's "no timeout"
        ("MONGO_TIMEOUT_S", "0.05"),
        ("MONGO_TIMEOUT_S", "301"),
        ("STARTUP_TIMEOUT_S", "3601"),
    ],
)
def test_an_infrastructure_timeout_out_of_its_bounds_is_refused(variable: str, value: str) -> None:
    with pytest.raises(ValidationError, match=variable):
        ServiceSettings.model_validate({variable: value})


@pytest.mark.parametrize("size", ["0", "-1", "257"])
def test_an_outcome_batch_of_no_events_or_of_too_many_is_refused(size: str) -> None:
    with pytest.raises(ValidationError, match="SCORER_OUTCOME_BATCH_MAX"):
        ScorerSettings.model_validate({"SCORER_OUTCOME_BATCH_MAX": size})
    assert ScorerSettings.model_validate({}).outcome_batch_max == 16
    assert ScorerSettings.model_validate({"SCORER_OUTCOME_BATCH_MAX": "1"}).outcome_batch_max == 1


def test_a_finished_task_stays_readable_past_the_gateways_read_your_writes_window() -> None:
    """With FINISHED_TASK_TTL_S below READ_YOUR_WRITES_WINDOW_S, a finished task expired from
    the status service and the gateway answered from its own record: `queued` again, until
    the window ended. Each service bounds its own setting by the same limit."""
    with pytest.raises(ValidationError, match="FINISHED_TASK_TTL_S"):
        StatusSettings.model_validate({"FINISHED_TASK_TTL_S": READ_YOUR_WRITES_MAX_S - 1})
    with pytest.raises(ValidationError, match="READ_YOUR_WRITES_WINDOW_S"):
        GatewaySettings.model_validate({"READ_YOUR_WRITES_WINDOW_S": READ_YOUR_WRITES_MAX_S + 1})
    shortest_ttl = StatusSettings.model_validate({"FINISHED_TASK_TTL_S": READ_YOUR_WRITES_MAX_S})
    longest_window = GatewaySettings.model_validate(
        {"READ_YOUR_WRITES_WINDOW_S": READ_YOUR_WRITES_MAX_S}
    )
    assert shortest_ttl.finished_task_ttl_s >= longest_window.read_your_writes_window_s


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MONGO_URL", "bogus://x"),
        ("MONGO_URL", "mongodb://127.0.0.1:notaport"),
        ("MONGO_URL", "mongodb://127.0.0.1:99999"),
        ("MONGO_URL", "mongodb://127.0.0.1/?noSuchOption=1"),
        ("MONGO_URL", "mongodb+srv://cluster.example.invalid:27017/"),
        ("MONGO_DB_PREFIX", "bad/prefix"),
        ("MONGO_DB_PREFIX", "a.b"),
        ("MONGO_DB_PREFIX", ""),
        ("MONGO_DB_PREFIX", "p" * 54),
        ("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:notaport/"),
        ("RABBITMQ_URL", "amqp://127.0.0.1:70000/"),
        ("RABBITMQ_URL", "notaurl"),
        ("RABBITMQ_URL", "http://127.0.0.1:5672/"),
        ("RABBITMQ_URL", "amqp:///"),
    ],
)
def test_an_infrastructure_setting_the_drivers_cannot_use_is_refused(
    variable: str, value: str
) -> None:
    """Each stopped the start with a driver's traceback (InvalidURI, ValueError,
    InvalidName), or, `notaurl` read as a vhost on localhost, waited out STARTUP_TIMEOUT_S
    first (found in a walkthrough)."""
    with pytest.raises(ValidationError, match=variable):
        StatusSettings.model_validate({variable: value})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MONGO_URL", "mongodb://u:p%40ss@db1:27017,db2/?replicaSet=rs&directConnection=false"),
        ("MONGO_URL", "mongodb+srv://u:p@cluster.example.invalid/?tls=true"),
        ("MONGO_DB_PREFIX", "p" * 53),
        ("MONGO_DB_PREFIX", "scorebox-test_1"),
        ("RABBITMQ_URL", "amqps://u:p@[::1]:5671/scorebox"),
        ("RABBITMQ_URL", "amqp://rabbitmq/"),
    ],
)
def test_an_infrastructure_setting_the_drivers_take_is_taken(variable: str, value: str) -> None:
    """A `mongodb+srv://` URI is checked without its DNS look-up (`.invalid` never
    resolves)."""
    StatusSettings.model_validate({variable: value})


def test_a_refused_infrastructure_url_is_shown_without_its_password() -> None:
    for variable, url in [
        ("MONGO_URL", "mongodb://u:hunter2@db:99999"),
        ("RABBITMQ_URL", "amqp://u:hunter2@broker:notaport/"),
    ]:
        with pytest.raises(ValidationError) as refused:
            StatusSettings.model_validate({variable: url})
        message = refused_settings("status", refused.value)
        assert variable in message
        assert "hunter2" not in message
