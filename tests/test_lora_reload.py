"""LoRA adapters change without a restart: a reload (SIGHUP, `kvctl config reload`) adds, replaces
and takes away adapters as lora_modules says, reads again only the adapters whose files changed,
and leaves every request in flight on the adapter it came for (its tokens, its blocks); an
adapter it cannot serve refuses the whole reload. And an adapter's blocks are seen as its own
(`kvctl prefixes`, `kvctl status`) and evicted whole (`kvctl evict --model`, `--adapter-id` for
weights a reload replaced)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import RequestError, SamplingParams  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.daemon.model.lora import adapter_changes, adapter_digest, load_adapters  # noqa: E402

from .lora_cases import merged_checkpoint, write_adapter  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = list(b"A reload swaps the adapter; the request keeps the weights it began on. ")
FULL = len(PROMPT) // 16 * 16  # the prompt's tokens in full blocks: what a later request can hit
OTHER = list(b"Another prompt for the same adapter, sharing no block with the first one. ")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def expected(base_dir, tmp_path_factory):
    """Adapter folders `a` and `b` (other weights) and the greedy tokens of PROMPT on each one's
    merged checkpoint: what kvd must give under each."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {"a": write_adapter(root / "a", rank=4, alpha=8, seed=1),
               "b": write_adapter(root / "b", ("q_proj", "v_proj", "down_proj"), rank=2, alpha=4, seed=2)}
    tokens = {name: greedy(load_model(merged_checkpoint(base_dir, folder, root / f"merged-{name}")))
              for name, folder in folders.items()}
    return folders, tokens


def greedy(loaded, prompt=PROMPT):
    engine = Engine(loaded, EngineSettings(num_blocks=64, block_size=16))
    request = engine.add_request(prompt, GREEDY)
    engine.run_until_done()
    return request.sequences[0].output_ids


def modules(**folders) -> tuple[tuple[str, str], ...]:
    return tuple((name.replace("_", "-"), str(path)) for name, path in folders.items())


def reloadable_service(base_dir, tmp_path, settings: str):
    """A started EngineService whose settings come from the YAML file `kvd.yaml` (`settings`, as
    written there at first), read again by reload_from_source as at a SIGHUP: (service, the file)."""
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.metrics import Metrics
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    shutil.copytree(base_dir, tmp_path / "state" / "models" / base_dir.name)  # the demo checkpoint, in place
    config = tmp_path / "kvd.yaml"
    config.write_text(settings)
    flags = {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "kvd.sock")}
    service = EngineService(resolve(flags, {}, config), Store(tmp_path / "kvd.sqlite3"))
    service.metrics = Metrics(service)
    service.config_source = lambda: resolve(flags, {}, config)
    service.start()
    return service, config


def test_a_request_in_flight_finishes_on_the_adapter_it_came_for_when_its_name_is_replaced_or_taken_away(
        base_dir, expected):
    folders, tokens = expected
    loaded = load_model(base_dir)
    loaded.adapters = load_adapters(modules(sql=folders["a"]), loaded, "demo")
    engine = Engine(loaded, EngineSettings(num_blocks=64, block_size=16))
    first = engine.add_request(PROMPT, GREEDY, adapter="sql")
    for _ in range(3):  # admitted, its prompt computed, a few tokens out
        engine.step()
    assert 0 < len(first.sequences[0].output_ids) < 12
    old = loaded.adapters["sql"]
    loaded.adapters = load_adapters(modules(sql=folders["b"]), loaded, "demo", current=loaded.adapters)
    assert loaded.adapters["sql"].digest != old.digest
    assert engine.retiring_adapters() == [{"name": "sql", "digest": old.digest, "requests": 1, "replaced": True}]
    second = engine.add_request(PROMPT, GREEDY, adapter="sql")  # the new weights, and none of the old's blocks
    engine.run_until_done()
    assert first.sequences[0].output_ids == tokens["a"]
    assert second.sequences[0].output_ids == tokens["b"]
    assert (first.metrics.cached_tokens, second.metrics.cached_tokens) == (0, 0)
    assert engine.retiring_adapters() == []
    # a's files served again under another name: a's blocks serve it (the cache knows files, not names)
    loaded.adapters = load_adapters(modules(sql=folders["b"], again=folders["a"]), loaded, "demo",
                                    current=loaded.adapters)
    third = engine.add_request(PROMPT, GREEDY, adapter="again")
    for _ in range(3):
        engine.step()
    loaded.adapters = {}  # taken away while `third` runs: it finishes on a's weights
    with pytest.raises(RequestError, match=r"^model: no LoRA adapter 'again' is loaded \(adapters: none\)$"):
        engine.add_request(PROMPT, GREEDY, adapter="again")
    assert engine.adapter_requests() == {"again": {"running": 1, "waiting": 0}}
    assert engine.retiring_adapters() == [{"name": "again", "digest": old.digest, "requests": 1, "replaced": False}]
    engine.run_until_done()
    assert third.sequences[0].output_ids == tokens["a"] and third.metrics.cached_tokens == FULL
    assert engine.adapter_requests() == {} and engine.retiring_adapters() == []


def test_a_reload_reads_again_only_the_adapters_whose_files_changed(base_dir, expected, tmp_path):
    folders, _ = expected
    loaded = load_model(base_dir)
    mine = shutil.copytree(folders["a"], tmp_path / "mine")
    copy = shutil.copytree(folders["a"], tmp_path / "copy")
    before = load_adapters(modules(sql=mine, chat=folders["b"]), loaded, "demo")
    same = load_adapters(modules(sql=mine, chat=folders["b"]), loaded, "demo", current=before)
    assert same["sql"] is before["sql"] and same["chat"] is before["chat"]  # not read again
    assert adapter_changes(before, same) == {"added": [], "removed": [], "replaced": []}
    # the same files in another folder: read, and the same adapter to the cache
    moved = load_adapters(modules(sql=copy, chat=folders["b"]), loaded, "demo", current=before)
    assert moved["sql"] is not before["sql"] and moved["sql"].digest == before["sql"].digest
    assert adapter_changes(before, moved) == {"added": [], "removed": [], "replaced": []}
    # new weights written over the folder's files, the modification times put back as they were
    stats = {name: os.stat(mine / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    write_adapter(mine, rank=4, alpha=8, seed=7)
    for name, st in stats.items():
        os.utime(mine / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    rewritten = load_adapters(modules(sql=mine, extra=copy), loaded, "demo", current=before)
    assert rewritten["sql"].digest != before["sql"].digest
    assert adapter_changes(before, rewritten) == {"added": ["extra"], "removed": ["chat"], "replaced": ["sql"]}


def test_kvd_reloads_its_adapters_and_requests_in_flight_finish_on_theirs(base_dir, expected, tmp_path):
    """Through the service: a request blocked mid-generation while `kvctl config reload` replaces
    its adapter, takes another away and adds a third; /v1/models, a 404 for the name taken away,
    `kvctl status` listing the old weights until their last request ends, the audit, and a
    reload refused for an adapter kvd cannot serve, changing nothing."""
    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.calls import Principal, ServiceError
    from kvctl.status_view import render_status

    from .daemon_fixtures import call

    folders, tokens = expected
    a_again = shutil.copytree(folders["a"], tmp_path / "a-again")
    service, config = reloadable_service(
        base_dir, tmp_path, f"num_blocks: 64\nlora_modules:\n  sql: {folders['a']}\n  chat-b: {folders['b']}\n")
    try:
        assert service.ready.wait(60), service.load_error
        unix = create_app(service, service.metrics, front="unix")
        old_sql = service.adapters()["sql"]
        first_token, go, done, out = threading.Event(), threading.Event(), threading.Event(), []

        def held(event):  # runs on the engine thread, outside the lock: the engine waits here
            if event.token_id is not None:
                out.append(event.token_id)
                first_token.set()
                go.wait(30)
            if event.finish_reason:
                done.set()

        service.submit_nowait([PROMPT], GREEDY, Principal("default", "admin", "t"), held, adapter="sql")
        assert first_token.wait(30)
        config.write_text(f"num_blocks: 64\nlora_modules:\n  sql: {folders['b']}\n  again: {a_again}\n")
        result = service.reload_from_source("ops")
        assert result["adapters"] == {"added": ["again"], "removed": ["chat-b"], "replaced": ["sql"]}
        assert result["changed"] == {"lora_modules": (("sql", str(folders["b"])), ("again", str(a_again)))}
        listed = [m["id"] for m in call(unix, "GET", "/v1/models").json()["data"]]
        assert listed == [base_dir.name, "sql", "again"]
        body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        gone = call(unix, "POST", "/v1/completions", json={**body, "model": "chat-b"})
        assert gone.status_code == 404 and gone.json()["error"]["message"].startswith(
            "model: 'chat-b' is not served here")
        status = call(unix, "GET", "/admin/status").json()
        assert [(a["name"], a["requests"]) for a in status["model"]["adapters"]] == [("sql", 0), ("again", 0)]
        assert status["model"]["retiring_adapters"] == [  # the prompt's full blocks: cached under its weights
            {"name": "sql", "digest": old_sql.digest, "requests": 1, "replaced": True, "cached_blocks": FULL // 16}]
        console = Console(record=True, width=160)
        console.print(render_status(status))
        assert f"LoRA adapter sql ({old_sql.digest[:12]}): replaced by a reload; 1 in flight finish on it, " \
               f"{FULL // 16} blocks cached" in \
            " ".join(console.export_text().split())
        go.set()
        assert done.wait(30)
        assert out == tokens["a"]  # the weights it began on
        answers = [call(unix, "POST", "/v1/completions", json={**body, "model": m}).json() for m in ("sql", "again")]
        assert [a["choices"][0]["token_ids"] for a in answers] == [tokens["b"], tokens["a"]]
        # sql's new weights hit none of the old weights' blocks; `again` holds a's files: it hits them
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, FULL]
        assert call(unix, "GET", "/admin/status").json()["model"]["retiring_adapters"] == []
        audited = service.store.audit_since(0, action="reload")
        assert audited[0]["detail"]["adapters"] == result["adapters"]  # the newest first
        # an adapter kvd cannot serve refuses the whole reload: nothing changes
        served = dict(service.adapters())
        config.write_text(f"num_blocks: 64\nmax_queue: 9\nlora_modules:\n  sql: {folders['b']}\n"
                          f"  nope: {tmp_path / 'missing'}\n")
        with pytest.raises(ServiceError, match=r"reload refused, nothing changed: lora_modules: nope='.*missing' "
                                               r"is not a directory"):
            service.reload_from_source("ops")
        assert service.adapters() == served and all(service.adapters()[n] is served[n] for n in served)
        assert service.engine.settings.max_queue != 9
        # the same config again: nothing read again, nothing to say about adapters
        config.write_text(f"num_blocks: 64\nlora_modules:\n  sql: {folders['b']}\n  again: {a_again}\n")
        same = service.reload_from_source("ops")
        assert "adapters" not in same and all(service.adapters()[n] is served[n] for n in served)
    finally:
        go.set()
        service.shutdown(1)


def test_kvctl_config_reload_prints_the_adapters_a_reload_changed():
    from .kvctl_fakes import kvctl_answered

    answer = {"changed": {"lora_modules": [["sql", "/srv/b"], ["again", "/srv/a2"]]},
              "previous": {"lora_modules": [["sql", "/srv/a"], ["chat-b", "/srv/b0"]]}, "needs_restart": [],
              "adapters": {"added": ["again"], "removed": ["chat-b"], "replaced": ["sql"]}}
    sent = []
    printed = kvctl_answered(["config", "reload"], answer, sent)
    assert sent == [("/admin/reload", {})]
    assert printed.exit_code == 0, printed.output
    assert printed.output.splitlines() == [
        "reloaded: lora_modules sql=/srv/a,chat-b=/srv/b0 -> sql=/srv/b,again=/srv/a2",
        "LoRA adapters added: again",
        "LoRA adapters replaced: sql",
        "LoRA adapters removed: chat-b",
        "requests in flight finish on the adapter they came for; `kvctl status` lists them until they have"]


def test_kvd_names_each_prefix_s_adapter_and_evicts_an_adapter_s_blocks_whole(base_dir, expected, tmp_path):
    from dataclasses import replace

    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.status_view import render_status
    from kvctl.tables import size

    from .daemon_fixtures import call, start_service

    folders, _ = expected
    other = write_adapter(tmp_path / "c", ("q_proj",), rank=2, alpha=4, seed=3)
    shutil.copytree(base_dir, tmp_path / "models" / base_dir.name)  # the demo checkpoint, in place
    service = start_service(tmp_path, lora_modules=f"sql={folders['a']},chat={folders['b']}")
    try:
        unix = create_app(service, service.metrics, front="unix")
        second = list(b"Another conversation for the sql adapter, two blocks and more. ")
        body = {"max_tokens": 12, "ignore_eos": True, "temperature": 0}
        sent = [("sql", PROMPT), ("sql", second), ("chat", PROMPT), (base_dir.name, PROMPT)]
        outs = [call(unix, "POST", "/v1/completions", json={**body, "model": m, "prompt": p}).json()
                ["choices"][0]["token_ids"] for m, p in sent]
        engine = service.engine
        # the blocks each one left: its prompt and output but the last token (whose K/V no step wrote)
        keys = {}
        for (model, prompt), out in zip(sent, outs):
            adapter = "" if model == base_dir.name else model
            keys.setdefault(model, []).extend(engine.prefix_keys("default", prompt + out[:-1], adapter)[2])
        digests = {"sql": service.adapters()["sql"].digest, "chat": service.adapters()["chat"].digest,
                   base_dir.name: ""}
        rows = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
        assert {(r["model"], r["adapter_id"]) for r in rows} == {(m, d) for m, d in digests.items()}
        for model in digests:
            mine = call(unix, "GET", "/admin/prefixes", params={"model": model}).json()["prefixes"]
            assert {r["model"] for r in mine} == {model}
            assert sum(r["blocks"] for r in mine) == len(keys[model])
        assert call(unix, "GET", "/admin/prefixes", params={"model": "nope"}).status_code == 404
        status = call(unix, "GET", "/admin/status").json()
        assert [(a["name"], a["cached_blocks"]) for a in status["model"]["adapters"]] == [
            ("sql", len(keys["sql"])), ("chat", len(keys["chat"]))]
        console = Console(record=True, width=200)
        console.print(render_status(status))
        sql_memory = size(service.adapters()["sql"].nbytes)
        assert f"LoRA adapter sql (rank 4, q,k,v,o,gate,up,down, {sql_memory}; {digests['sql'][:12]}): 0 in flight, " \
               f"{len(keys['sql'])} blocks cached" in " ".join(console.export_text().split())

        def cached(model):
            with service.lock:
                return [engine.cache.pool.block_of(k) is not None for k in keys[model]]

        preview = call(unix, "POST", "/admin/evict/preview", json={"model": "sql"}).json()
        assert (preview["evicted_blocks"], preview["target"]) == (len(keys["sql"]), "LoRA adapter sql")
        assert all(cached("sql"))
        gone = call(unix, "POST", "/admin/evict", json={"model": "sql"}).json()
        assert (gone["evicted_blocks"], gone["result"]) == (len(keys["sql"]), "ok")
        assert not any(cached("sql")) and all(cached("chat")) and all(cached(base_dir.name))
        # chat's weights replaced: its blocks stay, under an id no name serves now, until taken by it
        service.reload(replace(service.config, lora_modules=(("sql", str(folders["a"])), ("chat", str(other)))))
        rows = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
        assert {(r["model"], r["adapter_id"]) for r in rows} == {(None, digests["chat"]), (base_dir.name, "")}
        assert call(unix, "POST", "/admin/evict", json={"adapter_id": "deadbeef"}).json()["error"]["message"] == (
            "adapter_id: no LoRA adapter 'deadbeef' is served or has blocks cached here (kvctl prefixes and kvctl "
            "status show their ids)")
        bad = call(unix, "POST", "/admin/evict", json={"adapter_id": "xyz"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "adapter_id", bad.json()
        both = call(unix, "POST", "/admin/evict", json={"model": "sql", "tenant": "default"})
        assert both.status_code == 400 and both.json()["error"]["param"] == "model"
        old = call(unix, "POST", "/admin/evict", json={"adapter_id": digests["chat"][:8]}).json()
        assert old["evicted_blocks"] == len(keys["chat"])
        assert old["target"] == f"LoRA adapter {digests['chat'][:12]} (not served)"
        assert not any(cached("chat")) and all(cached(base_dir.name))
        own = call(unix, "POST", "/admin/evict", json={"model": base_dir.name}).json()
        assert own["evicted_blocks"] == len(keys[base_dir.name]) and not any(cached(base_dir.name))
        assert own["target"] == f"model {base_dir.name} (its own blocks, none of its LoRA adapters')"
        audited = [e["target"] for e in service.store.audit_since(0, action="evict")]
        assert audited[:3] == [own["target"], old["target"], "LoRA adapter sql"]
    finally:
        service.shutdown(1)


def test_kvctl_prefixes_names_the_adapters_and_kvctl_evict_takes_one_whole():
    from typer.testing import CliRunner

    from kvctl.cli import app as kvctl_app

    def row(prefix_id, model, adapter_id):
        return {"prefix_id": prefix_id, "parent_id": None, "root_id": prefix_id, "tenant": "default",
                "adapter_id": adapter_id, "model": model, "start_token": 0, "tokens": 64, "blocks": 4,
                "bytes": 4096, "hits": 1, "idle_seconds": 5.0, "last_use": 0, "tier": "device",
                "tiers": {"device": 4}, "pinned": False, "pinned_blocks": 0, "in_use_blocks": 0, "children": 0,
                "detached": False}

    listings = [{"prefixes": [row("aaaa000011112222", "sql", "3f2a" * 16), row("bbbb000011112222", None, "9c1b" * 16),
                              row("cccc000011112222", "demo", ""), row("dddd000011112222", None, None)], "total": 4},
                {"prefixes": [row("aaaa000011112222", "sql", "3f2a" * 16)], "total": 1},
                # no adapter: a tree restored from disk (adapter not known) beside the model's own
                {"prefixes": [row("cccc000011112222", "demo", ""), row("dddd000011112222", None, None)], "total": 2}]
    asked, sent = [], []

    class Answering:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def get(self, path, **params):
            asked.append((path, params.get("model")))
            return listings[len(asked) - 1]

        def post(self, path, body):
            sent.append((path, body))
            return {"evicted_blocks": 4, "skipped": {}, "result": "ok", "target": "LoRA adapter sql"}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvctl.command_kit.Client", Answering)
        runner = CliRunner()
        mixed = runner.invoke(kvctl_app, ["prefixes"], env={"COLUMNS": "120"})
        alone = runner.invoke(kvctl_app, ["prefixes", "--model", "sql"], env={"COLUMNS": "120"})
        plain = runner.invoke(kvctl_app, ["prefixes"], env={"COLUMNS": "120"})
        evicted = [runner.invoke(kvctl_app, args) for args in (["evict", "--model", "sql"],
                                                                ["evict", "--adapter-id", "9C1B9C1B", "--dry-run"])]
        refused = [runner.invoke(kvctl_app, args) for args in (["evict", "--model", "sql", "--tenant", "acme"],
                                                                ["evict", "--adapter-id", "9c1b"])]
    assert mixed.exit_code == 0, mixed.output
    models = {line.split()[0]: line.split()[2] for line in mixed.output.splitlines() if line[:4] in
              ("aaaa", "bbbb", "cccc", "dddd")}
    assert models == {"aaaa000011112222": "sql", "bbbb000011112222": "lora", "cccc000011112222": "demo",
                      "dddd000011112222": "-"}
    assert "lora 9c1b9c1b9c1b" in mixed.output
    assert alone.exit_code == 0 and "tenant default; model sql; none pinned or in use" in alone.output
    assert plain.exit_code == 0 and plain.output.splitlines()[0].split() == [
        "prefix", "parent", "tokens", "size", "hits", "idle", "tier"]  # no model column without an adapter
    assert asked == [("/admin/prefixes", None), ("/admin/prefixes", "sql"), ("/admin/prefixes", None)]
    assert [e.exit_code for e in evicted] == [0, 0]
    assert sent == [("/admin/evict", {"model": "sql"}), ("/admin/evict/preview", {"adapter_id": "9c1b9c1b"})]
    assert [str(r.exception) for r in refused] == [
        "--model alone takes every block of a LoRA adapter, and with a prompt that prompt's blocks under it; "
        "--adapter-id goes alone",
        "--adapter-id: give 8 or more hex digits of a LoRA adapter's id (kvctl prefixes and kvctl status show them), "
        "got '9c1b'"]


def test_admin_callers_load_and_unload_adapters_at_runtime_through_vllm_s_endpoints(base_dir, expected, tmp_path):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM's: off unless
    lora_runtime_updates, admin callers only, each change audited; what they change outlasts a
    reload of lora_modules (a restart serves lora_modules alone)."""
    from .daemon_fixtures import ADMIN_TOKEN, USER_TOKEN, apps, call, token_table

    folders, tokens = expected
    service, config = reloadable_service(base_dir, tmp_path, f"num_blocks: 64\nlora_modules:\n  sql: {folders['a']}\n")
    try:
        assert service.ready.wait(60), service.load_error
        _, tcp = apps(service, token_table(tmp_path))
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        def load(headers=admin, **body):
            return call(tcp, "POST", "/v1/load_lora_adapter", json=body, headers=headers)

        def unload(name):
            return call(tcp, "POST", "/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)

        def complete(model):
            return call(tcp, "POST", "/v1/completions", headers=admin, json={
                "model": model, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0})

        off = load(lora_name="chat", lora_path=str(folders["b"]))
        assert off.status_code == 403 and off.json()["error"]["message"].startswith(
            "LoRA adapters change at runtime only with lora_runtime_updates on")
        config.write_text(f"num_blocks: 64\nlora_runtime_updates: true\nlora_modules:\n  sql: {folders['a']}\n")
        assert service.reload_from_source("ops")["changed"] == {"lora_runtime_updates": True}
        user = load({"Authorization": f"Bearer {USER_TOKEN}"}, lora_name="chat", lora_path=str(folders["b"]))
        assert user.status_code == 403
        added = load(lora_name="chat", lora_path=str(folders["b"]))
        assert added.status_code == 200, added.json()
        assert (added.json()["name"], added.json()["loaded"], added.json()["replaced"]) == ("chat", True, False)
        assert [m["id"] for m in call(tcp, "GET", "/v1/models", headers=admin).json()["data"]] == [
            base_dir.name, "sql", "chat"]
        assert complete("chat").json()["choices"][0]["token_ids"] == tokens["b"]
        refusals = [load(lora_name="chat", lora_path=str(folders["b"])),
                    load(lora_name="chat2", lora_path="adapters/b"),
                    load(lora_name="chat2", lora_path=str(tmp_path / "missing")),
                    load(lora_name=base_dir.name, lora_path=str(folders["b"])),
                    load(lora_name="bad", lora_path=str(tmp_path))]  # a folder with no adapter in it
        assert [(r.status_code, r.json()["error"]["param"]) for r in refusals] == [
            (400, "lora_name"), (400, "lora_path"), (400, "lora_path"), (400, "lora_name"), (400, "lora_path")]
        assert [r.json()["error"]["message"] for r in refusals] == [
            "lora_name: the LoRA adapter 'chat' has already been loaded (load_inplace: true gives it new weights)",
            "lora_path: give the adapter folder's absolute path, got 'adapters/b'",
            f"lora_path: {str(tmp_path / 'missing')!r} is not a directory on kvd's machine",
            f"lora_name: adapter name {base_dir.name!r} is the base model's name; give the adapter another",
            f"lora_modules: {str(tmp_path)!r} has no adapter_config.json (a PEFT adapter folder, as save_pretrained "
            "writes it)"]
        # new weights under a name served: requests that come after get them
        swapped = load(lora_name="sql", lora_path=str(folders["b"]), load_inplace=True)
        assert swapped.json()["replaced"] is True and complete("sql").json()["choices"][0]["token_ids"] == tokens["b"]
        assert unload("sql").json() == {"name": "sql", "digest": adapter_digest(folders["b"]), "unloaded": True}
        assert complete("sql").status_code == 404
        gone = unload("sql")
        assert gone.status_code == 404 and gone.json()["error"]["message"] == (
            "lora_name: no LoRA adapter 'sql' is loaded (adapters: 'chat')")
        # a reload reads lora_modules again, over which the runtime changes stand until a restart
        again = service.reload_from_source("ops")
        assert "adapters" not in again and list(service.adapters()) == ["chat"]
        status = call(tcp, "GET", "/admin/status", headers=admin).json()
        assert [(a["name"], a["source"]) for a in status["model"]["adapters"]] == [("chat", "runtime")]
        # the config's entry for sql edited: the edit wins over the runtime unload; chat stays as loaded
        config.write_text(f"num_blocks: 64\nlora_runtime_updates: true\nlora_modules:\n  sql: {folders['b']}\n")
        back = service.reload_from_source("ops")
        assert back["adapters"] == {"added": ["sql"], "removed": [], "replaced": []}
        assert [(name, str(a.path)) for name, a in service.adapters().items()] == [
            ("sql", str(folders["b"])), ("chat", str(folders["b"]))]
        assert service.runtime_lora == {"chat": str(folders["b"])}
        audited = [(e["action"], e["target"], e["result"], e["actor"])
                   for e in service.store.audit_since(0) if e["action"].startswith("lora.")]
        actor = "token:2"  # the admin token's line in the token file
        assert audited == [("lora.unload", "lora:sql", "ok", actor), ("lora.load", "lora:sql", "ok", actor),
                           ("lora.load", "lora:bad", "refused", actor), ("lora.load", "lora:chat", "ok", actor)]
    finally:
        service.shutdown(1)


def test_asleep_kvd_loads_no_adapter_nor_reads_one_on_a_reload_and_wakes_serving_the_same(
        base_dir, expected, tmp_path):
    """Asleep, an adapter's weights would go where sleep gave the memory back: POST
    /v1/load_lora_adapter gets the sleep's 503, and a reload that would read an adapter is refused
    (one that keeps them as they are applies). The adapters sleep with the weights (on the CPU,
    where they are already) and serve the same tokens awake."""
    from kvctl.daemon.server.calls import ServiceError

    from .daemon_fixtures import ADMIN_TOKEN, apps, call, token_table

    folders, tokens = expected
    settings = f"num_blocks: 64\nlora_runtime_updates: true\nlora_modules:\n  sql: {folders['a']}\n"
    service, config = reloadable_service(base_dir, tmp_path, settings)
    try:
        assert service.ready.wait(60), service.load_error
        _, tcp = apps(service, token_table(tmp_path))
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        def complete(model):
            return call(tcp, "POST", "/v1/completions", headers=admin, json={
                "model": model, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0})

        def load():
            return call(tcp, "POST", "/v1/load_lora_adapter", headers=admin,
                        json={"lora_name": "chat", "lora_path": str(folders["b"])})

        slept = call(tcp, "POST", "/admin/sleep", headers=admin, json={"level": 2}).json()
        assert (slept["weights"], slept["adapters"], slept["adapter_bytes"]) == ("discarded", "kept", 0)
        refusal = service.asleep.refusal()
        refused = load()
        assert refused.status_code == 503 and refused.json()["error"]["message"] == refusal
        config.write_text(settings + f"  chat: {folders['b']}\n")
        with pytest.raises(ServiceError) as reload_refused:
            service.reload_from_source("ops")
        assert str(reload_refused.value) == ("reload refused, nothing changed: lora_modules: LoRA adapter 'chat' is "
                                             f"read only while kvd is awake, and {refusal}")
        assert list(service.adapters()) == ["sql"]
        config.write_text(settings.replace("num_blocks: 64\n", "num_blocks: 64\nmax_loras: 2\n"))
        assert service.reload_from_source("ops")["changed"] == {"max_loras": 2}  # the adapters kept as they are
        woke = call(tcp, "POST", "/admin/wake", headers=admin, json={}).json()
        assert woke["woke"] == ["kv_cache", "weights"] and "adapters" not in woke  # nothing to copy back
        assert complete("sql").json()["choices"][0]["token_ids"] == tokens["a"]
        assert load().status_code == 200 and complete("chat").json()["choices"][0]["token_ids"] == tokens["b"]
    finally:
        service.shutdown(1)


def test_kvd_router_loads_and_unloads_an_adapter_on_every_replica(base_dir, expected, tmp_path):
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service
    from .test_router import drive, post, router_app

    folders, _ = expected
    for name in ("r0", "r1"):
        shutil.copytree(base_dir, tmp_path / name / "models" / base_dir.name)
    services = [start_service(tmp_path / name, lora_runtime_updates=True) for name in ("r0", "r1")]
    try:
        _, app = router_app([create_app(s, s.metrics, front="unix") for s in services], "prefix")
        served = []

        async def adapters_served(client):
            served.append([list(s.adapters()) for s in services])

        load = {"lora_name": "sql", "lora_path": str(folders["a"])}
        steps = [lambda c: c.post("/v1/load_lora_adapter", json=load), adapters_served,
                 lambda c: post(c, "Served by either replica now.", model="sql"),
                 lambda c: c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), adapters_served,
                 lambda c: c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})]
        loaded, _, answered, unloaded, _, again = drive(app, steps)
        assert loaded.status_code == 200, loaded.json()
        assert (loaded.json()["result"], loaded.json()["digests"]) == ("ok", [adapter_digest(folders["a"])])
        assert [(r["replica"], r["status"]) for r in loaded.json()["replicas"]] == [
            ("replica-0", 200), ("replica-1", 200)]
        assert answered.status_code == 200 and answered.json()["model"] == "sql"
        assert (unloaded.json()["result"], unloaded.json()["unloaded"], "message" in unloaded.json()) == (
            "ok", True, False)
        assert served == [[["sql"], ["sql"]], [[], []]]
        assert again.status_code == 404 and again.json()["error"]["message"] == (
            "lora_name: no LoRA adapter 'sql' is loaded (adapters: none)")
    finally:
        for service in services:
            service.shutdown(deadline=5)


def test_pins_made_under_weights_a_reload_or_an_unload_takes_away_are_stranded_and_unpinned_at_once(
        base_dir, expected, tmp_path, caplog):
    """A pin is block keys made under one adapter's weights: when a reload replaces them or an
    unload takes them away, no request reaches its blocks, which stay pinned against the budget.
    kvd says which pins that stranded (the answer, the log), lists them as stranded (`kvctl pins`,
    `kvctl status`), and `kvctl unpin --stranded` takes exactly those."""
    import logging

    from rich.console import Console

    from kvctl.status_view import render_status

    from .daemon_fixtures import call

    folders, _ = expected
    c = write_adapter(tmp_path / "c", rank=2, alpha=4, seed=3)
    settings = ("num_blocks: 64\npin_budget_blocks: 12\nlora_runtime_updates: true\n"
                "lora_modules:\n  sql: {}\n  chat: {}\n")
    service, config = reloadable_service(base_dir, tmp_path, settings.format(folders["a"], folders["b"]))
    try:
        assert service.ready.wait(60), service.load_error
        from kvctl.daemon.server.app import create_app

        unix = create_app(service, service.metrics, front="unix")
        digests = {name: a.digest for name, a in service.adapters().items()}
        made = {model: call(unix, "POST", "/admin/pins", json={"tokens": PROMPT, "model": model}).json()
                for model in ("sql", "chat", None)}
        assert [made[m]["blocks"] for m in made] == [FULL // 16] * 3
        listed = call(unix, "GET", "/admin/pins").json()["pins"]
        assert [(p["pin_id"], p["model"], p["adapter_id"], p["space"], p["stranded"]) for p in listed] == [
            (made["sql"]["pin_id"], "sql", digests["sql"], service.block_space(), None),
            (made["chat"]["pin_id"], "chat", digests["chat"], service.block_space(), None),
            (made[None]["pin_id"], base_dir.name, "", service.block_space(), None)]
        stored = {row["pin_id"]: (row["space"], row["adapter_id"]) for row in service.store.pins()}
        assert stored == {made["sql"]["pin_id"]: (service.block_space(), digests["sql"]),
                          made["chat"]["pin_id"]: (service.block_space(), digests["chat"]),
                          made[None]["pin_id"]: (service.block_space(), "")}

        # a reload gives sql other weights: its pin is stranded, and the answer and the log say so
        config.write_text(settings.format(c, folders["b"]))
        with caplog.at_level(logging.WARNING, logger="kvd"):
            result = service.reload_from_source("ops")
        assert result["adapters"] == {"added": [], "removed": [], "replaced": ["sql"]}
        sql_row = {"pin_id": made["sql"]["pin_id"], "tenant": "default", "blocks": FULL // 16,
                   "adapter_id": digests["sql"], "stranded": "adapter"}
        assert result["stranded_pins"] == [sql_row]
        assert service.store.audit_since(0, action="reload")[0]["detail"]["stranded_pins"] == [sql_row]
        assert [r.getMessage() for r in caplog.records if "no request can reach" in r.getMessage()] == [
            f"reload by ops: 1 pins ({made['sql']['pin_id']}) hold {FULL // 16} blocks no request can reach now "
            "(made under LoRA weights kvd no longer serves); pin their prompts again, then kvctl unpin --stranded"]
        listed = call(unix, "GET", "/admin/pins").json()["pins"]
        assert [(p["model"], p["stranded"]) for p in listed] == [(None, "adapter"), ("chat", None),
                                                                 (base_dir.name, None)]
        assert call(unix, "GET", "/admin/status").json()["stranded_pins"] == 1
        scraped = [line for line in call(unix, "GET", "/metrics").text.splitlines()
                   if line.startswith("kvd_stranded_pins{")]
        assert scraped == ['kvd_stranded_pins{reason="adapter"} 1.0', 'kvd_stranded_pins{reason="space"} 0.0']
        # the stranded pin holds its share of the budget, and a refusal says so
        over = call(unix, "POST", "/admin/pins", json={"tokens": PROMPT, "model": "sql"})
        assert over.status_code == 409 and over.json()["error"]["message"] == (
            f"tenant 'default': pin budget is 12 blocks, 12 already pinned, this pin adds {FULL // 16}; "
            f"{FULL // 16} of them are held by pins no request reaches any more (kvctl pins marks them stranded), "
            "which `kvctl unpin --stranded` frees")

        # a runtime unload of chat strands its pin; the reload kept nothing else of it
        unloaded = call(unix, "POST", "/v1/unload_lora_adapter", json={"lora_name": "chat"}).json()
        assert unloaded["stranded_pins"] == [{**sql_row, "pin_id": made["chat"]["pin_id"],
                                              "adapter_id": digests["chat"]}]
        status = call(unix, "GET", "/admin/status").json()
        assert (status["pins"], status["stranded_pins"]) == (3, 2)
        console = Console(record=True, width=400)
        console.print(render_status(status))
        [line] = [line for line in console.export_text().splitlines() if line.startswith("pins ")]
        assert line.split(None, 1)[1].rstrip() == (
            "3; 2 stranded: made under weights, scales or a format no longer served, so no request reaches them "
            "(kvctl pins; kvctl unpin --stranded)")

        refused = call(unix, "DELETE", "/admin/pins")
        assert refused.status_code == 400 and refused.json()["error"] == {
            "message": "stranded: DELETE /admin/pins unpins the stranded pins only (stranded=true); unpin one pin by "
                       "its id, DELETE /admin/pins/{pin_id}, or a tenant's, DELETE /admin/tenants/{tenant}/pins",
                       "type": "invalid_request_error", "param": "stranded",
            "code": None}
        swept = call(unix, "DELETE", "/admin/pins", params={"stranded": "true"}).json()
        assert swept == {"unpinned": [{**sql_row, "unpinned_blocks": FULL // 16},
                                      {**sql_row, "pin_id": made["chat"]["pin_id"], "adapter_id": digests["chat"],
                                       "unpinned_blocks": FULL // 16}],
                         "unpinned_blocks": 2 * FULL // 16}
        # sql's new weights do not reach the old pin's blocks; pinned again, the prompt pins new keys
        again = call(unix, "POST", "/admin/pins", json={"tokens": PROMPT, "model": "sql"}).json()
        assert again["pin_id"] not in {p["pin_id"] for p in made.values()} and again["refreshed"] is False
        assert [p["pin_id"] for p in call(unix, "GET", "/admin/pins").json()["pins"]] == [
            made[None]["pin_id"], again["pin_id"]]
        assert sorted(row["pin_id"] for row in service.store.pins()) == sorted([made[None]["pin_id"], again["pin_id"]])
        unpins = [(e["target"], e["detail"]) for e in service.store.audit_since(0, action="unpin")]
        assert sorted(unpins) == sorted([(made["sql"]["pin_id"], {"blocks": FULL // 16, "stranded": "adapter"}),
                                         (made["chat"]["pin_id"], {"blocks": FULL // 16, "stranded": "adapter"})])
        assert call(unix, "GET", "/admin/status").json()["stranded_pins"] == 0
        assert call(unix, "DELETE", "/admin/pins", params={"stranded": "true"}).json() == {
            "unpinned": [], "unpinned_blocks": 0}
    finally:
        service.shutdown(1)


def test_kvctl_pins_marks_stranded_pins_and_kvctl_unpin_takes_an_id_or_stranded(capsys):
    from .test_router import _kvctl_prints

    def pin(pin_id, **fields):
        return {"pin_id": pin_id, "tenant": "default", "blocks": 4, "cached_blocks": 4, "owner": "ops", "note": "",
                "expires_at": None, "expires_in_seconds": None, "space": "ef" * 32, **fields}

    body = {"pins": [pin("pin-00000000000000a1", adapter_id="12" * 32, model="sql", stranded=None, note="sql prompt"),
                     pin("pin-00000000000000b2", adapter_id="ab" * 32, model=None, stranded="adapter",
                         cached_blocks=0)]}
    assert [line.rstrip() for line in _kvctl_prints(["pins"], body).splitlines()] == [
        "pin                  tenant  model             blocks cached     owner expires in note",
        "pin-00000000000000a1 default sql               4      4          ops   never      sql prompt",
        "pin-00000000000000b2 default lora abababababab 4      0 stranded ops   never",
        "stranded: made under LoRA weights kvd no longer serves (a reload or an unload took them away), so no",
        "request reaches them; pin the prompts again, then `kvctl unpin --stranded`"]
    plain = {"pins": [pin("pin-00000000000000c3", adapter_id="", model="kvd-demo", stranded=None)]}
    assert _kvctl_prints(["pins"], plain).splitlines()[0].split() == [  # no adapter: no model column
        "pin", "tenant", "blocks", "cached", "owner", "expires", "in", "note"]
    from kvctl.cli import main

    for args, said in ((["unpin"], "a pin's id, --stranded or --tenant, not neither"),
                       (["unpin", "pin-00000000000000a1", "--stranded"],
                        "a pin's id, or --stranded or --tenant, not both")):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2
        assert capsys.readouterr().err == f"error: pin_id: give {said}\n"
    assert _kvctl_prints(["unpin", "--stranded"], {"unpinned": [], "unpinned_blocks": 0}) == "no stranded pins\n"
    assert _kvctl_prints(["unpin", "pin-00000000000000a1"], {"pin_id": "pin-00000000000000a1", "unpinned_blocks": 3,
                                                             "dropped_stale_blocks": 3}) == (
        "unpinned pin-00000000000000a1 (3 blocks); 3 cached blocks dropped with them\n")
    reloaded = {"changed": {}, "previous": {}, "needs_restart": [], "adapters": {"added": [], "removed": [],
                                                                               "replaced": ["sql"]},
                "stranded_pins": [{"pin_id": "pin-00000000000000a1", "tenant": "default", "blocks": 4,
                                   "adapter_id": "12" * 32, "stranded": "adapter"}]}
    assert _kvctl_prints(["config", "reload"], reloaded).splitlines()[-1] == (
        "pins stranded on the weights taken away (pin-00000000000000a1: 4 blocks): no request reaches them now; pin "
        "their prompts again (--model NAME), then `kvctl unpin --stranded`")


def test_an_adapter_read_while_kvd_serves_is_weighed_against_the_gpu_room_beside_the_steps_workspace(
        base_dir, expected, tmp_path, monkeypatch):
    """Its packed weights' bytes (what the model's device holds of them, block-diagonal B and
    all), asked of the room check before they go to the device; one that does not fit beside the
    largest step's workspace is refused, at runtime (409) and in a reload, with nothing loaded."""
    from rich.console import Console

    from kvctl.daemon.model.demo import DEMO_CONFIG
    from kvctl.daemon.model.llama import load_model
    from kvctl.daemon.model.lora import load_adapter
    from kvctl.daemon.server import lora_ops, reload_ops
    from kvctl.daemon.model.lora import NoRoomForAdapter
    from kvctl.daemon.server.adapter_room import gpu_room, room_refusal
    from kvctl.status_view import render_status

    from .daemon_fixtures import call

    # fits exactly what is free beside the workspace; one byte more does not
    assert room_refusal("sql", 1000, 3000, 2000) is None
    assert room_refusal("sql", 3 * 2**20 + 1, 5 * 2**20, 2 * 2**20) == (
        "LoRA adapter 'sql' needs 3.0 MiB of GPU memory, and 3.0 MiB is free beside the 2.0 MiB the largest step so "
        "far has needed: unload an adapter, or give the cache less memory (cache_memory) at the next start")
    assert gpu_room(torch.device("cpu")) is None  # the host's memory is not planned the same way

    folders, tokens = expected
    loaded = load_model(base_dir)
    asked = []
    adapter = load_adapter("sql", folders["a"], loaded.config, torch.device("cpu"), torch.float32,
                           lambda name, nbytes: asked.append((name, nbytes)))
    hidden, inter, r = DEMO_CONFIG["hidden_size"], DEMO_CONFIG["intermediate_size"], 4
    q = DEMO_CONFIG["num_attention_heads"] * DEMO_CONFIG["head_dim"]
    kv = DEMO_CONFIG["num_key_value_heads"] * DEMO_CONFIG["head_dim"]
    per_layer = (3 * r * hidden + (q + 2 * kv) * 3 * r  # qkv: A stacked, B block-diagonal
                 + r * q + hidden * r  # o
                 + 2 * r * hidden + 2 * inter * 2 * r  # gate_up
                 + r * inter + hidden * r)  # down
    assert asked == [("sql", per_layer * DEMO_CONFIG["num_hidden_layers"] * 4)]  # float32
    assert adapter.nbytes == asked[0][1] and adapter.describe()["bytes"] == adapter.nbytes
    from kvctl.capacity import ModelShape, lora_bytes

    assert lora_bytes(ModelShape.from_model_dir(base_dir), 4) == adapter.nbytes  # kvctl capacity plans the same

    def no_room(device):
        def check(name, nbytes):
            raise NoRoomForAdapter(room_refusal(name, nbytes, 2**10, 0))
        return check

    service, config = reloadable_service(
        base_dir, tmp_path, f"num_blocks: 64\nlora_runtime_updates: true\nlora_modules:\n  sql: {folders['a']}\n")
    try:
        assert service.ready.wait(60), service.load_error
        from kvctl.daemon.server.app import create_app

        unix = create_app(service, service.metrics, front="unix")
        monkeypatch.setattr(lora_ops, "gpu_room", no_room)
        monkeypatch.setattr(reload_ops, "gpu_room", no_room)
        refused = call(unix, "POST", "/v1/load_lora_adapter",
                       json={"lora_name": "chat", "lora_path": str(folders["b"])})
        b_bytes = load_adapter("chat", folders["b"], loaded.config, torch.device("cpu"), torch.float32).nbytes
        message = (f"LoRA adapter 'chat' needs {b_bytes / 2**10:,.1f} KiB of GPU memory, and 1.0 KiB is free beside "
                   "the 0 B the largest step so far has needed: unload an adapter, or give the cache less memory "
                   "(cache_memory) at the next start")
        assert refused.status_code == 409 and refused.json()["error"]["message"] == message
        assert refused.json()["error"]["param"] == "lora_path" and list(service.adapters()) == ["sql"]
        [entry] = service.store.audit_since(0, action="lora.load")
        assert (entry["result"], entry["detail"]) == ("refused", {"error": message})
        config.write_text(f"num_blocks: 64\nlora_runtime_updates: true\nlora_modules:\n  sql: {folders['a']}\n"
                          f"  chat: {folders['b']}\n")
        with pytest.raises(Exception, match="reload refused, nothing changed: LoRA adapter 'chat' needs"):
            service.reload_from_source("ops")
        assert list(service.adapters()) == ["sql"]
        status = call(unix, "GET", "/admin/status").json()
        assert [a["bytes"] for a in status["model"]["adapters"]] == [adapter.nbytes]
        # max_loras changes live (and an unchanged adapter is not weighed again)
        config.write_text(f"num_blocks: 64\nlora_runtime_updates: true\nmax_loras: 1\nlora_modules:\n"
                          f"  sql: {folders['a']}\n")
        assert service.reload_from_source("ops")["changed"] == {"max_loras": 1}
        assert service.engine.settings.max_loras == 1
        status = call(unix, "GET", "/admin/status").json()
        assert (status["model"]["max_loras"], status["model"]["lora_turns_waiting"]) == (1, 0)
        console = Console(record=True, width=200)
        console.print(render_status(status))
        assert [line.split(None, 2)[2].rstrip() for line in console.export_text().splitlines()
                if line.startswith("LoRA batch")] == ["at most 1 adapters in a batch"]
    finally:
        service.shutdown(1)


def test_max_loras_holds_a_new_adapter_s_requests_until_a_running_one_drains_and_never_starves_them(
        base_dir, expected, tmp_path):
    """With max_loras 2: a request for a third adapter waits while two run; the model's requests
    go past it, adapter requests behind it (even of an adapter running) wait with it, so it gets
    the first turn that frees. Each request's tokens are its adapter's."""
    folders, tokens = expected
    c = write_adapter(tmp_path / "c", rank=2, alpha=4, seed=3)
    loaded = load_model(base_dir)
    loaded.adapters = load_adapters(modules(a=folders["a"], b=folders["b"], c=c), loaded, "demo")

    def admitted_in_turns(max_loras):
        engine = Engine(loaded, EngineSettings(num_blocks=128, block_size=16, max_loras=max_loras))
        def send(name, prompt, params=GREEDY, adapter=""):
            return engine.add_request(prompt, params, request_id=name, adapter=adapter)

        sent = {"a1": send("a1", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), "a"),
                "b1": send("b1", PROMPT, adapter="b"), "c1": send("c1", PROMPT, adapter="c"),
                # (another prompt: one sharing a1's would wait a step for a1's blocks, in-batch sharing)
                "a2": send("a2", OTHER, adapter="a"),
                "b2": send("b2", OTHER, adapter="b"),  # b runs: it would go ahead of c1
                "base": send("base", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))}
        turns, seen, waiting = [], set(), []
        while engine.has_work():
            engine.step()
            new = [name for name, r in sent.items() if name not in seen and r.metrics.admitted is not None]
            if new:
                turns.append(new)
                seen.update(new)
                waiting.append(sorted(engine.lora_turn_waiters))
        assert sent["a1"].sequences[0].output_ids == tokens["a"][:2]
        assert sent["b1"].sequences[0].output_ids == tokens["b"]
        return turns, waiting

    assert admitted_in_turns(None) == ([["a1", "b1", "c1", "a2", "b2", "base"]], [[]])
    # a1 ends after two tokens: c1 takes its turn, and b2 (b running) does not pass it; b1 ends: a2's
    # turn; then b2's
    assert admitted_in_turns(2) == ([["a1", "b1", "base"], ["c1"], ["a2"], ["b2"]],
                                    [["a2", "b2", "c1"], ["a2", "b2"], ["b2"], []])
    with pytest.raises(ValueError, match=r"^max_loras: must be >= 1, got 0$"):
        Engine(loaded, EngineSettings(num_blocks=16, max_loras=0))


def test_kvctl_requests_and_status_show_a_request_waiting_for_an_adapter_s_turn(base_dir, expected, tmp_path):
    import time

    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.calls import Principal
    from kvctl.requests_cmd import render_requests
    from kvctl.status_view import render_status

    from .daemon_fixtures import call

    folders, tokens = expected
    service, _ = reloadable_service(base_dir, tmp_path, f"num_blocks: 512\nmax_loras: 1\nlora_modules:\n"
                                                         f"  sql: {folders['a']}\n  chat: {folders['b']}\n")
    try:
        assert service.ready.wait(60), service.load_error
        unix = create_app(service, service.metrics, front="unix")
        long = SamplingParams(max_tokens=7000, ignore_eos=True)  # runs until it is cancelled
        [busy] = service.submit([PROMPT], long, Principal("default", "admin", "t"), lambda event: None, "sql")
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(call(unix, "POST", "/v1/completions", json={
            "model": "chat", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0})))
        waiter.start()
        for _ in range(200):
            listed = call(unix, "GET", "/admin/requests").json()
            rows = listed["requests"]
            if any(row["waiting_for_lora_turn"] for row in rows):
                break
            time.sleep(0.02)
        assert [(r["adapter"], r["state"], r["waiting_for_lora_turn"]) for r in rows] == [
            ("sql", "decode", False), ("chat", "waiting", True)]
        console = Console(width=160, record=True)
        console.print(render_requests(listed))
        assert "waiting (for an adapter's turn)" in console.export_text()
        status = call(unix, "GET", "/admin/status").json()
        assert (status["model"]["max_loras"], status["model"]["lora_turns_waiting"]) == (1, 1)
        console = Console(record=True, width=200)
        console.print(render_status(status))
        assert [line.split(None, 2)[2].rstrip() for line in console.export_text().splitlines()
                if line.startswith("LoRA batch")] == [
            "at most 1 adapters in a batch; 1 requests wait for an adapter's turn"]
        service.cancel(busy.request_id)  # sql's turn ends: chat's comes
        waiter.join(60)
        assert answers[0].json()["choices"][0]["token_ids"] == tokens["b"]
    finally:
        service.shutdown(1)
