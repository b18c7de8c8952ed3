"""JSON as data: the one recursive type for what is read from, or written to, JSON and YAML.

Declared once, at the lowest layer that reads such files, so that the packages above name
arbitrary data as what it is (a JSON value) instead of `Any`.
"""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
"""Any JSON value: an object, an array, a string, a number, a boolean or null."""

JSONObject: TypeAlias = dict[str, JSON]
"""A JSON object: the shape of one JSONL line, of a YAML mapping, of a request's body."""
