"""The canonical form of a text to score: the rule the scorer applies before it scores a text
and the gateway applies when it accepts one (one rule, so the two can never disagree about
whether a text is empty). Pure functions, no I/O.

A text is blank when nothing is left of it once normalised but invisible characters: only
whitespace (Unicode's, not just ASCII's), control characters (U+0000-U+001F, U+007F-U+009F),
format characters (Unicode category Cf: zero-width spaces and joiners, bidi marks, the
byte order mark...), the other characters Unicode says to render as nothing when unsupported
(Default_Ignorable_Code_Point: variation selectors, the Hangul fillers, the combining grapheme
joiner...), the blank Braille pattern (U+2800), and combining marks, which mark a letter
and are none. Normalisation keeps such characters among content (a zero-width joiner binds
an emoji sequence, a variation selector picks its glyph, a soft hyphen marks where a word may
break), but they are nobody's content: a text of them alone was accepted and scored as if it
said something (a variation selector, a Hangul filler, a blank Braille cell or two accents
alone, found in a walkthrough). The gateway refuses a blank text with a 422; the scorer
would only fail its task (`InputRejected`).
"""

from __future__ import annotations

import re
import unicodedata

from shared.combining_marks import COMBINING_MARKS

# Unicode category Cc is exactly U+0000-U+001F and U+007F-U+009F; newline and tab are kept.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_LINE_BREAKS = re.compile(r"\r\n?|[\u2028\u2029\x0b\x0c\x85]")
# The blanks left once line breaks are `\n` and control characters gone, but `\n` and tab:
# runs of them become one space. Without any but the space, only runs of two or more need
# it (the general class rewrote every single space of a text as a space, at several times
# the cost).
_SPACES = " \xa0\u1680\u2000-\u200a\u202f\u205f\u3000"
_SPACE_RUNS = re.compile(f"[{_SPACES}]+")
_OTHER_SPACES = re.compile(f"[{_SPACES[1:]}]")
_DOUBLE_SPACES = re.compile("  +")
_TRAILING_SPACES = re.compile(r"[ \t]+\n")
_BLANK_LINE_RUNS = re.compile(r"\n{3,}")
# Unicode 15.1's format characters (category Cf), as ranges (checked against every code
# point in tests/unit/test_text.py).
FORMAT_CHARACTERS = (
    r"\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
    r"\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    r"\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
    r"\U000e0020-\U000e007f"
)
# Unicode 15.1's Default_Ignorable_Code_Point characters that are not format characters
# (DerivedCoreProperties.txt: the combining grapheme joiner, the Hangul fillers, the Khmer
# inherent vowels, the Mongolian and other variation selectors, the reserved U+FFF0-U+FFF8
# and U+E0000-U+E0FFF), and the blank Braille pattern: what renders as nothing.
INVISIBLE_CHARACTERS = (
    r"\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180d\u180f\u2065\u2800\u3164\ufe00-\ufe0f"
    r"\uffa0\ufff0-\ufff8\U000e0000-\U000e0fff"
)
# Content: neither whitespace (`\s` is `str.isspace`, what `strip` removes), nor a control
# character, nor a format or other invisible character, nor a combining mark. `normalise_text`
# keeps something of each such character (every step after NFC only removes or rewrites the
# others), and NFC maps none of the others to content (both checked for every code point in
# tests/unit/test_text.py).
_CONTENT = re.compile(
    rf"[^\s\x00-\x1f\x7f-\x9f{FORMAT_CHARACTERS}{INVISIBLE_CHARACTERS}{COMBINING_MARKS}]"
)
# Every character `str.isspace` (and `\s`) accepts but the space and the newline, as ranges
# (checked against every code point in tests/unit/test_text.py): re scans a class of plain
# ranges many times faster than one built on `\s`, which it tests position by position.
OTHER_WHITESPACE = r"\t\x0b-\x0d\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# What any step of `normalise_text` could change, one character at a time: control
# characters and whitespace other than the space and the newline (tabs included, which the
# canonical form keeps but not before a newline: such a text takes the long way).
_NOT_PLAIN = re.compile(rf"[\x00-\x09\x0b-\x1f\x7f-\x9f{OTHER_WHITESPACE}]")


def normalise_text(text: str) -> str:
    """The canonical form of a text: NFC, no control characters but newlines and tabs,
    single spaces, no blank-line runs longer than one, trimmed."""
    if _is_canonical(text):
        return text  # most texts: one scan instead of five substitutions over the whole text
    text = _LINE_BREAKS.sub("\n", unicodedata.normalize("NFC", text)).strip()
    if _is_canonical(text):
        # Line endings other than `\n` (`\r\n`, most often) and blanks at the ends were
        # all it took: the other four substitutions would rewrite nothing, at a scan each.
        return text
    text = _CONTROLS.sub("", text)
    spaces = _SPACE_RUNS if _OTHER_SPACES.search(text) else _DOUBLE_SPACES
    text = spaces.sub(" ", text)
    if " \n" in text or "\t\n" in text:
        text = _TRAILING_SPACES.sub("\n", text)
    if "\n\n\n" in text:
        text = _BLANK_LINE_RUNS.sub("\n\n", text)
    return text.strip()


def _is_canonical(text: str) -> bool:
    """Whether `normalise_text` would give `text` back unchanged: in NFC, nothing
    `_NOT_PLAIN` matches, and no run of spaces, space before a newline, blank-line run or
    blank at either end."""
    return (
        _NOT_PLAIN.search(text) is None
        and "  " not in text
        and " \n" not in text
        and "\n\n\n" not in text
        and not (text and (text[0].isspace() or text[-1].isspace()))
        and unicodedata.is_normalized("NFC", text)
    )


def is_blank(text: str) -> bool:
    """Whether nothing of `text` is left to score once it is normalised: no content character
    in `normalise_text(text)`, which is so exactly when `text` has none (see `_CONTENT`), so
    a text with content answers at its first content character instead of being normalised
    whole (a batch may carry 16 MiB of text). Marks are in the class, not looked at one by
    one after it: 16 MiB of them held a gateway's event loop for three seconds (a review)."""
    return _CONTENT.search(text) is None
