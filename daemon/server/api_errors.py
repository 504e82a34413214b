"""The errors the HTTP API answers with, in OpenAI's shape, and the check of token ids at its edge."""

from __future__ import annotations

from typing import Any

from kvctl.daemon.model.tokenizer import first_outside_vocab

from .calls import ServiceError


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        super().__init__(message)


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_served(service, model: str | None) -> None:
    """Returns where `model` is the one kvd serves or one of its LoRA adapters (None: the model);
    else an ApiError 404 naming it and those served."""
    try:
        service.adapter_named(model)
    except ServiceError as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None


def checked_ids(ids: list[int], field: str, engine) -> list[int]:
    """`ids`, once each is a token id of the model (before echo decodes them or a pin warms
    them); else an ApiError 400 naming `field` and the first id outside."""
    vocab = engine.loaded.config.vocab_size
    bad = first_outside_vocab(ids, vocab)
    if bad is not None:
        raise ApiError(400, f"{field}: token ids must lie in [0, {vocab}), found {ids[bad]}", param=field)
    return ids


def refuse_unsupported(body: Any, unsupported: dict, hints: dict) -> None:
    """A 400 naming the first of a request's extra fields (pydantic's `model_extra`) that asks for
    what kvd does not do (`unsupported`: each field's values that ask for nothing; best_of equal to
    n is inert), with the field's hint (`hints`) or "leave it out"."""
    for name, value in (body.model_extra or {}).items():
        inert = unsupported.get(name)
        if inert is None or value in inert or (name == "best_of" and value == body.n):
            continue
        shown = "a salt" if name == "cache_salt" else repr(value)  # a salt is the client's secret: never echoed
        raise ApiError(400, f"{name}: not supported by kvd, got {shown}; "
                            + hints.get(name, "leave it out"), param=name,
                       code="unsupported_parameter")
