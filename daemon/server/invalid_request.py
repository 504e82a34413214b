"""One line for a request pydantic refused: the field, what it must be, and what came.

pydantic reports each refused value at a location such as ("body", "ttl", "str"). For a field
that takes one of several kinds (`str | Number`), it reports the value once per kind, each
location ending in pydantic's name for that kind, and the first says only "Input should be a
valid string" for a number of the wrong sort. The kinds are named here together instead:
`ttl: must be a string or a number (got [1])`.
"""

from __future__ import annotations

import re
from typing import Any

from .strict_json import NOT_A_POSITION

# pydantic's names for the kinds of a union: `str`, `list[str]`, `function-before[...]`, ...
_KIND_NAME = re.compile(r"^(str|int|float|bool|none|list|dict|tuple|set|bytes|function-[a-z-]+|constrained-[a-z]+)"
                        r"(\[.*\])?$")
_KIND_NOUNS = [("list[str]", "a list of strings"), ("list", "a list"), ("dict", "an object"), ("str", "a string"),
               ("float", "a number"), ("int", "an integer"), ("bool", "true or false")]
_LONGEST_SHOWN = 200  # characters of the value echoed back: never a huge body whole


def _noun(kind: str) -> str:
    if kind.startswith("function-"):  # a validator around a kind: `function-before[_not_a_boolean(), float]`
        kind = kind[kind.find("[") + 1:-1].split(",")[-1].strip()
    return next((noun for name, noun in _KIND_NOUNS if kind == name or kind.startswith(name + "[")), kind)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _LONGEST_SHOWN else text[:_LONGEST_SHOWN] + "..."


def describe(errors: list[dict]) -> tuple[str, str | None]:
    """The message for a refused request, and the request field it names (None: the body)."""
    first = errors[0]
    loc = list(first.get("loc", ()))
    fields = [str(p) for p in (loc[1:] if loc[:1] in (["body"], ["query"], ["path"]) else loc)]
    where = fields[0] if fields else None  # the request field, not pydantic's union branch
    got = _shown(first.get("input"))
    if first.get("type") == "json_invalid":  # loc is ("body", the character where it went wrong)
        at = loc[1] if len(loc) > 1 and isinstance(loc[1], int) and loc[1] != NOT_A_POSITION else None
        return (f"body: not valid JSON ({(first.get('ctx') or {}).get('error')}"
                + ("" if at is None else f", at character {at}") + ")"), None
    if loc == ["body"] and first.get("type") == "missing":
        return "body: a JSON object is required, and the request has none", None
    if where == "prompt":  # its kinds nest lists: say them as a person would
        return ("prompt: must be a string, a list of strings, a list of token ids (integers) or a list of lists "
                f"of token ids (got {got})"), where
    branch = next((i for i, part in enumerate(loc) if isinstance(part, str) and _KIND_NAME.match(part)), None)
    if branch is not None:
        kinds = list(dict.fromkeys(str(e["loc"][branch]) for e in errors
                                   if list(e["loc"][:branch]) == loc[:branch] and len(e["loc"]) > branch))
        if len(kinds) > 1:
            nouns = list(dict.fromkeys(_noun(kind) for kind in kinds))
            return f"{where}: must be {', '.join(nouns[:-1])} or {nouns[-1]} (got {got})", where
    return f"{where or 'body'}: {first.get('msg')} (got {got})", where
