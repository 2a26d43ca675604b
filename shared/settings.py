"""Settings every service shares; each service extends `ServiceSettings` with its own.

Names of environment variables are part of the public contract (see README).
Settings are built once in a service's entrypoint and passed down, never read at import.
"""

from __future__ import annotations

import sys
from typing import Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pymongo.errors import PyMongoError
from pymongo.uri_parser import parse_uri
from pymongo.uri_parser_shared import SRV_SCHEME, _validate_uri
from yarl import URL

MAX_PORT = 65_535
# `LLM_MODEL` unset or blank: the model the scorer asks for, and the gateway's result-cache
# key names (both read it the same way: stripped, blank taken as this).
DEFAULT_LLM_MODEL = "gpt-4o-mini"
# What both logging and uvicorn know, with the spellings operators also write.
LOG_LEVELS = {
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARNING": "WARNING",
    "WARN": "WARNING",
    "ERROR": "ERROR",
    "CRITICAL": "CRITICAL",
    "FATAL": "CRITICAL",
}
# The largest prefetch AMQP carries (a short unsigned integer): above it the consumer's
# channel failed to open at start, with a TypeError.
MAX_PREFETCH = 65_535
# The longest retention, TTL, grace or back-off a setting may name: ten years, beyond any
# use. A duration is added to the time of an event, and past ~2.5e11 s that date overflows
# (`datetime` ends in the year 9999): an OverflowError in every handler that computed it,
# not retried, its delivery left unacknowledged.
MAX_DURATION_S = 10 * 365 * 86_400
# The gateway answers a poll from its own record while the status service has not heard of
# a task submitted (or due) this recently, and a finished task must stay readable longer:
# one expiring first read as `queued` again until the window ended (the gateway's
# `READ_YOUR_WRITES_WINDOW_S` at most this, the status service's `FINISHED_TASK_TTL_S` at
# least this, so that one service's settings cannot contradict the other's).
READ_YOUR_WRITES_MAX_S = 600
# RabbitMQ closes the channel of a delivery held unacknowledged this long (`consumer_timeout`
# in deploy/rabbitmq/rabbitmq.conf, and RabbitMQ's default): every wait a delivery is held
# through must end before it.
BROKER_CONSUMER_TIMEOUT_S = 1800.0
# Bounds of one broker confirm or one database call. Below 0.1 s a publish is never
# confirmed in time, and a database timeout under a millisecond became `timeoutMS=0`, which
# PyMongo reads as *no* timeout (with a group-write deadline of 0 that failed every write).
# Above 5 minutes it is an outage, not a slow reply: the stop grace periods (the scorer's
# counts five of them) and every wait behind them would grow with it.
MIN_INFRA_TIMEOUT_S = 0.1
MAX_INFRA_TIMEOUT_S = 300.0
MAX_STARTUP_TIMEOUT_S = 3600.0
# The characters of a bearer token a header can carry as is: `!` to `~`.
VISIBLE_ASCII_MIN, VISIBLE_ASCII_MAX = 0x21, 0x7E
# MongoDB's database names (`<MONGO_DB_PREFIX>_<service>`): at most 63 bytes, none of these
# characters (PyMongo's own check, which raised `InvalidName` at the first use of the name;
# a MongoDB on Windows refuses `*<>:|?` too: a deployment there sees its own refusal). The
# longest service name is `scheduler`.
MAX_DATABASE_NAME_BYTES = 63
DATABASE_NAME_FORBIDDEN = frozenset(' ."$/\\\x00')
LONGEST_SERVICE_NAME = "scheduler"


class ServiceSettings(BaseSettings):
    # `inf` and `nan` are refused in every float setting (subclasses included): `inf` passed
    # `gt=0` and unbounded a timeout, or crashed the service where it became an int or a date.
    model_config = SettingsConfigDict(
        env_prefix="",
        extra="ignore",
        frozen=True,
        allow_inf_nan=False,
        # A refused value is not printed: a key or a URL's password mistyped ended up whole
        # in the service's log (the error names the setting and what is wrong with it).
        hide_input_in_errors=True,
    )

    rabbitmq_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/", validation_alias="RABBITMQ_URL"
    )
    mongo_url: str = Field(default="mongodb://127.0.0.1:27017", validation_alias="MONGO_URL")
    mongo_database_prefix: str = Field(default="scorebox", validation_alias="MONGO_DB_PREFIX")
    http_host: str = Field(default="127.0.0.1", validation_alias="HTTP_HOST")
    port: int = Field(
        default=0, description="Each service names its own variable (GATEWAY_PORT...)."
    )
    log_level: str = Field(default="INFO", validation_alias="LOG_LEVEL")
    # `json`: one JSON object per line, uvicorn's lines included, for a log collector.
    log_format: Literal["text", "json"] = Field(default="text", validation_alias="LOG_FORMAT")
    # One line per HTTP request (uvicorn's access log), off by default: the metrics count and
    # time every request by route, and a line each costs CPU on the submission path.
    access_log: bool = Field(default=False, validation_alias="ACCESS_LOG")
    # Timeouts of the infrastructure calls (seconds).
    broker_timeout_s: float = Field(
        default=10.0,
        ge=MIN_INFRA_TIMEOUT_S,
        le=MAX_INFRA_TIMEOUT_S,
        validation_alias="BROKER_TIMEOUT_S",
    )
    mongo_timeout_s: float = Field(
        default=5.0,
        ge=MIN_INFRA_TIMEOUT_S,
        le=MAX_INFRA_TIMEOUT_S,
        validation_alias="MONGO_TIMEOUT_S",
    )
    startup_timeout_s: float = Field(
        default=60.0, gt=0, le=MAX_STARTUP_TIMEOUT_S, validation_alias="STARTUP_TIMEOUT_S"
    )
    # How far this process's clock may be from the database server's at start-up (0: not
    # checked; `shared/clock_offset.py`).
    max_clock_offset_s: float = Field(
        default=5.0, ge=0, le=3600, validation_alias="MAX_CLOCK_OFFSET_S"
    )

    @field_validator("rabbitmq_url")
    @classmethod
    def _an_amqp_url(cls, url: str) -> str:
        return amqp_url(url)

    @field_validator("mongo_url")
    @classmethod
    def _a_mongodb_uri(cls, url: str) -> str:
        return mongodb_uri(url)

    @field_validator("mongo_database_prefix")
    @classmethod
    def _a_database_prefix(cls, prefix: str) -> str:
        return database_prefix(prefix)

    @field_validator("log_level")
    @classmethod
    def _a_log_level(cls, level: str) -> str:
        """A level both `logging` and uvicorn know: `warn` crashed uvicorn at start-up, and
        `trace` crashed `logging`, after the settings had been accepted."""
        known = LOG_LEVELS.get(level.strip().upper())
        if known is None:
            raise ValueError(f"{level!r} is not one of {', '.join(sorted(set(LOG_LEVELS)))}")
        return known

    @field_validator("port")
    @classmethod
    def _a_port(cls, port: int) -> int:
        """0 (any free port) or a TCP port, refused at start-up rather than at bind."""
        if not 0 <= port <= MAX_PORT:
            raise ValueError(f"a port is 0 (any free one) or 1 to {MAX_PORT}, not {port}")
        return port

    def database_name(self, service: str) -> str:
        return f"{self.mongo_database_prefix}_{service}"


def bearer_token(key: SecretStr | None, name: str) -> SecretStr | None:
    """A bearer key setting (`name`) as a header carries it. Empty is unset (compose passes
    `${SCOREBOX_INTERNAL_KEY:-}`), and the whitespace a secret file ends with is dropped.
    Otherwise visible ASCII only (RFC 6750's token has no spaces): the gateway's client
    refuses other characters (it would not start) or sends a control character as is (a
    broken request on every call), and a scraper that sends a key with spaces or other
    characters depends on how its HTTP library encodes a header. Refused at start, with the
    way to make one."""
    if key is None:
        return None
    value = key.get_secret_value().strip()
    if not value:
        return None
    if not all(VISIBLE_ASCII_MIN <= ord(character) <= VISIBLE_ASCII_MAX for character in value):
        raise ValueError(
            f"{name} must be visible ASCII characters without spaces "
            "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return SecretStr(value)


def require_distinct_keys(settings: object, name: str, others: tuple[str, ...]) -> None:
    """Refuse the key setting `name` where one of `others` (settings of the same object,
    absent ones passed over) holds the same value: each key opens its own routes, and the
    guards compare the whole header, so one value for two opened both. The error names the
    two variables, never the value."""
    key: SecretStr | None = getattr(settings, name, None)
    value = "" if key is None else key.get_secret_value().strip()
    if not value:
        return
    for other_name in others:
        other: SecretStr | None = getattr(settings, other_name, None)
        if other is not None and other.get_secret_value().strip() == value:
            raise ValueError(f"{name.upper()} must differ from {other_name.upper()}")


class MetricsApiSettings(ServiceSettings):
    """Settings of a service that serves `GET /metrics` (every one)."""

    # The scraper's bearer token, the same on every service: it opens `/metrics` alone. Unset
    # (or empty), the gateway's `/metrics` takes the admin key only, and the other services'
    # answer anyone who reaches them.
    metrics_api_key: SecretStr | None = Field(default=None, validation_alias="METRICS_API_KEY")

    @field_validator("metrics_api_key")
    @classmethod
    def _a_metrics_token(cls, key: SecretStr | None) -> SecretStr | None:
        return bearer_token(key, "METRICS_API_KEY")


class InternalApiSettings(MetricsApiSettings):
    """Settings of a service that serves the internal HTTP API (`/internal/...`) or calls it
    (the gateway)."""

    # The bearer token of the internal routes, the same on every service. Unset (or empty),
    # the routes answer anyone who reaches them: only the network protects them then.
    internal_api_key: SecretStr | None = Field(default=None, validation_alias="INTERNAL_API_KEY")

    @field_validator("internal_api_key")
    @classmethod
    def _usable_as_a_bearer_token(cls, key: SecretStr | None) -> SecretStr | None:
        return bearer_token(key, "INTERNAL_API_KEY")

    @model_validator(mode="after")
    def _not_another_key(self) -> Self:
        """The internal key is held by every service; the admin key opens the admin API, and
        the metrics key is a scraper's. One value for two gave anyone holding a service's
        settings the admin API, or a scraper every tenant's data."""
        require_distinct_keys(self, "internal_api_key", ("admin_api_key", "metrics_api_key"))
        return self


class AdminApiSettings(InternalApiSettings):
    """Settings of a service that serves admin routes (the gateway, the scheduler, the
    notifier)."""

    # The operators' bearer token, the same on every such service. Unset (or empty), the
    # admin routes answer 403.
    admin_api_key: SecretStr | None = Field(default=None, validation_alias="ADMIN_API_KEY")

    @field_validator("admin_api_key")
    @classmethod
    def _an_admin_token(cls, key: SecretStr | None) -> SecretStr | None:
        return bearer_token(key, "ADMIN_API_KEY")

    @model_validator(mode="after")
    def _not_the_scrapers_key(self) -> Self:
        """The metrics key exists so that a scraper need not hold the admin key; one value
        for both gave the scraper the admin API (minting keys, purging dead letters), and
        was taken (found in review)."""
        require_distinct_keys(self, "metrics_api_key", ("admin_api_key",))
        return self


def url_shown(url: str) -> str:
    """`url` as logs, errors and banners name it: without the credentials or the query it
    may carry (a key in `?subscription-key=` as well as in `user:password@`)."""
    return str(URL(url).with_user(None).with_query(None).with_fragment(None))


def redact_url(url: str) -> str:
    """The URL with its password replaced, fit for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def http_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host (for a setting that names a service to call):
    one without a scheme passed, and then every call failed (a 503 on every poll)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as error:
        raise ValueError(f"not a URL ({error}): {_shown(url)!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"an http(s) URL with a host is needed, e.g. http://status:8001, not {_shown(url)!r}"
        )
    return url


def amqp_url(url: str) -> str:
    """`url` if it is an amqp(s) URL with a host, and a port if it names one (`RABBITMQ_URL`).
    A port that is no number raised a `ValueError` traceback at start, and `notaurl` was read
    as the vhost `notaurl` on localhost: the start waited out `STARTUP_TIMEOUT_S` and ended
    in a traceback with exit status 3 (found in a walkthrough)."""
    try:
        parts = URL(url)
        port = parts.port  # raises on a port out of range
    except ValueError as error:
        raise ValueError(f"not a URL ({error}): {_shown(url)!r}") from None
    if parts.scheme not in ("amqp", "amqps") or not parts.host or port == 0:
        raise ValueError(
            "an amqp(s) URL with a host (and a port from 1 to 65535 if any) is needed, "
            f"e.g. amqp://guest:guest@127.0.0.1:5672/, not {_shown(url)!r}"
        )
    return url


def mongodb_uri(url: str) -> str:
    """`url` if PyMongo's own parser takes it (`MONGO_URL`): a URI it refused raised its
    `InvalidURI` or `ValueError` traceback at start (found in a walkthrough). The parser does
    no I/O but for a `mongodb+srv://` URI, whose hosts it looks up in DNS: that one is checked
    by the same parser without the look-up (the DNS may not answer yet at start, and its
    answer is the driver's to wait for)."""
    try:
        if url.startswith(SRV_SCHEME):
            _validate_uri(url)
        else:
            parse_uri(url)
    except (PyMongoError, ValueError) as error:
        reason = _without_password(str(error), url)
        raise ValueError(f"not a MongoDB URI ({reason}): {_shown(url)!r}") from None
    return url


def _without_password(message: str, url: str) -> str:
    """`message` with the password of `url` (if it has one) hidden: a parser's message may
    quote the part of the URL it refused."""
    userinfo = url.partition("://")[2].partition("/")[0].rpartition("@")[0]
    password = userinfo.partition(":")[2]
    return message.replace(password, "***") if password else message


def database_prefix(prefix: str) -> str:
    """`prefix` if every database name made from it is one MongoDB takes (`MONGO_DB_PREFIX`):
    `bad/prefix` passed, and the service stopped at start with PyMongo's `InvalidName`
    traceback (found in a walkthrough)."""
    if not prefix:
        raise ValueError("must not be empty")
    forbidden = sorted(set(prefix) & DATABASE_NAME_FORBIDDEN)
    if forbidden:
        shown = " ".join(repr(character) for character in forbidden)
        raise ValueError(
            f"must be a MongoDB database name's start, without the character(s) {shown}"
        )
    longest = f"{prefix}_{LONGEST_SERVICE_NAME}"
    room = MAX_DATABASE_NAME_BYTES - len(longest.encode()) + len(prefix.encode())
    if len(longest.encode()) > MAX_DATABASE_NAME_BYTES:
        raise ValueError(
            f"must be at most {room} bytes: the database names `<prefix>_<service>` "
            f"are at most {MAX_DATABASE_NAME_BYTES}"
        )
    return prefix


def _shown(url: str) -> str:
    """`url` fit for a refusal's message: its password hidden (a refused setting is printed
    at start-up, into logs; found in review), even where the URL cannot be parsed."""
    try:
        return redact_url(url)
    except ValueError:
        at = url.rfind("@")
        return url if at < 0 else "***" + url[at:]


class StartupRefused(Exception):
    """A service's configuration beyond its settings variables (a schedule file, the
    settings together) leaves it unable to run: `run_service` prints the reason in one line
    and exits with status 2, as `settings_or_exit` does for a refused variable."""


def settings_or_exit[S: BaseSettings](settings_class: type[S], service: str) -> S:
    """The service's settings read from its environment; a setting it refuses stops the
    process with one line per refusal naming the variable, and exit status 2 (a start-up
    refusal, as a command line's usage error). It stopped with pydantic's traceback, the
    variable's name buried in it (found in a walkthrough of `make run`). The values are not
    echoed: some are keys."""
    try:
        return settings_class()
    except ValidationError as error:
        print(refused_settings(service, error), file=sys.stderr)
        raise SystemExit(2) from None


def refused_settings(service: str, error: ValidationError) -> str:
    """What `settings_or_exit` prints: the service, then each refused setting and why."""
    lines = [f"{service}: cannot start, {error.error_count()} setting(s) refused:"]
    lines.extend(f"  {refusal}" for refusal in refusals(error))
    return "\n".join(lines)


def refusals(error: ValidationError) -> list[str]:
    """Each refusal of `error` as `where: why`, without pydantic's input (some values are
    keys) and links."""
    described = []
    for refusal in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in refusal["loc"])
        why = refusal["msg"].removeprefix("Value error, ")
        described.append(f"{where}: {why}" if where else why)
    return described
