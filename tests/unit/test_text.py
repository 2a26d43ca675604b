"""One rule for an empty text: the gateway refuses (422) exactly the texts the scorer would
find empty once normalised, instead of accepting a task the scorer can only fail."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.gateway import batches, schemas
from services.gateway.batches import BatchItem
from services.gateway.schemas import ScoreSubmission
from services.scorer.errors import InputRejected
from services.scorer.model import normalise, preparation
from services.scorer.model.preparation import prepare_text
from shared import text as shared_text
from shared.combining_marks import COMBINING_MARKS
from shared.text import FORMAT_CHARACTERS, OTHER_WHITESPACE, is_blank, normalise_text

# Whitespace (`str.isspace`) and control characters (category Cc).
_BLANK_CHARACTER = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")


# Unicode 15.1's Default_Ignorable_Code_Point (DerivedCoreProperties.txt), written out as
# the file lists it, and the blank Braille pattern.
_DEFAULT_IGNORABLE = re.compile(
    "[\u00ad\u034f\u061c\u115f-\u1160\u17b4-\u17b5\u180b-\u180f\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
_BLANK_BRAILLE = "\u2800"


def _no_content(character: str) -> bool:
    """Whitespace, a control character, a format character (category Cf), a default
    ignorable one, the blank Braille pattern or a combining mark (category M)."""
    category = unicodedata.category(character)
    return (
        bool(_BLANK_CHARACTER.fullmatch(character) or _DEFAULT_IGNORABLE.fullmatch(character))
        or character == _BLANK_BRAILLE
        or category == "Cf"
        or category.startswith("M")
    )


TRICKY = [
    "",
    " ",
    " \n\t ",
    "\x01",
    "\x00\x80 \t",
    "\x85\u2028\u00a0\x9f",
    "\r\n\x0b\x0c\x1c\x1d\x1e\x1f",
    "\u2000\u2001\u3000\u1680",  # two of them NFC-map to other spaces
    "\x7f" * 5 + "\n" * 5,
    # Format characters (category Cf): not whitespace to Python, kept by normalisation, but
    # no content (a text of them alone was accepted and scored).
    "\u200b",  # zero-width space
    "\ufeff",  # byte order mark
    "\u180e",  # Mongolian vowel separator: no longer a space (Unicode 6.3), a format character
    "\u200b\u2060\ufeff",
    "\u200d \u00ad\n\u202e\U000e0041",  # a joiner, a soft hyphen, a bidi override, a tag
    # Format characters with content: kept as they are.
    "\U0001f469\u200d\U0001f4bb",  # woman technologist: an emoji bound by a zero-width joiner
    "\u0915\u094d\u200d\u0937",  # a Devanagari half form, by a zero-width joiner
    "co\u00adoperate\u200b",
    "\u0301",  # a combining mark on its own
    "e\u0301",
    "\x00a\x00",
    "\x01 A text\x80 to score.\x07 \t",
    "\ud800",  # a lone surrogate
]


def _scorer_accepts(value: str) -> bool:
    try:
        prepare_text(value, max_chars=6000)
    except InputRejected:
        return False
    return True


def _refused_fields(model: type[ScoreSubmission | BatchItem], value: str) -> list[object]:
    try:
        model.model_validate({"text": value})
    except ValidationError as error:
        return [e["loc"] for e in error.errors()]
    return []


@pytest.mark.parametrize("value", TRICKY)
def test_the_gateway_refuses_exactly_the_texts_the_scorer_would_reject(value: str) -> None:
    refused = [] if _scorer_accepts(value) else [("text",)]
    assert _refused_fields(ScoreSubmission, value) == refused
    assert _refused_fields(BatchItem, value) == refused
    assert is_blank(value) == bool(refused)


def test_the_gateway_and_the_scorer_use_the_same_functions() -> None:
    # What each module imported (mypy has it re-export nothing it imports).
    scorer = [vars(module)["normalise_text"] for module in (preparation, normalise)]
    blank = [vars(module)["is_blank"] for module in (schemas, batches, preparation)]
    assert all(function is normalise_text for function in scorer)
    assert all(function is is_blank for function in blank)


@pytest.mark.parametrize("model", [ScoreSubmission, BatchItem])
def test_the_refusal_says_what_a_text_must_contain(
    model: type[ScoreSubmission | BatchItem],
) -> None:
    with pytest.raises(ValidationError) as error:
        model.model_validate({"text": "\x00\x80 \t"})
    (only,) = error.value.errors()
    assert only["loc"] == ("text",)
    assert "other than whitespace, control characters and invisible characters" in only["msg"]


def test_is_blank_agrees_with_normalise_text_for_every_code_point() -> None:
    """`is_blank` answers at the first character that is neither whitespace, nor a control
    character, nor a format character: normalisation must keep content of each such
    character, and NFC must keep blankness (a character's full decomposition is blank
    exactly when the character is), so no composition turns content into blanks or blanks
    into content."""
    disagree, unstable = [], []
    for character in map(chr, range(sys.maxunicode + 1)):
        blank = _no_content(character)
        normalised_blank = all(_no_content(part) for part in normalise_text(character))
        if is_blank(character) != normalised_blank or is_blank(character) != blank:
            disagree.append(character)
        decomposed = unicodedata.normalize("NFD", character)
        if all(_no_content(part) for part in decomposed) != blank:
            unstable.append(character)
    assert disagree == []
    assert unstable == []


def test_combining_marks_are_every_character_of_category_m() -> None:
    listed = re.compile(f"[{COMBINING_MARKS}]")
    every = [chr(c) for c in range(sys.maxunicode + 1)]
    marks = [c for c in every if unicodedata.category(c).startswith("M")]
    assert [c for c in every if listed.fullmatch(c)] == marks, _ranges(marks)


def _ranges(characters: list[str]) -> str:
    """The ranges of `characters` as `COMBINING_MARKS` writes them (to update it from)."""
    points = [ord(c) for c in characters]
    starts = [p for i, p in enumerate(points) if i == 0 or points[i - 1] != p - 1]
    ends = [p for i, p in enumerate(points) if i == len(points) - 1 or points[i + 1] != p + 1]
    return "".join(
        _escaped(a) if a == b else f"{_escaped(a)}-{_escaped(b)}"
        for a, b in zip(starts, ends, strict=True)
    )


def _escaped(point: int) -> str:
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def test_a_long_run_of_marks_is_one_regex_search() -> None:
    """Looked at one by one after the search, 16 MiB of marks held the gateway's event loop
    for three seconds (a review): `is_blank` is one search of `_CONTENT`, which now holds
    the marks, so it stops at the first content character or the end, in the regex engine."""
    text = "\u0301" * 100_000
    calls: list[str] = []
    original = shared_text._CONTENT

    class Counting:
        def search(self, value: str) -> object:
            calls.append(value)
            return original.search(value)

    shared_text._CONTENT = Counting()  # type: ignore[assignment]
    try:
        assert is_blank(text)
        assert not is_blank(text + "a")
    finally:
        shared_text._CONTENT = original
    assert len(calls) == 2


def test_format_characters_are_every_character_of_category_cf() -> None:
    listed = re.compile(f"[{FORMAT_CHARACTERS}]")
    every = [chr(c) for c in range(sys.maxunicode + 1)]
    assert [c for c in every if listed.fullmatch(c)] == [
        c for c in every if unicodedata.category(c) == "Cf"
    ]


@pytest.mark.parametrize(
    "text",
    ["\U0001f469\u200d\U0001f4bb", "\u0915\u094d\u200d\u0937", "co\u00adoperate", "a\u200cb"],
)
def test_a_text_with_format_characters_among_its_content_is_scored_as_it_is(text: str) -> None:
    """Only a text of format characters alone is blank: those among content are kept."""
    assert not is_blank(text)
    assert normalise_text(text) == text
    assert prepare_text(text, max_chars=6000).text == text


_STEPS = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\r\n?|[\u2028\u2029\x0b\x0c\x85]", "\n"),
        (r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", ""),
        (r"[^\S\n\t]+", " "),
        (r"[ \t]+\n", "\n"),
        (r"\n{3,}", "\n\n"),
    )
)


def _normalised_step_by_step(text: str) -> str:
    """The definition `normalise_text`'s shortcut for texts already canonical must keep."""
    text = unicodedata.normalize("NFC", text)
    for pattern, replacement in _STEPS:
        text = pattern.sub(replacement, text)
    return text.strip()


def test_other_whitespace_is_every_blank_but_the_space_and_the_newline() -> None:
    listed = re.compile(f"[{OTHER_WHITESPACE}]")
    every = [chr(c) for c in range(sys.maxunicode + 1)]
    assert [c for c in every if listed.fullmatch(c)] == [
        c for c in every if c.isspace() and c not in " \n"
    ]


def test_normalise_text_agrees_with_its_definition_around_every_code_point() -> None:
    """Each character doubled at the end of a line: the shortcut must not take a text with
    any character that normalisation changes for one it gives back as it is."""
    texts = (f"a{chr(code_point) * 2}\nb" for code_point in range(sys.maxunicode + 1))
    assert [text for text in texts if normalise_text(text) != _normalised_step_by_step(text)] == []


@pytest.mark.parametrize(
    "text",
    ["a \nb", "a  b", "a\n\n\nb", " a", "a ", "\na", "a\n", "a\tb", "a\t\nb", "e\u0301", "\u212b"],
)
def test_normalise_text_changes_what_only_its_later_steps_change(text: str) -> None:
    """Texts whose every character could stand in a canonical text, but not so placed."""
    assert normalise_text(text) == _normalised_step_by_step(text)


_PIECES = (
    *("a", "B", "e\u0301", "\u00e9", "\u212b", " ", "  ", "\t", "\n", "\n\n\n", "\r\n", "\r"),
    *("\x00", "\x85", "\u00a0", "\u2028", "\x0b", "\x1c", "\u3000", "\u200b", "\ud800"),
)


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12).map("".join))
def test_normalise_text_agrees_with_its_definition(text: str) -> None:
    assert normalise_text(text) == _normalised_step_by_step(text)


@pytest.mark.parametrize(
    "text",
    ["\ufe0f", "\u3164", "\u2800", "\u0301\u0301", "\u115f\u1160", "\uffa0", "\U000e0100"],
    ids=["selector", "filler", "braille", "marks", "jamo-fillers", "half-filler", "tag-selector"],
)
def test_a_text_of_invisible_characters_or_marks_alone_is_refused(text: str) -> None:
    """A walkthrough had four such texts accepted and a model call billed for each."""
    assert is_blank(text)
    assert _refused_fields(ScoreSubmission, text) == [("text",)]
    assert _refused_fields(BatchItem, text) == [("text",)]
    assert not _scorer_accepts(text)


@pytest.mark.parametrize(
    "text", ["e\u0301", "\u1100\u1161", "\u2801", "\u0301a", "\u2764\ufe0f", "\u3164x"]
)
def test_such_characters_among_content_are_scored(text: str) -> None:
    assert not is_blank(text)
    assert _scorer_accepts(text)
