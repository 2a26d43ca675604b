"""`scorebox submit-batch FILE`, `scorebox batch-status BATCH_ID`, `scorebox batches`, and the
options of `scorebox submit` that the API takes (the CLI had no batch command but
`cancel-batch`, and `submit` no model, metadata, callback, delay nor cache option: found in a
walkthrough). Against a fake gateway (httpx.MockTransport)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from scorebox import cli
from shared.contracts import MAX_BATCH_ITEMS
from tests.unit import test_cli_cancel
from tests.unit.cli_support import run_cli

environment = test_cli_cancel.environment  # autouse: SCOREBOX_URL and SCOREBOX_API_KEY set

BATCH = {
    "batch_id": "b1",
    "items": [{"task_id": "t1", "client_id": None}, {"task_id": "t2", "client_id": "c2"}],
    "status_url": "/v1/batches/b1",
}
PROGRESS: dict[str, Any] = {
    "batch_id": "b1",
    "counts": {"queued": 2},
    "items": [],
    "next_cursor": None,
}


def _gateway(
    monkeypatch: pytest.MonkeyPatch, status: int, body: dict[str, Any]
) -> list[httpx.Request]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        headers = {"content-type": "application/problem+json"} if status >= 400 else {}
        return httpx.Response(status, json=body, headers=headers)

    monkeypatch.setattr(cli, "transport", httpx.MockTransport(handle))
    return seen


def test_a_batch_is_read_one_item_per_line_and_posted_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _gateway(monkeypatch, 202, BATCH)
    lines = '"A first text,\\nover two lines."\n\n{"text": "A second.", "client_id": "c2"}\n'

    result = run_cli(
        "submit-batch", "-", "--rubric", "clarity", "--idempotency-key", "k1", input=lines
    )

    assert result.exit_code == 0, result.output
    [request] = seen
    assert (request.method, request.url.path) == ("POST", "/v1/batches")
    assert request.headers["idempotency-key"] == "k1"
    assert json.loads(request.content) == {
        "items": [
            {"text": "A first text,\nover two lines."},
            {"text": "A second.", "client_id": "c2"},
        ],
        "rubric": "clarity",
    }
    assert json.loads(result.stdout) == BATCH


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ('"one"\nnot json\n', "line 2 is not JSON"),
        ("[1, 2]\n", "line 1 is neither a text"),
        ("\n\n", "no items"),
        # `json.loads` takes these, and the client raised a traceback sending them (a review).
        ('{"text": "a", "metadata": {"x": NaN}}\n', "line 1 is not JSON: NaN"),
        ('{"text": "a", "metadata": {"x": 1e999}}\n', "line 1 is not JSON: 1e999"),
        ('{"text": "a", "metadata": {"x": -Infinity}}\n', "line 1 is not JSON: -Infinity"),
    ],
)
def test_a_file_that_is_not_items_exits_2_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, lines: str, said: str
) -> None:
    seen = _gateway(monkeypatch, 202, BATCH)

    result = run_cli("submit-batch", "-", input=lines)

    assert result.exit_code == 2
    assert said in result.stderr
    assert seen == []


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ('"one"\n{"text": "a", "text": "b"}\n', 'line 2 gives the key "text" more than once'),
        ('{"text": "a", "metadata": {"k": 1, "k": 2}}\n', 'line 1 gives the key "k" more'),
        ('{"text": "a", "\\u0074ext": "b"}\n', 'line 1 gives the key "text" more'),
    ],
)
def test_a_key_given_twice_in_a_line_exits_2_naming_it_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, lines: str, said: str
) -> None:
    """The gateway refuses a key given twice (422); `json.loads` kept the last value without
    a word, so the batch was sent and "b" scored (found in review)."""
    seen = _gateway(monkeypatch, 202, BATCH)

    result = run_cli("submit-batch", "-", input=lines)

    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert said in result.stderr
    assert result.stderr.count("\n") == 1
    assert seen == []


def test_a_refused_batch_exits_1_with_its_detail(monkeypatch: pytest.MonkeyPatch) -> None:
    _gateway(monkeypatch, 422, {"status": 422, "detail": "items.0.text: too long"})

    result = run_cli("submit-batch", "-", input='"x"\n')

    assert result.exit_code == 1
    assert "too long" in result.stderr


def test_a_batchs_status_is_a_page_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _gateway(monkeypatch, 200, PROGRESS)

    result = run_cli("batch-status", "b1", "--limit", "10", "--cursor", "20")

    assert result.exit_code == 0, result.output
    [request] = seen
    assert request.url.path == "/v1/batches/b1"
    assert dict(request.url.params) == {"limit": "10", "cursor": "20"}
    assert json.loads(result.stdout) == PROGRESS


def test_an_unknown_batch_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    _gateway(monkeypatch, 404, {"status": 404, "detail": "No batch 'b9'."})

    result = run_cli("batch-status", "b9")

    assert result.exit_code == 1
    assert "No batch" in result.stderr


LISTING: dict[str, Any] = {
    "count": 1,
    "items": [
        {
            "batch_id": "b1",
            "created_at": "2030-05-17T12:00:00.125000Z",
            "total": 2,
            "status_url": "/v1/batches/b1",
        }
    ],
    "next_cursor": "c2",
}


def test_batches_lists_a_page_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _gateway(monkeypatch, 200, LISTING)

    given = run_cli("batches", "--limit", "1", "--cursor", "c1")
    bare = run_cli("batches")

    assert given.exit_code == 0, given.output
    assert bare.exit_code == 0, bare.output
    assert [request.url.path for request in seen] == ["/v1/batches", "/v1/batches"]
    assert dict(seen[0].url.params) == {"limit": "1", "cursor": "c1"}
    assert dict(seen[1].url.params) == {"limit": "20"}
    assert json.loads(given.stdout) == LISTING


@pytest.mark.parametrize("limit", ["0", "101"])
def test_batches_refuses_a_limit_the_gateway_refuses(
    monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    seen = _gateway(monkeypatch, 200, LISTING)

    result = run_cli("batches", "--limit", limit)

    assert result.exit_code == 2
    assert seen == []


def test_a_refused_listing_exits_1_with_its_detail(monkeypatch: pytest.MonkeyPatch) -> None:
    detail = "query.cursor: is not a `next_cursor` of this listing."
    _gateway(monkeypatch, 422, {"status": 422, "detail": detail})

    result = run_cli("batches", "--cursor", "x")

    assert result.exit_code == 1
    assert "next_cursor" in result.stderr


def test_submit_sends_the_options_given_and_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = {"task_id": "t1", "status": "scheduled", "status_url": "/v1/scores/t1"}
    seen = _gateway(monkeypatch, 202, answer)
    options = ["--model", "m1", "--metadata", '{"order": 42}', "--delay-seconds", "60"]
    hook = ["--callback-url", "https://example.com/hook", "--no-cache"]

    given = run_cli("submit", "-", *options, *hook, input="A text.")
    bare = run_cli("submit", "-", input="A text.")

    assert given.exit_code == 0, given.output
    assert bare.exit_code == 0, bare.output
    assert json.loads(seen[0].content) == {
        "text": "A text.",
        "model": "m1",
        "metadata": {"order": 42},
        "delay_seconds": 60,
        "callback_url": "https://example.com/hook",
        "use_cache": False,
    }
    assert json.loads(seen[1].content) == {"text": "A text."}


@pytest.mark.parametrize("metadata", ["{order: 42}", "[1]"])
def test_metadata_that_is_no_json_object_exits_2_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, metadata: str
) -> None:
    seen = _gateway(monkeypatch, 202, {})

    result = run_cli("submit", "-", "--metadata", metadata, input="A text.")

    assert result.exit_code == 2
    assert "--metadata" in result.stderr
    assert seen == []


@pytest.mark.parametrize(
    ("metadata", "key"), [('{"a": 1, "a": 2}', '"a"'), ('{"a": {"b": 1, "b": 2}}', '"b"')]
)
def test_metadata_giving_a_key_twice_exits_2_naming_it_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, metadata: str, key: str
) -> None:
    """Sent as `{"a": 2}` before (found in review): the gateway refuses such a body."""
    seen = _gateway(monkeypatch, 202, {})

    result = run_cli("submit", "-", "--metadata", metadata, input="A text.")

    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --metadata gives the key {key} more than once")
    assert seen == []


def test_help_reflows_a_docstrings_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The docstrings' own line breaks were kept, then wrapped again: "…or --wait runs" on
    one line, "out" on the next (found in a walkthrough)."""
    monkeypatch.setenv("COLUMNS", "200")

    result = run_cli("submit", "--help")

    assert "or --wait runs out before the task finishes" in result.stdout


def test_a_text_holding_a_unicode_line_separator_stays_one_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JSON writes U+2028, U+2029 and U+0085 raw inside strings (jq does): split at them,
    a valid line was refused as unterminated (found in a walkthrough). A BOM is skipped."""
    seen = _gateway(monkeypatch, 202, BATCH)
    lines = '\ufeff"a \u2029 paragraph"\n"a \u0085 next line"\r\n"a \u2028 line"\n'

    result = run_cli("submit-batch", "-", input=lines.encode())

    assert result.exit_code == 0, result.output
    texts = [item["text"] for item in json.loads(seen[0].content)["items"]]
    assert texts == ["a \u2029 paragraph", "a \u0085 next line", "a \u2028 line"]


def test_more_items_than_any_gateway_takes_exit_2_and_send_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _gateway(monkeypatch, 202, BATCH)

    result = run_cli("submit-batch", "-", input='"x"\n' * (cli.MAX_BATCH_ITEMS + 1))

    assert result.exit_code == 2
    assert "at most 1,000" in result.stderr
    assert seen == []


def test_the_clients_bound_is_the_gateways() -> None:
    assert cli.MAX_BATCH_ITEMS == MAX_BATCH_ITEMS
