"""The shape a request asks its reply to take, as the engine's `structured.Constraint`.

The fields clients send today, one per request:
- OpenAI's `response_format`: `{"type": "text"}` (no shape), `{"type": "json_object"}` (a JSON
  object), `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `guided_json` (a JSON Schema, or its text), `guided_regex`, `guided_choice` (the reply is
  one of these strings, as written);
- vLLM's `guided_grammar`: a context-free grammar, GBNF (`root ::= ...`, as vLLM's xgrammar backend
  reads it) or Lark (`start: ...`, as its guidance backend does);
- structural tags, OpenAI-style `response_format: {"type": "structural_tag", "structures": [{"begin",
  "schema", "end"}], "triggers": [...]}` as vLLM takes them: free text, in which each structure's
  `begin` (which starts with one of the triggers) is followed by JSON its schema accepts and `end`;
- vLLM's newer `structured_outputs`: `{"json": ...}`, `{"regex": ...}`, `{"choice": [...]}`,
  `{"grammar": ...}`, `{"json_object": true}` or `{"structural_tag": ...}` (the object above without
  its type, or its JSON text).

A field kvd cannot follow is refused by name (400), never ignored: a client that asked for JSON
must not be handed prose. The schema, pattern or grammar itself is checked by the engine when the
request is submitted (`GrammarVocabulary.check`), with the field named.
"""

from __future__ import annotations

import json
from typing import Any

from kvctl.daemon.engine.structured import Constraint

from .chat_messages import MessagesError

SHAPE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs")
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def asks_for_a_shape(body: Any) -> bool:
    """Whether the request names a shape at all (constraint_of, which may take a while for a long
    grammar, is then worth a worker thread)."""
    return any(getattr(body, name, None) not in (None, {"type": "text"}) for name in SHAPE_FIELDS)


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
    if kind == "structural_tag":
        return _structural_tag(value, "response_format")
    raise MessagesError(f"response_format.type: must be {', '.join(RESPONSE_FORMAT_TYPES[:-1])} or "
                        f"{RESPONSE_FORMAT_TYPES[-1]}, got {kind!r}", "response_format.type")


def _structured_outputs(value: Any) -> Constraint:
    given = [k for k in value if value[k] not in (None, False)] if isinstance(value, dict) else None
    if given is None or len(given) != 1 or given[0] not in STRUCTURED_OUTPUT_KINDS:
        shown = given if given is not None else type(value).__name__
        raise MessagesError(f"structured_outputs: give one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {shown}",
                            "structured_outputs")
    kind = given[0]
    if kind == "json_object":
        return _shape("json", {"type": "object"}, "structured_outputs.json_object")
    if kind == "structural_tag":
        spec, field = value[kind], "structured_outputs.structural_tag"
        if isinstance(spec, str):  # vLLM takes it as JSON text
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than Python recurses
                raise MessagesError(f"{field}: not JSON text of structural tags", field) from None
        return _structural_tag(spec, field)
    return _shape(kind, value[kind], f"structured_outputs.{kind}")


def _structural_tag(spec: Any, field: str) -> Constraint:
    """vLLM's structural tags ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}): each
    structure's begin starts with one of the triggers (the longest that fits is its own)."""
    if not isinstance(spec, dict):
        raise MessagesError(f"{field}: must be an object with structures and triggers, got {type(spec).__name__}",
                            field)
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise MessagesError(f"{field}.triggers: must be a list of one or more non-empty strings, got "
                            f"{_short(triggers)}", f"{field}.triggers")
    structures = spec.get("structures")
    if not isinstance(structures, list) or not structures:
        raise MessagesError(f"{field}.structures: must be a list of one or more {{begin, schema, end}} objects, "
                            f"got {_short(structures)}", f"{field}.structures")
    tags = []
    for i, structure in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(structure, dict):
            raise MessagesError(f"{where}: must be an object with begin, schema and end, got "
                                f"{type(structure).__name__}", where)
        begin, schema, end = structure.get("begin"), structure.get("schema"), structure.get("end")
        for name, given, ok in (("begin", begin, isinstance(begin, str) and begin),
                                ("end", end, isinstance(end, str)),
                                ("schema", schema, isinstance(schema, dict))):
            if not ok:
                wanted = "a JSON Schema object" if name == "schema" else "a string" + (
                    " (may be empty)" if name == "end" else " that starts with a trigger")
                raise MessagesError(f"{where}.{name}: must be {wanted}, got {_short(given)}", f"{where}.{name}")
        trigger = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if trigger is None:
            raise MessagesError(f"{where}.begin: {_short(begin)} starts with none of the triggers "
                                f"{_short(triggers)}", f"{where}.begin")
        problem = _shape("json", schema, f"{where}.schema").problem()  # named by its structure, not the whole
        if problem:
            raise MessagesError(f"{where}.schema: {problem}", f"{where}.schema")
        tags.append((trigger, begin, schema, end))
    try:
        return Constraint.structural_tags(tags, field)
    except ValueError as exc:
        raise MessagesError(f"{field}: {exc}", field) from None


def _shape(kind: str, value: Any, field: str) -> Constraint:
    """A JSON Schema (an object, or its JSON text), a regex or choices as a Constraint."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
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
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise MessagesError(f"{field}: must be the text of a grammar (GBNF or Lark), got {_short(value)}", field)
        try:
            return Constraint.grammar_text(value, field)
        except ValueError as exc:
            raise MessagesError(f"{field}: {exc}", field) from None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise MessagesError(f"{field}: must be a list of one or more non-empty strings, got {value!r}", field)
    return Constraint.choice(value, field)


def _short(value: Any) -> str:
    """A value a client sent, as an error shows it: its repr, cut to 80 characters."""
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
