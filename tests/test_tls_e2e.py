"""A real kvd serving its TCP front over TLS, driven with kvctl as an operator would: a private CA
passed with --ca-file, mutual TLS with --client-cert, the certificate in `kvctl status` and
/metrics, and a rotation by `kvctl config reload` that new connections see at once, while a
half-done one (a new certificate beside the old key) is refused with nothing changed."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import subprocess

import pytest

trustme = pytest.importorskip("trustme")
pytest.importorskip("torch")

from .kvd_process import BIN, running_kvd  # noqa: E402
from .tls_certs import write_pair  # noqa: E402

ADMIN_TOKEN = "ops-token-0123456789"


def served_digest(port: int, context: ssl.SSLContext) -> str:
    """The SHA-256 of the certificate a new connection to 127.0.0.1:`port` is served."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest()


def answers(port: int, context: ssl.SSLContext) -> bool:
    """Whether a new connection to 127.0.0.1:`port` with `context` gets an answer to /healthz (a
    client certificate refused fails the handshake, or, under TLS 1.3, the first read)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvd\r\nConnection: close\r\n\r\n")
                return tls.recv(64).startswith(b"HTTP/1.1 200")
    except (ssl.SSLError, ConnectionError):
        return False


def test_kvctl_over_tls_with_a_private_ca_client_certificates_and_a_rotation(tmp_path):
    ca, clients_ca = trustme.CA(), trustme.CA()
    cert, key, first = write_pair(tmp_path, ca)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    (tmp_path / "clients-ca.pem").write_bytes(clients_ca.cert_pem.bytes())
    mine = tmp_path / "kvctl.pem"
    clients_ca.issue_cert("ops@kvd.test").private_key_and_cert_chain_pem.write_to_path(str(mine))
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN_TOKEN} ops admin\n")
    tokens.chmod(0o600)
    (tmp_path / "token").write_text(ADMIN_TOKEN + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def kvctl(*args: str, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        return subprocess.run([str(BIN / "kvctl"), *args],
                              env={**base, "KVD_URL": f"https://127.0.0.1:{port}", "COLUMNS": "200",
                                   "KVD_TOKEN_FILE": str(tmp_path / "token"), **env},
                              capture_output=True, text=True, timeout=120)

    trusted = {"KVD_CA_FILE": str(tmp_path / "ca.pem"), "KVD_CLIENT_CERT": str(mine)}
    with running_kvd(tmp_path, "--listen", f"127.0.0.1:{port}", "--token-file", str(tokens), "--ssl-certfile", cert,
                     "--ssl-keyfile", key, "--ssl-ca-certs", str(tmp_path / "clients-ca.pem")) as (_, unix, sock):
        untrusted = kvctl("status")
        assert untrusted.returncode != 0
        said = " ".join(untrusted.stderr.split())
        assert f"kvd at https://127.0.0.1:{port}: its TLS certificate is not trusted (" in said
        assert "pass --ca-file (KVD_CA_FILE) with the CA that signed it" in said
        no_cert = kvctl("status", KVD_CA_FILE=str(tmp_path / "ca.pem"))
        assert no_cert.returncode != 0
        assert " ".join(no_cert.stderr.split()) == (
            f"error: kvd at https://127.0.0.1:{port} asks for a client certificate (ssl_ca_certs) and refused kvctl's "
            "connection, which sent none: pass --client-cert (KVD_CLIENT_CERT) with one its CAs signed")
        plain = kvctl("status", KVD_URL=f"http://127.0.0.1:{port}")
        assert plain.returncode != 0 and "(if it serves TLS there, use an https:// URL)" in plain.stderr

        shown = kvctl("status", **trusted)
        assert shown.returncode == 0, shown.stderr
        line = next(row for row in shown.stdout.splitlines() if row.startswith("TLS"))
        assert "CN=server.kvd.test" in line and "(localhost, 127.0.0.1), expires " in line
        assert "client certificates required" in line
        status = json.loads(kvctl("status", "--json", **trusted).stdout)["tls"]
        assert status["fingerprint_sha256"] == first and status["rotations"] == 0
        expiry = [line.split() for line in unix.get("/metrics").text.splitlines()
                  if line.startswith("kvd_tls_certificate_expiry_timestamp_seconds ")]
        assert len(expiry) == 1 and float(expiry[0][1]) == status["not_after"]

        client = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        client.load_cert_chain(str(mine))
        assert served_digest(port, client) == first
        renewed, _, second = write_pair(tmp_path, ca, "renewed")
        (tmp_path / "server.pem").write_bytes((tmp_path / "renewed.pem").read_bytes())
        (tmp_path / "server.key").write_bytes((tmp_path / "renewed.key").read_bytes())
        rotated = kvctl("config", "reload", **trusted)
        assert rotated.returncode == 0, rotated.stderr
        assert ("TLS certificate rotated: CN=renewed.kvd.test" in rotated.stdout
                and f"(sha256 {first[:16]}... -> {second[:16]}...)" in rotated.stdout)
        assert served_digest(port, client) == second  # a new connection; no restart

        write_pair(tmp_path, ca, "third")  # half a rotation: a new certificate beside the old key
        (tmp_path / "server.pem").write_bytes((tmp_path / "third.pem").read_bytes())
        refused = kvctl("config", "reload", **trusted)
        assert refused.returncode == 2
        assert (f"reload refused, nothing changed: ssl_keyfile: the key in {key!r} does not match the certificate "
                f"in {cert!r}") in " ".join(refused.stderr.split())
        assert served_digest(port, client) == second
        audit = json.loads(subprocess.run([str(BIN / "kvctl"), "--socket", str(sock), "audit", "--json"],
                                          capture_output=True, text=True, timeout=120).stdout)["entries"]
        assert [(e["target"], e["result"]) for e in audit[:4]] == [
            ("config", "refused"), ("ssl_certfile", "ok"), ("token_file", "ok"), ("config", "ok")]
        assert audit[1]["detail"]["to"] == second[:16]

        # a CA rotation for the clients: the new CA beside the old, then the old one gone (the
        # certificate's half rotation put right first)
        (tmp_path / "server.pem").write_bytes((tmp_path / "renewed.pem").read_bytes())
        next_ca = trustme.CA()
        newer = tmp_path / "kvctl-next.pem"
        next_ca.issue_cert("ops@kvd.test").private_key_and_cert_chain_pem.write_to_path(str(newer))
        next_client = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        next_client.load_cert_chain(str(newer))
        assert not answers(port, next_client)
        (tmp_path / "clients-ca.pem").write_bytes(clients_ca.cert_pem.bytes() + next_ca.cert_pem.bytes())
        both = kvctl("config", "reload", **trusted)
        assert both.returncode == 0, both.stderr
        assert "TLS client CAs reloaded: 2 CAs (sha256 " in both.stdout
        assert answers(port, client) and answers(port, next_client)
        (tmp_path / "clients-ca.pem").write_bytes(next_ca.cert_pem.bytes())
        moved = kvctl("config", "reload", **trusted)
        assert moved.returncode == 0 and "TLS client CAs reloaded: 1 CA (sha256 " in moved.stdout, moved.stderr
        assert answers(port, next_client) and not answers(port, client)  # the old CA's clients refused
        shown = kvctl("status", **{**trusted, "KVD_CLIENT_CERT": str(newer)})
        assert shown.returncode == 0, shown.stderr
        assert "client certificates required (1 CA)" in next(row for row in shown.stdout.splitlines()
                                                             if row.startswith("TLS"))
        audit = json.loads(subprocess.run([str(BIN / "kvctl"), "--socket", str(sock), "audit", "--json"],
                                          capture_output=True, text=True, timeout=120).stdout)["entries"]
        assert [(e["target"], e["detail"]["cas"]) for e in audit if e["target"] == "ssl_ca_certs"] == [
            ("ssl_ca_certs", 1), ("ssl_ca_certs", 2)]


def test_kvd_router_serves_tls_and_reaches_an_https_replica_through_a_private_ca(tmp_path):
    """kvd router in front of a kvd it reaches over https (its certificate from a private CA,
    --replica-ca-certs) and one on a Unix socket; callers reach the router over TLS too, and a
    SIGHUP serves the router's rotated certificate to new connections."""
    import signal
    import time

    import httpx

    replica_ca, router_ca = trustme.CA(), trustme.CA()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, key, _ = write_pair(tmp_path / "a", replica_ca)
    (tmp_path / "replica-ca.pem").write_bytes(replica_ca.cert_pem.bytes())
    router_cert, router_key, first = write_pair(tmp_path, router_ca, "router")
    (tmp_path / "router-ca.pem").write_bytes(router_ca.cert_pem.bytes())
    for name, line in (("tokens", f"{ADMIN_TOKEN} ops admin\n"), ("clients", "client-token-0123456789 acme user\n")):
        (tmp_path / name).write_text(line)
        (tmp_path / name).chmod(0o600)
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    replica_url = f"https://127.0.0.1:{ports[0]}"
    with running_kvd(tmp_path / "a", "--listen", f"127.0.0.1:{ports[0]}", "--token-file", str(tmp_path / "tokens"),
                     "--ssl-certfile", cert, "--ssl-keyfile", key), \
            running_kvd(tmp_path / "b", "--num-blocks", "64") as (_, _, sock_b):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        router = subprocess.Popen(
            [str(BIN / "kvd"), "router", "--replica", replica_url, "--replica", str(sock_b), "--routing",
             "round_robin", "--token-file", str(tmp_path / "tokens"), "--replica-ca-certs",
             str(tmp_path / "replica-ca.pem"), "--socket", str(tmp_path / "router.sock"), "--listen",
             f"127.0.0.1:{ports[1]}", "--clients-file", str(tmp_path / "clients"), "--ssl-certfile", router_cert,
             "--ssl-keyfile", router_key, "--log-level", "info"],
            env=env, stdout=open(tmp_path / "router.log", "ab"), stderr=subprocess.STDOUT)
        remote = httpx.Client(base_url=f"https://127.0.0.1:{ports[1]}", timeout=60,
                              verify=ssl.create_default_context(cafile=str(tmp_path / "router-ca.pem")),
                              headers={"Authorization": "Bearer client-token-0123456789"})
        try:
            deadline = time.monotonic() + 60
            while True:
                assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                try:
                    if remote.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            answered = {remote.post("/v1/completions", json={"prompt": f"Question {i}?", "max_tokens": 2,
                                                              "temperature": 0}).headers["x-kvd-replica"]
                        for i in range(4)}
            assert answered == {replica_url, str(sock_b)}
            log = (tmp_path / "router.log").read_text()
            assert f"and 127.0.0.1:{ports[1]} (TLS)" in log
            client = ssl.create_default_context(cafile=str(tmp_path / "router-ca.pem"))
            assert served_digest(ports[1], client) == first
            with httpx.Client(base_url="http://router", transport=httpx.HTTPTransport(
                    uds=str(tmp_path / "router.sock"))) as local:
                tls = local.get("/router/status").json()["tls"]
                assert tls["fingerprint_sha256"] == first and tls["subject"].startswith("CN=router.kvd.test")
                expiry = [line.split()[1] for line in local.get("/metrics").text.splitlines()
                          if line.startswith("kvd_router_tls_certificate_expiry_timestamp_seconds ")]
                assert [float(value) for value in expiry] == [tls["not_after"]]
            shown = subprocess.run([str(BIN / "kvctl"), "--socket", str(tmp_path / "router.sock"), "status"],
                                   env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60)
            assert "kvd router's TLS: CN=router.kvd.test" in shown.stdout, shown.stderr
            _, _, second = write_pair(tmp_path, router_ca, "renewed")
            (tmp_path / "router.pem").write_bytes((tmp_path / "renewed.pem").read_bytes())
            (tmp_path / "router.key").write_bytes((tmp_path / "renewed.key").read_bytes())
            router.send_signal(signal.SIGHUP)
            while served_digest(ports[1], client) != second:
                assert time.monotonic() < deadline + 30
                time.sleep(0.1)
            assert "TLS certificate rotated: CN=renewed.kvd.test" in (tmp_path / "router.log").read_text()
        finally:
            remote.close()
            router.send_signal(signal.SIGTERM)
            assert router.wait(60) == 0


def test_kvd_refuses_to_start_on_a_certificate_that_cannot_serve_and_starts_nothing(tmp_path):
    """A key that is not the certificate's is named before kvd loads a model or binds a socket."""
    ca = trustme.CA()
    cert, _, _ = write_pair(tmp_path, ca)
    _, other_key, _ = write_pair(tmp_path, ca, "other")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN_TOKEN} ops admin\n")
    tokens.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    done = subprocess.run([str(BIN / "kvd"), "serve", "--state-dir", str(tmp_path / "state"), "--socket",
                           str(tmp_path / "kvd.sock"), "--listen", "127.0.0.1:8443", "--token-file", str(tokens),
                           "--ssl-certfile", cert, "--ssl-keyfile", other_key], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvd: error: ssl_keyfile: the key in {other_key!r} does not match the certificate in {cert!r}")
    assert not (tmp_path / "kvd.sock").exists() and not (tmp_path / "state").exists()
