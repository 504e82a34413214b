"""TLS for the TCP fronts of kvd and kvd router (`ssl_certfile`, `ssl_keyfile`, `ssl_ca_certs`,
as vLLM and uvicorn name them).

Without TLS, every bearer token and prompt crosses the network in clear text. With it:

- `ssl_certfile` is the server's certificate chain (PEM, leaf first), `ssl_keyfile` its private
  key (PEM; absent: the key is in the certificate file). The file holding the key must not be
  open to every user on the machine, as the token file must not be.
- `ssl_ca_certs` (optional) asks each client for a certificate signed by one of these CAs
  (mutual TLS); bearer tokens are still checked on top of it.
- A reload (SIGHUP, `kvctl config reload`) reads the certificate, its key and the CA file again,
  so a rotated certificate (cert-manager, ACME) or a new CA bundle (a CA rotation: the new CA
  beside the old, later the old one gone) serves from the next connection on, without a restart;
  connections already open keep theirs. A pair that does not load, a key that does not match its
  certificate, or a CA file that does not load changes nothing and is refused by name. Whether
  clients are asked for a certificate at all (`ssl_ca_certs` set or not) is fixed at start.
- The certificate's subject, names and expiry show in `kvctl status`; kvd warns in its log
  when fewer than EXPIRY_WARN_DAYS remain, and `kvd_tls_certificate_expiry_timestamp_seconds`
  gives the time to alert on.

The front's `ssl.SSLContext` is the one it started with for its whole life (asyncio's server
holds it); each handshake switches to the context made from the files as last read (Python's
`sni_callback`, called for every ClientHello, with or without a server name), which serves that
certificate and checks clients against those CAs. A reload builds a whole new context from one
private copy of the files' bytes before anything changes, so a file replaced meanwhile cannot leave
a certificate beside a key that is not its own, and a CA file that is half written is refused.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .auth import read_private_file

log = logging.getLogger("kvd")
EXPIRY_WARN_DAYS = 14  # a certificate with fewer days left is warned of at start, on a reload and daily
PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


class TlsFileError(ValueError):
    """A TLS file that cannot serve, naming the setting, the file and why."""


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class Certificate:
    """What an operator needs of the served certificate: never its key."""
    subject: str  # the leaf's subject, RFC 4514 (CN=kvd.example.com)
    names: tuple[str, ...]  # its subject alternative names (DNS, then IP)
    not_before: float  # epoch seconds
    not_after: float
    fingerprint: str  # SHA-256 of the leaf's DER, hex

    @classmethod
    def of_pem(cls, pem: bytes, where: str) -> "Certificate":
        """The first certificate of `pem` (a chain's leaf)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes

        try:
            cert = x509.load_pem_x509_certificate(pem[pem.index(PEM_CERTIFICATE):])
        except ValueError:
            raise TlsFileError(f"ssl_certfile: {where!r} holds no PEM certificate") from None
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names = tuple(str(n) for n in sans.get_values_for_type(x509.DNSName)) + \
                tuple(str(n) for n in sans.get_values_for_type(x509.IPAddress))
        except x509.ExtensionNotFound:
            names = ()
        return cls(subject=cert.subject.rfc4514_string() or "(no subject)", names=names,
                   not_before=cert.not_valid_before_utc.timestamp(), not_after=cert.not_valid_after_utc.timestamp(),
                   fingerprint=cert.fingerprint(hashes.SHA256()).hex())

    def days_left(self, now: float) -> float:
        return (self.not_after - now) / 86_400

    def describe(self, now: float) -> dict:
        return {"subject": self.subject, "names": list(self.names), "not_before": self.not_before,
                "not_after": self.not_after, "days_left": round(self.days_left(now), 1),
                "fingerprint_sha256": self.fingerprint}

    def warning(self, now: float) -> str | None:
        """A line for the log when the certificate has expired, is not valid yet, or expires soon."""
        days = self.days_left(now)
        if days < 0:
            return (f"ssl_certfile: the certificate ({self.subject}) expired {_utc(self.not_after)}: clients refuse "
                    "it; rotate it and run `kvctl config reload`")
        if now < self.not_before:
            return (f"ssl_certfile: the certificate ({self.subject}) is not valid before {_utc(self.not_before)}: "
                    "clients refuse it until then")
        if days < EXPIRY_WARN_DAYS:
            return (f"ssl_certfile: the certificate ({self.subject}) expires {_utc(self.not_after)}, in {days:.1f} "
                    "days; rotate it and run `kvctl config reload`")
        return None


@dataclass(frozen=True)
class ServerPair:
    """A certificate chain and its key, read once: bytes, and the leaf they describe."""
    chain: bytes
    key: bytes
    certificate: Certificate
    certfile: str
    keyfile: str | None

    @classmethod
    def read(cls, certfile: str, keyfile: str | None) -> "ServerPair":
        """Read the pair (TlsFileError naming the setting otherwise); TlsFiles.read loads it into
        the context it serves from, which checks that the key is the certificate's."""
        chain = read_pem(certfile, "ssl_certfile")
        if keyfile is None:
            if b"PRIVATE KEY-----" not in chain:
                raise TlsFileError(f"ssl_keyfile: not set, and ssl_certfile {certfile!r} holds no private key; "
                                   "set ssl_keyfile to the key's file")
            key = read_private_file(certfile, "ssl_certfile (it holds the key)", TlsFileError)
        else:
            key = read_private_file(keyfile, "ssl_keyfile", TlsFileError)
        return cls(chain, key, Certificate.of_pem(chain, certfile), certfile, keyfile)

    def load_into(self, context: ssl.SSLContext) -> None:
        """Load this pair into `context`, from a private temporary copy (`load_cert_chain` takes paths)."""
        with tempfile.TemporaryDirectory(prefix="kvd-tls-") as folder:
            chain_path, key_path = os.path.join(folder, "chain.pem"), os.path.join(folder, "key.pem")
            for path, data in ((chain_path, self.chain), (key_path, self.key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                    out.write(data)
            try:
                context.load_cert_chain(chain_path, key_path)
            except ssl.SSLError as exc:
                key_from = self.keyfile or self.certfile
                if "mismatch" in str(exc.reason or exc).lower():
                    raise TlsFileError(f"ssl_keyfile: the key in {key_from!r} does not match the certificate in "
                                       f"{self.certfile!r}") from None
                raise TlsFileError(f"ssl_keyfile: {key_from!r} and {self.certfile!r} do not load as a certificate "
                                   f"and its key ({exc.reason or exc})") from None


@dataclass(frozen=True)
class TlsFiles:
    """What a TCP front serves with, read once: the certificate and its key, and the CAs that sign
    its clients' certificates (None where clients are not asked for one)."""
    pair: ServerPair
    client_cas: bytes | None
    ca_certs: str | None
    context: ssl.SSLContext  # a server context loaded with them: what a front serves once they are adopted

    @classmethod
    def read(cls, certfile: str, keyfile: str | None, ca_certs: str | None) -> "TlsFiles":
        """Read the files and load them into a server context (TlsFileError naming the setting
        when they do not load): files that read serve."""
        pair = ServerPair.read(certfile, keyfile)
        client_cas = read_pem(ca_certs, "ssl_ca_certs") if ca_certs else None
        return cls(pair, client_cas, ca_certs, serving_context(pair, client_cas, ca_certs))

    @property
    def ca_digest(self) -> str | None:
        return hashlib.sha256(self.client_cas).hexdigest() if self.client_cas is not None else None

    @property
    def ca_count(self) -> int:
        return self.client_cas.count(PEM_CERTIFICATE) if self.client_cas is not None else 0



def serving_context(pair: ServerPair, client_cas: bytes | None, ca_certs: str | None) -> ssl.SSLContext:
    """A server context that serves `pair` and, with `client_cas` (read from `ca_certs`), requires
    a client certificate they signed; TlsFileError naming the setting when they do not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    pair.load_into(context)
    if client_cas is not None:
        try:
            context.load_verify_locations(cadata=client_cas.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise TlsFileError(f"ssl_ca_certs: {ca_certs!r} does not load as CA certificates ({exc})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file that holds a certificate (`ssl_certfile`, `ssl_ca_certs`): TlsFileError
    naming `setting` and the file when it cannot be read or holds none."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsFileError(f"{setting}: cannot read {path!r} ({exc.strerror})") from None
    if PEM_CERTIFICATE not in data:
        raise TlsFileError(f"{setting}: {path!r} holds no PEM certificate")
    return data


class ServingTls:
    """The TLS of one TCP front: the context it serves with, and the certificate and CAs in it now."""

    def __init__(self, certfile: str, keyfile: str | None = None, ca_certs: str | None = None) -> None:
        self.certfile, self.keyfile, self.ca_certs = certfile, keyfile, ca_certs
        files = TlsFiles.read(certfile, keyfile, ca_certs)
        self.context = files.context  # the front's, for its whole life: each handshake moves to `_serving`
        self.context.sni_callback = self._switch
        self._serving = self.context
        self.certificate = files.pair.certificate
        self.ca_digest, self.ca_count = files.ca_digest, files.ca_count
        self.rotations = 0
        self.ca_reloads = 0

    def _switch(self, ssl_object, server_name, context) -> None:
        """Each ClientHello: the handshake goes on under the context of the files as last read."""
        if context is not self._serving:
            ssl_object.context = self._serving

    @classmethod
    def from_settings(cls, settings) -> "ServingTls | None":
        """The front's TLS from a kvd or kvd router config (None when ssl_certfile is unset)."""
        if not settings.ssl_certfile:
            return None
        return cls(settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs)

    def read_again(self) -> TlsFiles:
        """The certificate, its key and the CAs as their files hold them now (a reload reads them
        before it changes anything): TlsFileError, naming the setting, when they do not load."""
        return TlsFiles.read(self.certfile, self.keyfile, self.ca_certs)

    def adopt(self, files: TlsFiles) -> dict:
        """Serve `files` from the next connection on, where they differ from those served (those
        open keep theirs). Says what changed: `rotated` (the certificate: fingerprints, subject,
        expiry), `client_cas` (the CA file: digests and how many CAs). The log says both, and warns
        of the certificate now served if it is near its end."""
        said: dict = {}
        certificate = files.pair.certificate
        if certificate.fingerprint != self.certificate.fingerprint or files.ca_digest != self.ca_digest:
            self._serving = files.context
        if certificate.fingerprint != self.certificate.fingerprint:
            said["rotated"] = {"from": self.certificate.fingerprint[:16], "to": certificate.fingerprint[:16],
                               "subject": certificate.subject, "not_after": certificate.not_after}
            self.certificate = certificate
            self.rotations += 1
            log.info("TLS certificate rotated: %s, sha256 %s..., expires %s", certificate.subject,
                     said["rotated"]["to"], _utc(certificate.not_after))
        if files.ca_digest != self.ca_digest:
            said["client_cas"] = {"from": self.ca_digest[:16], "to": files.ca_digest[:16], "cas": files.ca_count}
            self.ca_digest, self.ca_count = files.ca_digest, files.ca_count
            self.ca_reloads += 1
            log.info("TLS client CAs reloaded from %s: %d CA%s, sha256 %s...; new connections are checked "
                     "against them", self.ca_certs, files.ca_count, "" if files.ca_count == 1 else "s",
                     said["client_cas"]["to"])
        self.warn()
        return said

    def warn(self, log: logging.Logger = log, now: float | None = None) -> str | None:
        """Log the certificate's warning (expired, not valid yet, or near its end), if any."""
        warning = self.certificate.warning(time.time() if now is None else now)
        if warning:
            log.warning("%s", warning)
        return warning

    def describe(self, now: float) -> dict:
        return {**self.certificate.describe(now), "client_certificates": self.ca_certs is not None,
                "client_cas": self.ca_count, "rotations": self.rotations, "ca_reloads": self.ca_reloads,
                "warning": self.certificate.warning(now)}


def clear_text_warning(listen: str | None, tls: "ServingTls | None") -> str | None:
    """A warning for a TCP front that other hosts reach without TLS (None on loopback, with TLS, or
    without a TCP front): its bearer tokens and prompts cross the network as they are."""
    if listen is None or tls is not None:
        return None
    host = listen.rpartition(":")[0].strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    return (f"listen: {listen} serves TCP without TLS: bearer tokens and prompts cross the network in clear text; "
            "set ssl_certfile (or keep a TLS proxy in front of it on this host)")


def client_context(ca_file: str | None = None, client_cert: str | None = None, client_key: str | None = None,
                   names: tuple[str, str] = ("ca_file", "client_cert")) -> ssl.SSLContext | bool:
    """What an https client (kvctl, kvd router to its replicas) verifies with: the system's CAs,
    or `ca_file`'s; with `client_cert` (and its key, in `client_key` or the same file) for mutual
    TLS. True (httpx's default verification) when neither is given. `names`: the settings named
    in a TlsFileError."""
    if ca_file is None and client_cert is None:
        return True
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFileError(f"{names[0]}: {ca_file!r} does not load as CA certificates "
                           f"({getattr(exc, 'strerror', None) or exc})") from None
    if client_cert is not None:
        try:
            context.load_cert_chain(client_cert, client_key)
        except (OSError, ssl.SSLError) as exc:
            raise TlsFileError(f"{names[1]}: {client_cert!r} does not load as a certificate and its key "
                               f"({getattr(exc, 'strerror', None) or getattr(exc, 'reason', None) or exc})") from None
    return context
