"""Property tests of the fingerprint: equal calls, equal keys (in every process); else not."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import pickle
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from taskiq_deduplication.model.fingerprint import call_fingerprint, fields_fingerprint
from tests.faults._values import Colour, Point, User

pytestmark = pytest.mark.timeout(120)

_ROOT = Path(__file__).resolve().parents[2]
# A digest spelled in URL-safe characters only (hex or base64url).
_WELL_FORMED = re.compile(r"[A-Za-z0-9_-]{40,}")
_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON data: what taskiq sends. Dict keys are strings, as they are on the wire.
_json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
)
json_values = st.recursive(
    _json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)

# Values taskiq can send that JSON alone cannot encode; sets of strings iterate
# in an order that depends on the hash seed of the process.
_rich_scalars = (
    _json_scalars
    | st.uuids()
    | st.datetimes()
    | st.dates()
    | st.decimals(allow_nan=False, allow_infinity=False, places=4)
    | st.binary(max_size=8)
    | st.sampled_from(Colour)
    | st.sets(st.text(max_size=6), max_size=6)
    | st.frozensets(st.integers(), max_size=5)
    | st.builds(Point, x=st.integers(), tags=st.frozensets(st.text(max_size=4), max_size=4))
    | st.builds(User, name=st.text(max_size=6), groups=st.sets(st.text(max_size=4), max_size=4))
)
rich_values = st.recursive(
    _rich_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)

task_names = st.text(min_size=1, max_size=20)


def calls(
    values: st.SearchStrategy[Any],
) -> st.SearchStrategy[tuple[str, list[Any], dict[str, Any]]]:
    """A task call: name, positional arguments, keyword arguments."""
    return st.tuples(
        task_names,
        st.lists(values, max_size=3),
        st.dictionaries(st.text(max_size=8), values, max_size=4),
    )


def _shape(value: Any) -> Any:
    """A comparable form of JSON data that keeps every distinction JSON makes."""
    if value is None or isinstance(value, (bool, str)):
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", repr(value))  # -0.0 and 0.0 are sent differently
    if isinstance(value, list):
        return ("list", tuple(_shape(v) for v in value))
    assert isinstance(value, dict)
    return ("dict", frozenset((k, _shape(v)) for k, v in value.items()))


_OTHER_PROCESS = """
import json, pickle, sys
from taskiq_deduplication.model.fingerprint import call_fingerprint, fields_fingerprint
calls = pickle.load(sys.stdin.buffer)
print(json.dumps([
    [call_fingerprint(name, args, kwargs), fields_fingerprint(name, kwargs)]
    for name, args, kwargs in calls
]))
"""


def _keys_in_another_process(calls: list[Any], hash_seed: str) -> list[list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS],
        input=pickle.dumps(calls),
        env=env,
        cwd=_ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    keys: list[list[str]] = json.loads(done.stdout)
    return keys


def test_equal_calls_give_equal_keys_in_this_and_other_processes() -> None:
    seen: list[tuple[Any, list[str]]] = []

    @_SETTINGS
    @given(calls(rich_values))
    def equal_in_this_process(call: tuple[str, list[Any], dict[str, Any]]) -> None:
        name, args, kwargs = call
        keys = [call_fingerprint(name, args, kwargs), fields_fingerprint(name, kwargs)]
        # An equal copy, with its sets rebuilt and its kwargs in another order.
        twin_name, twin_args, twin_kwargs = pickle.loads(pickle.dumps(call))  # noqa: S301 (our own data)
        twin_kwargs = dict(reversed(list(twin_kwargs.items())))
        assert call_fingerprint(twin_name, twin_args, twin_kwargs) == keys[0]
        assert fields_fingerprint(twin_name, twin_kwargs) == keys[1]
        assert all(_WELL_FORMED.fullmatch(key) for key in keys)
        assert len(keys[0]) == len(keys[1])  # a fixed-size digest
        seen.append((call, keys))

    equal_in_this_process()
    sent = [call for call, _ in seen]
    expected = [keys for _, keys in seen]
    for seed in ("1", "4242"):  # at least one differs from this process's seed
        assert _keys_in_another_process(sent, seed) == expected


@_SETTINGS
@given(calls(json_values), calls(json_values))
def test_different_calls_give_different_keys(
    one: tuple[str, list[Any], dict[str, Any]], other: tuple[str, list[Any], dict[str, Any]]
) -> None:
    one_shape = (one[0], _shape(one[1]), _shape(one[2]))
    other_shape = (other[0], _shape(other[1]), _shape(other[2]))
    assume(one_shape != other_shape)
    assert call_fingerprint(*one) != call_fingerprint(*other)
    if (one[0], _shape(one[2])) != (other[0], _shape(other[2])):
        assert fields_fingerprint(one[0], one[2]) != fields_fingerprint(other[0], other[2])


@_SETTINGS
@given(task_names, json_values)
def test_a_value_and_its_near_twins_give_different_keys(name: str, value: Any) -> None:
    twins = [value, [value], {"v": value}, json.dumps(value)]
    if isinstance(value, bool):
        twins.append(int(value))
    elif isinstance(value, int):
        twins.append(float(value))
    keys = {call_fingerprint(name, [twin], {}) for twin in twins}
    assert len(keys) == len(twins)
    # The same value as a positional or a keyword argument, or as a key field.
    assert (
        len(
            {
                call_fingerprint(name, [value], {}),
                call_fingerprint(name, [], {"v": value}),
                fields_fingerprint(name, {"v": value}),
                call_fingerprint(name + "x", [value], {}),
            }
        )
        == 4
    )


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (1, "1"),
        (1, 1.0),
        (1, True),
        (0, False),
        (None, "null"),
        (0.0, -0.0),
        ("", []),
        ([], {}),
        ([1, 2], [2, 1]),
        ({"a": 1}, {"a": "1"}),
        (uuid.UUID(int=1), uuid.UUID(int=2)),
        (dt.date(2024, 1, 1), dt.date(2024, 1, 2)),
        (decimal.Decimal("1.0"), decimal.Decimal("1.00")),
        ({"x"}, {"y"}),
    ],
)
def test_values_that_a_worker_would_receive_differently_give_different_keys(
    one: object, other: object
) -> None:
    assert call_fingerprint("t", [one], {}) != call_fingerprint("t", [other], {})


def test_kwargs_order_does_not_matter() -> None:
    assert call_fingerprint("t", [], {"a": 1, "b": 2}) == call_fingerprint(
        "t", [], {"b": 2, "a": 1}
    )
