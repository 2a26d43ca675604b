import pytest

from services.scorer.model.normalise import fit_to_budget, text_fingerprint
from shared.text import normalise_text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  hello   world  ", "hello world"),
        ("a\r\nb\rc", "a\nb\nc"),
        ("a\x00b\x07c\x1bd", "abcd"),
        ("keeps\ttabs", "keeps\ttabs"),
        ("a\n\n\n\nb", "a\n\nb"),
        ("a  \n  \n \n\nb", "a\n\nb"),
        ("trailing   \nspaces", "trailing\nspaces"),
        ("e\u0301te\u0301", "\u00e9t\u00e9"),
        ("non\u00a0breaking\u2003space", "non breaking space"),
        ("line\u2028separator", "line\nseparator"),
        ("\x00\x01 \n ", ""),
        ("", ""),
    ],
)
def test_normalise_text(raw: str, expected: str) -> None:
    assert normalise_text(raw) == expected


def test_normalise_text_is_idempotent() -> None:
    once = normalise_text(" A  text.\r\n\r\n\r\nWith\x00 noise.  ")
    assert normalise_text(once) == once


@pytest.mark.parametrize(
    ("text", "max_chars", "expected"),
    [
        ("short", 10, ("short", False)),
        ("exactly ten", 11, ("exactly ten", False)),
        # paragraph end within the last 20 % of the budget wins over a later sentence end
        ("First paragraph here.\n\nSecond one. More", 25, ("First paragraph here.", True)),
        # sentence end, closing quote included
        ('He said "stop." Then he left the room', 18, ('He said "stop."', True)),
        ("One two three four five six seven", 20, ("One two three four", True)),
        # no boundary near the limit: a hard cut
        ("abcdefghijklmnopqrstuvwxyz", 10, ("abcdefghij", True)),
        ("Short. Averyveryveryverylongword", 20, ("Short. Averyveryvery", True)),
        # a boundary right at the limit still counts
        ("Ends here. Next", 10, ("Ends here.", True)),
        (
            "\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002\u6211\u4eec",
            8,
            ("\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002", True),
        ),
    ],
)
def test_fit_to_budget(text: str, max_chars: int, expected: tuple[str, bool]) -> None:
    assert fit_to_budget(text, max_chars) == expected


@pytest.mark.parametrize("max_chars", [1, 7, 50, 99])
def test_fit_to_budget_never_exceeds_the_budget(max_chars: int) -> None:
    text = "Lorem ipsum dolor sit amet. " * 10
    fitted, truncated = fit_to_budget(text, max_chars)
    assert len(fitted) <= max_chars
    assert truncated


def test_fit_to_budget_rejects_a_nonpositive_budget() -> None:
    with pytest.raises(ValueError, match="positive"):
        fit_to_budget("text", 0)


def test_fingerprint_ignores_what_normalisation_removes() -> None:
    assert text_fingerprint("Hello  world\r\n", None, "m") == text_fingerprint(
        "Hello world", None, "m"
    )


def test_fingerprint_treats_no_rubric_and_a_blank_rubric_alike() -> None:
    assert text_fingerprint("t", None, "m") == text_fingerprint("t", "  ", "m")


@pytest.mark.parametrize(
    ("other_text", "other_rubric", "other_model"),
    [("other text", None, "m"), ("text", "be strict", "m"), ("text", None, "other-model")],
)
def test_fingerprint_changes_with_text_rubric_and_model(
    other_text: str, other_rubric: str | None, other_model: str
) -> None:
    base = text_fingerprint("text", None, "m")
    other = text_fingerprint(other_text, other_rubric, other_model)
    assert other != base
    assert len(other) == 64
    assert int(other, 16) >= 0
