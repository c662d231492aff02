"""The fingerprint, as a pure function: canonical, type-aware, stable across processes."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taskiq_deduplication.model.fingerprint import call_fingerprint, fields_fingerprint

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
kwargs_strategy = st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=5)


class Color(enum.Enum):
    RED = "red"


class User(pydantic.BaseModel):
    id: int
    tags: set[str]


@dataclasses.dataclass
class Point:
    x: int
    y: int


def test_digest_is_a_full_sha256() -> None:
    digest = call_fingerprint("t", [], {})
    assert len(digest) == 43
    assert len(base64.urlsafe_b64decode(digest + "=")) == 32  # the whole SHA-256 digest


@given(kwargs_strategy)
def test_keyword_order_does_not_matter(kwargs: dict[str, Any]) -> None:
    reordered = dict(reversed(list(kwargs.items())))
    assert call_fingerprint("t", [], kwargs) == call_fingerprint("t", [], reordered)


@given(json_values, json_values)
def test_different_values_give_different_fingerprints(a: Any, b: Any) -> None:
    same = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert (call_fingerprint("t", [a], {}) == call_fingerprint("t", [b], {})) == same


@pytest.mark.parametrize(
    "values",
    [
        [1, "1", 1.0, True, None, [1], {"1": 1}],
        [0, False, "", [], {}, None, 0.0, -0.0],
    ],
)
def test_types_are_distinct(values: list[Any]) -> None:
    digests = {call_fingerprint("t", [value], {}) for value in values}
    assert len(digests) == len(values)


def test_positional_and_keyword_calls_differ() -> None:
    assert call_fingerprint("t", [42], {}) != call_fingerprint("t", [], {"user_id": 42})


def test_task_name_is_part_of_the_fingerprint() -> None:
    assert call_fingerprint("a", [], {"x": 1}) != call_fingerprint("b", [], {"x": 1})


def test_fields_fingerprint_never_equals_a_whole_call_one() -> None:
    assert fields_fingerprint("t", {"x": 1}) != call_fingerprint("t", [], {"x": 1})
    assert fields_fingerprint("t", {"x": 1}) == fields_fingerprint("t", {"x": 1})


RICH = {
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "when": dt.datetime(2026, 12, 1, 8, 30, tzinfo=dt.timezone.utc),
    "day": dt.date(2026, 12, 1),
    "span": dt.timedelta(seconds=90),
    "amount": decimal.Decimal("12.50"),
    "color": Color.RED,
    "user": User(id=1, tags={"b", "a", "c"}),
    "point": Point(1, 2),
    "tags": {"x", "y", "z", "w"},
    "frozen": frozenset({3, 1, 2}),
    "raw": b"bytes",
    "nested": [{"inner": {"q", "p"}}],
    "mixed_keys": {1: "one", "a": "letter", None: "none"},
    "tuple": (1, 2),
}


def test_rich_values_are_encoded_as_they_travel() -> None:
    plain = {
        **RICH,
        "id": "12345678-1234-5678-1234-567812345678",
        "amount": "12.50",
        "color": "red",
        "user": {"id": 1, "tags": {"a", "b", "c"}},
        "point": {"x": 1, "y": 2},
        "tuple": [1, 2],
    }
    assert call_fingerprint("t", [], RICH) == call_fingerprint("t", [], plain)
    assert call_fingerprint("t", [], RICH) != call_fingerprint("t", [], {**RICH, "raw": b"other"})


def test_bytes_that_are_not_utf8_are_encoded_too() -> None:
    binary = call_fingerprint("t", [b"\xff\x00"], {})
    assert binary == call_fingerprint("t", [bytearray(b"\xff\x00")], {})
    assert binary != call_fingerprint("t", [b"\xff\x01"], {})
    assert binary != call_fingerprint("t", ["\xff\x00"], {})


STABLE_SCRIPT = """
import datetime, decimal, json, sys, uuid
sys.path[:0] = json.loads(sys.argv[1])
from tests.test_fingerprint import RICH
from taskiq_deduplication.model.fingerprint import call_fingerprint
print(call_fingerprint("t", [{"s", "e", "t"}], RICH))
"""


def test_fingerprint_is_the_same_in_every_process() -> None:
    digests = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", STABLE_SCRIPT, json.dumps(sys.path)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1
    assert digests == {call_fingerprint("t", [{"s", "e", "t"}], RICH)}


@settings(max_examples=50)
@given(st.sets(st.text(max_size=5), max_size=6))
def test_sets_do_not_depend_on_iteration_order(values: set[str]) -> None:
    rebuilt = set(sorted(values, reverse=True))  # noqa: C414 (insertion order is the point)
    assert call_fingerprint("t", [values], {}) == call_fingerprint("t", [rebuilt], {})


@pytest.mark.parametrize(
    "value",
    [object(), lambda: None, type("Opaque", (), {})()],
    ids=["object", "lambda", "custom-class"],
)
def test_values_that_cannot_be_encoded_raise_a_clear_error(value: object) -> None:
    with pytest.raises(TypeError, match="deduplication_key") as caught:
        call_fingerprint("tasks:job", [], {"handle": value})
    assert "'tasks:job'" in str(caught.value)


def test_circular_structures_raise_a_clear_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(TypeError, match="nested too deeply"):
        call_fingerprint("t", [loop], {})


def test_unencodable_dict_key_raises() -> None:
    with pytest.raises(TypeError, match="deduplication_key"):
        call_fingerprint("t", [{object(): 1}], {})
