"""The router's followers: for each replica, one task that keeps its `ReplicaView` current from
its event feed (a snapshot, then long-polled pages of events, every tier) and one that polls its load
(`/admin/route-facts` with no prompt) every `load_interval` seconds. A replica whose tokenizer the
router has not seen is asked for it once (`GET /admin/tokenizer`), and the digest checked against
the namespace its cache keys are made under; so is a chat template (the snapshot names its digest).

A broken feed (the replica gone, an answer that makes no sense) clears the view's keys and the
task starts over from a snapshot after a pause that doubles up to `RETRY_MAX_S`, or as soon as the
load poll, having failed, is answered again (the replica is back: a restart costs no pause);
meanwhile the router asks that replica per request, as `--view ask` does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from kvctl.daemon.model.chat_template import ChatTemplate, special_tokens_of
from kvctl.daemon.model.config import ModelError
from kvctl.daemon.model.tokenizer import Tokenizer

from .replica_errors import described
from .replica_view import ReplicaView

log = logging.getLogger("kvd.router")

EVENT_WAIT_S = 20.0  # how long one read of the feed is held open by the replica
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
PAGE_LIMIT = 10_000


class FeedError(Exception):
    """A replica's answer the view cannot use."""


@dataclass
class Tokenizers:
    """Tokenizers and chat templates by digest, each fetched once from a replica that uses it."""

    by_digest: dict[str, Tokenizer] = field(default_factory=dict)
    templates: dict[str, ChatTemplate] = field(default_factory=dict)  # chat templates by their digest
    _fetching: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def ensure(self, client: httpx.AsyncClient, digest: str, template: str | None = None) -> Tokenizer:
        """The tokenizer of `digest` and, when `template` names one, the chat template of that
        digest, from this replica (checked against both digests) unless already here."""
        def missing() -> bool:
            return digest not in self.by_digest or (template is not None and template not in self.templates)

        if not missing():
            return self.by_digest[digest]
        async with self._fetching.setdefault(digest, asyncio.Lock()):
            if missing():
                answer = await client.get("/admin/tokenizer", timeout=30.0)
                answer.raise_for_status()
                body = answer.json()
                tokenizer = self.by_digest.get(digest) or await asyncio.to_thread(
                    Tokenizer.from_texts, body["tokenizer_json"], body["tokenizer_config_json"])
                if tokenizer.digest != digest:
                    raise FeedError(f"tokenizer: the files served have digest {tokenizer.digest[:12]}, "
                                    f"its cache keys are made under {digest[:12]}")
                if template is not None and template not in self.templates:
                    self.templates[template] = served_template(body, template, tokenizer)
                self.by_digest[digest] = tokenizer
        return self.by_digest[digest]


def served_template(body: dict, digest: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template of a `GET /admin/tokenizer` answer, compiled in the sandbox, checked to be
    the one of `digest` the replica's snapshot named."""
    text = body.get("chat_template")
    if not isinstance(text, str):
        raise FeedError(f"chat_template: the replica names template {digest[:12]} but serves none")
    defaults = body.get("chat_template_kwargs") or {}  # the replica's own setting (an older kvd has none)
    try:
        template = ChatTemplate.compile(text, "the replica's chat template", special_tokens_of(tokenizer.config))
        template = template.with_defaults(defaults)
    except ModelError as exc:
        raise FeedError(str(exc)) from None
    if template.digest != digest:
        raise FeedError(f"chat_template: the template served has digest {template.digest[:12]}, "
                        f"the replica named {digest[:12]}")
    return template


async def follow_events(client: httpx.AsyncClient, view: ReplicaView, tokenizers: Tokenizers,
                        on_error: Callable[[str | None], None], back: asyncio.Event | None = None) -> None:
    """Keep `view` current from the replica's event feed until cancelled. `back`: set by the load
    poll when the replica answers again after failing; it ends a pause early."""
    pause = RETRY_MIN_S
    while True:
        try:
            answer = await client.get("/admin/events/snapshot", timeout=30.0)
            answer.raise_for_status()
            snapshot = answer.json()
            await tokenizers.ensure(client, snapshot["namespace"]["tokenizer_digest"], snapshot.get("chat_template"))
            view.reset(snapshot)
            on_error(None)
            pause = RETRY_MIN_S
            while True:
                answer = await client.get("/admin/events", params={
                    "since": view.seq, "wait": EVENT_WAIT_S, "limit": PAGE_LIMIT},
                    timeout=EVENT_WAIT_S + 10.0)
                answer.raise_for_status()
                if not view.apply(answer.json()):
                    log.info("replica's feed restarted or fell behind: taking a new snapshot")
                    break
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, FeedError, KeyError, TypeError, ValueError) as exc:
            view.lose()
            on_error(f"feed: {described(exc)}")
            if back is None:
                await asyncio.sleep(pause)
            else:
                back.clear()
                try:
                    async with asyncio.timeout(pause):  # not wait_for: test_import_rules says why
                        await back.wait()
                except TimeoutError:
                    pass
            pause = min(pause * 2, RETRY_MAX_S)


async def poll_load(client: httpx.AsyncClient, view: ReplicaView, interval: float,
                    clock: Callable[[], float] = time.monotonic, back: asyncio.Event | None = None,
                    unanswered: Callable[[float, str], None] | None = None) -> None:
    """Ask the replica for its queue figures every `interval` seconds until cancelled; a failed
    ask leaves the last answer to age (the router stops trusting it, see `RouterService`); one that
    got no answer (timed out, no connection) is told to `unanswered(asked_at, why)`. The first
    answer after failures sets `back`."""
    failing = False
    while True:
        asked = clock()
        try:
            answer = await client.post("/admin/route-facts", json={"tokens": []}, timeout=2.0)
            answer.raise_for_status()
            view.note_load(answer.json(), asked)
            if failing and back is not None:
                back.set()
            failing = False
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, ValueError) as exc:
            failing = True
            if unanswered is not None and isinstance(exc, httpx.TransportError):  # (not an answer saying no)
                unanswered(asked, described(exc))
        await asyncio.sleep(interval)
