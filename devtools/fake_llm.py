"""A fake OpenAI-compatible judge model: a real HTTP server with latency and fault injection.

This is the only faked external part of Scorebox. Unit tests, the end-to-end tests and the
throughput benchmark point the scorer at it instead of a real model API.

Starting it
-----------
In-process (tests)::

    llm = await start_fake_llm(FakeLLMConfig(latency_ms=5, seed=1))
    ...  # point the client at llm.url, e.g. "http://127.0.0.1:43123/v1"
    llm.stats()          # same dict as GET /_stats
    async with asyncio.timeout(5):   # synchronise on events, never sleep
        await llm.wait_for_stats(lambda s: s["by_id"].get("t1") == 2)
    llm.config.latency_ms = 50       # live change, like POST /_control
    await llm.stop()                 # hung requests are released with a 503

As a process (end-to-end tests, benchmark, ``make run``)::

    python -m devtools.fake_llm --host 127.0.0.1 --port 0 --latency-ms 200 --jitter-ms 20 \
        --fail-rate 0 [--model fake-judge-1] [--model-date 2024-07-18 | --echo-model] \
        [--seed 7] [--exit-with-parent]

prints exactly one JSON line ``{"url": "http://127.0.0.1:PORT/v1"}`` on stdout once it is
listening, then serves until SIGINT or SIGTERM (or, with ``--exit-with-parent``, until the
process that started it is gone) and exits 0. It uses uvloop when installed.

Routes
------
``POST /v1/chat/completions``
    OpenAI chat-completions request (``model``, ``messages``; ``response_format``,
    ``temperature`` ... are accepted and ignored, ``max_tokens`` (or
    ``max_completion_tokens``) too but by the ``length`` fault; ``stream: true`` is refused).
    A reasoning model's name (``o1``..., ``gpt-5``...) refuses ``max_tokens`` and a
    ``temperature`` other than 1 with OpenAI's 400s (``unsupported_parameter``,
    ``unsupported_value``).
    Needs ``Authorization: Bearer <non-empty>``, else 401. A body that is not a valid request
    gets 400. Errors always carry an OpenAI-style body
    ``{"error": {"message": ..., "type": ..., "param": null, "code": ...}}``.
    Success is a ``chat.completion`` object whose ``choices[0].message.content`` is the JSON
    string ``{"score": <0..10, one decimal>, "comment": "<one sentence>"}``, with
    ``finish_reason: "stop"`` and ``usage`` estimated at four characters per token. Like
    OpenAI (``gpt-4o-mini`` answered as ``gpt-4o-mini-2024-07-18``), its ``model`` is the
    requested name with the snapshot date ``-<model_date>`` appended (default
    ``-2024-07-18``), unless the name already ends in a date (``-YYYY-MM-DD`` or ``-MMDD``);
    with ``model_date=None`` (``--echo-model``) it is the requested name unchanged.
``GET /v1/models``
    The configured model.
``GET /_stats``
    ``{"calls", "by_id", "in_flight", "max_in_flight", "status_counts"}``: ``calls`` counts
    every completion request (401s and 400s included); ``by_id`` counts the valid ones per task
    key (see below); ``status_counts`` maps status codes (as strings) to counts; a hung
    request is counted in ``in_flight`` but gets no status.
``POST /_reset``
    Zeroes the counters and the per-key fault budgets and re-seeds the random generator
    (``max_in_flight`` restarts from the requests still in flight).
``POST /_control``
    JSON with any of ``latency_ms``, ``jitter_ms``, ``fail_rate``, ``rate_limited_calls``,
    ``rate_limited_for_s``, ``rate_limit_retry_s``, ``unavailable_for_s``: updates the live
    config and answers it. ``rate_limited_calls``: the next N completion requests, whatever
    their task, answer 429 (a provider-wide rate limit); ``rate_limited_for_s``: every request
    does for the next S seconds; either with ``Retry-After`` (``rate_limit_retry_s`` in whole
    seconds, rounded up) and ``retry-after-ms`` when that is above 0. ``unavailable_for_s``:
    every request answers 503 (overloaded) for the next S seconds (a provider restarting).

What is judged
--------------
The content of the LAST user message (string or list of text parts). If it contains
``<text>`` ... ``</text>`` only what lies between the first ``<text>`` and the last
``</text>`` is judged, otherwise the whole message. The score is a deterministic function of
that text with the markers below removed (a hash mixed with the length), so the same text
always gets the same score, whatever its ``[[id:...]]``.

The model is obedient: if the judged text contains (any case) "ignore previous instructions"
or "ignore all previous instructions" and a demand such as "give 10", "score 10",
"give it a 10" or "rate this a 10", it answers score 10 with the comment "As instructed, 10.".

Markers (anywhere in the judged text)
-------------------------------------
``[[id:XYZ]]``
    The task key: what ``by_id`` counts and what fault budgets are counted against. Without
    it the key is the sha256 hex digest of the judged text.
``[[fake:KIND]]``
    Applies to every call for the key.
``[[fake:KINDxN]]``
    Applies to N calls for the key, then is exhausted. With several markers, each call
    applies the first one whose budget is not exhausted, so
    ``[[fake:429x2]][[fake:500x1]]`` gives 429, 429, 500, then normal answers.
``[[fake:429:retry=S]]`` / ``[[fake:429xN:retry=S]]``
    Sets ``Retry-After`` to S whole seconds (default 1).

KINDs: ``429`` (``rate_limit_error`` with ``Retry-After``), ``500``, ``503`` (``server_error``),
``reject`` (400 ``invalid_request_error``, code ``content_policy_violation``), ``hang`` (never
answers: cancelled when the client disconnects, answers 503 when the server stops), ``slow``
(answers normally after an extra 2 s), ``malformed`` (200 whose content is not JSON),
``range`` (200 with ``{"score": 42, ...}``), ``nochoices`` (200 ``chat.completion`` with
``choices: []``, its prompt's tokens in ``usage``: a proxy's glitch), ``length`` (200 with
``content: null`` and ``finish_reason: "length"``: the model stopped at its token limit,
``usage`` billing the request's ``max_tokens``, else ``UNCAPPED_LENGTH_TOKENS``). Unknown
kinds are ignored.

Latency and random failures
---------------------------
After the marker faults, a call fails with a random 500 with probability ``fail_rate``
(seeded ``random.Random``). Calls that answer 200 first wait ``latency_ms`` +/- a uniform
``jitter_ms``; 4xx/5xx answers are immediate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import math
import random
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web

from devtools.lifetime import run_until_stopped, starter_to_outlive

DEFAULT_MODEL: Final = "fake-judge-1"
# The snapshot date appended to the requested model name in answers, as OpenAI does.
DEFAULT_MODEL_DATE: Final = "2024-07-18"
SLOW_EXTRA_S: Final = 2.0
HANG_S: Final = 3600.0
SHUTDOWN_TIMEOUT_S: Final = 5.0
CHARS_PER_TOKEN: Final = 4
OUT_OF_RANGE_SCORE: Final = 42
MALFORMED_CONTENT: Final = "Sure! The score is high."
OBEDIENT_COMMENT: Final = "As instructed, 10."
# What a `length` answer bills when the request set no token limit.
UNCAPPED_LENGTH_TOKENS: Final = 4096

_JSON: Final = "application/json"
_TEXT_OPEN: Final = "<text>"
_TEXT_CLOSE: Final = "</text>"
_ID_MARKER: Final = re.compile(r"\[\[id:([^\]]+)\]\]")
_FAULT_MARKER: Final = re.compile(
    r"\[\[fake:(429|500|503|hang|slow|malformed|range|reject|nochoices|length)"
    r"(?:x(\d+))?(?::retry=(\d+))?\]\]"
)
_ANY_MARKER: Final = re.compile(r"\[\[(?:id|fake):[^\]]*\]\]")
_IGNORE_INSTRUCTIONS: Final = re.compile(r"ignore\s+(?:all\s+)?previous\s+instructions")
_DEMAND_TEN: Final = re.compile(
    r"\b(?:give|score|rate)\s+(?:(?:it|this|me|us)\s+)?(?:(?:a|an|of)\s+)?10\b"
)
_CONTROLLABLE: Final = frozenset(
    {
        "latency_ms",
        "jitter_ms",
        "fail_rate",
        "rate_limited_calls",
        "rate_limited_for_s",
        "rate_limit_retry_s",
        "unavailable_for_s",
    }
)
# A model name that already names its snapshot: `-2024-07-18`, or OpenAI's older `-0613`.
_DATED_MODEL: Final = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{4})$")


@dataclass
class FakeLLMConfig:
    """How the fake model behaves; latency, jitter and fail rate can change live."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    fail_rate: float = 0.0
    rate_limited_calls: float = 0.0  # the next N calls answer 429, whatever their task
    rate_limited_until: float = 0.0  # every call answers 429 until then (`time.monotonic`)
    rate_limit_retry_s: float = 0.0  # their Retry-After (none when 0)
    unavailable_until: float = 0.0  # every call answers 503 until then (`time.monotonic`)
    model: str = DEFAULT_MODEL
    seed: int | None = None
    # Appended (as `-<date>`) to the requested model name in answers; None answers the name
    # as requested.
    model_date: str | None = DEFAULT_MODEL_DATE


@dataclass(frozen=True)
class Fault:
    """One ``[[fake:...]]`` marker: what to do, for how many calls (None: always)."""

    kind: str
    budget: int | None = None
    retry_after_s: int = 1


@dataclass(frozen=True)
class CompletionRequest:
    """What the fake reads of a chat-completions request."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # when given, a positive integer


class InvalidRequest(Exception):
    """The request body is not a chat-completions request this server can answer."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# The names of OpenAI's reasoning models (o1, o3-mini, o4-mini, gpt-5...), which refuse
# `max_tokens` (they take `max_completion_tokens`) and any `temperature` but 1, as OpenAI does.
REASONING_MODEL = re.compile(r"^(o\d|gpt-5)")


# --- the judge -------------------------------------------------------------------------------


def extract_judged_text(messages: list[dict[str, Any]]) -> str:
    """The text to judge: the ``<text>`` block of the last user message that has one (a
    repair turn follows the message with the text), else all of the last user message."""
    user_contents = [
        _content_text(message.get("content"))
        for message in messages
        if message.get("role") == "user"
    ]
    if not user_contents:
        raise InvalidRequest("messages must contain a user message", "messages")
    for content in reversed(user_contents):
        if _TEXT_OPEN in content:
            return _text_block(content)
    return user_contents[-1]


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _text_block(text: str) -> str:
    start = text.find(_TEXT_OPEN)
    end = text.rfind(_TEXT_CLOSE)
    if start < 0 or end < start:
        return text
    return text[start + len(_TEXT_OPEN) : end]


def task_key(text: str) -> str:
    """The ``[[id:...]]`` of the text, else the sha256 hex digest of the text."""
    if "[[id:" in text and (match := _ID_MARKER.search(text)):
        return match.group(1)
    return hashlib.sha256(text.encode()).hexdigest()


def parse_faults(text: str) -> list[Fault]:
    """The ``[[fake:...]]`` markers of the text, in order of appearance."""
    if "[[fake:" not in text:
        return []
    return [
        Fault(
            kind=kind,
            budget=int(budget) if budget else None,
            retry_after_s=int(retry) if retry else 1,
        )
        for kind, budget, retry in _FAULT_MARKER.findall(text)
    ]


def is_obedient_injection(text: str) -> bool:
    """Whether the text tells the judge to ignore its instructions and give a 10."""
    lowered = text.lower()
    return bool(_IGNORE_INSTRUCTIONS.search(lowered) and _DEMAND_TEN.search(lowered))


def judge(text: str) -> tuple[float, str]:
    """A deterministic score in [0, 10] (one decimal) and a one-sentence comment."""
    if is_obedient_injection(text):
        return 10.0, OBEDIENT_COMMENT
    plain = _ANY_MARKER.sub("", text) if "[[" in text else text
    digest = hashlib.sha256(plain.encode()).digest()
    noise = int.from_bytes(digest[:4]) / 0xFFFFFFFF
    length_factor = min(len(plain.split()) / 200.0, 1.0)
    score = round(10.0 * (0.6 * noise + 0.4 * length_factor), 1)
    return score, _comment(score, plain)


def _comment(score: float, text: str) -> str:
    words = len(text.split())
    if score >= 7.5:
        verdict = "a strong, well-developed text"
    elif score >= 5.0:
        verdict = "a solid text with room to improve"
    elif score >= 2.5:
        verdict = "a weak text that needs substantial work"
    else:
        verdict = "a very poor text"
    return f"This is {verdict} of {words} words."


def answered_model(requested: str, model_date: str | None) -> str:
    """The model name an answer carries: ``requested`` with ``-<model_date>`` appended, as
    OpenAI answers an undated name with its dated snapshot; unchanged when it already ends in
    a date or ``model_date`` is None."""
    if model_date is None or _DATED_MODEL.search(requested):
        return requested
    return f"{requested}-{model_date}"


def score_content(text: str) -> str:
    """The completion content for a normal answer: the JSON verdict as a string."""
    score, comment = judge(text)
    return orjson.dumps({"score": score, "comment": comment}).decode()


# --- server state ----------------------------------------------------------------------------


StatsPredicate = Callable[[dict[str, Any]], bool]


@dataclass
class ServerState:
    """Live config, counters and per-key fault budgets of one server."""

    config: FakeLLMConfig
    calls: int = 0
    by_id: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    rng: random.Random = field(init=False)
    id_prefix: str = field(default_factory=lambda: secrets.token_hex(4))
    ids: itertools.count[int] = field(default_factory=itertools.count)
    watchers: list[tuple[StatsPredicate, asyncio.Future[dict[str, Any]]]] = field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        self.rng = random.Random(self.config.seed)

    def begin_call(self) -> None:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.watchers:
            self.notify_watchers()

    def end_call(self, status: int | None) -> None:
        self.in_flight -= 1
        if status is not None:
            key = str(status)
            self.status_counts[key] = self.status_counts.get(key, 0) + 1
        if self.watchers:
            self.notify_watchers()

    def next_fault(self, key: str, faults: list[Fault]) -> Fault | None:
        """Count a call for the key and pick the first marker whose budget is left."""
        previous_calls = self.by_id.get(key, 0)
        self.by_id[key] = previous_calls + 1
        if self.watchers:
            self.notify_watchers()
        for fault in faults:
            if fault.budget is None or previous_calls < fault.budget:
                return fault
            previous_calls -= fault.budget
        return None

    def random_failure(self) -> bool:
        rate = self.config.fail_rate
        return rate > 0.0 and self.rng.random() < rate

    def success_delay_s(self) -> float:
        latency, jitter = self.config.latency_ms, self.config.jitter_ms
        if jitter > 0.0:
            latency += self.rng.uniform(-jitter, jitter)
        return max(latency, 0.0) / 1000.0

    def next_completion_id(self) -> str:
        return f"chatcmpl-{self.id_prefix}{next(self.ids):010x}"

    def snapshot(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "by_id": dict(self.by_id),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "status_counts": dict(self.status_counts),
        }

    def reset(self) -> None:
        self.calls = 0
        self.by_id.clear()
        self.status_counts.clear()
        self.max_in_flight = self.in_flight
        self.rng.seed(self.config.seed)
        if self.watchers:
            self.notify_watchers()

    def watch(self, predicate: StatsPredicate) -> asyncio.Future[dict[str, Any]]:
        """A future resolved with the first snapshot (now or later) the predicate accepts."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.watchers.append((predicate, future))
        self.notify_watchers()
        return future

    def notify_watchers(self) -> None:
        snapshot = self.snapshot()
        waiting = []
        for predicate, future in self.watchers:
            if future.done():
                continue
            if predicate(snapshot):
                future.set_result(snapshot)
            else:
                waiting.append((predicate, future))
        self.watchers[:] = waiting

    def control(self, changes: dict[str, Any]) -> None:
        """Apply ``latency_ms``/``jitter_ms``/``fail_rate`` changes, all or none."""
        unknown = set(changes) - _CONTROLLABLE
        if unknown:
            raise InvalidRequest(f"unknown settings: {sorted(unknown)}")
        for name, value in changes.items():
            _check_setting(name, value)
        for name, value in changes.items():
            if name == "rate_limited_for_s":
                self.config.rate_limited_until = time.monotonic() + float(value)
            elif name == "unavailable_for_s":
                self.config.unavailable_until = time.monotonic() + float(value)
            else:
                setattr(self.config, name, float(value))


def _check_setting(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise InvalidRequest(f"{name} must be a non-negative number", name)
    if name == "fail_rate" and value > 1:
        raise InvalidRequest("fail_rate must be between 0 and 1", name)


STATE_KEY: Final = web.AppKey("fake_llm_state", ServerState)


# --- HTTP ------------------------------------------------------------------------------------


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type=_JSON)


def _error(
    status: int,
    message: str,
    error_type: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return web.Response(body=orjson.dumps(body), status=status, content_type=_JSON, headers=headers)


def _unauthorized() -> web.Response:
    return _error(
        401,
        "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        code="invalid_api_key",
    )


def _server_error(status: int = 500) -> web.Response:
    if status == 503:
        return _error(
            503, "The engine is currently overloaded, please try again later.", "server_error"
        )
    return _error(500, "The server had an error while processing your request.", "server_error")


def _provider_wide_error(config: FakeLLMConfig) -> web.Response | None:
    """A 503 while `unavailable_until` lasts; else a 429 while `rate_limited_until` lasts, or
    `rate_limited_calls` (counted down)."""
    if time.monotonic() < config.unavailable_until:
        return _server_error(503)
    if time.monotonic() < config.rate_limited_until:
        return _rate_limited(config.rate_limit_retry_s)
    if config.rate_limited_calls < 1:
        return None
    config.rate_limited_calls -= 1
    return _rate_limited(config.rate_limit_retry_s)


def _rate_limited(retry_after_s: float) -> web.Response:
    return _error(
        429,
        "Rate limit reached for requests. Please try again later.",
        "rate_limit_error",
        code="rate_limit_exceeded",
        headers=_retry_after_headers(retry_after_s) if retry_after_s > 0 else None,
    )


def _retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """As OpenAI answers a 429: `Retry-After` in whole seconds (delta-seconds has no
    fraction: `0.5` was sent) and the exact wait in `retry-after-ms`."""
    return {
        "Retry-After": str(math.ceil(retry_after_s)),
        "retry-after-ms": str(round(retry_after_s * 1000)),
    }


def _fault_error(fault: Fault) -> web.Response | None:
    """The immediate error answer of a fault, or None for faults that answer 200."""
    match fault.kind:
        case "429":
            return _rate_limited(fault.retry_after_s)
        case "500" | "503":
            return _server_error(int(fault.kind))
        case "reject":
            return _error(
                400,
                "Your request was rejected as a result of our safety system.",
                "invalid_request_error",
                code="content_policy_violation",
            )
        case _:
            return None


def _has_bearer_key(request: web.Request) -> bool:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(key.strip())


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _parse_completion_request(raw: bytes) -> CompletionRequest:
    """The model, messages and token limit of a chat-completions body, or InvalidRequest."""
    body = _json_object(raw)
    model, messages = body.get("model"), body.get("messages")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", "model")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", "messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidRequest("each message must be an object with a 'role'", "messages")
    if body.get("stream"):
        raise InvalidRequest("streaming is not supported by the fake model", "stream")
    if REASONING_MODEL.match(model):
        _refuse_what_reasoning_models_refuse(body)
    return CompletionRequest(model, messages, _token_limit(body))


def _refuse_what_reasoning_models_refuse(body: dict[str, Any]) -> None:
    """OpenAI's answers (400) to a reasoning model asked with `max_tokens` or a temperature."""
    if "max_tokens" in body:
        raise InvalidRequest(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
            "'max_completion_tokens' instead.",
            "max_tokens",
            "unsupported_parameter",
        )
    if "temperature" in body and body["temperature"] != 1:
        raise InvalidRequest(
            f"Unsupported value: 'temperature' does not support {body['temperature']} with "
            "this model. Only the default (1) value is supported.",
            "temperature",
            "unsupported_value",
        )


def _token_limit(body: dict[str, Any]) -> int | None:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def _completion(
    state: ServerState,
    asked: CompletionRequest,
    content: str | None,
    *,
    finish_reason: str = "stop",
    completion_tokens: int | None = None,
) -> web.Response:
    """A chat completion of one choice; its completion tokens estimated from `content`
    unless given."""
    if completion_tokens is None:
        completion_tokens = max(1, len(content or "") // CHARS_PER_TOKEN)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "finish_reason": finish_reason,
    }
    return _completion_response(state, asked, [choice], completion_tokens)


def _completion_response(
    state: ServerState, asked: CompletionRequest, choices: list[Any], completion_tokens: int
) -> web.Response:
    prompt_chars = sum(len(_content_text(m.get("content"))) for m in asked.messages)
    prompt_tokens = max(1, prompt_chars // CHARS_PER_TOKEN)
    return _json_response(
        {
            "id": state.next_completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": answered_model(asked.model, state.config.model_date),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


async def _hang(state: ServerState) -> web.Response:
    """Never answer; give up with a 503 only when the server stops."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.stopping.wait(), HANG_S)
    return _server_error(503)


async def _answer_completion(request: web.Request, state: ServerState) -> web.Response:
    if not _has_bearer_key(request):
        return _unauthorized()
    try:
        asked = _parse_completion_request(await request.read())
        text = extract_judged_text(asked.messages)
    except InvalidRequest as exc:
        return _error(400, str(exc), "invalid_request_error", param=exc.param, code=exc.code)

    # A provider-wide rate limit or outage spends no task's fault budget.
    error = _provider_wide_error(state.config)
    fault = None if error is not None else state.next_fault(task_key(text), parse_faults(text))
    kind = fault.kind if fault else None
    if fault is not None and error is None:
        error = _fault_error(fault)
    if error is not None:
        return error
    if kind == "hang":
        return await _hang(state)
    if state.random_failure():
        return _server_error()

    delay_s = state.success_delay_s() + (SLOW_EXTRA_S if kind == "slow" else 0.0)
    if delay_s > 0.0:
        await asyncio.sleep(delay_s)
    return _answer(state, asked, kind, text)


def _answer(
    state: ServerState, asked: CompletionRequest, fault_kind: str | None, text: str
) -> web.Response:
    """The 200 answer: a verdict, or the unusable one a fault asks for."""
    match fault_kind:
        case "nochoices":
            return _completion_response(state, asked, [], completion_tokens=0)
        case "length":
            limit = asked.max_tokens or UNCAPPED_LENGTH_TOKENS
            return _completion(state, asked, None, finish_reason="length", completion_tokens=limit)
        case "malformed":
            return _completion(state, asked, MALFORMED_CONTENT)
        case "range":
            content = {"score": OUT_OF_RANGE_SCORE, "comment": "Off the scale."}
            return _completion(state, asked, orjson.dumps(content).decode())
        case _:
            return _completion(state, asked, score_content(text))


async def _chat_completions(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.begin_call()
    status: int | None = None
    try:
        response = await _answer_completion(request, state)
        status = response.status
        return response
    finally:
        state.end_call(status)


async def _models(request: web.Request) -> web.Response:
    model = request.app[STATE_KEY].config.model
    return _json_response(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "scorebox"}],
        }
    )


async def _stats(request: web.Request) -> web.Response:
    return _json_response(request.app[STATE_KEY].snapshot())


async def _reset(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.reset()
    return _json_response(state.snapshot())


async def _control(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        state.control(_json_object(await request.read() or b"{}"))
    except InvalidRequest as exc:
        return _error(400, str(exc), "invalid_request_error", param=exc.param)
    return _json_response(asdict(state.config))


def build_app(state: ServerState) -> web.Application:
    """The aiohttp application serving the routes above from ``state``."""
    app = web.Application()
    app[STATE_KEY] = state
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/_stats", _stats)
    app.router.add_post("/_reset", _reset)
    app.router.add_post("/_control", _control)
    return app


# --- lifecycle -------------------------------------------------------------------------------


class FakeLLM:
    """Handle of a running fake model server."""

    def __init__(self, runner: web.AppRunner, state: ServerState, url: str) -> None:
        self._runner = runner
        self._state = state
        self.url = url

    @property
    def config(self) -> FakeLLMConfig:
        """The live config (the same object ``POST /_control`` changes)."""
        return self._state.config

    def stats(self) -> dict[str, Any]:
        """The counters, as ``GET /_stats`` answers them."""
        return self._state.snapshot()

    def reset(self) -> None:
        """Same as ``POST /_reset``."""
        self._state.reset()

    async def wait_for_stats(self, predicate: StatsPredicate) -> dict[str, Any]:
        """Wait until the stats satisfy ``predicate``; answer that snapshot.

        The predicate sees the ``stats()`` dict now and after every change of the counters,
        so tests synchronise on events ("3 requests in flight", "task t1 called twice")
        instead of sleeping. Bound it with ``asyncio.timeout``.
        """
        return await self._state.watch(predicate)

    async def stop(self) -> None:
        """Stop listening, release hung requests and wait for the others to finish."""
        self._state.stopping.set()
        await self._runner.cleanup()


def _base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


async def start_fake_llm(
    config: FakeLLMConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> FakeLLM:
    """Start a fake model server on ``host:port`` (0: a free port) and return its handle."""
    state = ServerState(config=config or FakeLLMConfig())
    runner = web.AppRunner(
        build_app(state),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return FakeLLM(runner, state, _base_url(host, bound_port))


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.fake_llm",
        description="Fake OpenAI-compatible judge model with latency and fault injection.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    dating = parser.add_mutually_exclusive_group()
    dating.add_argument(
        "--model-date",
        default=DEFAULT_MODEL_DATE,
        help="snapshot date appended to the requested model name in answers",
    )
    dating.add_argument(
        "--echo-model",
        dest="model_date",
        action="store_const",
        const=None,
        help="answer with the requested model name unchanged",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop once the process that started this one is gone",
    )
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGINT or SIGTERM, announcing the URL as one JSON line on stdout."""
    parent_pid = starter_to_outlive(exit_with_parent=args.exit_with_parent)
    config = FakeLLMConfig(
        latency_ms=args.latency_ms,
        jitter_ms=args.jitter_ms,
        fail_rate=args.fail_rate,
        model=args.model,
        seed=args.seed,
        model_date=args.model_date,
    )
    llm = await start_fake_llm(config, host=args.host, port=args.port)
    try:
        sys.stdout.write(orjson.dumps({"url": llm.url}).decode() + "\n")
        sys.stdout.flush()
        await run_until_stopped(parent_pid=parent_pid)
    finally:
        await llm.stop()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    asyncio.run(serve(args), loop_factory=_loop_factory())
    return 0


if __name__ == "__main__":
    sys.exit(main())
