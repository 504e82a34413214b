"""The Responses API's routes: `POST /v1/responses` (served as a chat turn, responses_api.py),
`POST /v1/responses/input_tokens` (the tokens its input would take, as it would be prompted),
`GET` and `DELETE /v1/responses/{id}` (the responses kept for `previous_response_id`,
response_store.py) and `GET /v1/responses/{id}/input_items` (the items a kept response was made
from). Each tenant reads and deletes its own responses only."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvctl.daemon.model.chat_template import ChatTemplateError

from . import serve_again
from .api_errors import ApiError, model_served, refuse_unsupported
from .calls import Principal, ServiceError
from .chat import ChatCompletionRequest
from .chat_messages import MessagesError, chat_messages, checked_tools
from .service_tiers import TIERS, served_tier
from .responses_api import (RESPONSE_HINTS, UNSUPPORTED_RESPONSE_FIELDS, OutputItems, ResponsesRequest, chat_body,
                            input_items_page, new_id, now, response_object, status_of, usage_of, without_logprobs)
from .response_logprobs import AnswerLogprobs
from .durations import format_duration
from .response_runs import Run, settled
from .webhooks import EVENT_TYPES
from .response_store import REPLAY_S
from .response_truncation import fitting_cut, kept_from
from .responses_input import input_items, input_messages
from .conversation_store import ConversationError, Turn
from .conversations_routes import not_found as conversation_not_found, refuse_include
from .strict_json import StrictJSONRoute

REQUEST_ID_HEADER = "X-KVD-Request-Id"
RESPONSE_ID_HEADER = "X-KVD-Response-Id"  # the response's id, before its body: kvd router learns its home from it


def _not_kept(response_id: str, param: str, why: str | None = None) -> ApiError:
    """The 404 of a response kvd does not keep; `why`: why it went, where kvd knows (gone_book.py)."""
    if why is not None:
        return ApiError(404, f"{param}: response {response_id!r} is no longer kept: {why}", type_="not_found_error",
                        param=param, code="response_not_found")
    return ApiError(404, f"{param}: no response {response_id!r} is kept here (kvd keeps its tenant's responses in "
                         "memory, within responses_store_bytes, until it restarts unless responses_store_file keeps "
                         "them; one sent with store: false is not kept)", type_="not_found_error", param=param,
                    code="response_not_found")


@dataclass
class Prepared:
    """What a response is made from: the chat request it is served as (`asked`), the messages of
    the conversation it continues (after truncation auto's cut) and the items it is made from
    (`inputs`: the earlier turns', then this request's `given`); `held`: the conversation of
    /v1/conversations it continues, and `new_start` the item its next turns start at, where the cut
    moved it (None: it did not)."""

    asked: dict
    conversation: list[dict]
    inputs: list[dict]
    given: list[dict]
    held: Any = None
    new_start: str | None = None


def _event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def responses_routes(service, principal, chat: Callable[..., Awaitable[Any]],
                     chat_shape: Callable[[ChatCompletionRequest], Any]) -> APIRouter:
    """The routes, answering through `chat(body, http, who, api)`: how the app serves a chat;
    `chat_shape(body)`: a fresh chat.ChatShape for a chat it has served (its parsers)."""
    router = APIRouter(route_class=StrictJSONRoute)  # NaN and Infinity are not JSON: refused

    def reasoning_tokens(text: str) -> int:
        """The thinking's length in tokens, as the tokenizer encodes its text."""
        loaded = service.loaded
        return len(loaded.tokenizer.encode(text, add_special_tokens=False)) if text and loaded is not None else 0

    def shaped(body: ResponsesRequest, head: dict, items: list[dict], status: str, usage: dict | None = None,
               finish_reason: str | None = None, error: dict | None = None) -> dict:
        """The Response object for this request (`head`: its id, creation time and model)."""
        asked = body.service_tier if body.service_tier in TIERS else None  # (a bad one is refused by the chat)
        return response_object(head["id"], body, head["model"], head["created"], items, status, usage, finish_reason,
                               error=error, defaults=service.sampling_defaults,
                               tier="auto" if asked is None else served_tier(asked, service.config.queue_order))

    def finished(body: ResponsesRequest, who: Principal, head: dict, items: OutputItems, finish_reason: str | None,
                 chat_usage: dict, conversation: list[dict], inputs: list[dict], turn: Turn | None) -> dict:
        """The response once the reply has ended, kept for a next turn unless `store` is false
        (`inputs`: the items it was made from); its input and output go to the conversation it
        continues (`turn`), unless it was cancelled."""
        usage = usage_of(chat_usage, reasoning_tokens(items.reasoning_text()))
        response = shaped(body, head, items.items, status_of(finish_reason), usage, finish_reason)
        if body.store:
            service.responses.put(who.tenant, response, [*conversation, items.assistant_turn()], inputs)
        if turn is not None:
            turn.end(without_logprobs(response["output"]) if response["status"] != "cancelled" else None)
        return response

    def ended_failed(body: ResponsesRequest, who: Principal, head: dict, items: OutputItems, error: dict,
                     conversation: list[dict], inputs: list[dict], turn: Turn | None) -> dict:
        """The response, failed with `error`: the item being written closed as incomplete; kept
        where it ran in the background (its client comes back for it); its conversation is left
        as it was."""
        items.close("incomplete")
        response = items.response = shaped(body, head, items.items, "failed", error=error)
        if body.background:
            service.responses.put(who.tenant, response, conversation, inputs)
        if turn is not None:
            turn.end(None)
        return response

    async def prepared(body: ResponsesRequest, who: Principal) -> Prepared:
        """The chat request `body` is served as, and what it continues (the caller's conversation or
        previous response), cut where truncation is auto and it does not fit; an ApiError naming the
        field at fault. Changes nothing kept."""
        earlier: list[dict] = []
        inputs: list[dict] = []  # the items this response is made from: the earlier turns', then its input
        held = None  # the conversation it continues (conversation_store.py)
        if body.conversation is not None and body.previous_response_id is not None:
            raise ApiError(400, "previous_response_id: a response continues a conversation or a previous response, "
                                "not both; give conversation or previous_response_id", param="previous_response_id")
        if body.conversation_id() is not None:
            held = service.conversations.get(who.tenant, body.conversation_id())
            if held is None:
                raise conversation_not_found(body.conversation_id(), "conversation",
                                             service.conversations.gone.why(who.tenant, body.conversation_id()))
            inputs = list(held.items)
            # with truncation auto, from where the last cut left it (its prompt then opens as the last turn's did)
            start = held.start() if body.truncation == "auto" else 0
            try:
                earlier = input_messages(inputs[start:], "conversation.items", kept=True) if inputs[start:] else []
            except MessagesError as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
        elif body.previous_response_id is not None:
            if service.responses.running(who.tenant, body.previous_response_id) is not None:
                raise ApiError(400, f"previous_response_id: response {body.previous_response_id!r} is still running "
                                    "in the background; continue it once it has ended", param="previous_response_id")
            kept = service.responses.get(who.tenant, body.previous_response_id)
            if kept is None:
                raise _not_kept(body.previous_response_id, "previous_response_id",
                                service.responses.gone.why(who.tenant, body.previous_response_id))
            earlier = list(kept.conversation)
            inputs = [*kept.inputs, *kept.response["output"]]
        template = service.chat_template
        try:
            asked, conversation = chat_body(body, earlier, template.request_kwargs if template else frozenset())
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        given = input_items(body.input)
        taken = held.taken_id(given) if held is not None else None  # (refused before it runs, not as it ends)
        if taken is not None:
            raise ApiError(400, f"input[{taken}].id: conversation {held.id!r} has an item {given[taken]['id']!r} "
                                "already (or this input has it twice); send this turn's new items only, each with "
                                "an id of its own", param=f"input[{taken}].id")
        inputs += given
        made = Prepared(asked, conversation, inputs, given, held)
        if body.truncation == "auto":  # (the conversation kept for the next turn starts at the cut too)
            instructions = asked["messages"][:len(asked["messages"]) - len(conversation)]
            cut = await fitting(body, instructions, asked, conversation, who.tenant)
            if cut and held is not None:  # the conversation's next turns start here too
                made.new_start = kept_from(inputs[start:], conversation[:cut])
            made.conversation = conversation[cut:]
            asked["messages"] = instructions + made.conversation
        return made

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, http: Request, who: Principal = Depends(principal)):
        refuse_unsupported(body, UNSUPPORTED_RESPONSE_FIELDS, RESPONSE_HINTS)
        if body.background and not (body.store and service.responses.keeps):
            why = "store is false" if not body.store else "kvd keeps no response (responses_store_bytes 0)"
            raise ApiError(400, f"background: a background response is kept for its client to fetch, and {why}",
                           param="background")
        made = await prepared(body, who)
        asked, conversation, inputs, given, held = made.asked, made.conversation, made.inputs, made.given, made.held
        if made.new_start is not None:
            service.conversations.set_start(held, made.new_start)
        if body.background:  # streamed from the engine whatever the client asked: its run keeps each event
            asked.update(stream=True, stream_options={"include_usage": True})
        chat_request = ChatCompletionRequest.model_validate(asked)
        turn = None
        if held is not None:  # one response at a time writes to a conversation
            try:
                turn = service.conversations.claim(held, given)
            except ConversationError as exc:
                raise ApiError(exc.status, str(exc), param=exc.param, code=exc.code) from None
        try:
            answer = await chat(chat_request, http, who, "responses")
        except BaseException:
            if turn is not None:
                turn.end(None)
            raise
        model = service.adapter_named(body.model) or service.model_name  # (the chat has checked it)
        again = http.scope.get(serve_again.SERVE_AGAIN)  # kvd serving it again after its stop: the same id
        head = {"id": again["id"] if again else new_id("resp_"),
                "created": again["created"] if again and again.get("created") else now(), "model": model}
        named = {REQUEST_ID_HEADER: answer.headers.get(REQUEST_ID_HEADER.lower(), "")}
        if body.store and service.responses.keeps:
            named[RESPONSE_ID_HEADER] = head["id"]
        answer_logprobs = AnswerLogprobs(chat_shape(chat_request), service.loaded.tokenizer) \
            if body.wants_logprobs() else None
        items = OutputItems(body.carries_reasoning(), answer_logprobs)
        if body.background:
            events = _events(answer.body_iterator, body, who, head, conversation, inputs, items, turn)
            run = in_background(events, body, who, head, named[REQUEST_ID_HEADER], items, conversation, inputs, turn,
                                again["attempts"] if again else 0)
            if body.stream and not again:  # (served again, it answers at once: no client reads its stream)
                return StreamingResponse(_sse(run.events_after(-1)), media_type="text/event-stream", headers=named)
            return JSONResponse(run.now(), headers=named)
        if isinstance(answer, StreamingResponse):
            events = _events(answer.body_iterator, body, who, head, conversation, inputs, items, turn)
            return StreamingResponse(_sse(events), media_type="text/event-stream", headers=named)
        if answer.status_code != 200:  # the client left (499)
            if turn is not None:
                turn.end(None)
            return answer
        reply = json.loads(answer.body)
        [choice] = reply["choices"]
        items.tokens(choice, True)
        items.feed(choice["message"])
        items.finish(choice["finish_reason"])
        return JSONResponse(finished(body, who, head, items, choice["finish_reason"], reply["usage"], conversation,
                                     inputs, turn), headers=named)

    @router.post("/v1/responses/input_tokens")
    async def count_input_tokens(body: ResponsesRequest, who: Principal = Depends(principal)):
        """OpenAI's input token count: the tokens this request's prompt would take, rendered as
        `POST /v1/responses` would render it (instructions, tools, the conversation or previous
        response it continues, cut as truncation auto would cut it). Nothing is served or kept."""
        refuse_unsupported(body, UNSUPPORTED_RESPONSE_FIELDS, RESPONSE_HINTS)
        service.require_ready()
        model_served(service, body.model)
        asked = (await prepared(body, who)).asked

        def counted() -> int:
            return len(service.chat_prompt(chat_messages(asked["messages"]), True, False,
                                           asked["chat_template_kwargs"], checked_tools(asked["tools"]), who.tenant))

        try:
            tokens = await run_in_threadpool(counted)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="input", code="chat_template_refused") from None
        return {"object": "response.input_tokens", "input_tokens": tokens}

    async def fitting(body: ResponsesRequest, instructions: list[dict], asked: dict, conversation: list[dict],
                      tenant: str) -> int:
        """How many of the conversation's first messages `truncation: "auto"` drops (0: it fits
        whole, or the chat will say why it cannot be rendered); ApiError 413 where even its last
        turn does not fit."""
        engine = service.engine
        if engine is None:
            return 0  # (the chat says why nothing is served)
        reply = body.max_output_tokens or 1

        def cut_and_latest() -> tuple[int | None, int]:
            """(the cut, or None and the last turn's length in tokens), rendering off the loop."""
            tools = checked_tools(asked["tools"])

            def length(messages: list[dict]) -> int:
                return len(service.chat_prompt(chat_messages(instructions + messages), True, False,
                                               asked["chat_template_kwargs"], tools, tenant))

            cut = fitting_cut(conversation, length, engine.context_limit - reply, service.config.truncation_headroom)
            if cut is not None:
                return cut, 0
            last = max((i for i, message in enumerate(conversation) if message.get("role") == "user"), default=0)
            return None, length(conversation[last:])

        try:
            cut, latest = await run_in_threadpool(cut_and_latest)
        except (MessagesError, ChatTemplateError, ServiceError):
            return 0
        if cut is None:
            raise ApiError(413, f"input: truncation auto drops a conversation's earliest turns, but its last turn "
                                f"alone is {latest} tokens, which with {reply} for the reply (max_output_tokens) "
                                f"exceeds {engine.context_limit_text()}", param="input", code="context_length_exceeded")
        return cut

    async def _events(chunks: AsyncIterator[str], body: ResponsesRequest, who: Principal, head: dict,
                      conversation: list[dict], inputs: list[dict], items: OutputItems,
                      turn: Turn | None) -> AsyncIterator[dict]:
        """The chat's stream as the Responses API's events, `items` built as they come. Leaving
        early closes the chat's stream, which cancels the request (and leaves its conversation as
        it was). A cancelled one (a background response's cancel) ends once its items close: kept,
        with no event of its own."""
        events = _stream_events(chunks, body, who, head, conversation, inputs, items, turn)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
            if turn is not None:
                turn.end(None)  # (nothing, where the response ended and added its turn)

    async def _stream_events(chunks: AsyncIterator[str], body: ResponsesRequest, who: Principal, head: dict,
                             conversation: list[dict], inputs: list[dict], items: OutputItems,
                             turn: Turn | None) -> AsyncIterator[dict]:
        opening = shaped(body, head, [], "in_progress")
        items.emit("response.created", response=opening)
        items.emit("response.in_progress", response=opening)
        for event in items.take_events():
            yield event
        finish_reason, chat_usage, failed = None, None, None
        try:
            async for piece in chunks:
                payload = piece[len("data: "):].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:  # turned away in the queue (pins kept it out)
                    failed = chunk["error"]
                    continue
                chat_usage = chunk.get("usage") or chat_usage
                for choice in chunk["choices"]:
                    items.tokens(choice, choice["finish_reason"] is not None)
                    items.feed(choice["delta"])
                    finish_reason = choice["finish_reason"] or finish_reason
                for event in items.take_events():
                    yield event
        finally:
            await chunks.aclose()
        if failed is not None:
            error = {"code": failed.get("code") or "server_error", "message": failed["message"]}
            response = ended_failed(body, who, head, items, error, conversation, inputs, turn)
            items.emit("response.failed", response=response)
        else:
            items.finish(finish_reason)
            response = items.response = finished(body, who, head, items, finish_reason, chat_usage, conversation,
                                                 inputs, turn)
            if response["status"] != "cancelled":
                items.emit(f"response.{response['status']}", response=response)
        for event in items.take_events():
            yield event

    async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _event(event)
        finally:
            await events.aclose()

    def in_background(events: AsyncIterator[dict], body: ResponsesRequest, who: Principal, head: dict,
                      request_id: str, items: OutputItems, conversation: list[dict], inputs: list[dict],
                      turn: Turn | None, attempts: int = 0) -> Run:
        """Runs the response's events in a task of its own, which no client's leaving cancels.
        `attempts`: how often it was served again after kvd's stop (serve_again.py)."""
        run = Run(who.tenant, request_id, bool(body.stream), lambda status: shaped(body, head, items.items, status))

        async def drive():
            try:
                async for event in events:
                    run.publish(event)
            finally:
                await events.aclose()
                ended(run, body, who, head, items, conversation, inputs, turn, attempts)

        service.responses.begin(head["id"], run, conversation, inputs,
                                body.model_dump(mode="json", exclude_unset=True), who.role, attempts)
        run.task = asyncio.get_running_loop().create_task(drive())
        return run

    def ended(run: Run, body: ResponsesRequest, who: Principal, head: dict, items: OutputItems,
              conversation: list[dict], inputs: list[dict], turn: Turn | None, attempts: int) -> None:
        """A background response's run has ended: kept and told as it ended. One kvd's stop cut short
        (its client did not cancel it) is set aside to be served again at the next start where the
        responses file keeps it (serve_again.py), else it ends `failed`."""
        stopped = items.response is None or (items.response["status"] == "cancelled" and not run.cancel_asked
                                             and not service.accepting)
        if stopped and not service.accepting and service.responses.serves_again(attempts):
            if turn is not None:
                turn.end(None)
            run.end(run.snapshot("queued"))
            service.responses.set_aside(who.tenant, head["id"])
            return
        if stopped:
            error = {"code": "server_error", "message": "kvd stopped serving it before it ended"}
            ended_failed(body, who, head, items, error, conversation, inputs, turn)
        run.end(items.response)
        ended_as = f"response.{items.response['status']}"  # (told to its tenant's webhook, if any)
        service.responses.ended(head["id"], run, ended_as if ended_as in EVENT_TYPES else None)

    @router.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str, stream: bool = False, starting_after: int = -1,
                            who: Principal = Depends(principal)):
        run = service.responses.running(who.tenant, response_id)
        if stream:  # a background response's events again, from `starting_after` on
            run = run or service.responses.replayable(who.tenant, response_id)
            if run is None and service.responses.get(who.tenant, response_id) is None:
                raise _not_kept(response_id, "response_id", service.responses.gone.why(who.tenant, response_id))
            if run is None or run.events is None:
                why = ("it was made without stream: true" if run is not None else
                       f"it is neither running nor ended in the last {format_duration(REPLAY_S)} (or was not made "
                       "with background and stream)")
                raise ApiError(400, f"stream: kvd streams a background response's events again while it runs and "
                                    f"for {format_duration(REPLAY_S)} after it ends, and {why}; GET it without stream",
                               param="stream")
            if starting_after < -1:
                raise ApiError(400, f"starting_after: must be a sequence number (0 or more), got {starting_after}",
                               param="starting_after")
            return StreamingResponse(_sse(run.events_after(starting_after)), media_type="text/event-stream")
        if run is not None:
            return run.now()
        kept = service.responses.get(who.tenant, response_id)
        if kept is None:
            raise _not_kept(response_id, "response_id", service.responses.gone.why(who.tenant, response_id))
        return kept.response

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, who: Principal = Depends(principal)):
        run = service.responses.running(who.tenant, response_id)
        if run is not None:
            return await settled(run, service.cancel)
        kept = service.responses.get(who.tenant, response_id)
        if kept is None:
            raise _not_kept(response_id, "response_id", service.responses.gone.why(who.tenant, response_id))
        if not kept.response.get("background"):
            raise ApiError(400, f"response_id: response {response_id!r} was not made with background: true; only a "
                                "background response can be cancelled", param="response_id")
        return kept.response  # it has ended: as it ended (cancelling twice changes nothing)

    @router.get("/v1/responses/{response_id}/input_items")
    async def kept_input_items(response_id: str, http: Request, after: str | None = None, before: str | None = None,
                               limit: str | None = None, order: str | None = None,
                               who: Principal = Depends(principal)):
        refuse_include(http)
        kept = service.responses.get(who.tenant, response_id)
        if kept is None:
            raise _not_kept(response_id, "response_id", service.responses.gone.why(who.tenant, response_id))
        try:
            return input_items_page(kept.inputs, after, before, limit, order)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, who: Principal = Depends(principal)):
        run = service.responses.running(who.tenant, response_id)
        if run is not None:  # (cancelled first: nothing runs on for a response no one can fetch)
            await settled(run, service.cancel)
        if not service.responses.delete(who.tenant, response_id):
            raise _not_kept(response_id, "response_id", service.responses.gone.why(who.tenant, response_id))
        return {"id": response_id, "object": "response", "deleted": True}

    return router
