"""LoRA adapters change without a restart: a reload (SIGHUP, `kvctl config reload`) adds, replaces
and takes away adapters as lora_modules says, reads again only the adapters whose files changed,
and leaves every request in flight on the adapter it came for (its tokens, its blocks); an
adapter it cannot serve refuses the whole reload."""

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
from kvctl.daemon.model.lora import adapter_changes, load_adapters  # noqa: E402

from .lora_cases import merged_checkpoint, write_adapter  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = list(b"A reload swaps the adapter; the request keeps the weights it began on. ")
FULL = len(PROMPT) // 16 * 16  # the prompt's tokens in full blocks: what a later request can hit


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

    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.calls import Principal, ServiceError
    from kvctl.daemon.server.metrics import Metrics
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store
    from kvctl.status_view import render_status

    from .daemon_fixtures import call

    folders, tokens = expected
    a_again = shutil.copytree(folders["a"], tmp_path / "a-again")
    shutil.copytree(base_dir, tmp_path / "state" / "models" / base_dir.name)  # the demo checkpoint, in place
    config = tmp_path / "kvd.yaml"
    config.write_text(f"num_blocks: 64\nlora_modules:\n  sql: {folders['a']}\n  chat-b: {folders['b']}\n")
    flags = {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "kvd.sock")}
    service = EngineService(resolve(flags, {}, config), Store(tmp_path / "kvd.sqlite3"))
    service.metrics = Metrics(service)
    service.config_source = lambda: resolve(flags, {}, config)
    service.start()
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
        assert status["model"]["retiring_adapters"] == [
            {"name": "sql", "digest": old_sql.digest, "requests": 1, "replaced": True}]
        console = Console(record=True, width=160)
        console.print(render_status(status))
        assert f"LoRA adapter sql ({old_sql.digest[:12]}): replaced by a reload; 1 in flight finish on it" in \
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
    from typer.testing import CliRunner

    from kvctl.cli import app as kvctl_app

    answer = {"changed": {"lora_modules": [["sql", "/srv/b"], ["again", "/srv/a2"]]},
              "previous": {"lora_modules": [["sql", "/srv/a"], ["chat-b", "/srv/b0"]]}, "needs_restart": [],
              "adapters": {"added": ["again"], "removed": ["chat-b"], "replaced": ["sql"]}}

    class Answering:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def post(self, path, body):
            assert path == "/admin/reload"
            return answer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvctl.command_kit.Client", Answering)
        printed = CliRunner().invoke(kvctl_app, ["config", "reload"], env={"COLUMNS": "200"})
    assert printed.exit_code == 0, printed.output
    assert printed.output.splitlines() == [
        "reloaded: lora_modules sql=/srv/a,chat-b=/srv/b0 -> sql=/srv/b,again=/srv/a2",
        "LoRA adapters added: again",
        "LoRA adapters replaced: sql",
        "LoRA adapters removed: chat-b",
        "requests in flight finish on the adapter they came for; `kvctl status` lists them until they have"]
