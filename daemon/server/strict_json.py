"""Request bodies read as strict JSON: NaN, Infinity and -Infinity are refused, and so is a number
past what a float holds (1e400).

Python's `json` reads those three words as floats, though JSON has no such numbers, and 1e400 as
infinity. A request could then carry one into a field with no finite bound (a rollout's policy
document), and every answer that later held it failed to render (`Out of range float values are
not JSON compliant`): the rollout list answered 500 until the rollout was gone. Refused at the
edge, the request gets a 400 that names the word, as a body that is not JSON does.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute

NOT_A_POSITION = -1  # a refused constant's JSONDecodeError: where it stands is not known


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON number", "", NOT_A_POSITION)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON, but past what a float holds
        raise json.JSONDecodeError(f"{text} is past the largest number a float holds", "", NOT_A_POSITION)
    return value


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), parse_constant=_refuse_constant, parse_float=_finite)
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose handler reads its JSON body as StrictJSONRequest does. Set it as the app's
    `router.route_class` before the routes are declared."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
