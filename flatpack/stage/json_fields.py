"""Checked reads of fields from a parsed JSON document that flatpack wrote (a stage's
``manifest.json``, an artifact's ``flatpack.json``): a missing field or one of the wrong JSON
type raises :class:`Invalid` naming the field and where it was read, so the module that parses
the document turns it into one ArtifactError instead of a KeyError later, in whatever reads it.
"""

from __future__ import annotations

from typing import Any, Mapping

# how a field's expected JSON type reads in an error
_JSON_NAMES: dict[type, str] = {int: "an integer", str: "a string", bool: "true or false", list: "a list",
                                dict: "an object"}


class Invalid(Exception):
    """A field is missing or has the wrong type (the message names it and where it was read)."""


def required(data: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    """``data[key]``, which must be there and of JSON type ``kind``."""
    if key not in data:
        raise Invalid(f"{where} has no {key!r}")
    value = data[key]
    # bool is an int to isinstance: a count or an index given as true/false is refused too
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise Invalid(f"{where}'s {key!r} is {value!r}, not {_JSON_NAMES.get(kind, kind.__name__)}")
    return value


def ints(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise Invalid(f"{where} is {values!r}, not a list of integers")
    return tuple(values)


def strings(values: Any, where: str) -> tuple[str, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise Invalid(f"{where} is {values!r}, not a list of strings")
    return tuple(values)
