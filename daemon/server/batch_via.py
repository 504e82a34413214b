"""Where a batch's requests go when `batch_via` names a kvd router (batches.py serves them).

A Unix socket on this host: its callers are trusted, so the X-KVD-Tenant that names each line's
batch tenant passes on to the replica that serves it. An http(s) URL: the router's TCP front,
reached with the bearer token of `batch_via_token_file` (an admin token of the router's
clients_file), its certificate checked against `batch_via_ca_file` (default: the system's CAs),
presenting `batch_via_client_cert` to a router that asks for one. A TCP front serves a request
under its token's tenant unless the router runs with `--trusted-proxy`, so before lines go to a
URL kvd asks the router's `/router/status` whether it does (again every VIA_CHECK_S): one that
would serve them as the token's tenant gets none, each line waiting as for a router down, with a
WARNING that says why. A line served as another tenant would be counted, limited and cached as
that tenant's: its prompt in that tenant's blocks.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import httpx

from .auth import read_private_file
from .tls import TlsFileError, client_context

VIA_CHECK_S = 60.0  # how long a URL router's word that it serves lines as their tenant holds


class BatchViaError(ValueError):
    """A batch_via setting that cannot be used: names the setting (never the token)."""


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


@dataclass(frozen=True)
class ViaRouter:
    """A kvd router that a batch's lines are sent through, and what reaching it takes."""
    target: str  # its Unix socket's path, or its TCP front's URL
    token: str | None = None  # a URL's bearer token
    verify: ssl.SSLContext | bool = True  # an https URL's certificate check (tls.client_context)

    @property
    def over_tcp(self) -> bool:
        return is_url(self.target)

    def transport(self) -> httpx.AsyncBaseTransport:
        if self.over_tcp:
            return httpx.AsyncHTTPTransport(verify=self.verify)
        return httpx.AsyncHTTPTransport(uds=self.target)

    def client(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> httpx.AsyncClient:
        if self.over_tcp:
            return httpx.AsyncClient(transport=transport, base_url=self.target.rstrip("/"), timeout=timeout,
                                     headers={"Authorization": f"Bearer {self.token}"})
        return httpx.AsyncClient(transport=transport, base_url="http://kvd-batch", timeout=timeout)


def via_router(config) -> ViaRouter | None:
    """The router `config.batch_via` names, with its token read and its TLS loaded: BatchViaError
    where one cannot be (read at start and at each reload, so a rotated token is taken then)."""
    if config.batch_via is None:
        return None
    if not is_url(config.batch_via):
        return ViaRouter(config.batch_via)
    words = read_private_file(config.batch_via_token_file, "batch_via_token_file", BatchViaError).split()
    if not words:
        raise BatchViaError(f"batch_via_token_file: {config.batch_via_token_file!r} holds no token")
    try:
        verify = client_context(config.batch_via_ca_file, config.batch_via_client_cert,
                                names=("batch_via_ca_file", "batch_via_client_cert"))
    except TlsFileError as exc:
        raise BatchViaError(str(exc)) from None
    return ViaRouter(config.batch_via, words[0].decode("utf-8", "replace"), verify)


async def refusal(client: httpx.AsyncClient, target: str) -> str | None:
    """Why the router at URL `target` would not serve lines under their batch's tenant (None: it
    would), by its /router/status; httpx.HTTPError where it cannot be reached."""
    answer = await client.get("/router/status")
    if answer.status_code == 401:
        return f"kvd router at {target} does not take the token of batch_via_token_file (401)"
    if answer.status_code == 403:
        return (f"kvd router at {target} gives the token of batch_via_token_file no admin role (403): give it an "
                "admin token of the router's clients_file")
    try:
        trusted = answer.json().get("trusted_proxy") if answer.status_code == 200 else None
    except (ValueError, AttributeError):
        trusted = None
    if trusted is None:
        return f"{target} answered /router/status with {answer.status_code}, not as a kvd router"
    if trusted is not True:
        return (f"kvd router at {target} serves a TCP caller's request under its token's tenant, not the batch's: "
                "start it with --trusted-proxy (trusted_proxy: true)")
    return None
