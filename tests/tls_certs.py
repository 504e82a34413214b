"""Certificates for the TLS tests, from trustme's throwaway CAs (nothing leaves the test's folder)."""

from __future__ import annotations

import datetime
import hashlib
import ssl


def write_pair(folder, ca, name: str = "server", **issue) -> tuple[str, str, str]:
    """A certificate for 127.0.0.1 and localhost from `ca` (a trustme.CA), CN `name`.kvd.test, in
    `folder`/`name`.pem and its key in `name`.key (mode 0600): (cert path, key path, its SHA-256)."""
    cert = ca.issue_cert("127.0.0.1", "localhost", common_name=f"{name}.kvd.test", **issue)
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_path.write_bytes(cert.private_key_pem.bytes())
    key_path.chmod(0o600)
    return str(cert_path), str(key_path), hashlib.sha256(ssl.PEM_cert_to_DER_cert(
        cert.cert_chain_pems[0].bytes().decode())).hexdigest()


def serving_tls(folder, days: float = 90.0):
    """A ServingTls whose certificate expires `days` from now (valid since an hour ago)."""
    import trustme

    from kvctl.daemon.server.tls import ServingTls

    now = datetime.datetime.now(datetime.timezone.utc)
    cert, key, _ = write_pair(folder, trustme.CA(), "tls", not_before=now - datetime.timedelta(hours=1),
                              not_after=now + datetime.timedelta(days=days))
    return ServingTls(cert, key)
