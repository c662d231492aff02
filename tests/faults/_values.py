"""Argument types for the fingerprint property tests, importable by a subprocess.

The property tests pickle their random calls to a second interpreter (with a
different hash seed) and compare the fingerprints it computes; the classes of
the values they hold must be importable there, so they live in a module.
"""

from __future__ import annotations

import dataclasses
import enum

import pydantic


class Colour(enum.Enum):
    """An enum argument."""

    RED = "red"
    GREEN = 2


@dataclasses.dataclass(frozen=True)
class Point:
    """A dataclass argument."""

    x: int
    tags: frozenset[str]


class User(pydantic.BaseModel):
    """A pydantic model argument."""

    name: str
    groups: set[str]
