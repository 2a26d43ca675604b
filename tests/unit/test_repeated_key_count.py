"""A key given twice in one object is told without reading the body again
(`shared.bodies._refuse_repeated_keys`): the body's colons outside string literals, one per
member, against the keys of orjson's objects. Checked here against a second reading by `json`
seeing each object's members (the check it replaced), on bodies made at random from a fixed
seed: objects and arrays nested, keys and strings holding `:`, `"`, `\\`, braces and text
outside ASCII, spelt with escapes or not (`"\\u0074ext"` is `"text"`), with whitespace
between tokens; some giving a key twice, some not."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest

from shared.bodies import _refuse_repeated_keys
from shared.http import Problem

BODIES = 3000
KEYS = ["a", "b", "text", "", ":", "a:b", '"', "\\", '":', "é", "日本", "\U0001f600", "\u2028"]
CHARACTERS = 'ab:"\\/{}[],: é日\U0001f600\n\t\x00\x1f\u2028'
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "/": "\\/"}
WHITESPACE = ["", "", " ", "\n", "\t", "\r\n  "]
NUMBERS = ["0", "-0", "12", "-7", "1.5", "2e3", "-2.5E-3", "1e+2"]


class _Members(list[tuple[str, Any]]):
    """An object as `json` reads it with `object_pairs_hook`: its members, in order."""


def _first_repeated_key(value: Any, path: tuple[str, ...] = ()) -> str | None:
    """The path of the first key given twice in one object, the objects taken in the body's
    order, each before what it holds (the 422's field); None where none is."""
    if isinstance(value, _Members):
        keys = [key for key, _ in value]
        for index, key in enumerate(keys):
            if key in keys[:index]:
                return ".".join((*path, key or '""'))
        children = [(key or '""', child) for key, child in value]
    elif isinstance(value, list):
        children = [(str(index), child) for index, child in enumerate(value)]
    else:
        return None
    for label, child in children:
        found = _first_repeated_key(child, (*path, label))
        if found is not None:
            return found
    return None


def _told(body: bytes) -> str | None:
    """What `read_json_object` tells of `body`: the repeated key's field, or None."""
    try:
        _refuse_repeated_keys(body, orjson.loads(body))
    except Problem as refusal:
        field: str = refusal.extensions["errors"][0]["field"]
        return field
    return None


def _character(rng: random.Random, character: str) -> str:
    code = ord(character)
    must = character in '"\\' or code < 0x20
    if not must and rng.random() < 0.75:
        return character
    if character in SHORT_ESCAPES and rng.random() < 0.5:
        return SHORT_ESCAPES[character]
    if code > 0xFFFF:
        high, low = divmod(code - 0x10000, 0x400)
        units = [0xD800 + high, 0xDC00 + low]
    else:
        units = [code]
    escape = "".join(f"\\u{unit:04x}" for unit in units)
    return escape.upper().replace("\\U", "\\u") if rng.random() < 0.5 else escape


def _string(rng: random.Random, text: str) -> str:
    return '"' + "".join(_character(rng, character) for character in text) + '"'


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(CHARACTERS) for _ in range(rng.randint(0, 8)))


def _value(rng: random.Random, keys: list[str], depth: int) -> str:
    roll = rng.random()
    if depth < 5 and roll < 0.3:
        return _object(rng, keys, depth + 1)
    if depth < 5 and roll < 0.45:
        items = [_value(rng, keys, depth + 1) for _ in range(rng.randint(0, 4))]
        return "[" + ",".join(f"{rng.choice(WHITESPACE)}{item}" for item in items) + "]"
    if roll < 0.75:
        return _string(rng, _text(rng))
    return rng.choice([*NUMBERS, "true", "false", "null"])


def _object(rng: random.Random, keys: list[str], depth: int) -> str:
    members = [
        f"{rng.choice(WHITESPACE)}{_string(rng, rng.choice(keys))}{rng.choice(WHITESPACE)}:"
        f"{rng.choice(WHITESPACE)}{_value(rng, keys, depth)}{rng.choice(WHITESPACE)}"
        for _ in range(rng.randint(0, 4))
    ]
    return "{" + ",".join(members) + rng.choice(WHITESPACE) + "}"


def _body(seed: int) -> bytes:
    rng = random.Random(seed)
    keys = rng.sample(KEYS, rng.randint(4, len(KEYS)))
    return (rng.choice(WHITESPACE) + _object(rng, keys, 0) + rng.choice(WHITESPACE)).encode()


def test_the_count_tells_a_repeated_key_as_a_second_reading_does() -> None:
    refused = 0
    for seed in range(BODIES):
        body = _body(seed)
        expected = _first_repeated_key(json.loads(body, object_pairs_hook=_Members))

        assert _told(body) == expected, (seed, body)
        refused += expected is not None
    # Both kinds, in numbers.
    assert BODIES // 5 < refused < BODIES * 4 // 5, refused


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"a:b": 1, "a": {"c": ":"}}', None),  # colons in strings
        (b'{"\\"": ":\\\\", "\\\\": "\\":"}', None),  # a quote and a backslash escaped
        (b'{"a": "\\u003a", "b": "\\\\u003a:"}', None),
        (b'{"\\u003a": 1, ":": 2}', ":"),  # one escaped, the other not
        (b'{"x": [{"t": 1, "\\u0074": 2}]}', "x.0.t"),
        (b'{"\xc3\xa9": 1, "\\u00e9": 2}', "\u00e9"),
        (b'{"\xf0\x9f\x98\x80": 1, "\\ud83d\\ude00": 2}', "\U0001f600"),
    ],
)
def test_escapes_and_colons_in_strings(body: bytes, field: str | None) -> None:
    assert _told(body) == field
