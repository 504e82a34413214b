"""TLS on the TCP fronts (daemon/server/tls.py): the pair read and checked, refusals naming the
setting, rotation by a reload, expiry warnings, mutual TLS, and the settings that go together.
Handshakes run in memory (ssl.MemoryBIO), so what a client is served is checked without a port."""

from __future__ import annotations

import datetime
import hashlib
import logging
import ssl

import pytest

trustme = pytest.importorskip("trustme")

from kvctl.daemon.config import ConfigError, resolve  # noqa: E402
from kvctl.daemon.router_config import resolve_router  # noqa: E402
from kvctl.daemon.server.tls import (EXPIRY_WARN_DAYS, ServingTls, TlsFileError, client_context)  # noqa: E402

from .tls_certs import write_pair  # noqa: E402


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str = "127.0.0.1") -> str:
    """Shake hands in memory; the SHA-256 of the certificate the client was served."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    theirs = client.wrap_bio(c_in, c_out, server_hostname=hostname)
    ours = server.wrap_bio(s_in, s_out, server_side=True)
    done = set()
    for _ in range(20):
        for name, side in (("client", theirs), ("server", ours)):
            if name not in done:
                try:
                    side.do_handshake()
                    done.add(name)
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == {"client", "server"}:
            break
    assert done == {"client", "server"}, done
    return hashlib.sha256(theirs.getpeercert(binary_form=True)).hexdigest()


def trusting(ca) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def test_a_certificate_serves_and_is_described_never_its_key(tmp_path):
    ca = trustme.CA()
    cert, key, digest = write_pair(tmp_path, ca)
    tls = ServingTls(cert, key)
    assert handshake(tls.context, trusting(ca)) == digest
    now = datetime.datetime.now(datetime.timezone.utc).timestamp()
    shown = tls.describe(now)
    assert shown["subject"].startswith("CN=server.kvd.test")
    assert shown["names"] == ["localhost", "127.0.0.1"]
    assert shown["fingerprint_sha256"] == digest
    assert shown["client_certificates"] is False and shown["rotations"] == 0 and shown["warning"] is None
    assert (shown["client_cas"], shown["ca_reloads"]) == (0, 0)
    assert shown["days_left"] > EXPIRY_WARN_DAYS
    assert "PRIVATE" not in repr(shown)
    assert tls.context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_a_key_inside_the_certificate_file_serves_and_must_be_private(tmp_path):
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    both = tmp_path / "both.pem"
    leaf.private_key_and_cert_chain_pem.write_to_path(str(both))
    both.chmod(0o640)
    assert handshake(ServingTls(str(both)).context, trusting(ca))
    both.chmod(0o644)
    with pytest.raises(TlsFileError) as refused:
        ServingTls(str(both))
    assert str(refused.value) == (f"ssl_certfile (it holds the key): {str(both)!r} is open to every user on the "
                                  f"machine (mode 0644); restrict it, e.g. chmod 600 {both}")
    alone = tmp_path / "alone.pem"
    leaf.cert_chain_pems[0].write_to_path(str(alone))
    with pytest.raises(TlsFileError) as no_key:
        ServingTls(str(alone))
    assert str(no_key.value) == (f"ssl_keyfile: not set, and ssl_certfile {str(alone)!r} holds no private key; set "
                                 "ssl_keyfile to the key's file")


def test_files_that_cannot_serve_are_refused_by_name(tmp_path):
    ca = trustme.CA()
    cert, key, _ = write_pair(tmp_path, ca)
    _, other_key, _ = write_pair(tmp_path, ca, "other")
    with pytest.raises(TlsFileError) as mismatch:
        ServingTls(cert, other_key)
    assert str(mismatch.value) == f"ssl_keyfile: the key in {other_key!r} does not match the certificate in {cert!r}"
    with pytest.raises(TlsFileError) as missing:
        ServingTls(str(tmp_path / "nope.pem"), key)
    assert str(missing.value) == f"ssl_certfile: cannot read {str(tmp_path / 'nope.pem')!r} (No such file or directory)"
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TlsFileError) as not_pem:
        ServingTls(str(junk), key)
    assert str(not_pem.value) == f"ssl_certfile: {str(junk)!r} holds no PEM certificate"
    (tmp_path / "server.key").chmod(0o604)
    with pytest.raises(TlsFileError) as open_key:
        ServingTls(cert, key)
    assert str(open_key.value).startswith(f"ssl_keyfile: {key!r} is open to every user on the machine (mode 0604)")
    (tmp_path / "server.key").chmod(0o600)
    with pytest.raises(TlsFileError) as bad_ca:
        ServingTls(cert, key, str(junk))
    assert str(bad_ca.value) == f"ssl_ca_certs: {str(junk)!r} holds no PEM certificate"


def test_a_rotation_serves_the_new_pair_to_new_handshakes_and_a_bad_one_changes_nothing(tmp_path):
    ca = trustme.CA()
    cert, key, first = write_pair(tmp_path, ca)
    tls = ServingTls(cert, key)
    client = trusting(ca)
    assert tls.adopt(tls.read_again()) == {}  # the same pair: nothing to say
    renewed = ca.issue_cert("127.0.0.1", "localhost", common_name="server.kvd.test")
    (tmp_path / "server.pem").write_bytes(renewed.cert_chain_pems[0].bytes())
    (tmp_path / "server.key").write_bytes(renewed.private_key_pem.bytes())
    second = hashlib.sha256(ssl.PEM_cert_to_DER_cert(renewed.cert_chain_pems[0].bytes().decode())).hexdigest()
    said = tls.adopt(tls.read_again())
    assert said["rotated"]["from"] == first[:16] and said["rotated"]["to"] == second[:16]
    assert said["rotated"]["subject"].startswith("CN=server.kvd.test")
    assert handshake(tls.context, client) == second and tls.rotations == 1
    # a half-done rotation: a new certificate beside the old key is refused, the pair served stays
    _, _, _ = write_pair(tmp_path, ca, "third")
    (tmp_path / "server.pem").write_bytes((tmp_path / "third.pem").read_bytes())
    with pytest.raises(TlsFileError, match="ssl_keyfile: the key in .* does not match the certificate"):
        tls.read_again()
    assert handshake(tls.context, client) == second and tls.certificate.fingerprint == second


def test_a_certificate_near_its_end_or_past_it_is_warned_of(tmp_path, caplog):
    ca = trustme.CA()
    now = datetime.datetime.now(datetime.timezone.utc)
    soon, _, _ = write_pair(tmp_path, ca, "soon", not_before=now - datetime.timedelta(hours=1),
                            not_after=now + datetime.timedelta(days=3))
    tls = ServingTls(soon, str(tmp_path / "soon.key"))
    with caplog.at_level(logging.WARNING, logger="kvd"):
        said = tls.warn(logging.getLogger("kvd"), now.timestamp())
    assert said.startswith("ssl_certfile: the certificate (CN=soon.kvd.test") and ", in 3.0 days; rotate it and run " \
        "`kvctl config reload`" in said
    assert caplog.records[-1].getMessage() == said
    assert tls.describe(now.timestamp())["warning"] == said
    later = (now + datetime.timedelta(days=4)).timestamp()
    assert "expired" in tls.certificate.warning(later) and "clients refuse it" in tls.certificate.warning(later)
    early = (now - datetime.timedelta(days=1)).timestamp()
    assert "is not valid before" in tls.certificate.warning(early)
    fine, _, _ = write_pair(tmp_path, ca, "fine")
    assert ServingTls(fine, str(tmp_path / "fine.key")).warn(logging.getLogger("kvd")) is None


def test_mutual_tls_asks_every_client_for_a_certificate_its_cas_signed(tmp_path):
    ca, clients_ca, stranger = trustme.CA(), trustme.CA(), trustme.CA()
    cert, key, digest = write_pair(tmp_path, ca)
    (tmp_path / "clients-ca.pem").write_bytes(clients_ca.cert_pem.bytes())
    tls = ServingTls(cert, key, str(tmp_path / "clients-ca.pem"))
    assert tls.describe(0)["client_certificates"] is True
    with pytest.raises(ssl.SSLError, match="PEER_DID_NOT_RETURN_A_CERTIFICATE|CERTIFICATE_REQUIRED"):
        handshake(tls.context, trusting(ca))
    signed = tmp_path / "kvctl.pem"
    clients_ca.issue_cert("ops@kvd.test").private_key_and_cert_chain_pem.write_to_path(str(signed))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    assert handshake(tls.context, client_context(str(tmp_path / "ca.pem"), str(signed))) == digest
    unknown = tmp_path / "stranger.pem"
    stranger.issue_cert("ops@kvd.test").private_key_and_cert_chain_pem.write_to_path(str(unknown))
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED|UNKNOWN_CA|unknown ca"):
        handshake(tls.context, client_context(str(tmp_path / "ca.pem"), str(unknown)))
    assert tls.adopt(tls.read_again()) == {}


def test_a_reload_rotates_the_client_cas_for_new_connections_and_refuses_a_file_that_does_not_load(tmp_path):
    """A CA rotation as cert-manager's trust bundles do it: the new CA beside the old, then the old
    one gone; each reload checks new connections against the bundle as it is, without a restart."""
    ca, old_ca, new_ca = trustme.CA(), trustme.CA(), trustme.CA()
    cert, key, digest = write_pair(tmp_path, ca)
    bundle = tmp_path / "clients-ca.pem"
    bundle.write_bytes(old_ca.cert_pem.bytes())
    tls = ServingTls(cert, key, str(bundle))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    clients = {}
    for name, signer in (("old", old_ca), ("new", new_ca)):
        signer.issue_cert(f"{name}@kvd.test").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / name))
        clients[name] = client_context(str(tmp_path / "ca.pem"), str(tmp_path / name))
    assert handshake(tls.context, clients["old"]) == digest
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED|UNKNOWN_CA|unknown ca"):
        handshake(tls.context, clients["new"])
    digests = [hashlib.sha256(bundle.read_bytes()).hexdigest()[:16]]
    bundle.write_bytes(old_ca.cert_pem.bytes() + new_ca.cert_pem.bytes())
    digests.append(hashlib.sha256(bundle.read_bytes()).hexdigest()[:16])
    assert tls.adopt(tls.read_again()) == {"client_cas": {"from": digests[0], "to": digests[1], "cas": 2}}
    assert [handshake(tls.context, clients[name]) for name in ("old", "new")] == [digest, digest]
    bundle.write_bytes(new_ca.cert_pem.bytes())
    digests.append(hashlib.sha256(bundle.read_bytes()).hexdigest()[:16])
    assert tls.adopt(tls.read_again()) == {"client_cas": {"from": digests[1], "to": digests[2], "cas": 1}}
    assert handshake(tls.context, clients["new"]) == digest
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED|UNKNOWN_CA|unknown ca"):
        handshake(tls.context, clients["old"])
    shown = tls.describe(0)
    assert (shown["client_certificates"], shown["client_cas"], shown["ca_reloads"], shown["rotations"]) == (
        True, 1, 2, 0)
    # a bundle cut off mid-write, or gone: refused by name, and the CAs served stay
    bundle.write_bytes(new_ca.cert_pem.bytes()[:200])
    with pytest.raises(TlsFileError, match=r"^ssl_ca_certs: '.*clients-ca.pem' does not load as CA certificates \("):
        tls.read_again()
    bundle.unlink()
    with pytest.raises(TlsFileError, match=r"^ssl_ca_certs: cannot read '.*clients-ca.pem' \(No such file"):
        tls.read_again()
    assert handshake(tls.context, clients["new"]) == digest
    # a certificate and its CAs rotated by one reload: both said, one new context
    bundle.write_bytes(old_ca.cert_pem.bytes())
    renewed, renewed_key, second = write_pair(tmp_path, ca, "renewed")
    (tmp_path / "server.pem").write_bytes((tmp_path / "renewed.pem").read_bytes())
    (tmp_path / "server.key").write_bytes((tmp_path / "renewed.key").read_bytes())
    said = tls.adopt(tls.read_again())
    assert sorted(said) == ["client_cas", "rotated"] and said["rotated"]["to"] == second[:16]
    assert handshake(tls.context, clients["old"]) == second


def test_client_contexts_name_the_file_that_does_not_load(tmp_path):
    assert client_context() is True
    with pytest.raises(TlsFileError, match=r"^ca_file: '.*nope.pem' does not load as CA certificates \(No such file"):
        client_context(str(tmp_path / "nope.pem"))
    junk = tmp_path / "junk.pem"
    junk.write_text("junk")
    with pytest.raises(TlsFileError, match=r"^replica_client_cert: '.*junk.pem' does not load as a certificate and "):
        client_context(None, str(junk), names=("replica_ca_certs", "replica_client_cert"))


def test_tls_settings_that_serve_nothing_are_refused(tmp_path):
    tokens = tmp_path / "tokens"
    with pytest.raises(ConfigError) as no_listen:
        resolve({"ssl_certfile": "/etc/kvd/tls.pem"}, env={})
    assert str(no_listen.value) == ("ssl_certfile: set (from --ssl-certfile) but listen is not: TLS serves the TCP "
                                    "front (--listen HOST:PORT); the Unix socket needs none")
    with pytest.raises(ConfigError) as no_cert:
        resolve({"listen": "127.0.0.1:8443", "token_file": str(tokens)}, env={"KVD_SSL_KEYFILE": "/etc/kvd/tls.key"})
    assert str(no_cert.value) == ("ssl_keyfile: set (from KVD_SSL_KEYFILE) but ssl_certfile is not: TLS needs the "
                                  "server's certificate (--ssl-certfile)")
    settings = resolve({"listen": "127.0.0.1:8443", "token_file": str(tokens), "ssl_certfile": "/etc/kvd/tls.pem",
                        "ssl_ca_certs": "/etc/kvd/clients.pem"}, env={})
    assert (settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs) == (
        "/etc/kvd/tls.pem", None, "/etc/kvd/clients.pem")
    replicas = {"socket": str(tmp_path / "r.sock"), "replicas": ("/a.sock", "/b.sock")}
    with pytest.raises(ConfigError, match="^ssl_ca_certs: set .* but ssl_certfile is not"):
        resolve_router({**replicas, "ssl_ca_certs": "/etc/kvd/clients.pem"}, env={})
    with pytest.raises(ConfigError) as key_alone:
        resolve_router({**replicas, "replica_client_key": "/etc/kvd/router.key"}, env={})
    assert str(key_alone.value) == ("replica_client_key: set (from --replica-client-key) but replica_client_cert is "
                                    "not: the key goes with the router's certificate")


def test_a_tcp_front_other_hosts_reach_without_tls_is_warned_of(tmp_path):
    from kvctl.daemon.server.tls import clear_text_warning

    assert clear_text_warning("0.0.0.0:8000", None) == (
        "listen: 0.0.0.0:8000 serves TCP without TLS: bearer tokens and prompts cross the network in clear text; "
        "set ssl_certfile (or keep a TLS proxy in front of it on this host)")
    assert clear_text_warning("[2001:db8::1]:8000", None).startswith("listen: [2001:db8::1]:8000 serves TCP")
    assert clear_text_warning("kvd-1.internal:8000", None) is not None
    for loopback in ("127.0.0.1:8000", "127.0.1.1:8000", "[::1]:8000", "localhost:8000"):
        assert clear_text_warning(loopback, None) is None, loopback
    assert clear_text_warning(None, None) is None
    cert, key, _ = write_pair(tmp_path, trustme.CA())
    assert clear_text_warning("0.0.0.0:8443", ServingTls(cert, key)) is None
