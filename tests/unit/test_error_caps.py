"""A 422 names a bounded number of a body's errors, however many the body holds."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from shared.bodies import dotted_field, refuse_many_unknown_fields, unknown_fields
from shared.http import MAX_ERRORS_SHOWN, Problem, described_errors


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class Lenient(BaseModel):
    text: str


def test_more_unknown_fields_than_are_shown_are_refused_before_the_models_checks() -> None:
    body = {"text": "hi", **{f"k{key}": 0 for key in range(MAX_ERRORS_SHOWN + 1)}}
    with pytest.raises(Problem) as refused:
        refuse_many_unknown_fields(unknown_fields(body, Strict), dotted_field)
    errors = refused.value.extensions["errors"]
    assert [each["field"] for each in errors] == [f"k{key}" for key in range(MAX_ERRORS_SHOWN)]
    assert refused.value.status == 422


def test_as_many_unknown_fields_as_are_shown_are_left_to_the_models_checks() -> None:
    body = {"text": "hi", **{f"k{key}": 0 for key in range(MAX_ERRORS_SHOWN)}}
    refuse_many_unknown_fields(unknown_fields(body, Strict), dotted_field)


def test_a_model_taking_any_field_has_none_unknown() -> None:
    assert list(unknown_fields({"text": "hi", "colour": "red"}, Lenient)) == []


def test_only_the_first_errors_are_described_and_the_rest_counted() -> None:
    errors = [{"loc": ("items", index, "text"), "msg": "blank"} for index in range(120)]
    detail, described = described_errors(errors, lambda error: dotted_field(error["loc"]))
    assert len(described) == MAX_ERRORS_SHOWN
    assert described[-1] == {"field": f"items.{MAX_ERRORS_SHOWN - 1}.text", "message": "blank"}
    assert detail.endswith(f"; and {120 - MAX_ERRORS_SHOWN} more errors, not listed")
    assert detail.count("blank") == MAX_ERRORS_SHOWN
