"""Label parsing, as a pure function: string forms, raw values, bad values."""

from __future__ import annotations

import pytest

from taskiq_deduplication.model.formats import RecordedLock, read_lock_labels
from taskiq_deduplication.model.settings import Defaults, SendOptions, read_send_options


def options(**labels: object) -> SendOptions | None:
    return read_send_options(labels, Defaults(enabled=True, ttl=300))


def test_no_labels_gives_the_defaults() -> None:
    assert options() == SendOptions(ttl=300, key=None, key_fields=None)
    assert read_send_options({}, Defaults(enabled=False, ttl=300)) is None


@pytest.mark.parametrize("value", [False, "False", "false", " FALSE ", "0", "no", "off"])
def test_off(value: object) -> None:
    assert options(deduplication=value) is None


@pytest.mark.parametrize("value", [True, "True", "true", "1", "yes", "on"])
def test_on(value: object) -> None:
    assert read_send_options({"deduplication": value}, Defaults(enabled=False, ttl=5))


@pytest.mark.parametrize(("value", "ttl"), [(30, 30), ("30", 30), (" 7 ", 7), ("+9", 9)])
def test_ttl(value: object, ttl: int) -> None:
    parsed = options(deduplication_ttl=value)
    assert parsed is not None
    assert parsed.ttl == ttl


@pytest.mark.parametrize(
    ("value", "fields"),
    [
        (["user_id"], ("user_id",)),
        (("a", "b"), ("a", "b")),
        ("['user_id']", ("user_id",)),
        ('["a", "b"]', ("a", "b")),
        (["a", "a", "b"], ("a", "b")),
    ],
)
def test_key_fields(value: object, fields: tuple[str, ...]) -> None:
    parsed = options(deduplication_key_fields=value)
    assert parsed is not None
    assert parsed.key_fields == fields


@pytest.mark.parametrize(
    ("label", "value"),
    [
        ("deduplication", "sometimes"),
        ("deduplication", 2),
        ("deduplication_ttl", "1.5"),
        ("deduplication_ttl", "0"),
        ("deduplication_ttl", True),
        ("deduplication_ttl", [30]),
        ("deduplication_key", ""),
        ("deduplication_key", 5),
        ("deduplication_key_fields", "user_id"),
        ("deduplication_key_fields", "[1, 2]"),
        ("deduplication_key_fields", "{'a': 1}"),
        ("deduplication_key_fields", "["),
        ("deduplication_key_fields", ["a-b"]),
        ("deduplication_key_fields", []),
    ],
)
def test_bad_values_name_the_label_and_the_value(label: str, value: object) -> None:
    with pytest.raises(ValueError, match=label) as caught:
        options(**{label: value})
    assert repr(value) in str(caught.value)


def test_bool_and_int_are_not_confused_by_the_cache() -> None:
    assert options(deduplication_ttl=1) == SendOptions(ttl=1, key=None, key_fields=None)
    with pytest.raises(ValueError, match="boolean"):
        options(deduplication_ttl=True)


def test_lock_labels_are_read_back_tolerantly() -> None:
    good = {
        "_deduplication_lock_key": "p:k",
        "_deduplication_lock_owner": "abc task-1",
        "_deduplication_lock_ttl": "60",
    }
    expected = RecordedLock(key="p:k", token="abc", ttl=60)  # noqa: S106
    assert read_lock_labels(good, "task-1") == expected
    assert read_lock_labels({}, "task-1") is None
    # Labels copied onto another message name another owner.
    assert read_lock_labels(good, "task-2") is None
    for broken in (
        {"_deduplication_lock_ttl": "x"},
        {"_deduplication_lock_ttl": ["60"]},
        {"_deduplication_lock_key": ""},
        {"_deduplication_lock_owner": 5},
        {"_deduplication_lock_owner": " task-1"},
        {"_deduplication_lock_owner": "abc"},
    ):
        assert read_lock_labels({**good, **broken}, "task-1") is None
