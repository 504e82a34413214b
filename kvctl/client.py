"""The HTTP client kvctl uses to reach kvd: the Unix socket by default, or TCP with a token.

    --socket PATH  / KVD_SOCKET      (default: the daemon's default socket; where no kvd is there,
                                      the one socket kvd's systemd units keep in /run/kvd*, if one)
    --url URL      / KVD_URL         (TCP; needs --token-file / KVD_TOKEN_FILE)
    --ca-file PEM  / KVD_CA_FILE     (https: the CAs kvd's certificate is checked against; default the system's)
    --client-cert PEM / KVD_CLIENT_CERT  (https: kvctl's certificate and key, where kvd asks for one)
"""

from __future__ import annotations

import os
import socket
import ssl
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Callable

import httpx

from .errors import KvdUnavailable, UserError

REFUSAL_PROBE_S = 2.0  # how long a probe after a closed https connection waits to learn why (_tls_refusal)
HEALTH_PROBE_S = 2.0  # after a call that timed out: how long kvd's /healthz may take to say why
STORE_WAIT_NOTE_AFTER_S = 2.0  # an admin call that changes something and has not answered by then: ask kvd why
STORE_WRITE_WAIT_S = 30  # how long a write to kvd's store waits for another process's lock (daemon/store.py)
# who holds a store's write lock, most likely, when a write waits for it: every kvctl message about such a wait says
LOCK_HOLDERS = "a sqlite3 shell left in a transaction, a long kvctl db command"


SYSTEMD_RUN = Path("/run")  # kvd.service's /run/kvd, kvd@N's /run/kvd-N, kvd router's /run/kvd-router


def systemd_sockets() -> tuple[list[str], list[str]]:
    """The sockets in systemd's runtime folders for kvd and kvd router (RuntimeDirectory=kvd,
    kvd-N, kvd-router), and the folders this user may not look into (0750: the kvd group's)."""
    found, closed = [], []
    try:
        folders = sorted(path for path in SYSTEMD_RUN.glob("kvd*") if path.is_dir())
    except OSError:
        return [], []
    for folder in folders:
        try:
            found += sorted(str(path) for path in folder.iterdir() if path.suffix == ".sock" and path.is_socket())
        except PermissionError:
            closed.append(str(folder))
        except OSError:
            continue
    return found, closed


def waiting_writes_note(status: dict) -> str | None:
    """What an operator waiting on kvd should know when its store's writes wait for another
    process's write lock (an /admin/status answer, kvd's or kvd router's); None when none wait."""
    rows = status.get("replica_status")
    stores = [(row.get("replica"), row.get("store") or {}) for row in rows] if rows else [(None, status.get("store") or {})]
    waiting = [(name, store["waiting_writes"], store.get("longest_write_wait_seconds") or 0.0)
               for name, store in stores if store.get("waiting_writes")]
    if not waiting:
        return None
    parts = [(f"{name}: " if name else "") + f"{count} write{'s' if count != 1 else ''} waiting {longest:.0f} s"
             for name, count, longest in waiting]
    return (f"note: kvd is waiting for its store's write lock ({'; '.join(parts)}): another process holds it "
            f"({LOCK_HOLDERS}?); this call fails after {STORE_WRITE_WAIT_S} s if it goes on")


def tls_problem(where: str, exc: Exception) -> str | None:
    """What an operator should do about a connection to `where` that TLS broke, or None when
    `exc` is not about TLS (from OpenSSL's reason, which httpx passes on in its message)."""
    said = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in said:
        reason = said.split("certificate verify failed:", 1)[-1].split("(_ssl")[0].strip(" )") or "not trusted"
        return (f"kvd at {where}: its TLS certificate is not trusted ({reason}); pass --ca-file (KVD_CA_FILE) "
                "with the CA that signed it")
    if "WRONG_VERSION_NUMBER" in said or "record layer failure" in said or "packet length too long" in said:
        return f"kvd at {where} does not speak TLS there: use an http:// URL, or set ssl_certfile on that kvd"
    if "CERTIFICATE_REQUIRED" in said or "certificate required" in said:
        return (f"kvd at {where} asks for a client certificate (ssl_ca_certs): pass --client-cert "
                "(KVD_CLIENT_CERT) with one its CAs signed")
    if "SSL" in said or "TLS" in said:
        return f"kvd at {where}: the TLS handshake failed ({said})"
    return None


class Client:
    def __init__(self, socket: str | None = None, url: str | None = None, token_file: str | None = None,
                 tenant: str | None = None, timeout: float = 120.0, ca_file: str | None = None,
                 client_cert: str | None = None) -> None:
        from kvctl.daemon.default_paths import default_socket

        url = url or os.environ.get("KVD_URL")
        token_file = token_file or os.environ.get("KVD_TOKEN_FILE")
        self.verify: Any = True  # an https URL's check (tls.client_context); True: the system's CAs
        self.client_cert = client_cert or os.environ.get("KVD_CLIENT_CERT")
        headers, self.named = {}, None  # named: the socket kvctl was told (--socket, KVD_SOCKET)
        if tenant:
            headers["X-KVD-Tenant"] = tenant
        if url:
            if not token_file:
                raise UserError("url: TCP needs a bearer token; pass --token-file or set KVD_TOKEN_FILE")
            try:
                token = Path(token_file).read_text().split()[0]
            except (OSError, IndexError):
                raise UserError(f"token_file: cannot read a token from {token_file!r}") from None
            headers["Authorization"] = f"Bearer {token}"
            self.where, self.socket = url, None
            if url.startswith("https://"):
                from kvctl.daemon.server.tls import TlsFileError, client_context
                try:
                    self.verify = client_context(ca_file or os.environ.get("KVD_CA_FILE"), self.client_cert)
                except TlsFileError as exc:
                    raise UserError(str(exc)) from None
            verify = self.verify
            self._connect: Callable[[float], httpx.Client] = \
                lambda seconds: httpx.Client(base_url=url, headers=headers, timeout=seconds, verify=verify)
        else:
            self.named = socket or os.environ.get("KVD_SOCKET")
            path = self.named or default_socket()
            if not self.named and not os.path.exists(path):  # no kvd of this user's: the one systemd runs
                found, _ = systemd_sockets()
                path = found[0] if len(found) == 1 else path
            self.where, self.socket = path, path
            self._connect = lambda seconds: httpx.Client(base_url="http://kvd", headers=headers, timeout=seconds,
                                                         transport=httpx.HTTPTransport(uds=path))
        self.http = self._connect(timeout)
        self.say: Callable[[str], object] = lambda line: print(line, file=sys.stderr, flush=True)

    def async_session(self, timeout: float = 600.0):
        """An aiohttp session to the same place with the same headers, for load generation:
        its C HTTP parser spends a quarter of httpx's CPU per streamed token, CPU that a bench
        on a small machine would otherwise take from the daemon it measures."""
        import aiohttp

        connector = aiohttp.UnixConnector(path=self.socket) if self.socket else \
            aiohttp.TCPConnector(limit=0, ssl=self.verify)
        base = str(self.http.base_url).rstrip("/") + "/"  # paths are joined to it: a proxy prefix stays
        return aiohttp.ClientSession(base_url=base, headers=dict(self.http.headers),
                                     connector=connector, timeout=aiohttp.ClientTimeout(total=timeout))

    def request(self, method: str, path: str, **kwargs) -> Any:
        watch = None
        if method != "GET" and path.startswith("/admin/"):  # it may write kvd's store: say so if that waits
            watch = threading.Timer(STORE_WAIT_NOTE_AFTER_S, self._note_store_wait)
            watch.daemon = True
            watch.start()
        try:
            response = self.http.request(method, path, **kwargs)
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as exc:
            raise KvdUnavailable(tls_problem(self.where, exc) or f"kvd is not reachable at {self.where} (is it "
                                 "running? `kvd serve`)" + self._elsewhere()) from None
        except httpx.TimeoutException:
            raise KvdUnavailable(f"kvd at {self.where} did not answer in time" + self._health_says()) from None
        except httpx.TransportError as exc:  # it went away mid-answer (a restart), or refused kvctl's TLS
            raise KvdUnavailable(tls_problem(self.where, exc) or self._tls_refusal()
                                 or f"kvd at {self.where} broke off its answer "
                                 f"({type(exc).__name__})" + (" (if it serves TLS there, use an https:// URL)"
                                                              if self.where.startswith("http://") else "")) from None
        finally:
            if watch is not None:
                watch.cancel()
        return self.answered(response)

    def _health_says(self) -> str:
        """What kvd's /healthz says of it where it is not well (its engine stalled, holding the lock
        most calls wait for; its device lost): /healthz answers without that lock. "" otherwise."""
        try:
            answer = self.http.get("/healthz", timeout=HEALTH_PROBE_S)
            reason = answer.json().get("reason") if answer.status_code == 503 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return ""
        return f"; its /healthz says: {reason}" if isinstance(reason, str) else ""

    def _tls_refusal(self) -> str | None:
        """Why kvd at an https URL closed the connection, where its TLS refused kvctl: with TLS 1.3
        a server that wants a client certificate refuses it after kvctl's side of the handshake is
        done, and closes without a word, so the request sees only the close. A bare handshake here
        tells: kvd keeps a quiet connection open for 10 s, and closes at once one whose certificate
        it refused."""
        if not self.where.startswith("https://"):
            return None
        context = self.verify if isinstance(self.verify, ssl.SSLContext) else ssl.create_default_context()
        parts = urllib.parse.urlsplit(self.where)
        try:
            with socket.create_connection((parts.hostname, parts.port or 443), timeout=REFUSAL_PROBE_S) as raw, \
                    context.wrap_socket(raw, server_hostname=parts.hostname) as conn:
                closed = conn.recv(1) == b""
        except TimeoutError:
            return None  # it waits for a request: the handshake stood
        except (OSError, ValueError) as exc:
            return tls_problem(self.where, exc)
        if not closed:
            return None
        sent = "the client certificate kvctl sent" if self.client_cert else "kvctl's connection, which sent none"
        return (f"kvd at {self.where} asks for a client certificate (ssl_ca_certs) and refused {sent}: pass "
                "--client-cert (KVD_CLIENT_CERT) with one its CAs signed")

    def _elsewhere(self) -> str:
        """Where else kvd may answer, when kvctl was not told where (--socket, KVD_SOCKET): the
        sockets systemd's kvd units keep, and their folders this user cannot look into."""
        if self.socket is None or self.named:
            return ""
        found, closed = systemd_sockets()
        found = [path for path in found if path != self.socket]
        said = f"; kvd sockets on this host: {', '.join(found)} (--socket or KVD_SOCKET)" if found else ""
        if closed:
            said += (f"; {', '.join(closed)} may hold one, open to the kvd group only "
                     f"(join it, or run kvctl as its user)")
        return said

    def _note_store_wait(self) -> None:
        """Asked on a connection of its own while a call waits: kvd answers /admin/status at once
        while its writes wait for the store (they hold worker threads, not the event loop)."""
        try:
            with self._connect(5.0) as http:
                note = waiting_writes_note(http.get("/admin/status").json())
        except (httpx.HTTPError, ValueError, TypeError, AttributeError, KeyError):
            return  # only a note: the call itself says what went wrong, if anything
        if note:
            self.say(note)

    def answered(self, response: httpx.Response) -> Any:
        """The answer's JSON, or the error kvd (or kvd router) named: a 503 as KvdUnavailable. An
        answer not in kvd's shape (another server at that address) says so, not a JSON error."""
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                raise UserError(self._not_kvd(response)) from None
            error = KvdUnavailable if response.status_code == 503 else UserError
            raise error(f"kvd answered {response.status_code}: {message}")
        try:
            return response.json()
        except ValueError:
            raise UserError(self._not_kvd(response)) from None

    def _not_kvd(self, response: httpx.Response) -> str:
        from kvctl.daemon.server.replica_errors import content_kind, first_line

        kind, first = content_kind(response), first_line(response)[:80]
        return (f"{self.where} answered {response.request.method} {response.url.path} with {response.status_code} "
                f"({kind}{': ' + repr(first) if first else ''}), not kvd's JSON: is kvd (or kvd router) what "
                f"listens there? (--socket, --url)")

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict) -> Any:
        return self.request("POST", path, json=body)

    def delete(self, path: str, **params) -> Any:
        return self.request("DELETE", path, params={k: v for k, v in params.items() if v is not None})
