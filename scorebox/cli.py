"""`scorebox`: the command line client of a Scorebox gateway.

    scorebox submit FILE [--rubric R] [--wait]     submit a text (FILE or - for stdin)
    scorebox status TASK_ID                        show a task
    scorebox cancel TASK_ID                        cancel a task not started yet
    scorebox cancel-batch BATCH_ID                 cancel a batch's items not started yet
    scorebox batches [--limit N] [--cursor C]      your tenant's batches, newest first
    scorebox dlq list | show ID | replay [ID...|--all] | drop ID... | purge   (drop and
                                                   purge: [--before LISTED_AT])
    scorebox keys create --tenant T [--name N] [--expires-in-days D]
                | list [--tenant T] | revoke KEY_ID
    scorebox usage [--from YYYY-MM-DD] [--to YYYY-MM-DD]     your tenant's daily usage
    scorebox cron list | run JOB [--wait]                    the scheduler's cron jobs
    scorebox cron dlq list | replay [RUN_ID...|--all] | drop RUN_ID... | purge
                                                             its dead runs
    scorebox webhooks dlq list | show ID | replay [ID...|--all] | drop ID... | purge
                                                             webhooks given up (notifier)

The gateway is `SCOREBOX_URL` (default http://127.0.0.1:8000); `SCOREBOX_API_KEY`, when set,
is sent as a bearer token; admin commands (`dlq`, `keys`) send `SCOREBOX_ADMIN_KEY` instead.
`cron` talks to the scheduler at `SCOREBOX_SCHEDULER_URL` (default http://127.0.0.1:8003) and
sends `SCOREBOX_ADMIN_KEY` too: the scheduler's admin routes check the services'
`ADMIN_API_KEY` as the gateway's do (401 without it, 403 when the service has none set).
`webhooks` talks to the notifier at `SCOREBOX_NOTIFIER_URL` (default http://127.0.0.1:8004),
with `SCOREBOX_ADMIN_KEY` as well.

A dead-letter queue is walked up to a bound (10,000 letters or 64 MiB of their bodies) and
for 20 s at most: when a walk stopped there, `list`, `replay` and `drop` say so on stderr,
and ids it did not reach exit 1 as ids not found do; so do letters a `replay` left
unreadable (kept: drop them), and a `replay --all` that stopped short (that bound, or its
time budget: run it again). Letters a later generation superseded, removed unsent, are named
on stderr and change no exit code.
`drop` and `purge` given `--before` a listing's `listed_at` remove only the letters
dead-lettered before it, keeping those that came after the listing (a `drop` that so kept
every copy of a letter exits 1). `purge` asks on stderr:
stdout carries its JSON alone.

Proxy variables (`HTTPS_PROXY`, `NO_PROXY`, ...) apply to a remote URL, never to a loopback
one (127.0.0.1, ::1, localhost). Every failure is one line on stderr and a non-zero exit;
`submit --wait` and `cron run --wait` name the accepted task (the fired run) on stderr before
they wait, however the wait ends.
"""

from __future__ import annotations

import contextlib
import email.utils
import ipaddress
import itertools
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import httpx
import typer

app = typer.Typer(
    help="Command line client of Scorebox.", no_args_is_help=True, rich_markup_mode="markdown"
)
dlq = typer.Typer(help="Operate the dead-letter queue (needs SCOREBOX_ADMIN_KEY).")
app.add_typer(dlq, name="dlq")

TERMINAL = {"completed", "failed"}
# What a keyed submission's replay answers once its finished task has left the status
# service: there is nothing left to wait for (a poll reads 404).
EXPIRED = "expired"
REQUEST_TIMEOUT_S = 30.0
# The least time a poll of a wait (`submit --wait`, `cron run --wait`) is given, however
# little of the wait is left.
MIN_POLL_S = 1.0
# The least pause between two polls of `cron run --wait`.
MIN_POLL_PAUSE_S = 0.2
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
DEFAULT_SCHEDULER_URL = "http://127.0.0.1:8003"
DEFAULT_NOTIFIER_URL = "http://127.0.0.1:8004"
MAX_PORT = 65_535
# How much of an answer that is not what was expected an error line quotes.
QUOTED_CHARS = 300
# What the gateway takes as an Idempotency-Key (`services.gateway.api.IDEMPOTENCY_KEY`), and
# what an HTTP header can carry of a key at all: visible ASCII.
IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
# The most items any gateway takes in a batch (`shared.contracts.MAX_BATCH_ITEMS`, not
# imported: the client loads none of the services' code); one set lower answers 422.
MAX_BATCH_ITEMS = 1000
VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
# Answers to poll again after (the gateway's Retry-After), not to give up on.
RETRY_LATER = {429, 503}
# The problem type of a 409 whose key's first request is still being accepted.
IN_PROGRESS = "/request-in-progress"
# The problem types of the scheduler's 503s to `cron run` that started no run (the broker
# refused it and it was withdrawn; the job's lease changed hands at every try).
CRON_STARTED_NOTHING = ("/broker-unavailable", "/lease-contended")
API_KEY_VARIABLE, ADMIN_KEY_VARIABLE = "SCOREBOX_API_KEY", "SCOREBOX_ADMIN_KEY"
# What the services' walk of a dead-letter queue stops at (`shared.dead_letters.WALK_BOUND`).
WALK_STOPPED = (
    "the walk stopped at its bound (10,000 letters or 64 MiB of their bodies) or its time "
    "budget (20 s)"
)
# What a replay stops at besides (`shared.dead_letters.REPLAY_BUDGET_S`).
REPLAY_STOPPED = "the replay stopped at its time budget (20 s) with letters left in the queue"
# The dead-letter queues `dlq purge`, `cron dlq purge` and `webhooks dlq purge` empty
# (`shared.topology`: those of SCORE_REQUESTS, CRON_JOBS and WEBHOOK_DELIVERIES).
SCORE_REQUESTS_DLQ, CRON_JOBS_DLQ = "scorebox.score-requests.dlq", "scorebox.cron-jobs.dlq"
WEBHOOK_DELIVERIES_DLQ = "scorebox.webhook-deliveries.dlq"

# The seam for tests: every client uses this transport when set (e.g. an httpx.MockTransport),
# the network otherwise.
transport: httpx.BaseTransport | None = None


def _exit(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def _usage_error(message: str) -> NoReturn:
    """An argument the command cannot send: one line and exit 2, as click's own usage errors,
    before anything is sent."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _segment(value: str, name: str) -> str:
    """`value` as one path segment: `/`, `?`, `#` and the rest percent-encoded, and `.` or
    `..` too, which the client would otherwise resolve (`keys revoke ../dead-letters` sent
    `DELETE /admin/v1/dead-letters` and purged the dead-letter queue)."""
    if not value:
        _usage_error(f"{name} must not be empty")
    quoted = quote(value, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


def _base_url(variable: str, default: str) -> httpx.URL:
    """The http(s) URL in `variable` (`default` when unset or empty); exits 1 with one line
    when it is none (`127.0.0.1:8000` without a scheme, `http://[::1`, a port past 65535)."""
    raw = os.environ.get(variable) or default
    try:
        url = httpx.URL(raw)
        port = url.port
    except httpx.InvalidURL as error:
        _exit(f"{variable}={raw!r} is not a URL: {error}")
    if url.scheme not in ("http", "https") or not url.host:
        _exit(f"{variable}={raw!r} is not an http(s) URL such as {default}")
    if port is not None and not 0 < port <= MAX_PORT:
        _exit(f"{variable}={raw!r}: the port must be 1 to {MAX_PORT}")
    return url


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _http(base_url: httpx.URL, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # Passed only when injected, so that `httpx.Client` keeps choosing its own otherwise.
    injected: dict[str, Any] = {"transport": transport} if transport is not None else {}
    try:
        return httpx.Client(
            base_url=base_url,
            headers=headers,
            timeout=REQUEST_TIMEOUT_S,
            # A gateway on this machine is never behind the environment's proxy (which would
            # be asked for 127.0.0.1 and answer for itself); a remote one may well be.
            trust_env=not _loopback(base_url.host),
            **injected,
        )
    except (ImportError, ValueError) as error:
        # The environment's proxy variables, read here: a SOCKS proxy without `socksio`
        # installed, or a scheme httpx has no transport for, raised a traceback.
        _exit(f"cannot use the proxy settings of the environment for {base_url}: {error}")


def _key(variable: str) -> str | None:
    """The key in `variable` (None when unset or empty); exits 1 with one line when it holds
    what no HTTP header can carry: the README's `sbx_…` pasted as it stands raised a
    UnicodeEncodeError traceback."""
    key = os.environ.get(variable)
    if key and not VISIBLE_ASCII.fullmatch(key):
        _exit(
            f"{variable} holds characters no key has (only visible ASCII does): set it to "
            "the key itself as `scorebox keys create` printed it, not a placeholder"
        )
    return key or None


def _client(*, admin: bool = False) -> httpx.Client:
    key = _key(ADMIN_KEY_VARIABLE if admin else API_KEY_VARIABLE)
    return _http(_base_url("SCOREBOX_URL", DEFAULT_GATEWAY_URL), key)


def _scheduler_client() -> httpx.Client:
    base_url = _base_url("SCOREBOX_SCHEDULER_URL", DEFAULT_SCHEDULER_URL)
    return _http(base_url, _key(ADMIN_KEY_VARIABLE))


def _notifier_client() -> httpx.Client:
    base_url = _base_url("SCOREBOX_NOTIFIER_URL", DEFAULT_NOTIFIER_URL)
    return _http(base_url, _key(ADMIN_KEY_VARIABLE))


# Failures of a request before any of it went out: the server never saw it.
NOTHING_SENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
    httpx.UnsupportedProtocol,
)
# Requests that change nothing: one unanswered was not done, however it ended.
READS = {"GET", "HEAD"}
MAY_HAVE_BEEN_DONE = "it may have been done: check before running it again"


@contextlib.contextmanager
def _reaching(
    client: httpx.Client, *, unanswered: str = MAY_HAVE_BEEN_DONE
) -> Iterator[httpx.Client]:
    """Use `client`; a request that failed exits 1 with one line, not a traceback, saying
    which of two things happened.

    Not sent (no connection, `NOTHING_SENT`): "unreachable (nothing was sent)", and running
    the command again is safe. Sent and then unanswered (a read or write timeout, the
    connection closed or reset before an answer): the server may have done it, and the line
    says so with `unanswered`, what to do before running the command again (for a
    submission: the same --idempotency-key, or where to look). Both were "unreachable":
    a user retried, and a text was scored twice, a key created twice, a cron job fired
    twice (found in review)."""
    try:
        with client:
            yield client
    except httpx.HTTPError as error:
        typer.echo(f"error: {_not_answered(client, error, unanswered)}", err=True)
        raise typer.Exit(code=1) from error


def _not_answered(client: httpx.Client, error: httpx.HTTPError, unanswered: str) -> str:
    """What an error line says of a request that got no answer (`_reaching`)."""
    if isinstance(error, NOTHING_SENT):
        return f"{client.base_url} unreachable (nothing was sent): {error}"
    try:
        request: httpx.Request | None = error.request
    except RuntimeError:  # raised without its request
        request = None
    what = "the request" if request is None else f"{request.method} {request.url}"
    line = f"{what} was sent, but no answer came ({type(error).__name__}: {error})"
    if request is not None and request.method in READS:
        return line
    return f"{line}: {unanswered}"


def _resubmit_advice(idempotency_key: str | None, *, batch: bool) -> str:
    """What to do about a submission sent and never answered (it may have been taken)."""
    what = "batch" if batch else "task"
    if idempotency_key is not None:
        return (
            f"the gateway may have accepted it: submit it again with the same "
            f"--idempotency-key {idempotency_key}, which answers with the {what} if it was"
        )
    if batch:
        return (
            "the gateway may have accepted it: look for it with `scorebox batches` (newest "
            "first) before submitting it again, or it may be scored twice"
        )
    return (
        "the gateway may have accepted it: submitted again, the text may be scored twice (an "
        "--idempotency-key makes submitting again safe)"
    )


def _quote(text: str) -> str:
    """`text` on one line, at most `QUOTED_CHARS` long (an HTML error page, a stray body)."""
    line = " ".join(text.split())
    return line if len(line) <= QUOTED_CHARS else line[: QUOTED_CHARS - 3] + "..."


def _submission_failed(response: httpx.Response, unanswered: str) -> typer.Exit:
    """`_fail` for a submission's answer; one that may have kept it (a 5xx: a proxy's
    after forwarding it, a gateway's "may have taken effect"; a 409 saying its key's first
    request is still being accepted) says what to do, `unanswered`: the key `--wait` makes
    for itself was shown on no other path, and a run again under a new one scored the text
    twice (a review of the CLI)."""
    kept = response.status_code >= 500 or (
        response.status_code == 409 and _problem_type(response).endswith(IN_PROGRESS)
    )
    return _fail(response, advice=unanswered if kept else None)


def _fail(response: httpx.Response, *, advice: str | None = None) -> typer.Exit:
    """The exit for an unwanted status: the problem's `detail`, else the body, on one line
    (and `advice`, when given)."""
    try:
        body = response.json()
    except ValueError:  # not JSON, or not UTF-8
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if detail is None:
        detail = _quote(response.text) or response.reason_phrase
    elif not isinstance(detail, str):
        detail = json.dumps(detail, ensure_ascii=False)
    hints = f"{_retry_after_hint(response)}{_no_key_hint(response)}"
    advised = f"; {advice}" if advice else ""
    typer.echo(f"error {response.status_code}: {detail}{hints}{advised}", err=True)
    return typer.Exit(code=1)


def _problem_type(response: httpx.Response) -> str:
    """The problem+json `type` of `response`, or "" (not one, not JSON)."""
    try:
        body = response.json()
    except ValueError:
        return ""
    kind = body.get("type") if isinstance(body, dict) else None
    return kind if isinstance(kind, str) else ""


def _retry_after_hint(response: httpx.Response) -> str:
    """When the server said when to try again (a 429, a 503), that time, in seconds."""
    seconds = _retry_after(response)
    return "" if seconds is None else f" (retry after {math.ceil(seconds)} s)"


def _no_key_hint(response: httpx.Response) -> str:
    """For a 401 to a request sent with no key: which variable to set (the gateway's detail
    speaks of an Authorization header, which the CLI's user never writes)."""
    if response.status_code != 401 or "Authorization" in response.request.headers:
        return ""
    admin = response.request.url.path.startswith("/admin/")
    return f" (no key was sent: set {ADMIN_KEY_VARIABLE if admin else API_KEY_VARIABLE})"


def _answer(response: httpx.Response, *fields: str) -> dict[str, Any]:
    """The JSON object `response` carries, with `fields` in it; exits 1 with one line when it
    is something else (another server at that URL, a proxy's page, a truncated answer)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    where = f"{response.request.method} {response.request.url} answered {response.status_code}"
    if not isinstance(body, dict):
        _exit(f"{where} with no JSON object: {_quote(response.text) or '(empty)'}")
    missing = [field for field in fields if field not in body]
    if missing:
        _exit(f"{where} without {', '.join(missing)}: {_quote(response.text)}")
    return body


def _show(body: dict[str, Any]) -> None:
    typer.echo(json.dumps(body, indent=2, ensure_ascii=False))


def _wait(
    client: httpx.Client, task_id: str, deadline: float, accepted: dict[str, Any]
) -> dict[str, Any]:
    """Poll the task (`accepted` by the submission) until it is final or the `deadline`
    passes (`_poll_until`'s rules)."""
    return _poll_until(
        client,
        f"/v1/scores/{_segment(task_id, 'task_id')}",
        last=accepted,
        deadline=deadline,
        pauses=_backoff(),
        final=lambda body: body["status"] in TERMINAL,
        fields=("status",),
    )


def _backoff() -> Iterator[float]:
    """`submit --wait`'s pauses between polls: from 0.2 s, half as long again each time, to
    3 s at most."""
    delay = 0.2
    while True:
        yield delay
        delay = min(delay * 1.5, 3.0)


def _poll_until(
    client: httpx.Client,
    path: str,
    *,
    last: dict[str, Any],
    deadline: float,
    pauses: Iterator[float],
    final: Callable[[dict[str, Any]], bool],
    fields: tuple[str, ...],
) -> dict[str, Any]:
    """GET `path` until its object (with `fields` in it) is `final`, or the `deadline`
    (monotonic time) passes: then the last object read, final or not.

    Each poll is bounded by what is left of the wait (a server that accepted the connection
    and never answered held a `--timeout 3` wait for the client's 30 s). A 429 or 503 (the
    server busy, its database away for a moment) is polled again after its Retry-After,
    while that falls before the deadline: it ended the wait at once with exit 1. Any other
    answer but 200 exits 1.

    A poll that timed out when bounded by what was left of the wait (not by the client's
    own bound) timed out because the wait ran out: it ends as a wait that ran out does, with
    `last`, the last object read (the accepted one before any poll), not final. It said
    "unreachable" (found in review)."""
    while True:
        bound = _request_bound(deadline)
        try:
            response = client.get(path, timeout=bound)
        except httpx.TimeoutException:
            if bound >= REQUEST_TIMEOUT_S:
                raise  # the client's own bound ran out, with time left: no answer
            return last
        if response.status_code in RETRY_LATER:
            _pause_before_asking_again(response, next(pauses), deadline)
            continue
        if response.status_code != 200:
            raise _fail(response)
        body = last = _answer(response, *fields)
        if final(body) or time.monotonic() > deadline:
            return body
        # Never past the deadline: one more poll then tells how the wait ended.
        time.sleep(max(min(next(pauses), deadline - time.monotonic()), 0.0))


def _request_bound(deadline: float) -> float:
    """The timeout of one request of a wait: what is left of it until the `deadline`
    (monotonic time), at least `MIN_POLL_S`, at most the client's own."""
    return min(REQUEST_TIMEOUT_S, max(deadline - time.monotonic(), MIN_POLL_S))


def _pause_before_asking_again(
    response: httpx.Response,
    pause: float,
    deadline: float,
    *,
    refused: Callable[[httpx.Response], typer.Exit] = _fail,
) -> None:
    """Wait out a busy answer's Retry-After (at least `pause`); exit 1 with that answer
    (`refused` says it) when it would end past the `deadline`."""
    pause = max(_retry_after(response) or 0.0, pause)
    if time.monotonic() + pause > deadline:
        raise refused(response)
    time.sleep(pause)


def _check_duration(seconds: float, option: str) -> None:
    """`option`'s value a number of seconds, 0 or more, checked before anything is sent: no
    time is past `nan` (a wait polled for ever), and `time.sleep(inf)` raised a traceback."""
    if not math.isfinite(seconds) or seconds < 0:
        _usage_error(f"{option} must be a number of seconds, 0 or more")


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds `response`'s Retry-After asks for (seconds or an HTTP date); None when it
    has none the CLI can read."""
    value = response.headers.get("Retry-After", "").strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, the zone unstated
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="The text to score; - reads stdin.")],
    *,
    rubric: Annotated[str | None, typer.Option(help="What to judge the text on.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Poll until the task finishes.")] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds --wait takes at most, the submission included.")
    ] = 300.0,
    idempotency_key: Annotated[str | None, typer.Option(help="Idempotency-Key header.")] = None,
    model: Annotated[str | None, typer.Option(help="The model to score with.")] = None,
    metadata: Annotated[
        str | None, typer.Option(help="A JSON object kept with the task, shown with it.")
    ] = None,
    callback_url: Annotated[
        str | None, typer.Option(help="An https URL POSTed the outcome (a webhook).")
    ] = None,
    delay_seconds: Annotated[
        int | None, typer.Option(min=0, help="Score no sooner than this many seconds from now.")
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Score it even if the same text was scored.")
    ] = False,
) -> None:
    """Submit a text for scoring and print the task (or, with --wait, its result).

    Exits 1 when the gateway refuses the text, cannot be reached, or does not answer (it may
    have accepted the text: the line says what to do), or --wait runs out before the task
    finishes or finds the key's task expired; 2 when the text or --metadata cannot be read
    (nothing is sent) or the task failed under --wait. With --wait, a 429 or 503 to the
    submission or a poll is asked again after its Retry-After, within --timeout.
    """
    _check_idempotency_key(idempotency_key)
    _check_duration(timeout, "--timeout")
    text = _read_text(file)
    if wait and idempotency_key is None:
        # Its submission is asked again after a 429 or 503: under a key of its own, for a
        # 503 that kept the text (a proxy's, after forwarding it; the gateway's "may have
        # taken effect") answers with that task rather than scoring it twice (a review).
        idempotency_key = f"scorebox-cli-{uuid.uuid4().hex}"
    payload: dict[str, Any] = {"text": text}
    if rubric:
        payload["rubric"] = rubric
    payload |= _submission_options(
        model=model,
        metadata=metadata,
        callback_url=callback_url,
        delay_seconds=delay_seconds,
        use_cache=not no_cache,
    )
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else {}
    unanswered = _resubmit_advice(idempotency_key, batch=False)
    with _reaching(_client(), unanswered=unanswered) as client:
        deadline = time.monotonic() + timeout
        response = _post_submission(
            client,
            payload,
            headers,
            wait_deadline=deadline if wait else None,
            timeout_s=timeout,
            unanswered=unanswered,
        )
        if response.status_code not in (200, 202):
            raise _submission_failed(response, unanswered)
        body = _answer(response, "task_id", "status")
        if wait and body["status"] == EXPIRED:
            _show(body)
            _exit(
                f"task {body['task_id']} of this Idempotency-Key finished earlier and has "
                "expired: its result can no longer be read (submit the text under another "
                "key, or none, to have it scored again)"
            )
        if wait and body["status"] not in TERMINAL:
            # Named before the wait, so that however the wait ends (the status service away,
            # the gateway gone, Ctrl-C), the accepted task is known: it is being scored, and
            # submitting the text again would have it scored twice.
            task_id = body["task_id"]
            typer.echo(f"task {task_id} accepted; waiting up to {timeout:g} s for it", err=True)
            body = _wait(client, task_id, deadline, body)
        _show(body)
        # Only under --wait: without it, a keyed submission answered with its earlier task,
        # failed, exited 2 too, where `status` of that task exits 0 (found in review).
        if wait and body["status"] == "failed":
            raise typer.Exit(code=2)
        if wait and body["status"] not in TERMINAL:
            typer.echo(
                f"task {body['task_id']} still {body['status']} after {timeout:g}s", err=True
            )
            raise typer.Exit(code=1)


def _post_submission(
    client: httpx.Client,
    payload: dict[str, Any],
    headers: dict[str, str],
    *,
    wait_deadline: float | None,
    timeout_s: float,
    unanswered: str,
) -> httpx.Response:
    """POST the text; with --wait, bounded by what is left of it (`wait_deadline`) as its
    polls are (a gateway that accepted the connection and never answered held a
    `--timeout 3` wait for the client's 30 s), and asked again after a 429 or 503's
    Retry-After while that falls before the deadline, as a poll is (it ended the wait with
    exit 1 however much of --timeout was left; found in review): only under an
    Idempotency-Key (`submit` gives --wait one of its own), for not every 503 kept nothing
    of it (a proxy's after forwarding it; a review).

    When the wait's bound ran out before an answer, exits 1 saying so and what to do
    (`unanswered`); the client's own bound running out, or the connection lost, is
    `_reaching`'s "sent, but no answer came", as without --wait."""
    if wait_deadline is None:
        return client.post("/v1/scores", json=payload, headers=headers)
    keyed = "Idempotency-Key" in headers
    return _post_within(
        client,
        "/v1/scores",
        wait_deadline,
        ask_again=lambda response: keyed and _to_ask_again(response),
        # Unanswered is not refused: the gateway may have recorded the text all the same.
        unanswered=f"submission still unanswered after {timeout_s:g}s: {unanswered}",
        refused=lambda response: _submission_failed(response, unanswered),
        json=payload,
        headers=headers,
    )


def _post_within(
    client: httpx.Client,
    path: str,
    deadline: float,
    *,
    ask_again: Callable[[httpx.Response], bool],
    unanswered: str,
    refused: Callable[[httpx.Response], typer.Exit] = _fail,
    **request: Any,
) -> httpx.Response:
    """POST `path` for a wait that ends at `deadline`: bounded by what is left of it, as its
    polls are, and asked again after the Retry-After of an answer `ask_again` accepts, while
    that falls before the deadline. When the wait's bound ran out before an answer, exits 1
    with `unanswered`; the client's own bound running out, or the connection lost, is
    `_reaching`'s "sent, but no answer came"."""
    pauses = _backoff()
    while True:
        bound = _request_bound(deadline)
        try:
            response = client.post(path, timeout=bound, **request)
        except (httpx.ReadTimeout, httpx.WriteTimeout):
            # Not a connect or pool timeout: then nothing was sent, and `_reaching` says
            # "unreachable" (said to be unanswered, it was taken for maybe accepted).
            if bound >= REQUEST_TIMEOUT_S:
                raise
            _exit(unanswered)
        if not ask_again(response):
            return response
        _pause_before_asking_again(response, next(pauses), deadline, refused=refused)


def _to_ask_again(response: httpx.Response) -> bool:
    """A 429 or 503, or a 409 saying the key's first request is still being accepted (its
    own answer, a retry's under the same key: the first went on behind a proxy's 503, and
    the wait ended with exit 1 however much of it was left; a review)."""
    if response.status_code in RETRY_LATER:
        return True
    return response.status_code == 409 and _problem_type(response).endswith(IN_PROGRESS)


def _submission_options(
    *,
    model: str | None,
    metadata: str | None,
    callback_url: str | None,
    delay_seconds: int | None,
    use_cache: bool,
) -> dict[str, Any]:
    """The body fields the options give (none for an option left out: the gateway's default
    applies); exits 2 when --metadata is not a JSON object."""
    fields: dict[str, Any] = {
        "model": model,
        "callback_url": callback_url,
        "delay_seconds": delay_seconds,
    }
    if metadata is not None:
        fields["metadata"] = _json_object(metadata, "--metadata")
    if not use_cache:
        fields["use_cache"] = False
    return {name: value for name, value in fields.items() if value is not None}


class _RepeatedKeyError(Exception):
    """A key given twice in one object of the JSON read (`_strict_json`)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object_refusing_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict, raising `_RepeatedKeyError` on a key given twice."""
    value: dict[str, Any] = {}
    for key, member in pairs:
        if key in value:
            raise _RepeatedKeyError(key)
        value[key] = member
    return value


def _strict_json(text: str) -> Any:
    """`text` read as JSON, as the gateway reads a body: a key given twice in one object
    (at any depth) is refused (`_RepeatedKeyError`), where `json.loads` kept the last value
    without a word (`{"text": "a", "text": "b"}` was sent as "b"; the API answers 422)."""
    return json.loads(
        text,
        object_pairs_hook=_object_refusing_repeats,
        parse_constant=_no_constant,
        parse_float=_finite_float,
    )


def _no_constant(name: str) -> Any:
    """`NaN` and `Infinity`, which `json.loads` takes and no JSON body may carry: sent, the
    client raised a traceback where a line and exit 2 were due (a review of the CLI)."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise ValueError(f"{literal} is beyond what a JSON number can carry here")
    return number


def _repeated(key: str) -> str:
    """A repeated key as an error line names it: quoted, at most `QUOTED_CHARS` long."""
    return _quote(json.dumps(key, ensure_ascii=False))


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = _strict_json(text)
    except _RepeatedKeyError as error:
        _usage_error(f"{what} gives the key {_repeated(error.key)} more than once; give it once")
    except ValueError as error:
        _usage_error(f"{what} is not JSON: {error}")
    if not isinstance(value, dict):
        _usage_error(f"{what} must be a JSON object")
    return value


def _check_idempotency_key(key: str | None) -> None:
    """The gateway's rule, checked before anything is sent: a key with other than ASCII in it
    raised a UnicodeEncodeError traceback, one with a space was sent to be refused."""
    if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
        _usage_error("--idempotency-key must be 1 to 255 visible ASCII characters (no spaces)")


def _read_text(file: Path) -> str:
    """The text in `file` (`-`: stdin) as UTF-8, line endings as they are; exits 2 with one
    line when it cannot be read (a text it cannot send, as the README's exit codes say). Stdin
    is read as bytes and decoded here: decoded by Python, a stream that is not UTF-8 raised a
    traceback."""
    try:
        raw = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
        # Bytes decoded as they are: `read_text` turned CRLF into LF, so a file and the same
        # file on stdin sent different texts (and a key reused across them was a 409).
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        source = "stdin" if str(file) == "-" else file
        _usage_error(f"cannot read {source}: {error}")


@app.command()
def status(task_id: str) -> None:
    """Show a task's status and, once completed, its score."""
    path = f"/v1/scores/{_segment(task_id, 'TASK_ID')}"
    with _reaching(_client()) as client:
        response = client.get(path)
        if response.status_code != 200:
            raise _fail(response)
        _show(_answer(response))


@app.command()
def cancel(task_id: str) -> None:
    """Cancel a task whose model call has not started (poll `status` for how it ended)."""
    path = f"/v1/scores/{_segment(task_id, 'TASK_ID')}/cancel"
    with _reaching(_client()) as client:
        response = client.post(path)
        if response.status_code != 202:
            raise _fail(response)
        _show(_answer(response, "task_id", "status"))


@app.command("cancel-batch")
def cancel_batch(batch_id: str) -> None:
    """Cancel every item of a batch whose model call has not started (its answer counts the
    items sent a cancellation and those already finished)."""
    path = f"/v1/batches/{_segment(batch_id, 'BATCH_ID')}/cancel"
    with _reaching(_client()) as client:
        response = client.post(path)
        if response.status_code != 202:
            raise _fail(response)
        _show(_answer(response, "batch_id", "cancelling", "already_finished"))


@app.command("submit-batch")
def submit_batch(
    file: Annotated[
        Path,
        typer.Argument(
            help="JSON Lines, one item per line: the text as a JSON string, or an object "
            '{"text", "client_id"?, "rubric"?, "model"?, "metadata"?}; - reads stdin.'
        ),
    ],
    rubric: Annotated[str | None, typer.Option(help="For the items that name none.")] = None,
    model: Annotated[str | None, typer.Option(help="For the items that name none.")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="Idempotency-Key header.")] = None,
) -> None:
    """Submit up to 1,000 texts as one batch and print it, each item's task id included
    (`batch-status` shows its progress).

    Exits 1 when the gateway refuses the batch or cannot be reached; 2 when the file cannot
    be read or a line is not an item or gives a key twice in one object (nothing is sent).
    """
    _check_idempotency_key(idempotency_key)
    items = _batch_items(_read_text(file))
    payload: dict[str, Any] = {"items": items}
    if rubric:
        payload["rubric"] = rubric
    if model:
        payload["model"] = model
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else {}
    unanswered = _resubmit_advice(idempotency_key, batch=True)
    with _reaching(_client(), unanswered=unanswered) as client:
        response = client.post("/v1/batches", json=payload, headers=headers)
        if response.status_code not in (200, 202):
            raise _submission_failed(response, unanswered)
        _show(_answer(response, "batch_id", "items"))


def _batch_items(text: str) -> list[dict[str, Any]]:
    """The items of a JSON Lines file (blank lines skipped); exits 2 naming the first line
    that is not one."""
    items: list[dict[str, Any]] = []
    # Lines end at "\n" alone: `splitlines` also broke at U+2028, U+2029 and U+0085, which
    # JSON writes raw inside strings (found in a walkthrough).
    lines = text.removeprefix("\ufeff").split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = _strict_json(line)
        except _RepeatedKeyError as error:
            _usage_error(
                f"line {number} gives the key {_repeated(error.key)} more than once in one "
                "object; give it once"
            )
        except ValueError as error:
            _usage_error(f"line {number} is not JSON: {error}")
        if isinstance(item, str):
            item = {"text": item}
        if not isinstance(item, dict):
            _usage_error(f"line {number} is neither a text (a JSON string) nor an item (an object)")
        items.append(item)
    if not items:
        _usage_error("no items: give one per line")
    if len(items) > MAX_BATCH_ITEMS:
        _usage_error(f"{len(items):,} items: a batch holds at most {MAX_BATCH_ITEMS:,}")
    return items


@app.command("batch-status")
def batch_status(
    batch_id: str,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Items per page.")] = 100,
    cursor: Annotated[str | None, typer.Option(help="The next_cursor of the page before.")] = None,
) -> None:
    """Show a batch's counts per status and a page of its items."""
    path = f"/v1/batches/{_segment(batch_id, 'BATCH_ID')}"
    params: dict[str, Any] = {"limit": limit}
    if cursor is not None:
        params["cursor"] = cursor
    with _reaching(_client()) as client:
        response = client.get(path, params=params)
        if response.status_code != 200:
            raise _fail(response)
        _show(_answer(response, "batch_id", "counts"))


@app.command("batches")
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100, help="Batches per page.")] = 20,
    cursor: Annotated[str | None, typer.Option(help="The next_cursor of the page before.")] = None,
) -> None:
    """List your tenant's batches, newest first, a page at a time: each with its id, creation
    time, item count and status URL (finds a batch whose answer was lost)."""
    params: dict[str, Any] = {"limit": limit}
    if cursor is not None:
        params["cursor"] = cursor
    with _reaching(_client()) as client:
        response = client.get("/v1/batches", params=params)
        if response.status_code != 200:
            raise _fail(response)
        _show(_answer(response, "items", "next_cursor"))


def _admin_call(
    method: str, path: str, *, client: httpx.Client | None = None, **kwargs: Any
) -> dict[str, Any]:
    with _reaching(client or _client(admin=True)) as reached:
        response = reached.request(method, path, **kwargs)
        if response.status_code != 200:
            raise _fail(response)
        body = _answer(response)
        _show(body)
        return body


def _replay_body(ids: list[str] | None, replay_all: bool, *, field: str) -> dict[str, Any]:
    if replay_all == bool(ids):
        said = "ids and --all: give one or the other" if ids else "give ids, or --all"
        typer.echo(f"error: {said}", err=True)
        raise typer.Exit(code=2)
    return {"all": True} if replay_all else {field: ids}


def _note_truncated(answer: dict[str, Any], consequence: str) -> None:
    """One line on stderr when the service's walk of the DLQ stopped short of its end."""
    if answer.get("truncated") is True:
        typer.echo(f"truncated: {WALK_STOPPED}; {consequence}", err=True)


# The fields of a replay's report that name letters left in the queue, unreplayed.
_NOT_REPLAYED = (
    "not_found",
    "not_reached",
    "skipped_unreadable",
    "skipped_in_progress",
    "skipped_unconfigured",
    "skipped_being_rescored",
)


def _exit_on_missed(replay: dict[str, Any], *, drop_command: str, replay_all: bool) -> None:
    """Say what a replay did not reach, and exit 1 when an id asked for was not replayed for
    want of a letter (not found, or past the end of a walk cut short), a letter was left
    unreplayed because it is unreadable (kept: only `drop_command` removes it) or, for a
    cron run, because its job has a run in progress or is no longer configured (a
    walkthrough found those exiting 0, silent), or a replay of all stopped short (letters
    left that a script would take as replayed)."""
    _note_truncated(replay, "letters past it were not looked at: run again to reach them")
    if replay.get("timed_out") is True:
        typer.echo(f"timed out: {REPLAY_STOPPED}; run it again for the rest", err=True)
    if isinstance(interrupted := replay.get("interrupted"), str):
        typer.echo(f"interrupted: {interrupted}", err=True)  # it says what to do
    if replay.get("superseded"):
        typer.echo(
            f"superseded by a later generation, removed: {' '.join(replay['superseded'])}",
            err=True,
        )
    if replay.get("not_found"):
        typer.echo(
            f"not found: {' '.join(replay['not_found'])} (no letter of the queue has it: "
            "replayed or dropped since, perhaps by another operator, or held a moment by "
            "another look at the queue; list again)",
            err=True,
        )
    if replay.get("not_reached"):
        typer.echo(f"{_not_reached_why(replay)}: {' '.join(replay['not_reached'])}", err=True)
    if replay.get("skipped_unreadable"):
        typer.echo(
            f"unreadable, kept (drop them with `{drop_command} ID`): "
            f"{' '.join(replay['skipped_unreadable'])}",
            err=True,
        )
    if replay.get("skipped_in_progress"):
        typer.echo(
            "kept, their job has a run in progress (replay them once it ends): "
            f"{' '.join(replay['skipped_in_progress'])}",
            err=True,
        )
    if replay.get("skipped_being_rescored"):
        typer.echo(
            "kept, a re-score of their task was being sent (replay them again shortly; "
            "one quiet for an hour keeps them no longer): "
            f"{' '.join(replay['skipped_being_rescored'])}",
            err=True,
        )
    if replay.get("skipped_unconfigured"):
        typer.echo(
            f"kept, their job is no longer configured (drop them with `{drop_command} ID`): "
            f"{' '.join(replay['skipped_unconfigured'])}",
            err=True,
        )
    if any(replay.get(field) for field in _NOT_REPLAYED):
        raise typer.Exit(code=1)
    if replay_all and _stopped_short(replay):
        raise typer.Exit(code=1)


def _stopped_short(replay: dict[str, Any]) -> bool:
    """The replay left letters it did not look at: its walk's bound, its time budget, or the
    broker or the database failing part-way."""
    return (
        replay.get("truncated") is True
        or replay.get("timed_out") is True
        or isinstance(replay.get("interrupted"), str)
    )


def _not_reached_why(replay: dict[str, Any]) -> str:
    """What the ids a replay did not reach wait for: a walk cut short, or its time budget."""
    if isinstance(replay.get("interrupted"), str) and replay.get("truncated") is not True:
        return "not replayed yet (the replay was interrupted, as said above)"
    if replay.get("truncated") is not True:
        return "not replayed yet (the replay ran out of time: run it again)"
    ran_out = "; or the replay ran out of time: run it again" if replay.get("timed_out") else ""
    if isinstance(replay.get("interrupted"), str):
        ran_out = "; or the replay was interrupted, as said above"
    return (
        "not reached (they may lie past the walk: replay or drop the letters before them, then "
        f"ask again{ran_out})"
    )


def _list_letters(path: str, client: httpx.Client) -> None:
    listing = _admin_call("GET", path, client=client)
    count = listing.get("count")
    _note_truncated(
        listing, f"{count} listed, the rest not reached (replay or drop some first, or ask again)"
    )


# The service's own check of a cut-off (`shared.dead_letters._DATE_TIME`, which the CLI does
# not import; a test keeps the two equal): RFC 3339's date-time, seconds and zone required.
CUT_OFF_DATE_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", re.ASCII)


def _rfc3339_or_none(value: str | None) -> str | None:
    """`--before` as given, once it reads as an RFC 3339 date-time with a zone: checked here,
    a purge asked its question first and the service refused the value only after a yes
    (found in a walkthrough); checked as the service checks it (`CUT_OFF_DATE_TIME`)."""
    if value is None:
        return None
    text = value.upper()  # RFC 3339 takes `t` and `z` too
    parsed = None
    if CUT_OFF_DATE_TIME.fullmatch(text):
        with contextlib.suppress(ValueError, OverflowError):  # 2030-02-30
            parsed = datetime.fromisoformat(text)
    if parsed is None:
        raise typer.BadParameter(
            f"{value!r} is not an RFC 3339 date-time with a zone, such as a listing's "
            "listed_at (2030-01-01T10:00:00Z)"
        )
    return value


# A drop's or a purge's cut-off: letters dead-lettered at or after it are kept.
Before = Annotated[
    str | None,
    typer.Option(
        "--before",
        metavar="LISTED_AT",
        help="Remove only letters dead-lettered before this RFC 3339 time (a listing's "
        "listed_at); those dead-lettered since are kept.",
        callback=_rfc3339_or_none,
    ),
]


def _cut_off(before: str | None) -> dict[str, str]:
    return {} if before is None else {"dead_lettered_before": before}


def _drop(
    path: str,
    ids: list[str],
    name: str,
    client: Callable[[], httpx.Client],
    *,
    before: str | None = None,
) -> None:
    """DELETE each letter in turn, every id tried; exits 1 when one was not dropped (a 404,
    a 409: the walk stopped before reaching it, or every copy kept, dead-lettered at or after
    `before`) or got no answer (a timeout, a connection
    refused or reset: one line for that id, and the next is tried all the same; a drop whose
    answer was lost may have happened, and asked again is a 404)."""
    paths = [(letter_id, f"{path}/{_segment(letter_id, name)}") for letter_id in ids]
    missed: typer.Exit | None = None
    with _reaching(client()) as reached:
        for letter_id, letter_path in paths:
            try:
                response = reached.delete(letter_path, params=_cut_off(before))
            except httpx.HTTPError as error:
                url = reached.build_request("DELETE", letter_path).url
                typer.echo(
                    f"error: DELETE {url}: no answer ({type(error).__name__}: {error})", err=True
                )
                missed = typer.Exit(code=1)
                continue
            if response.status_code != 200:
                missed = _fail(response)
                continue
            dropped = _answer(response, "removed")
            _show(dropped)
            _note_truncated(dropped, "copies past it, if any, are still there")
            if not dropped.get("removed") and dropped.get("kept"):
                # Printed `removed: 0, kept: 1` and exited 0: read as done (a walkthrough).
                typer.echo(
                    f"{letter_id}: kept, "
                    "dead-lettered at or after --before "
                    "(the cut-off), or at a time the letter does not say; nothing removed",
                    err=True,
                )
                missed = typer.Exit(code=1)
    if missed is not None:
        raise missed


@dlq.command("list")
def dlq_list() -> None:
    """List dead letters with their reason, attempts and age."""
    _list_letters("/admin/v1/dead-letters", _client(admin=True))


@dlq.command("show")
def dlq_show(letter_id: str) -> None:
    """Show one dead letter by message id or task id."""
    _admin_call("GET", f"/admin/v1/dead-letters/{_segment(letter_id, 'LETTER_ID')}")


@dlq.command("replay")
def dlq_replay(
    ids: Annotated[list[str] | None, typer.Argument(help="Message or task ids.")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
) -> None:
    """Send dead letters back to the work queue with a fresh attempt budget.

    Exits 1 when an id matched no letter, was not reached by a walk cut short, a letter
    was unreadable (kept: drop it), or --all stopped short (run it again for the rest).
    Letters a later generation superseded are removed unsent and named on stderr."""
    body = _replay_body(ids, replay_all, field="ids")
    replay = _admin_call("POST", "/admin/v1/dead-letters/replay", json=body)
    _exit_on_missed(replay, drop_command="scorebox dlq drop", replay_all=replay_all)


@dlq.command("drop")
def dlq_drop(
    ids: Annotated[list[str], typer.Argument(help="Message or task ids.")],
    before: Before = None,
) -> None:
    """Delete the dead letters named (every copy of each), sending nothing; the others stay.

    Exits 1 when an id matched no letter, was not reached by a walk cut short, or got no
    answer (the other ids are dropped all the same)."""
    _drop("/admin/v1/dead-letters", ids, "LETTER_ID", lambda: _client(admin=True), before=before)


@dlq.command("purge")
def dlq_purge(
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
    before: Before = None,
) -> None:
    """Delete every dead letter of the score queue (with --before, those dead-lettered before
    it). Asks first, on stderr: stdout carries the answer's JSON alone.
    Exits 1 when the walk stopped short of the queue's end (`truncated`): purge again."""
    if not yes:
        _confirm_purge(SCORE_REQUESTS_DLQ, before)
    _purge("/admin/v1/dead-letters", before)


def _purge(path: str, before: str | None, client: httpx.Client | None = None) -> None:
    """DELETE `path` (with the cut-off `before`); exits 1 when the service's walk stopped
    short of the queue's end: letters before the cut-off it did not reach are still there
    (it exited 0 with `truncated: true` in its JSON alone; a review of the CLI)."""
    purged = _admin_call("DELETE", path, client=client, params=_cut_off(before))
    if purged.get("truncated") is True:
        _note_truncated(purged, "letters past it are still there: purge again")
        raise typer.Exit(code=1)


def _confirm_purge(queue: str, before: str | None) -> None:
    """Ask on stderr, so that `echo y | scorebox dlq purge | jq` reads the JSON alone (asked
    on stdout, the question came before it); abort on anything but yes."""
    question = f"Delete every dead letter in {queue}"
    if before is not None:
        question += f" dead-lettered before {before}"
    # `err=True` alone is not enough: typer writes the question's last character (and, under
    # a test runner, the answer) through `input()`, which writes to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        typer.confirm(f"{question}?", abort=True, err=True)


keys = typer.Typer(help="Manage API keys (needs SCOREBOX_ADMIN_KEY).")
app.add_typer(keys, name="keys")


@keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    name: Annotated[str, typer.Option(help="What the key is for.")] = "",
    expires_in_days: Annotated[
        int | None,
        typer.Option(help="Days until the key stops opening requests (default: until revoked)."),
    ] = None,
) -> None:
    """Create a key and print it: the `key` field is shown this once, never again."""
    wanted: dict[str, Any] = {"tenant_id": tenant, "name": name}
    if expires_in_days is not None:
        wanted["expires_in_days"] = expires_in_days
    unanswered = (
        f"the key may have been created: look for it with `scorebox keys list --tenant "
        f"{tenant}` before creating another (revoke one not wanted)"
    )
    with _reaching(_client(admin=True), unanswered=unanswered) as client:
        response = client.post("/admin/v1/keys", json=wanted)
        if response.status_code != 201:
            raise _fail(response)
        _show(_answer(response))


@keys.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
) -> None:
    """List keys (ids, tenants, names, dates; never a secret)."""
    _admin_call("GET", "/admin/v1/keys", params={"tenant_id": tenant} if tenant else None)


@keys.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key; every gateway refuses it within a few seconds (API_KEY_CACHE_TTL_S)."""
    _admin_call("DELETE", f"/admin/v1/keys/{_segment(key_id, 'KEY_ID')}")


@app.command()
def usage(
    first_day: Annotated[
        str | None, typer.Option("--from", help="First UTC day (default: 30 days before --to).")
    ] = None,
    last_day: Annotated[
        str | None, typer.Option("--to", help="Last UTC day (default: today).")
    ] = None,
) -> None:
    """Show your tenant's daily usage (completed tasks, tokens, cost) and its totals."""
    params = {name: day for name, day in (("from", first_day), ("to", last_day)) if day}
    with _reaching(_client()) as client:
        response = client.get("/v1/usage", params=params)
        if response.status_code != 200:
            raise _fail(response)
        _show(_answer(response))


cron = typer.Typer(
    help="The scheduler's cron jobs (SCOREBOX_SCHEDULER_URL; needs SCOREBOX_ADMIN_KEY)."
)
app.add_typer(cron, name="cron")

FINAL_RUN_STATES = {"succeeded", "failed", "skipped"}
JOB_COLUMNS = ("NAME", "CRON", "TZ", "ENABLED", "NEXT FIRE (UTC)", "LAST STATE")


JOB_FIELDS = ("name", "cron", "tz", "enabled")


def _job_row(job: dict[str, Any]) -> tuple[str, ...]:
    last = job.get("last_firing")
    state = last.get("state") if isinstance(last, dict) else None
    return (
        str(job["name"]),
        str(job["cron"]),
        str(job["tz"]),
        "yes" if job["enabled"] else "no",
        str(job.get("next_fire_at") or "-"),
        str(state or "-"),
    )


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(line[i]) for line in (header, *rows)) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (header, *rows)
    )


@cron.command("list")
def cron_list() -> None:
    """List the cron jobs: schedule, zone, next fire time and the last firing's state."""
    with _reaching(_scheduler_client()) as client:
        response = client.get("/admin/v1/cron/jobs")
        if response.status_code != 200:
            raise _fail(response)
        jobs = _jobs(response)
    typer.echo(_table(JOB_COLUMNS, [_job_row(job) for job in jobs]))


def _jobs(response: httpx.Response) -> list[dict[str, Any]]:
    jobs = _answer(response, "jobs")["jobs"]
    if isinstance(jobs, list) and all(
        isinstance(job, dict) and all(field in job for field in JOB_FIELDS) for job in jobs
    ):
        return jobs
    _exit(f"{response.request.url} answered a job list without jobs: {_quote(response.text)}")


def _started_nothing(response: httpx.Response) -> bool:
    """A refusal of `cron run` to ask again: a 429, or a 503 whose problem type says no run
    was started (`CRON_STARTED_NOTHING`). Not the database's 503 (the run may have been
    recorded), `run-outcome-unknown`, nor a 503 of no type of ours (a proxy's, maybe after
    forwarding the request): asked again, the job could run twice."""
    if response.status_code == 429:
        return True
    return response.status_code == 503 and _problem_type(response).endswith(CRON_STARTED_NOTHING)


def _await_run(
    client: httpx.Client,
    accepted: dict[str, Any],
    *,
    deadline: float,
    timeout_s: float,
    poll_s: float,
) -> dict[str, Any]:
    """Poll the `accepted` run until it is final (`_poll_until`'s rules); exits 1 when it
    cannot be read or the `deadline` (`timeout_s` after the command began) passes.

    The run is named before the wait: however the wait ends (the scheduler away, Ctrl-C), it
    was fired and goes on, and running the command again would fire the job a second time."""
    typer.echo(f"run {accepted['run_id']} fired; waiting up to {timeout_s:g} s for it", err=True)
    run = _poll_until(
        client,
        accepted["status_url"],
        last=accepted,
        deadline=deadline,
        # At least `MIN_POLL_PAUSE_S`: `--poll-s 0` asked the scheduler back to back for as
        # long as the run took, up to ten minutes (a review of the CLI).
        pauses=itertools.repeat(max(poll_s, MIN_POLL_PAUSE_S)),
        final=lambda body: body["state"] in FINAL_RUN_STATES,
        fields=("run_id", "state"),
    )
    if run["state"] not in FINAL_RUN_STATES:
        _show(run)
        typer.echo(f"run {run['run_id']} still {run['state']} after {timeout_s:g}s", err=True)
        raise typer.Exit(code=1)
    return run


@cron.command("run")
def cron_run(
    job: Annotated[str, typer.Argument(help="The job's name (see `scorebox cron list`).")],
    wait: Annotated[bool, typer.Option("--wait", help="Poll until the run finishes.")] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds --wait takes at most, firing the run included.")
    ] = 600.0,
    poll_s: Annotated[float, typer.Option(help="Seconds between polls.")] = 1.0,
) -> None:
    """Fire a job by hand and print the run; with --wait, the run once finished (the run's
    id goes to stderr before the wait, however it ends).

    Exits 1 when the job is unknown (404), the scheduler unavailable (503) or the wait timed
    out, and 2 when the run failed. With --wait, a 429, or a 503 saying no run was started,
    is asked again after its Retry-After, as is a 429 or 503 to a poll, within --timeout.
    """
    _check_duration(timeout, "--timeout")
    _check_duration(poll_s, "--poll-s")
    unanswered = (
        "the job may have been fired: see its last firing in `scorebox cron list` before "
        "running it again"
    )
    path = f"/admin/v1/cron/jobs/{_segment(job, 'JOB')}/run"
    with _reaching(_scheduler_client(), unanswered=unanswered) as client:
        if not wait:
            response = client.post(path)
            if response.status_code != 202:
                raise _fail(response)
            _show(_answer(response))
            return
        deadline = time.monotonic() + timeout
        # Asked again only when the scheduler said it started nothing: the wait ended with
        # exit 1 at a broker's moment away however much of it was left.
        response = _post_within(
            client,
            path,
            deadline,
            ask_again=_started_nothing,
            unanswered=f"run still unanswered after {timeout:g}s: {unanswered}",
        )
        if response.status_code != 202:
            raise _fail(response)
        accepted = _answer(response, "run_id", "state", "status_url")
        run = _await_run(client, accepted, deadline=deadline, timeout_s=timeout, poll_s=poll_s)
    _show(run)
    if run["state"] == "failed":
        raise typer.Exit(code=2)


cron_dlq = typer.Typer(help="Operate the cron runs' dead-letter queue (on the scheduler).")
cron.add_typer(cron_dlq, name="dlq")
CRON_DEAD_LETTERS = "/admin/v1/cron/dead-letters"


@cron_dlq.command("list")
def cron_dlq_list() -> None:
    """List the cron runs given up for good: job, run id, reason, and whether the job is
    still configured and able to run (a replay of one that is not is refused: drop it, or
    set what its job lacks)."""
    _list_letters(CRON_DEAD_LETTERS, _scheduler_client())


@cron_dlq.command("replay")
def cron_dlq_replay(
    run_ids: Annotated[list[str] | None, typer.Argument(help="Run ids of dead runs.")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead run.")] = False,
) -> None:
    """Run each dead run's job again as a new run; prints the new runs and their status URLs.

    Exits 1 when a run id matched no letter or was not reached by a walk cut short, a letter
    was unreadable (kept: drop it by its message id), a letter was kept because its job has
    a run in progress or is no longer configured, --all stopped short (run it again for the
    rest), or the scheduler refused (a job no longer configured: 409, nothing replayed)."""
    body = _replay_body(run_ids, replay_all, field="run_ids")
    replay = _admin_call(
        "POST", f"{CRON_DEAD_LETTERS}/replay", client=_scheduler_client(), json=body
    )
    _exit_on_missed(replay, drop_command="scorebox cron dlq drop", replay_all=replay_all)


@cron_dlq.command("drop")
def cron_dlq_drop(
    run_ids: Annotated[
        list[str], typer.Argument(help="Run ids of dead runs (or a letter's message id).")
    ],
    before: Before = None,
) -> None:
    """Delete the dead letters of the runs named (every copy), running nothing: the way out
    for a letter of a job no longer configured, which replay refuses.

    Exits 1 when a run id matched no letter, was not reached by a walk cut short, or got no
    answer (the other ids are dropped all the same)."""
    _drop(CRON_DEAD_LETTERS, run_ids, "RUN_ID", _scheduler_client, before=before)


@cron_dlq.command("purge")
def cron_dlq_purge(
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
    before: Before = None,
) -> None:
    """Delete every cron dead letter (with --before, those dead-lettered before it). Asks
    first, on stderr: stdout carries the answer's JSON alone.
    Exits 1 when the walk stopped short of the queue's end (`truncated`): purge again."""
    if not yes:
        _confirm_purge(CRON_JOBS_DLQ, before)
    _purge(CRON_DEAD_LETTERS, before, _scheduler_client())


webhooks = typer.Typer(
    help="The notifier's webhooks (SCOREBOX_NOTIFIER_URL; needs SCOREBOX_ADMIN_KEY).",
    no_args_is_help=True,
)
app.add_typer(webhooks, name="webhooks")
webhooks_dlq = typer.Typer(
    help="Operate the dead-letter queue of webhooks given up (on the notifier).",
    no_args_is_help=True,
)
webhooks.add_typer(webhooks_dlq, name="dlq")
WEBHOOK_DEAD_LETTERS = "/admin/v1/webhooks/dead-letters"


@webhooks_dlq.command("list")
def webhooks_dlq_list() -> None:
    """List the webhooks given up: delivery id (the receiver's webhook-id), task, tenant,
    destination, the attempt given up and the reason."""
    _list_letters(WEBHOOK_DEAD_LETTERS, _notifier_client())


@webhooks_dlq.command("show")
def webhooks_dlq_show(
    letter_id: Annotated[str, typer.Argument(help="A delivery id (or a letter's message id).")],
) -> None:
    """Show one dead letter with the JSON its webhook POSTs."""
    path = f"{WEBHOOK_DEAD_LETTERS}/{_segment(letter_id, 'ID')}"
    _admin_call("GET", path, client=_notifier_client())


@webhooks_dlq.command("replay")
def webhooks_dlq_replay(
    ids: Annotated[
        list[str] | None, typer.Argument(help="Delivery ids (or a letter's message id).")
    ] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every letter.")] = False,
) -> None:
    """Move dead letters back to the webhook queue: each delivery gets a fresh round of
    attempts (one delivered since is not sent again).

    Exits 1 when an id matched no letter, was not reached by a walk cut short, a letter was
    unreadable (kept: drop it by its message id), or --all stopped short (run it again for
    the rest)."""
    body = _replay_body(ids, replay_all, field="ids")
    replay = _admin_call(
        "POST", f"{WEBHOOK_DEAD_LETTERS}/replay", client=_notifier_client(), json=body
    )
    _exit_on_missed(replay, drop_command="scorebox webhooks dlq drop", replay_all=replay_all)


@webhooks_dlq.command("drop")
def webhooks_dlq_drop(
    ids: Annotated[list[str], typer.Argument(help="Delivery ids (or a letter's message id).")],
    before: Before = None,
) -> None:
    """Delete the dead letters named (every copy of a delivery's), sending nothing.

    Exits 1 when an id matched no letter, was not reached by a walk cut short, or got no
    answer (the other ids are dropped all the same)."""
    _drop(WEBHOOK_DEAD_LETTERS, ids, "ID", _notifier_client, before=before)


@webhooks_dlq.command("purge")
def webhooks_dlq_purge(
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
    before: Before = None,
) -> None:
    """Delete every webhook dead letter (with --before, those dead-lettered before it). Asks
    first, on stderr: stdout carries the answer's JSON alone.
    Exits 1 when the walk stopped short of the queue's end (`truncated`): purge again."""
    if not yes:
        _confirm_purge(WEBHOOK_DELIVERIES_DLQ, before)
    _purge(WEBHOOK_DEAD_LETTERS, before, _notifier_client())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
