"""Edits of the JSON Schemas pydantic generates, for rules its field constraints cannot carry:
those checked by hand-written validators (which keep their own error messages) and the limits
only known at run time (``openapi``).

A pydantic field schema is either one schema or, for ``X | None`` and other unions, an
``anyOf`` of members; edits apply to the members of a JSON type and never to ``null``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

JsonSchema = dict[str, Any]


def members(schema: JsonSchema) -> Iterator[JsonSchema]:
    """The schema's union members (itself when it is no union), ``null`` left out."""
    parts = schema.get("anyOf") or schema.get("oneOf") or [schema]
    for part in parts:
        if part.get("type") != "null":
            yield part


def constrain(schema: JsonSchema, json_type: str, **constraints: Any) -> None:
    """Adds ``constraints`` to every member of ``json_type`` (``"array"``, ``"string"``, ...)."""
    for part in members(schema):
        if part.get("type") == json_type:
            part.update(constraints)


def constrain_items(schema: JsonSchema, item_type: str, **constraints: Any) -> None:
    """Adds ``constraints`` to the items of every array member whose items are ``item_type``,
    one level of nesting down as well (``list[list[int]]``)."""
    for part in members(schema):
        if part.get("type") != "array":
            continue
        items = part.get("items", {})
        if items.get("type") == item_type:
            items.update(constraints)
        elif items.get("type") == "array":
            constrain_items(items, item_type, **constraints)


def stating(**by_type: JsonSchema) -> Callable[[JsonSchema], None]:
    """A ``json_schema_extra`` that adds ``by_type[t]`` to the members of JSON type ``t``: the
    schema states a rule that a validator of the model checks (with its own message)."""

    def edit(schema: JsonSchema) -> None:
        for json_type, constraints in by_type.items():
            constrain(schema, json_type, **constraints)

    return edit
