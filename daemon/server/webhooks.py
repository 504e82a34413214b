"""OpenAI's webhooks, sent by kvd: when a batch (/v1/batches) or a background response ends, the
tenant's endpoint is told, so its caller need not poll.

Each event is OpenAI's (`{"id": "evt_...", "object": "event", "type": "batch.completed",
"created_at": ..., "data": {"id": "batch_..."}}`; types batch.completed, batch.failed,
batch.expired, batch.cancelled, response.completed, response.failed, response.cancelled,
response.incomplete), POSTed with the Standard Webhooks headers OpenAI sends (`webhook-id`,
`webhook-timestamp`, `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`), so
OpenAI's own client verifies it (`client.webhooks.unwrap(body, headers, secret=...)`).

Endpoints are the operator's (`webhooks_file`: `TENANT URL SECRET` lines, `*` for every tenant
not named; a file only its owner and group may read, re-read on reload), never a caller's, so no
caller can make kvd reach an address of its choosing. An event waiting to be delivered is a file
in `state_dir/webhooks`, written whole before it is first sent: it outlives a restart. A delivery
answered other than 2xx, or not at all, is tried again with backoff (5 s doubling to 10 min) for
up to 3 days, as OpenAI retries for 72 h; then it is dropped, said in kvd's log.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx

from kvctl.daemon.whole_file import write_json_whole

from .auth import TENANT_PATTERN, read_private_file
from .replica_errors import described

log = logging.getLogger("kvd")

EVENT_TYPES = tuple(f"{kind}.{end}" for kind, ends in (
    ("batch", ("completed", "failed", "expired", "cancelled")),
    ("response", ("completed", "failed", "cancelled", "incomplete"))) for end in ends)
FIRST_RETRY_S = 5.0
MOST_RETRY_S = 600.0
KEEP_TRYING_S = 3 * 86_400.0  # OpenAI retries for 72 h
SEND_TIMEOUT_S = 10.0
SECRET_PREFIX = "whsec_"


class WebhooksFileError(ValueError):
    """webhooks_file cannot be read or has a faulty line (its number named; never its secret)."""


@dataclass(frozen=True)
class Endpoint:
    tenant: str  # or "*": every tenant the file does not name
    url: str
    key: bytes = b""  # the secret's bytes (what follows whsec_, base64-decoded)
    line: int = 0


def read_endpoints(path: str | Path) -> dict[str, Endpoint]:
    """The endpoints of a webhooks file, by tenant: `TENANT URL SECRET` a line (`#` comments and
    blank lines skipped). WebhooksFileError names the file, the line and what is wrong."""
    try:
        text = read_private_file(path, "webhooks_file", WebhooksFileError).decode("utf-8")
    except UnicodeDecodeError:
        raise WebhooksFileError(f"webhooks_file: {str(path)!r} is not UTF-8 text") from None
    endpoints: dict[str, Endpoint] = {}
    for number, row in enumerate(text.splitlines(), start=1):
        words = row.split("#", 1)[0].split()
        if not words:
            continue
        where = f"webhooks_file: line {number} of {str(path)!r}"
        if len(words) != 3:
            raise WebhooksFileError(f"{where}: expected TENANT URL SECRET, got {len(words)} fields")
        tenant, url, secret = words
        if tenant != "*" and not TENANT_PATTERN.match(tenant):
            raise WebhooksFileError(f"{where}: {tenant!r} is not a tenant name (letters, digits, . _ -; or *)")
        if tenant in endpoints:
            raise WebhooksFileError(f"{where}: tenant {tenant!r} has an endpoint on line {endpoints[tenant].line} too")
        if not url.startswith(("https://", "http://")):
            raise WebhooksFileError(f"{where}: the URL must be http:// or https://, got {url!r}")
        try:
            key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except (binascii.Error, ValueError):
            key = b""
        if not secret.startswith(SECRET_PREFIX) or len(key) < 24:
            raise WebhooksFileError(f"{where}: the secret must be whsec_ and 24 or more bytes in base64 (as "
                                    "`kvd webhook-secret` makes one)")
        endpoints[tenant] = Endpoint(tenant, url, key, number)
    return endpoints


def shown_url(url: str) -> str:
    """An endpoint's address as kvd's log and an operator's view show it: scheme, host, port and
    path, without the user and password or the query a URL may carry."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


def new_secret() -> str:
    """A signing secret in the form OpenAI's dashboard gives: whsec_ and 32 random bytes in base64."""
    import secrets

    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def signature(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The Standard Webhooks signature of `body` as sent at `timestamp`: v1,<base64 HMAC-SHA256>."""
    signed = f"{event_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


@dataclass
class Pending:
    """An event not yet delivered: kept as `state_dir/webhooks/<id>.json`."""

    id: str
    tenant: str
    type: str
    body: str
    created_at: float
    attempts: int = 0
    next_at: float = 0.0
    last_error: str | None = None


class Webhooks:
    """The events waiting to be delivered, and the task that delivers them (on kvd's event loop,
    started by `start`; `send` may be called from any thread)."""

    def __init__(self, folder: str | Path, endpoints: Callable[[], dict[str, Endpoint]],
                 clock: Callable[[], float] = time.time, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.folder = Path(folder)
        self.endpoints = endpoints
        self.clock = clock
        self.transport = transport
        self.pending: dict[str, Pending] = {}
        self.outcomes: Counter[str] = Counter()  # delivered, retried (an attempt that failed), dropped
        self.lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._load()

    def _load(self) -> None:
        for path in sorted(self.folder.glob("evt_*.json")) if self.folder.is_dir() else ():
            try:
                self.pending[path.stem] = Pending(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                log.error("webhook event %s cannot be read; left as it is", path)

    def endpoint_for(self, tenant: str) -> Endpoint | None:
        known = self.endpoints()
        return known.get(tenant) or known.get("*")

    def send(self, tenant: str, event_type: str, object_id: str) -> Pending | None:
        """Tell `tenant`'s endpoint that `object_id` ended (`event_type`, one of EVENT_TYPES); None
        where it has none, or where it cannot be written down. Written whole before it is first sent.
        Its id is the same each time the same end is told (`event_id`): a receiver dedupes on it."""
        if event_type not in EVENT_TYPES:
            raise ValueError(f"event type: one of {', '.join(EVENT_TYPES)}, got {event_type!r}")
        if self.endpoint_for(tenant) is None:
            return None
        now = self.clock()
        event_id = self.event_id(tenant, event_type, object_id)
        body = json.dumps({"id": event_id, "object": "event", "type": event_type, "created_at": int(now),
                           "data": {"id": object_id}})
        pending = Pending(event_id, tenant, event_type, body, now, next_at=now)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_json_whole(self.folder / f"{event_id}.json", asdict(pending))
        except OSError as exc:  # (a full disk): it ends all the same (a batch's end is told again at the next start)
            self.outcomes["dropped"] += 1
            log.error("webhook %s (%s of tenant %s) dropped: it could not be written down (%s)", event_id,
                      event_type, tenant, exc)
            return None
        with self.lock:
            self.pending[event_id] = pending
        self._kick_from_any_thread()
        return pending

    @staticmethod
    def event_id(tenant: str, event_type: str, object_id: str) -> str:
        """The id of the event telling this end: an object ends once, so told again (kvd stopped before
        it could note it had been told) it keeps its id."""
        return "evt_" + hashlib.blake2b(f"{tenant}\n{event_type}\n{object_id}".encode(), digest_size=16).hexdigest()

    def told(self, tenant: str, event_type: str, object_id: str) -> bool:
        """`send`, and whether the end is told: True where the event is written down or the tenant has
        no endpoint; False where it could not be written down (BatchRunner tells it again at a start)."""
        return self.send(tenant, event_type, object_id) is not None or self.endpoint_for(tenant) is None

    def retry_now(self) -> int:
        """Every event waiting is tried at once (an endpoint mended); how many."""
        with self.lock:
            waiting = list(self.pending.values())
            for pending in waiting:
                pending.next_at = self.clock()
        self._kick_from_any_thread()
        return len(waiting)

    def _kick_from_any_thread(self) -> None:
        """Wake the delivering task on kvd's loop (none yet before `start`: it delivers what waits then)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._kick)

    def figures(self) -> dict:
        return {"pending": len(self.pending), **{k: self.outcomes[k] for k in ("delivered", "retried", "dropped")}}

    # ---- delivering ---------------------------------------------------------------------------
    def start(self) -> None:
        """Deliver on the running loop: what waits from before a restart, and each event sent."""
        self._loop = asyncio.get_running_loop()
        self._kick()

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._deliver_all())
        self._wake.set()

    async def _deliver_all(self) -> None:
        async with httpx.AsyncClient(transport=self.transport, timeout=SEND_TIMEOUT_S,
                                     headers={"User-Agent": "kvd-webhooks"}) as client:
            while self.pending:
                now = self.clock()
                due = [p for p in list(self.pending.values()) if p.next_at <= now]
                await asyncio.gather(*(self._deliver(client, p) for p in due))
                self._wake.clear()  # (before reading what waits: an event sent from now on wakes it)
                waits = [p.next_at for p in list(self.pending.values())]
                if not waits:
                    return
                try:
                    async with asyncio.timeout(max(0.0, min(waits) - self.clock())):
                        await self._wake.wait()
                except TimeoutError:
                    pass

    async def _deliver(self, client: httpx.AsyncClient, pending: Pending) -> None:
        endpoint = self.endpoint_for(pending.tenant)
        if endpoint is None:
            self._drop(pending, "webhooks_file names no endpoint for its tenant now")
            return
        timestamp = int(self.clock())
        body = pending.body.encode()
        headers = {"Content-Type": "application/json", "webhook-id": pending.id,
                   "webhook-timestamp": str(timestamp),
                   "webhook-signature": signature(endpoint.key, pending.id, timestamp, body)}
        try:
            answer = await client.post(endpoint.url, content=body, headers=headers)
            error = None if 200 <= answer.status_code < 300 else f"answered {answer.status_code}"
        except httpx.HTTPError as exc:
            error = described(exc)
        if error is None:
            self._done(pending)
            self.outcomes["delivered"] += 1
            return
        pending.attempts += 1
        pending.last_error = error
        self.outcomes["retried"] += 1
        if self.clock() - pending.created_at >= KEEP_TRYING_S:
            self._drop(pending, f"not delivered in {KEEP_TRYING_S / 3600:.0f} h ({pending.attempts} tries; {error})")
            return
        pending.next_at = self.clock() + min(FIRST_RETRY_S * 2 ** (pending.attempts - 1), MOST_RETRY_S)
        log.warning("webhook %s (%s of tenant %s) to %s: %s; tried again in %.0f s", pending.id, pending.type,
                    pending.tenant, shown_url(endpoint.url), error, pending.next_at - self.clock())

    def _drop(self, pending: Pending, why: str) -> None:
        self._done(pending)
        self.outcomes["dropped"] += 1
        log.error("webhook %s (%s of tenant %s) dropped: %s", pending.id, pending.type, pending.tenant, why)

    def _done(self, pending: Pending) -> None:
        with self.lock:
            self.pending.pop(pending.id, None)
        (self.folder / f"{pending.id}.json").unlink(missing_ok=True)
