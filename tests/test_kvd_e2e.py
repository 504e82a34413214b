"""The real `kvd serve` process on a Unix socket, driven as a user would: the openai client,
kvctl, a client that disconnects mid-stream, pins across a restart, and systemd's notify
protocol (READY, WATCHDOG, STOPPING) on a socket the test listens on."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

BIN = Path(sys.executable).parent


class Kvd:
    def __init__(self, tmp_path: Path, notify: str | None = None) -> None:
        self.socket = tmp_path / "run" / "kvd.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        if notify:
            env.update(NOTIFY_SOCKET=notify, WATCHDOG_USEC="400000")
        self.log = open(tmp_path / "kvd.log", "ab")
        self.proc = subprocess.Popen(
            [str(BIN / "kvd"), "serve", "--state-dir", str(tmp_path / "state"), "--socket", str(self.socket),
             "--num-blocks", "128", "--log-level", "warning"], env=env, stdout=self.log, stderr=self.log)
        self.http = httpx.Client(base_url="http://kvd", transport=httpx.HTTPTransport(uds=str(self.socket)),
                                 timeout=60)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp_path / "kvd.log").read_text()
            try:
                if self.http.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("kvd did not become ready")

    def kvctl(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "KVD_SOCKET": str(self.socket), "COLUMNS": "80"}  # an operator's terminal
        return subprocess.run([str(BIN / "kvctl"), *args], env=env, capture_output=True, text=True, timeout=120)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.http.close()
        self.log.close()
        return code


def openai_client(kvd: Kvd):
    return openai.OpenAI(base_url="http://kvd/v1", api_key="unused-on-the-socket",
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(kvd.socket))))


def notifications(sock: socket.socket, until: str, timeout: float = 30) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            message = sock.recv(4096).decode()
        except socket.timeout:
            break
        seen.append(message)
        if until in message:
            return seen
    raise AssertionError(f"no {until!r} among {seen!r}")


def drain(sock: socket.socket) -> None:
    """Read every notification waiting on `sock`."""
    sock.setblocking(False)
    try:
        while True:
            sock.recv(4096)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)


def test_kvd_end_to_end(tmp_path):
    notify_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    kvd = Kvd(tmp_path, notify=notify_path)
    try:
        assert any("READY=1" in m for m in notifications(listener, "READY=1"))
        assert stat.S_IMODE(os.stat(kvd.socket).st_mode) == 0o660
        client = openai_client(kvd)
        assert [m.id for m in client.models.list()] == ["kvd-demo-llama-v1"]
        system = "You are the support assistant of a KV cache daemon. Answer in one line. "
        first = client.completions.create(model="kvd-demo-llama-v1", prompt=system + "How do pins work?",
                                          max_tokens=8, seed=4)
        second = client.completions.create(model="kvd-demo-llama-v1", prompt=system + "What is a block?",
                                           max_tokens=8, seed=4)
        assert first.usage.completion_tokens == 8
        assert second.usage.prompt_tokens_details.cached_tokens == 64
        chunks = list(client.completions.create(model="kvd-demo-llama-v1", prompt=system + "Stream it.",
                                                max_tokens=5, stream=True, seed=2))
        # five tokens, in as many chunks as the reader needed (a reader that fell behind gets several per chunk)
        assert sum(len(c.choices[0].token_ids) for c in chunks if c.choices) == 5
        assert chunks[-1].choices[0].finish_reason == "length"
        too_big = kvd.http.post("/v1/completions", content=b" " * (32 * 2**20 + 1),
                                headers={"content-type": "application/json"})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"

        status = json.loads(kvd.kvctl("status", "--json").stdout)
        assert status["tokens"]["hit"] >= 64 and status["blocks"]["device"]["total"] == 128
        # three requests one after another: a prefill step each, then 7 + 7 + 4 decode steps
        assert {kind: s["count"] for kind, s in status["steps"].items()} == {"prefill": 3, "decode": 18}
        shown = kvd.kvctl("status").stdout
        assert "prefix hits" in shown and "18 decode, 3 prefill steps on " in " ".join(shown.split())
        assert status["engine_threads"] >= 1
        # settings left to the daemon, and what it chose for them
        config = json.loads(kvd.kvctl("config", "show", "--json").stdout)
        assert config["config"]["quick_prefill_tokens"] is None and config["config"]["device"] == "auto"
        device = config["effective"]["device"]  # cpu here; cuda where the test finds a GPU
        quick = 0 if device == "cuda" else 64
        assert config["effective"] == {"device": device, "num_blocks": 128, "quick_prefill_tokens": quick}
        shown = " ".join(kvd.kvctl("config", "show").stdout.split())
        assert f"quick_prefill_tokens auto ({quick} in effect)" in shown
        assert f"device auto ({device} in effect)" in shown and "block_size 16 " in shown
        assert "tenant_cache_shares none " in shown  # per-tenant settings as an operator writes them

        # The same daemon serves chat through the openai client: the system prompt is shared
        # across conversations, and a stream's deltas make up the whole answer.
        talk = [{"role": "system", "content": system}, {"role": "user", "content": "How do pins work?"}]
        reply = client.chat.completions.create(model="kvd-demo-llama-v1", messages=talk, max_tokens=4, seed=4)
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
        assert reply.usage.completion_tokens == 4
        other = client.chat.completions.create(model="kvd-demo-llama-v1", max_completion_tokens=4, seed=4,
                                               messages=[talk[0], {"role": "user", "content": "And blocks?"}])
        assert other.usage.prompt_tokens_details.cached_tokens >= 64
        streamed = list(client.chat.completions.create(model="kvd-demo-llama-v1", messages=talk, max_tokens=4,
                                                       seed=4, stream=True))
        assert streamed[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content for c in streamed) == reply.choices[0].message.content
        assert kvd.kvctl("status").stdout.count("chat template") == 1

        # A client that goes away mid-stream cancels its request and frees its blocks.
        body = {"prompt": system + "Tell a very long story.", "max_tokens": 1800, "ignore_eos": True,
                "stream": True}
        with kvd.http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        for _ in range(200):
            state = json.loads(kvd.kvctl("status", "--json").stdout)
            if state["queue"]["running"] == 0 and state["blocks"]["device"]["active"] == 0:
                break
            time.sleep(0.1)
        assert state["queue"]["running"] == 0 and state["blocks"]["device"]["reserved"] == 0

        pinned = kvd.kvctl("pin", system, "--ttl", "1h", "--note", "support", "--json")
        pin_id = json.loads(pinned.stdout)["pin_id"]
        refreshed = kvd.kvctl("pin", system, "--ttl", "2h", "--note", "support")  # the same prefix: the same pin
        assert f"pinned {pin_id}:" in refreshed.stdout and "expires in 1h 59m" in " ".join(refreshed.stdout.split())
        odd = kvd.kvctl("pin", system, "--tenant", "bad tenant!")
        assert odd.returncode == 2 and "tenant: String should match pattern" in odd.stderr
        assert any("WATCHDOG=1" in m for m in notifications(listener, "WATCHDOG=1"))
        drain(listener)  # room for STOPPING=1 (kvd drops what a full queue will not take)
        assert kvd.stop() == 0
        assert any("STOPPING=1" in m for m in notifications(listener, "STOPPING=1"))
        assert not kvd.socket.exists()

        kvd = Kvd(tmp_path)
        pins = json.loads(kvd.kvctl("pins", "--json").stdout)["pins"]
        assert [p["pin_id"] for p in pins] == [pin_id]
        [row] = kvd.kvctl("pins").stdout.splitlines()[1:]  # the whole id, to copy into `kvctl unpin`
        assert row.split()[:2] == [pin_id, "default"] and "59m" in row.split() and "support" in row.split()
        audit = json.loads(kvd.kvctl("audit", "--json").stdout)["entries"]
        assert [e["action"] for e in audit] == ["pin", "pin"]  # pinned, then refreshed
    finally:
        if kvd.proc.poll() is None:
            kvd.stop()
        listener.close()


def test_kvctl_without_a_daemon_says_so(tmp_path):
    env = {**os.environ, "KVD_SOCKET": str(tmp_path / "none.sock")}
    done = subprocess.run([str(BIN / "kvctl"), "status"], env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: kvd is not reachable at {tmp_path / 'none.sock'}")


def test_kvd_cache_flags_are_validated(tmp_path):
    done = subprocess.run([str(BIN / "kvd"), "serve", "--cache-dtype", "fp4", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "cache_dtype: invalid value 'fp4' from --cache-dtype: must be auto, fp8_e4m3 (or fp8), fp8_e5m2 or int8" \
        in done.stderr


def test_kvd_refuses_bad_settings(tmp_path):
    done = subprocess.run([str(BIN / "kvd"), "serve", "--block-size", "24", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "block_size: invalid value 24 from --block-size" in done.stderr


def test_kvd_names_the_setting_whose_path_or_port_it_cannot_use_and_starts_nothing(tmp_path):
    """These said `[Errno 17] File exists: '/srv/kvd'` or `AF_UNIX path too long`, naming no setting;
    a port in use aborted kvd (`terminate called without an active exception`) after it had said it
    was listening, its engine running."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "tokens").write_text("a-token-0123456789 ops admin\n")
    (tmp_path / "tokens").chmod(0o600)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    state, sock = str(tmp_path / "state"), str(tmp_path / "kvd.sock")
    long_sock = str(tmp_path / ("s" * 120 + ".sock"))
    cases = [
        (["--state-dir", str(tmp_path / "a-file"), "--socket", sock],
         f"state_dir: {str(tmp_path / 'a-file')!r} cannot be used: a file stands at {str(tmp_path / 'a-file')!r}, "
         "not a folder; kvd keeps its store and lock there, and needs to write it"),
        (["--state-dir", state, "--socket", str(tmp_path / "a-file" / "kvd.sock")],
         f"socket: {str(tmp_path / 'a-file' / 'kvd.sock')!r} cannot be bound: a file stands at "
         f"{str(tmp_path / 'a-file')!r}, not a folder"),
        (["--state-dir", state, "--socket", long_sock],
         f"socket: {long_sock!r} is {len(long_sock.encode())} bytes long, over the 107 a Unix socket's path may "
         "have; choose a shorter one"),
        (["--state-dir", state, "--socket", sock, "--listen", f"127.0.0.1:{port}", "--token-file",
          str(tmp_path / "tokens")],
         f"listen: '127.0.0.1:{port}' cannot be bound: Address already in use (another process listens there)"),
    ]
    try:
        for flags, message in cases:
            done = subprocess.run([str(BIN / "kvd"), "serve", "--num-blocks", "24", *flags], capture_output=True,
                                  text=True, timeout=60)
            assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (2, f"kvd: error: {message}")
            assert "listening" not in done.stderr
        assert not os.path.exists(sock)  # no socket left behind by the port in use
    finally:
        taken.close()


def test_a_reader_that_falls_behind_never_blocks_the_serving_loop(tmp_path):
    """systemd notifications are datagrams that queue until read; when the queue is full a
    watchdog ping is dropped at once and READY/STOPPING give up after their timeout, so the
    engine loop that sends them never waits on the reader (it did: the end-to-end test's kvd
    hung at shutdown when the test read its notifications late)."""
    from kvctl.daemon.server.notify import Notifier

    path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    try:
        notifier = Notifier(path, watchdog_usec=400_000)
        notifier.interval = 0.0  # a ping due at every call
        sent = [notifier.watchdog() for _ in range(10_000)]
        assert sent[0] and False in sent  # the queue filled, and then pings were dropped
        queued = sent.index(False)
        assert all(sent[:queued]) and not any(sent[queued:])
        assert notifier.send("STOPPING=1", timeout=0.05) is False
        assert listener.recv(4096) == b"WATCHDOG=1"  # the reader catches up by one...
        assert notifier.watchdog() is True  # ...and the next ping goes through
        assert Notifier(None).watchdog() is False and Notifier(None).ready() is False  # outside systemd
        assert Notifier(str(tmp_path / "gone.sock")).ready() is False  # a receiver that went away
    finally:
        listener.close()


def test_the_api_socket_replaces_only_a_stale_socket(tmp_path):
    """A slip in --socket must never delete a file: only a socket nobody listens on is replaced."""
    from kvctl.daemon.server.unix_front import bind_unix_socket

    config = tmp_path / "kvd.yaml"
    config.write_text("block_size: 16\n")
    with pytest.raises(RuntimeError) as refused:
        bind_unix_socket(str(config))
    assert str(refused.value) == f"socket: {str(config)!r} exists and is not a socket; kvd will not replace it"
    assert config.read_text() == "block_size: 16\n"
    path = str(tmp_path / "kvd.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a daemon that died: the file stays, nobody listens
    live = bind_unix_socket(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        with pytest.raises(RuntimeError, match="another kvd is listening"):
            bind_unix_socket(path)
    finally:
        live.close()


def test_a_socket_removed_under_kvd_is_bound_again_and_one_put_in_its_place_outlives_kvd(tmp_path):
    """An `rm` of kvd's socket left kvctl saying no kvd answers while kvd went on serving; and a
    kvd stopping removed whatever socket stood at its path, a second kvd's among them."""
    from .kvd_process import kvctl, running_kvd

    with running_kvd(tmp_path, "--eviction", "lru") as (proc, client, sock):
        os.unlink(sock)
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        shown = kvctl(sock, "status", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["blocks"]["device"]["total"] == 24
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # another process's, moved into place
        other.bind(str(tmp_path / "other.sock"))
        other.listen(1)
        os.replace(tmp_path / "other.sock", sock)
        time.sleep(3)  # a check or two: kvd leaves it, and goes on
        assert proc.poll() is None
    try:
        assert sock.exists() and stat.S_ISSOCK(os.lstat(sock).st_mode)  # kvd stopped; the other's socket stays
        log = (tmp_path / "kvd.log").read_text()
        assert f"the Unix socket {str(sock)!r} was removed under this process; bound again" in log
        assert log.count(f"the Unix socket {str(sock)!r} was replaced under this process") == 1
    finally:
        other.close()


def test_a_second_kvd_on_the_same_state_dir_is_refused_naming_the_first(tmp_path):
    """Two kvd on one state folder (a systemd template's instances sharing StateDirectory) shared
    one store: each restored the other's pins at its start, an unpin on one left the pin standing
    on the other, and their audit records mixed with nothing to tell them apart."""
    from .kvd_process import launch, running_kvd

    with running_kvd(tmp_path, "--eviction", "lru") as (proc, client, sock):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        second = subprocess.run([str(BIN / "kvd"), "serve", "--state-dir", str(tmp_path / "state"), "--socket",
                                 str(tmp_path / "second.sock"), "--num-blocks", "24"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1] == (
            f"kvd: error: state_dir: {str(tmp_path / 'state')!r} is in use by another kvd (pid {proc.pid}, socket "
            f"{str(sock)}); give each kvd a state_dir of its own (--state-dir; kvctl and cron jobs may share one)")
        assert not (tmp_path / "second.sock").exists()
        assert client.get("/readyz").status_code == 200
        (tmp_path / "state" / "kvd.lock").unlink()  # a cleanup of the folder: kvd claims it again
        deadline = time.monotonic() + 20
        while not (tmp_path / "state" / "kvd.lock").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        again = subprocess.run([str(BIN / "kvd"), "serve", "--state-dir", str(tmp_path / "state"), "--socket",
                                str(tmp_path / "second.sock"), "--num-blocks", "24"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and "is in use by another kvd (pid " in again.stderr
    proc, client = launch(tmp_path / "state", tmp_path / "second.sock", tmp_path / "second.log",
                          "--eviction", "lru")  # the first gone, the folder is free
    try:
        assert client.get("/readyz").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        client.close()


def test_kvctl_config_reload_applies_the_file_and_refuses_a_bad_one_changing_nothing(tmp_path):
    """`kvctl config reload` against a real kvd started with --config: what changed (old -> new),
    what needs a restart, and a config that does not validate refused by name with nothing
    applied; each attempt audited under the caller."""
    import json

    from .kvd_process import kvctl, running_kvd

    config = tmp_path / "kvd.yaml"
    config.write_text("max_queue: 256\nreservation: p95\n")
    with running_kvd(tmp_path, "--config", str(config)) as (proc, client, sock):
        same = kvctl(sock, "config", "reload")
        assert same.returncode == 0 and "reloaded: no setting that applies live has changed" in same.stdout
        config.write_text("max_queue: 64\nreservation: p95\nblock_size: 32\n")
        done = kvctl(sock, "config", "reload")
        assert done.returncode == 0, done.stderr
        lines = [" ".join(line.split()) for line in done.stdout.splitlines()]
        assert "reloaded: max_queue 256 -> 64" in lines
        assert "changed in the config but applied only at a restart: block_size" in lines
        shown = json.loads(kvctl(sock, "config", "show", "--json").stdout)
        assert shown["config"]["max_queue"] == 64 and shown["sources"]["max_queue"] == str(config)
        assert shown["sources"]["state_dir"] == "--state-dir"
        assert shown["sources"]["max_running"] == "default"
        config.write_text("max_queue: -3\nreservation: fraction:0.5\n")
        bad = kvctl(sock, "config", "reload")
        assert bad.returncode == 2
        assert " ".join(bad.stderr.split()).startswith(
            "error: kvd answered 400: reload refused, nothing changed: max_queue: invalid value -3 from "
            f"{config}:")
        shown = json.loads(kvctl(sock, "config", "show", "--json").stdout)["config"]
        assert (shown["max_queue"], shown["reservation"]) == (64, "p95")  # the valid half was not applied either
        config.write_text("max_queue: [\n")
        broken = kvctl(sock, "config", "reload")
        assert broken.returncode == 2 and f"config: {str(config)!r} is not valid YAML" in broken.stderr
        audit = json.loads(kvctl(sock, "audit", "--json").stdout)["entries"]
        assert [(e["action"], e["actor"], e["result"]) for e in audit[:4]] == [
            ("reload", "unix-socket", "refused"), ("reload", "unix-socket", "refused"),
            ("reload", "unix-socket", "ok"), ("reload", "unix-socket", "ok")]
        assert audit[2]["detail"]["changed"] == {"max_queue": 64} and audit[2]["detail"]["previous"] == {
            "max_queue": 256}
        # a refused reload leaves kvd on its earlier settings: status and /metrics say so until one succeeds
        glance = " ".join(kvctl(sock, "status").stdout.split())
        assert "by unix-socket) was refused, kvd runs on its earlier settings: config: " in glance
        assert "is not valid YAML" in glance

        def reload_metrics():
            text = client.get("/metrics").text
            return [line for line in text.splitlines() if line.startswith("kvd_config_")]

        assert reload_metrics() == ['kvd_config_reloads_total{result="ok"} 2.0',
                                    'kvd_config_reloads_total{result="refused"} 2.0',
                                    "kvd_config_last_reload_successful 0.0"]
        config.write_text("max_queue: 64\nreservation: p95\n")
        assert kvctl(sock, "config", "reload").returncode == 0
        assert reload_metrics()[-1] == "kvd_config_last_reload_successful 1.0"
        assert "the latest reload" not in kvctl(sock, "status").stdout


def test_a_reload_rotates_the_tcp_tokens_and_a_bad_token_file_changes_nothing(tmp_path):
    """Tokens rotate without a restart: `kvctl config reload` (or SIGHUP) reads the token file
    again; the old token stops working at once and the new one works. A token file that does not
    load (here: readable by everyone) refuses the reload and the tokens in use stay."""
    import socket as sockets

    from .kvd_process import kvctl, running_kvd

    with sockets.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tokens = tmp_path / "tokens"
    tokens.write_text("old-token-0123456789 acme user\n")
    tokens.chmod(0o600)
    tcp = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def models(token: str) -> int:
        return tcp.get("/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code

    with running_kvd(tmp_path, "--listen", f"127.0.0.1:{port}", "--token-file", str(tokens)) as (_, _, sock), tcp:
        assert models("old-token-0123456789") == 200
        tokens.write_text("new-token-0123456789 acme user\nops-token-0123456789 ops admin\n")
        done = kvctl(sock, "config", "reload")
        assert done.returncode == 0, done.stderr
        assert "token file read again: 2 tokens (2 added, 1 removed)" in done.stdout
        assert "0123456789" not in done.stdout  # counts, never tokens
        assert models("old-token-0123456789") == 401 and models("new-token-0123456789") == 200
        tokens.chmod(0o644)
        refused = kvctl(sock, "config", "reload")
        assert refused.returncode == 2
        assert "reload refused, nothing changed: token_file:" in refused.stderr and "mode 0644" in refused.stderr
        assert models("new-token-0123456789") == 200 and models("old-token-0123456789") == 401
        # a caller that connects and sends no request (slowloris) is let go after 10 s, token or not
        silent = sockets.create_connection(("127.0.0.1", port))
        opened = time.monotonic()
        silent.settimeout(30)
        answer = b""
        while chunk := silent.recv(4096):
            answer += chunk
        silent.close()
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")  # closed: recv's 30 s timeout did not fire
        assert time.monotonic() - opened >= 9  # and not before its 10 s
        assert models("new-token-0123456789") == 200
        with httpx.Client(base_url="http://kvd", transport=httpx.HTTPTransport(uds=str(sock))) as unix:
            assert 'kvd_http_cut_connections_total{reason="header_timeout"} 1.0' in unix.get("/metrics").text


def test_a_client_that_leaves_a_non_streamed_completion_stops_its_generation(tmp_path):
    """Tokens flow to the handler at every step, so it used to look for a departed client only
    when none came: an abandoned request generated all its tokens for nobody."""
    from .kvd_process import running_kvd

    with running_kvd(tmp_path, "--num-blocks", "512") as (_, client, sock):
        impatient = httpx.Client(base_url="http://kvd", transport=httpx.HTTPTransport(uds=str(sock)), timeout=1.0)
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json={"prompt": "a long story, please", "max_tokens": 6000,
                                                    "ignore_eos": True})
        impatient.close()
        queue = client.get("/admin/status").json()["queue"]
        for _ in range(30):  # 6,000 tokens take this VM 9 s or more; the check comes every 0.5 s
            queue = client.get("/admin/status").json()["queue"]
            if queue["running"] == queue["waiting"] == 0:
                break
            time.sleep(0.1)
        assert queue["running"] == queue["waiting"] == 0


def test_an_rl_loop_through_kvctl_sleep_wake_and_update_weights(tmp_path):
    """What an RL trainer's loop does to the real process, through kvctl: sleep, wake the weights,
    swap in a training step's checkpoint, wake the cache; completions refused while asleep, and
    kvctl's error (exit 2) where kvd refuses."""
    import shutil

    from safetensors.torch import load_file, save_file

    kvd = Kvd(tmp_path)
    try:
        prompt = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        before = kvd.http.post("/v1/completions", json=prompt).json()["choices"][0]["text"]
        slept = kvd.kvctl("sleep", "--json")
        assert slept.returncode == 0, slept.stderr
        assert json.loads(slept.stdout)["released"] == ["kv_cache"]
        refused = kvd.http.post("/v1/completions", json=prompt)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "asleep"
        woke = kvd.kvctl("wake", "--only", "weights")
        assert woke.returncode == 0 and woke.stdout.startswith("still asleep: kv_cache given back"), woke.stdout
        demo = tmp_path / "state" / "models" / "kvd-demo-llama-v1"
        step = shutil.copytree(demo, tmp_path / "step-1")
        weights = load_file(str(step / "model.safetensors"))
        save_file({name: t * 1.05 for name, t in weights.items()}, str(step / "model.safetensors"))
        wrong = kvd.kvctl("update-weights", "step-1")
        assert wrong.returncode == 2 and wrong.stderr.strip() == (
            "error: kvd answered 400: model_path: give the checkpoint folder's absolute path, got 'step-1'")
        updated = kvd.kvctl("update-weights", str(step))
        assert updated.returncode == 0 and updated.stdout.startswith(f"serving {step}: revision "), updated.stdout
        assert kvd.kvctl("wake").returncode == 0
        after = kvd.http.post("/v1/completions", json=prompt).json()
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and after["choices"][0]["text"] != before
    finally:
        assert kvd.stop() == 0
