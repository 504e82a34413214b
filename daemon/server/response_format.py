"""The shape a request asks its reply to take, as the engine's `structured.Constraint`.

The fields clients send today, one per request:
- OpenAI's `response_format`: `{"type": "text"}` (no shape), `{"type": "json_object"}` (a JSON
  object), `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `guided_json` (a JSON Schema, or its text), `guided_regex`, `guided_choice` (the reply is
  one of these strings, as written);
- vLLM's newer `structured_outputs`: `{"json": ...}`, `{"regex": ...}`, `{"choice": [...]}` or
  `{"json_object": true}`.

A field kvd cannot follow is refused by name (400), never ignored: a client that asked for JSON
must not be handed prose. `guided_grammar` (EBNF, whose dialect differs between vLLM's backends) is
refused with the fields kvd takes. The schema or pattern itself is checked by the engine when the
request is submitted (`GrammarVocabulary.check`), with the field named.
"""

from __future__ import annotations

import json
from typing import Any

from kvctl.daemon.engine.structured import Constraint

from .chat_messages import MessagesError

SHAPE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "json_object")


def constraint_of(body: Any) -> Constraint | None:
    """The request's shape (None: free text); MessagesError naming the field at fault."""
    asked = [(name, getattr(body, name, None)) for name in SHAPE_FIELDS]
    asked = [(name, value) for name, value in asked if value is not None and value != {"type": "text"}]
    if len(asked) > 1:
        raise MessagesError(f"{asked[1][0]}: give one shape for the reply, not {asked[0][0]} and {asked[1][0]}",
                            asked[1][0])
    if not asked:
        return None
    [(name, value)] = asked
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _shape(name.removeprefix("guided_"), value, name)


def _response_format(value: Any) -> Constraint:
    if not isinstance(value, dict):
        raise MessagesError(f"response_format: must be an object with type, got {type(value).__name__}",
                            "response_format")
    kind = value.get("type")
    if kind == "json_object":
        return _shape("json", {"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise MessagesError("response_format.json_schema.schema: must be a JSON Schema object "
                                "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}})",
                                "response_format.json_schema.schema")
        return _shape("json", spec["schema"], "response_format.json_schema.schema")
    raise MessagesError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
                        "response_format.type")


def _structured_outputs(value: Any) -> Constraint:
    given = [k for k in value if value[k] not in (None, False)] if isinstance(value, dict) else None
    if given is None or len(given) != 1 or given[0] not in STRUCTURED_OUTPUT_KINDS:
        shown = given if given is not None else type(value).__name__
        raise MessagesError(f"structured_outputs: give one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {shown}",
                            "structured_outputs")
    kind = given[0]
    if kind == "json_object":
        return _shape("json", {"type": "object"}, "structured_outputs.json_object")
    return _shape(kind, value[kind], f"structured_outputs.{kind}")


def _shape(kind: str, value: Any, field: str) -> Constraint:
    """A JSON Schema (an object, or its JSON text), a regex or choices as a Constraint."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise MessagesError(f"{field}: not JSON text of a schema", field) from None
        if not isinstance(value, dict):
            raise MessagesError(f"{field}: must be a JSON Schema object, got {type(value).__name__}", field)
        try:
            return Constraint.json_schema(value, field)
        except ValueError as exc:
            raise MessagesError(f"{field}: {exc}", field) from None
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise MessagesError(f"{field}: must be a regular expression, got {value!r}", field)
        return Constraint.regex(value, field)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise MessagesError(f"{field}: must be a list of one or more non-empty strings, got {value!r}", field)
    return Constraint.choice(value, field)
