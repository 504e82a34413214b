"""OpenAI's Conversations API (`/v1/conversations`): a conversation, its metadata, and its items,
which a Responses request's `conversation` continues (responses_routes.py) and adds its turn to.
Each tenant reads and changes its own conversations only (conversation_store.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from .api_errors import ApiError
from .calls import Principal
from .chat_messages import MessagesError
from .conversation_store import Conversation, ConversationError
from .responses_api import input_items_page, now
from .responses_input import checked_metadata, input_items, input_messages
from .strict_json import StrictJSONRoute

ITEMS_AT_ONCE = 20  # OpenAI's most items one request adds


class ConversationBody(BaseModel):
    """`POST /v1/conversations` (items and metadata) and `POST /v1/conversations/{id}` (metadata)."""

    model_config = ConfigDict(extra="forbid")

    items: Any = None
    metadata: Any = None
    safety_identifier: str | None = None  # OpenAI's abuse-monitoring hint: kvd has no use for it


class ItemsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: Any = None


def not_found(conversation_id: str, param: str = "conversation_id", why: str | None = None) -> ApiError:
    """The 404 of a conversation kvd does not keep; `why`: why it went, where kvd knows (gone_book.py)."""
    if why is not None:
        return ApiError(404, f"{param}: conversation {conversation_id!r} is no longer kept: {why}",
                        type_="not_found_error", param=param, code="conversation_not_found")
    return ApiError(404, f"{param}: no conversation {conversation_id!r} is kept here (kvd keeps its tenant's "
                         "conversations in memory, within conversations_store_bytes)", type_="not_found_error",
                    param=param, code="conversation_not_found")


def shaped_items(raw: Any, required: bool) -> list[dict]:
    """Items to add, checked as a Responses request's input is (each with its id, else a new one);
    MessagesError names `items[i]` and the field at fault."""
    if raw is None and not required:
        return []
    if isinstance(raw, list) and len(raw) > ITEMS_AT_ONCE:
        raise MessagesError(f"items: at most {ITEMS_AT_ONCE} items at a time, got {len(raw)}", "items")
    if raw == [] and not required:
        return []
    input_messages(raw, "items")
    return input_items(raw)


def refuse_include(http: Request) -> None:
    """A 400 for `include` on an item listing (a response's input items, a conversation's items):
    kvd keeps nothing more of an item to add."""
    include = [name for key in ("include", "include[]") for name in http.query_params.getlist(key) if name]
    if include:  # (OpenAI's client sends include[]=...)
        raise ApiError(400, f"include: kvd adds nothing to the items (got {include!r}); leave it out",
                       param="include", code="unsupported_parameter")


def conversations_routes(service, principal) -> APIRouter:
    router = APIRouter(route_class=StrictJSONRoute)
    store = service.conversations

    def held(who: Principal, conversation_id: str) -> Conversation:
        conversation = store.get(who.tenant, conversation_id)
        if conversation is None:
            raise not_found(conversation_id, why=store.gone.why(who.tenant, conversation_id))
        return conversation

    def checked(work):
        """`work()`, its MessagesError and ConversationError as the API's errors."""
        try:
            return work()
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ConversationError as exc:
            raise ApiError(exc.status, str(exc), param=exc.param, code=exc.code) from None

    @router.post("/v1/conversations")
    async def create_conversation(body: ConversationBody, who: Principal = Depends(principal)):
        def make():
            metadata = checked_metadata(body.metadata)
            return store.create(who.tenant, shaped_items(body.items, False), metadata, now()).shown()
        return checked(make)

    @router.get("/v1/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str, who: Principal = Depends(principal)):
        return held(who, conversation_id).shown()

    @router.post("/v1/conversations/{conversation_id}")
    async def update_conversation(conversation_id: str, body: ConversationBody, who: Principal = Depends(principal)):
        conversation = held(who, conversation_id)
        if body.items is not None:
            raise ApiError(400, "items: add items with POST /v1/conversations/{id}/items", param="items")
        if body.metadata is None:
            raise ApiError(400, "metadata: required (the conversation's new metadata)", param="metadata")
        checked(lambda: store.set_metadata(conversation, checked_metadata(body.metadata)))
        return conversation.shown()

    @router.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str, who: Principal = Depends(principal)):
        if not store.delete(who.tenant, conversation_id):
            raise not_found(conversation_id, why=store.gone.why(who.tenant, conversation_id))
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @router.post("/v1/conversations/{conversation_id}/items")
    async def add_items(conversation_id: str, body: ItemsBody, http: Request, who: Principal = Depends(principal)):
        refuse_include(http)
        conversation = held(who, conversation_id)

        def add():
            items = shaped_items(body.items, True)
            store.add(conversation, items)
            return items
        added = checked(add)
        return {"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                "has_more": False}

    @router.get("/v1/conversations/{conversation_id}/items")
    async def list_items(conversation_id: str, http: Request, after: str | None = None, limit: str | None = None,
                         order: str | None = None, who: Principal = Depends(principal)):
        refuse_include(http)
        conversation = held(who, conversation_id)
        return checked(lambda: input_items_page(list(conversation.items), after, None, limit, order, "conversation"))

    @router.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_item(conversation_id: str, item_id: str, http: Request, who: Principal = Depends(principal)):
        refuse_include(http)
        item = held(who, conversation_id).item(item_id)
        if item is None:
            raise _no_item(conversation_id, item_id)
        return item

    @router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str, who: Principal = Depends(principal)):
        conversation = held(who, conversation_id)
        if not store.delete_item(conversation, item_id):
            raise _no_item(conversation_id, item_id)
        return conversation.shown()

    return router


def _no_item(conversation_id: str, item_id: str) -> ApiError:
    return ApiError(404, f"item_id: conversation {conversation_id!r} has no item {item_id!r}", type_="not_found_error",
                    param="item_id", code="item_not_found")
