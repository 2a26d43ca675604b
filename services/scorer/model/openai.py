"""A judge behind an OpenAI-compatible `POST /chat/completions` (OpenAI, vLLM, llama.cpp...).

One `score` call makes one request, plus one repair request when the first answer is
unusable, all within a single hard deadline of LLM_TIMEOUT_S. It never retries on its own:
it raises a typed error and the scorer decides, through the broker, whether to try again.
Whatever the error, it carries the usage of the answers that came back before it (`usage`,
`model`): the provider billed them, and the scorer meters them with the task's outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from yarl import URL

from services.scorer.errors import (
    InputRejected,
    ModelMisconfigured,
    ModelRateLimited,
    ModelReplyUnusable,
    ModelTimeout,
    ModelUnavailable,
    RepairCutShort,
    ScoringError,
    UnusableOutput,
)
from services.scorer.model.base import FLAG_REPAIRED, ModelVerdict, ScoringRequest
from services.scorer.model.dialects import Dialect, Dialects
from services.scorer.model.http_client import ProviderClient, ProviderReply, ReplyTooLarge
from services.scorer.model.parsing import Verdict, parse_verdict
from services.scorer.model.preparation import prepare_text
from services.scorer.model.prompt import (
    PROMPT_VERSION,
    VERDICT_JSON_SCHEMA,
    build_messages,
    build_repair_messages,
)
from services.scorer.model.settings import ModelSettings
from shared.contracts import ScoreResult, Usage
from shared.http import parse_retry_after, parse_seconds
from shared.settings import url_shown

Messages = list[dict[str, str]]

_MAX_DETAIL_CHARS: Final = 300
# Phrases providers use when a request fails because of the text itself.
_INPUT_PROBLEMS: Final = (
    "context_length",
    "context length",
    "context size",
    "context window",
    "maximum context",
    "too many tokens",
    "input token count",  # Gemini: "The input token count exceeds the maximum number ..."
    "too long",
    "string_above_max_length",
    "content_policy",
    "content policy",
    "content management policy",
    "content_filter",
    "safety",
    "flagged",
    "invalid_prompt",
)
# A 403's words for a text a moderation layer refused (not a key without access).
_MODERATION_WORDS: Final = ("flagged", "moderation", "content_policy", "content policy")
# Read in the error's code and type only: a rate limit's message may point at a billing page
# ("Need more tokens? Upgrade ... /settings/billing"), which no retry would have fixed.
_CONFIG_PROBLEMS_429: Final = ("insufficient_quota", "billing")
# A 429 for one request larger than the account's tokens-per-minute limit (OpenAI's "Request
# too large ... must be reduced in order to run successfully"): no wait lets that text through.
_TOO_LARGE_FOR_THE_RATE_LIMIT: Final = ("request too large", "must be reduced in order to run")
# Statuses no retry changes: the key (401, 403), credit (402: OpenRouter and others), or
# LLM_BASE_URL and LLM_MODEL naming no chat-completions endpoint (404, 405, 410, 415).
_MISCONFIGURED: Final = frozenset({401, 402, 403, 404, 405, 410, 415})
# A proxy refusing our credentials (407) or the tunnel to the provider (403) refuses every
# call alike until its settings change.
_PROXY_REFUSALS: Final = frozenset({403, 407})
_PROXY_SETTINGS: Final = "HTTPS_PROXY/HTTP_PROXY"
# Named in the failure of an answer cut at the token limit: the setting that raises it.
MAX_OUTPUT_TOKENS_SETTING: Final = "LLM_MAX_OUTPUT_TOKENS"
# A check of the provider (`OpenAIChatModel.check`): short, and no text's.
CHECK_MESSAGES: Final[Messages] = [{"role": "user", "content": "Answer OK."}]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # A string, or (Mistral's reasoning models, among others) a list of typed parts.
    content: str | list[Any] | None = None
    refusal: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                part["text"]
                for part in self.content
                if isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            )
        return self.content or ""


class _Choice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    message: _Message
    finish_reason: str | None = None


# Above any model's context window: a provider reporting more for one call is wrong, and its
# usage is read as none rather than summed into a task's (`shared.contracts.MAX_TOKENS`).
_MAX_TOKENS_PER_CALL = 2**30


class _ChatCompletion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    choices: list[_Choice] = Field(min_length=1)
    usage: Any = None  # read leniently (`_usage_of`): a bad usage block loses no verdict


class _ChoicelessCompletion(BaseModel):
    """What there is to read in a chat completion that came back without a choice."""

    model_config = ConfigDict(extra="ignore")

    kind: str | None = Field(default=None, alias="object")
    model: str | None = None
    choices: list[Any] | None = None
    prompt_filter_results: Any = None
    usage: Any = None

    @property
    def is_chat_completion(self) -> bool:
        # `choices: []` says it on its own; without `choices`, the `object` has to.
        return self.choices == [] or (self.choices is None and self.kind == "chat.completion")


@dataclass(frozen=True)
class _Answer:
    """One chat completion, reduced to what scoring needs."""

    content: str
    model: str
    usage: Usage
    cut_at_token_limit: bool = False  # `finish_reason: "length"`


@dataclass(frozen=True)
class _Judgement:
    verdict: Verdict
    final: _Answer
    usage: Usage
    repaired: bool


def _utcnow() -> datetime:
    return datetime.now(UTC)


class OpenAIChatModel:
    """A `ScoreModel` that asks a chat-completions endpoint to judge the text.

    `request.model` overrides LLM_MODEL. `clock` (UTC) dates `Retry-After` HTTP-dates.
    """

    def __init__(
        self,
        http: ProviderClient,
        settings: ModelSettings,
        *,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.name: str = settings.llm_model
        self._http = http
        self._settings = settings
        self._clock = clock
        # Parsed once: a URL given as a string is parsed again on every request.
        self._url = completions_url(settings.llm_base_url)
        # As errors name it (task errors, logs): without the credentials a URL may carry.
        self._shown = url_shown(str(self._url))
        self._request_headers = _request_headers(settings)
        self._dialects = Dialects(
            Dialect(settings.llm_token_limit_field, temperature=settings.llm_temperature)
        )

    async def score(self, request: ScoringRequest) -> ModelVerdict:
        prepared = prepare_text(request.text, max_chars=self._settings.llm_max_input_chars)
        messages = build_messages(prepared.text, request.rubric, truncated=prepared.truncated)
        model = request.model or self._settings.llm_model
        started = time.perf_counter()
        answered: list[_Answer] = []
        try:
            async with asyncio.timeout(self._settings.llm_timeout_s):
                judgement = await self._judge(messages, model, answered)
        except TimeoutError as exc:
            # An answer came back: the deadline cut its repair short, the provider is up.
            cut_short = RepairCutShort if answered else ModelTimeout
            timeout = cut_short(
                f"no usable answer from {model} within {self._settings.llm_timeout_s:g} s"
            )
            for answer in answered:  # an unusable first answer, its repair cut short
                timeout.also_spent(answer.usage, answer.model)
            raise timeout from exc
        latency_ms = (time.perf_counter() - started) * 1000
        flags = [*prepared.flags, *([FLAG_REPAIRED] if judgement.repaired else [])]
        result = ScoreResult(
            score=judgement.verdict.score,
            comment=judgement.verdict.comment,
            model=judgement.final.model,
            usage=judgement.usage,
            latency_ms=latency_ms,
            flags=flags,
            prompt_version=PROMPT_VERSION,
        )
        return ModelVerdict(
            result=result, raw_output=judgement.final.content, requested_model=model
        )

    async def check(self, model: str | None = None) -> None:
        """A call of `model` (None: LLM_MODEL) asking for one token of an answer to a fixed
        message (`CHECK_MESSAGES`), no text's: returns on a completion, raises as `score`
        would on anything else (a 4xx too, which `provider_checks` takes for the provider
        up; a 200 carrying the upstream's error, as OpenRouter sends, for what it says)."""
        model = model or self._settings.llm_model
        dialect = self._dialects.of(model)
        body = {"model": model, "messages": CHECK_MESSAGES, dialect.token_limit_field: 1}
        try:
            async with asyncio.timeout(self._settings.llm_timeout_s):
                response = await self._post(body)
        except TimeoutError as exc:
            raise ModelTimeout(
                f"no answer from {model} within {self._settings.llm_timeout_s:g} s"
            ) from exc
        if not response.is_success:
            raise error_for_response(response, now=self._clock())
        _read_answer(response, model, now=self._clock())

    async def _judge(self, messages: Messages, model: str, answered: list[_Answer]) -> _Judgement:
        """The verdict; `answered` collects the answers that came back, for a deadline that
        cuts the repair short to report them."""
        first = await self._complete(messages, model)
        answered.append(first)
        try:
            return _Judgement(parse_verdict(first.content), first, first.usage, repaired=False)
        except UnusableOutput as problem:
            # Repaired even when cut at the token limit: the repair asks for the JSON object
            # alone, which fits where a verbose answer did not.
            repair = build_repair_messages(messages, first.content, problem.message)
        try:
            second = await self._complete(repair, model)
        except ScoringError as error:
            # Refused, or failed for now (a retry will call the model afresh): either way
            # the first answer is billed, and goes with the error to be metered.
            error.also_spent(first.usage, first.model)
            raise
        usage = _add(first.usage, second.usage)
        try:
            return _Judgement(parse_verdict(second.content), second, usage, repaired=True)
        except UnusableOutput as problem:
            cut = first.cut_at_token_limit or second.cut_at_token_limit
            why = self._cut_at_token_limit() if cut else problem.message
            raise UnusableOutput(
                f"still unusable after one repair attempt: {why}",
                raw_output=second.content,
                usage=usage,
                model=second.model,
            ) from problem

    def _cut_at_token_limit(self) -> str:
        """Why an answer the token limit cut held no verdict, and what raises the limit."""
        return (
            "the model stopped at its token limit "
            f"({self._settings.llm_max_output_tokens} tokens) before a complete answer; "
            f"{MAX_OUTPUT_TOKENS_SETTING} raises it"
        )

    async def _complete(self, messages: Messages, model: str) -> _Answer:
        """The model's answer; a refusal of the output limit's field or of the temperature
        is answered by sending the call again in the dialect it asks for (`dialects.py`)."""
        dialect = self._dialects.of(model)
        refused: frozenset[str] = frozenset()
        # Ends: the temperature is dropped once, and the field never goes back to one refused.
        while True:
            response = await self._post(self._body(messages, model, dialect))
            if response.is_success:
                return _read_answer(response, model, now=self._clock())
            error = _error_object(response) if response.status == 400 else None
            adapted = dialect.adapted_to(error, refused=refused)
            if adapted is None:
                raise error_for_response(response, now=self._clock())
            refused |= {dialect.token_limit_field} - {adapted.token_limit_field}
            dialect = self._dialects.learn(model, adapted, refused=_provider_detail(response))

    async def _post(self, body: dict[str, Any]) -> ProviderReply:
        try:
            return await self._http.post(
                self._url, body=orjson.dumps(body), headers=self._request_headers
            )
        except (aiohttp.ClientError, OSError) as exc:
            raise _transport_error(exc, self._shown) from exc
        except ReplyTooLarge as exc:
            # A 5xx page that large (a gateway's) says the provider is down like any 5xx.
            too_much = ModelUnavailable if exc.status >= 500 else ModelReplyUnusable
            raise too_much(f"{self._shown} answered too much ({exc.status}): {exc}") from exc

    def _body(self, messages: Messages, model: str, dialect: Dialect) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            dialect.token_limit_field: self._settings.llm_max_output_tokens,
        }
        if dialect.temperature is not None:
            body["temperature"] = dialect.temperature
        match self._settings.llm_json_mode:
            case "json_schema":
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": VERDICT_JSON_SCHEMA,
                }
            case "json_object":
                body["response_format"] = {"type": "json_object"}
            case "none":
                pass
        return body


def completions_url(base_url: str) -> URL:
    """`base_url` + `/chat/completions`, its query kept (Azure's `?api-version=`): glued on
    as text, the path went into the query and every call was a 404 (a review)."""
    base = URL(base_url)
    path = base.raw_path.rstrip("/") + "/chat/completions"  # `%2F` in it stays encoded
    return base.with_path(path, encoded=True, keep_query=True)


def _request_headers(settings: ModelSettings) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    key = settings.llm_api_key.get_secret_value()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _add(first: Usage, second: Usage) -> Usage:
    return Usage(
        prompt_tokens=first.prompt_tokens + second.prompt_tokens,
        completion_tokens=first.completion_tokens + second.completion_tokens,
    )


def _transport_error(exc: Exception, url: str) -> ScoringError:
    # A provider that cannot be connected to is unavailable, not slow: only a request that
    # got through and then took too long counts as the model being slow.
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ModelTimeout(f"{url} timed out: {type(exc).__name__}")
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        # The same certificate fails every retry until LLM_BASE_URL or the trust store changes.
        return ModelMisconfigured(f"{url} presented a certificate we do not trust: {exc}")
    if isinstance(exc, aiohttp.ClientHttpProxyError) and exc.status in _PROXY_REFUSALS:
        return ModelMisconfigured(
            f"the proxy ({_PROXY_SETTINGS}) refused the connection to {url}: {exc}"
        )
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return ModelUnavailable(f"cannot reach {url}: {reason}")


def _read_answer(response: ProviderReply, requested_model: str, *, now: datetime) -> _Answer:
    try:
        completion = _chat_completion(response.body)
    except ValidationError as exc:
        raise _without_completion(response, requested_model, now=now) from exc
    choice = completion.choices[0]
    usage = _usage_of(completion.usage)
    model = completion.model or requested_model
    if choice.message.refusal:
        raise InputRejected(
            f"the model refused the text: {_trim(choice.message.refusal)}", usage=usage, model=model
        )
    if choice.finish_reason == "content_filter":
        raise InputRejected(
            "the provider's content filter stopped the answer", usage=usage, model=model
        )
    return _Answer(
        content=choice.message.text,
        model=model,
        usage=usage,
        cut_at_token_limit=choice.finish_reason == "length",
    )


def _chat_completion(body: bytes) -> _ChatCompletion:
    """The chat completion in `body`. An answer cut at the token limit in the middle of a
    character (raw bytes of half an emoji, or an escaped lone surrogate, as some servers send
    it) made the whole body unreadable: the task failed for good as "misconfigured", without
    the repair such an answer gets, and its billed tokens went unmetered. Read again with the
    broken characters replaced, only when the strict reading fails."""
    try:
        return _ChatCompletion.model_validate_json(body)
    except ValidationError:
        lenient = _leniently_decoded(body)
        if lenient is None:
            raise
        return _ChatCompletion.model_validate(lenient)


def _leniently_decoded(body: bytes) -> Any:
    """`body` as JSON, invalid UTF-8 and lone surrogates replaced; None when it is no JSON."""
    try:
        return _without_lone_surrogates(json.loads(body.decode("utf-8", errors="replace")))
    except (ValueError, RecursionError):  # nested past the interpreter's depth: a crash
        return None


def _without_lone_surrogates(value: Any) -> Any:
    """`value` (decoded JSON) with every lone surrogate in its strings replaced."""
    if isinstance(value, str):
        return value.encode("utf-8", errors="replace").decode("utf-8")
    if isinstance(value, list):
        return [_without_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_lone_surrogates(item) for key, item in value.items()}
    return value


def _without_completion(
    response: ProviderReply, requested_model: str, *, now: datetime
) -> ScoringError:
    """The error of a 200 that holds no usable chat completion: an error in its body, a chat
    completion without a choice, or something else altogether."""
    embedded = _embedded_error(response, now=now)
    if embedded is not None:
        billed = _billed_with_error(response)
        if billed.total_tokens:  # the call answered, if not usably: billed all the same
            embedded.also_spent(billed, requested_model)
        return embedded
    choiceless = _choiceless_error(response, requested_model)
    if choiceless is not None:
        return choiceless
    # Deterministic for a given endpoint (a web page, another API): retrying it would only
    # bill more calls.
    return ModelMisconfigured(
        f"the provider answered {response.status} without a chat completion "
        f"(is LLM_BASE_URL an OpenAI-compatible /v1 endpoint?): {_trim(response.text)}"
    )


def _choiceless_error(response: ProviderReply, requested_model: str) -> ScoringError | None:
    """The error of a chat completion that came back without a choice; None when the body is
    no chat completion. Azure OpenAI answers so when its filter stops the prompt (it says
    which categories in `prompt_filter_results`): the text is refused. Without such a
    verdict (a proxy's glitch) the endpoint is right and the answer went missing: retried."""
    try:
        completion = _ChoicelessCompletion.model_validate_json(response.body)
    except ValidationError:
        return None
    if not completion.is_chat_completion:
        return None
    error = _no_choice_error(_filtered_categories(completion.prompt_filter_results))
    billed = _usage_of(completion.usage)
    if billed.total_tokens:
        error.also_spent(billed, completion.model or requested_model)
    return error


def _no_choice_error(filtered: list[str]) -> ScoringError:
    if filtered:
        return InputRejected(
            f"the provider's content filter stopped the prompt: {', '.join(filtered)}"
        )
    return ModelReplyUnusable("the provider answered a chat completion without any choice")


def _filtered_categories(prompt_filter_results: Any) -> list[str]:
    """The categories Azure OpenAI's prompt filter stopped, in the order it gives them:
    `[{"prompt_index": 0, "content_filter_results": {"hate": {"filtered": true, ...}}}]`."""
    results = prompt_filter_results if isinstance(prompt_filter_results, list) else []
    found: dict[str, None] = {}  # ordered, without repeats
    for result in results:
        verdicts = result.get("content_filter_results") if isinstance(result, dict) else None
        if isinstance(verdicts, dict):
            found.update(
                dict.fromkeys(name for name, verdict in verdicts.items() if _filtered(verdict))
            )
    return list(found)


def _filtered(verdict: Any) -> bool:
    # `custom_blocklists` is a list of such verdicts in older API versions.
    if isinstance(verdict, list):
        return any(_filtered(item) for item in verdict)
    return isinstance(verdict, dict) and verdict.get("filtered") is True


def _usage_of(reported: Any) -> Usage:
    """The token counts the provider reported, each read on its own: a count missing, null
    or unreadable is none, not the whole block's (`"completion_tokens": null` metered the
    prompt's 812 tokens as none; a review). A `total_tokens` above their sum counts its
    surplus as completion tokens (the reasoning tokens some gateways report only there, or
    the completion whose own count was unread), unless the prompt's count was unread."""
    if not isinstance(reported, dict):
        return Usage()
    prompt = _count(reported.get("prompt_tokens"))
    completion = _count(reported.get("completion_tokens"))
    if prompt is None:  # a surplus could be the prompt's: none
        return Usage(prompt_tokens=0, completion_tokens=completion or 0)
    completion = completion or 0
    surplus = max(0, (_count(reported.get("total_tokens")) or 0) - prompt - completion)
    return Usage(prompt_tokens=prompt, completion_tokens=completion + surplus)


def _count(value: Any) -> int | None:
    """A token count as reported: a whole number from 0 to `_MAX_TOKENS_PER_CALL` (a float
    of one included), else None."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _MAX_TOKENS_PER_CALL else None


def error_for_response(response: ProviderReply, *, now: datetime) -> ScoringError:
    """The typed error for an unsuccessful chat-completions response."""
    status = response.status
    provider_says = _provider_detail(response)
    detail = f"{status} from the provider: {provider_says}"
    code = _error_code(response).lower()
    blames = f"{provider_says} {code}".lower()
    if status == 429:
        return _rate_limit_error(response, detail, code, now=now)
    if status == 407:
        return ModelMisconfigured(f"407 from the proxy ({_PROXY_SETTINGS}): {provider_says}")
    if _blames_the_text(response, blames):
        return InputRejected(detail)
    if status in _MISCONFIGURED or 300 <= status < 400:
        return ModelMisconfigured(detail)
    if status in (400, 422):
        # Our request is malformed for this server (e.g. an unsupported LLM_JSON_MODE).
        return ModelMisconfigured(detail)
    unavailable = ModelUnavailable if status >= 500 else ModelReplyUnusable
    return unavailable(detail, retry_after_s=retry_after_s(response.headers, now=now))


def _blames_the_text(response: ProviderReply, blames: str) -> bool:
    """Whether an error status says the text itself is refused, which no retry changes."""
    if response.status == 403:
        return _flagged_by_moderation(response)
    return response.status == 413 or (
        response.status in (400, 422) and any(problem in blames for problem in _INPUT_PROBLEMS)
    )


def _flagged_by_moderation(response: ProviderReply) -> bool:
    """Whether a 403 refuses the text rather than the key: OpenRouter answers 403 for an input
    its moderation flagged (`error.metadata` with `reasons` or `flagged_input`, "... requires
    moderation ..."), and such a text failed as a misconfiguration, telling the operator to
    mend settings that were right (a review). Words are read in the error's code and type
    only, and OpenRouter's phrase in its message: "account flagged for review" in a 403's
    message is the key's."""
    error = _error_object(response) or {}
    metadata = error.get("metadata")
    if isinstance(metadata, dict) and ("flagged_input" in metadata or "reasons" in metadata):
        return True
    kinds = f"{error.get('code')} {error.get('type')}".lower()
    message = str(error.get("message", "")).lower()
    return any(word in kinds for word in _MODERATION_WORDS) or "requires moderation" in message


def _rate_limit_error(
    response: ProviderReply, detail: str, code: str, *, now: datetime
) -> ScoringError:
    """The error of a 429, which no wait fixes when it blames the account or the text."""
    if any(problem in code for problem in _CONFIG_PROBLEMS_429):
        return ModelMisconfigured(detail)
    if _too_large_for_the_rate_limit(response):
        return InputRejected(detail)
    return ModelRateLimited(detail, retry_after_s=retry_after_s(response.headers, now=now))


def _too_large_for_the_rate_limit(response: ProviderReply) -> bool:
    message = " ".join(_error_message(response).split()).lower()
    return any(phrase in message for phrase in _TOO_LARGE_FOR_THE_RATE_LIMIT)


def _embedded_error(response: ProviderReply, *, now: datetime) -> ScoringError | None:
    """The error a 200 carries in its body, as for its own status: gateways such as OpenRouter
    send the status before the upstream model has answered, then report a rate limit or an
    upstream failure as `{"error": {"code": 429, ...}}`. Without an HTTP status in it, an
    upstream failure (502)."""
    error = _error_object(response)
    if error is None:
        return None
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return error_for_response(dataclasses.replace(response, status=status), now=now)


def _billed_with_error(response: ProviderReply) -> Usage:
    """The usage block an error body reports next to its `error`: none when there is none."""
    try:
        body = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return Usage()
    return _usage_of(body.get("usage") if isinstance(body, dict) else None)


def _provider_detail(response: ProviderReply) -> str:
    message = _error_message(response)
    if message:
        return _trim(message)
    return _trim(response.text) or response.reason or "no detail"


def _error_message(response: ProviderReply) -> str:
    """The message of an OpenAI-style error body, whole; empty when there is none."""
    error = _error_object(response)
    message = error.get("message") if error else None
    return message if isinstance(message, str) else ""


def _error_code(response: ProviderReply) -> str:
    error = _error_object(response)
    parts = [error.get(key) for key in ("code", "type")] if error else []
    return " ".join(part for part in parts if isinstance(part, str))


def _error_object(response: ProviderReply) -> dict[str, Any] | None:
    """The `error` object of an OpenAI-style error body, when there is one."""
    try:
        body = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(body, list) and body and isinstance(body[0], dict):
        body = body[0]  # Gemini's OpenAI-compatible endpoint: the error object in a list
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return {"message": error}
    return error if isinstance(error, dict) else None


def retry_after_s(headers: Mapping[str, str], *, now: datetime) -> float | None:
    """Seconds to wait according to `retry-after-ms` or `Retry-After` (seconds or HTTP-date)."""
    milliseconds = parse_seconds(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return milliseconds / 1000
    return parse_retry_after(headers.get("retry-after"), now=now)


def _trim(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_DETAIL_CHARS else flat[: _MAX_DETAIL_CHARS - 1] + "…"
