"""LoRA adapters served beside the base model: the logits and greedy tokens of the checkpoint with
the adapter merged into it, one batch mixing adapters, a prefix cache of their own per adapter
(and shared by two names for the same files), errors that name the file and field, and the HTTP
surface (`model` picks the adapter, /v1/models lists them)."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvctl.daemon.config import ConfigError, resolve  # noqa: E402
from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402
from kvctl.daemon.engine.sampling import RequestError, SamplingParams  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.errors import ModelError  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.daemon.model.lora import load_adapter, load_adapters  # noqa: E402

from .lora_cases import lora_tensors, merged_checkpoint, write_adapter  # noqa: E402
from .test_model import full_forward_logits  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    """Adapter folders: `a` (every projection), `b` (q and v only, rsLoRA), `a_copy` (a's files in
    another folder), and each one's merged checkpoint."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {"a": write_adapter(root / "a", ALL, rank=4, alpha=8, seed=1),
               "b": write_adapter(root / "b", ("q_proj", "v_proj"), rank=2, alpha=4, seed=2, use_rslora=True)}
    folders["a_copy"] = root / "a_copy"
    shutil.copytree(folders["a"], folders["a_copy"])
    merged = {name: merged_checkpoint(base_dir, folders[name], root / f"merged-{name}") for name in ("a", "b")}
    return folders, merged


def serving(base_dir, modules):
    loaded = load_model(base_dir)
    loaded.adapters = load_adapters(tuple((name, str(path)) for name, path in modules.items()), loaded, "demo")
    return loaded


def greedy(loaded, prompt, **settings):
    engine = Engine(loaded, EngineSettings(**{"num_blocks": 64, "block_size": 16, **settings}))
    request = engine.add_request(prompt, GREEDY)
    engine.run_until_done()
    return request.sequences[0].output_ids


PROMPT = list(b"An adapter's prefix is its own, block by block, in every tier. ")


@pytest.mark.parametrize("modules", [ALL, ("q_proj", "v_proj"), ("gate_proj", "down_proj"), ("k_proj",)])
def test_an_adapter_gives_the_logits_of_its_checkpoint_with_the_adapter_merged(base_dir, tmp_path, modules):
    folder = write_adapter(tmp_path / "adapter", modules, rank=3, alpha=6, seed=5)
    merged = load_model(merged_checkpoint(base_dir, folder, tmp_path / "merged"))
    loaded = serving(base_dir, {"x": folder})
    adapter = loaded.adapters["x"]
    assert adapter.modules == tuple(m for m in ALL if m in modules) and adapter.rank == 3
    base_logits = full_forward_logits(loaded, PROMPT)
    adapted = full_forward_logits(loaded, PROMPT, lora=[(adapter, None)])
    # the same rows named one by one take the other path (index_add_), with the same result
    by_rows = full_forward_logits(loaded, PROMPT, lora=[(adapter, torch.arange(len(PROMPT)))])
    torch.testing.assert_close(by_rows, adapted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adapted, full_forward_logits(merged, PROMPT), atol=1e-4, rtol=1e-4)
    assert (adapted - base_logits).abs().max() > 0.05  # the adapter changes what the model says


def test_one_batch_mixes_the_base_model_and_two_adapters_each_as_it_would_run_alone(base_dir, adapters):
    folders, merged = adapters
    loaded = serving(base_dir, {"a": folders["a"], "b": folders["b"]})
    prompts = [PROMPT, PROMPT[:40], list(b"A second prompt, longer than one chunk of the step's budget."),
               PROMPT[5:]]
    who = ["", "a", "b", "a"]
    expected = {"": load_model(base_dir), "a": load_model(merged["a"]), "b": load_model(merged["b"])}
    alone = [greedy(expected[name], prompt) for name, prompt in zip(who, prompts)]
    assert len({tuple(tokens) for tokens in alone}) == 4
    # a small step budget: prompts go in chunks while the others decode, rows of every adapter in a step
    engine = Engine(loaded, EngineSettings(num_blocks=64, block_size=16, max_batch_tokens=24))
    requests = [engine.add_request(prompt, GREEDY, adapter=name) for name, prompt in zip(who, prompts)]
    mixed_steps = 0
    while engine.has_work():
        running = {r.adapter for r in requests if any(s.seq_id in engine._running for s in r.sequences)}
        mixed_steps += len(running) == 3
        engine.step()
        engine.cache.audit()
    assert mixed_steps > 0
    assert [r.sequences[0].output_ids for r in requests] == alone


def test_an_adapters_blocks_are_its_own_and_two_names_for_one_adapter_share_them(base_dir, adapters):
    folders, _ = adapters
    loaded = serving(base_dir, {"a": folders["a"], "a_copy": folders["a_copy"], "b": folders["b"]})
    engine = Engine(loaded, EngineSettings(num_blocks=64, block_size=16))
    assert loaded.adapters["a"].digest == loaded.adapters["a_copy"].digest != loaded.adapters["b"].digest
    assert engine.namespace("default", "a").adapter_id == loaded.adapters["a"].digest
    assert engine.namespace("default").adapter_id == ""
    cached = []
    for adapter in ("", "a", "", "a", "a_copy", "b"):
        request = engine.add_request(PROMPT, GREEDY, adapter=adapter)
        engine.run_until_done()
        cached.append(request.metrics.cached_tokens)
    full = len(PROMPT) // 16 * 16
    # base: cold; a: cold (the base model's blocks are not its); base and a again: their own hits;
    # a_copy: a's blocks (the same files); b: cold
    assert cached == [0, 0, full, full, full, 0]
    engine.cache.audit()


def test_a_request_for_an_adapter_not_loaded_is_refused_naming_it(base_dir, adapters):
    folders, _ = adapters
    engine = Engine(serving(base_dir, {"a": folders["a"]}), EngineSettings(num_blocks=16, block_size=16))
    with pytest.raises(RequestError, match=r"^model: no LoRA adapter 'c' is loaded \(adapters: 'a'\)$"):
        engine.add_request(PROMPT, GREEDY, adapter="c")
    assert not engine.requests and engine.cache.state_counts()["free"] == 16


def test_rslora_and_alpha_pattern_scale_as_peft_does(base_dir, tmp_path):
    loaded = load_model(base_dir)
    tensors = lora_tensors(("q_proj", "v_proj"), rank=4, seed=3, layers=[0])
    plain = load_adapter("p", write_adapter(tmp_path / "p", ("q_proj", "v_proj"), rank=4, alpha=8, tensors=tensors),
                         loaded.config, loaded.model.device, loaded.model.dtype)
    rs = load_adapter("r", write_adapter(tmp_path / "r", ("q_proj", "v_proj"), rank=4, alpha=8, tensors=tensors,
                                         use_rslora=True), loaded.config, loaded.model.device, loaded.model.dtype)
    pattern = load_adapter("t", write_adapter(tmp_path / "t", ("q_proj", "v_proj"), rank=4, alpha=8,
                                              tensors=tensors, alpha_pattern={"v_proj": 2}),
                           loaded.config, loaded.model.device, loaded.model.dtype)
    q_rows, v_rows = slice(0, 128), slice(192, 256)  # the packed qkv rows of q (2 heads x 64) and v (1 x 64)
    b_q = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    b_v = tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    for adapter, q_scale, v_scale in ((plain, 2.0, 2.0), (rs, 4.0, 4.0), (pattern, 2.0, 0.5)):
        b = adapter.layers[0]["qkv"].b
        torch.testing.assert_close(b[q_rows, 0:4], b_q * q_scale)
        torch.testing.assert_close(b[v_rows, 4:8], b_v * v_scale)
        assert not b[128:192].any() and not b[q_rows, 4:8].any()  # k: untouched; q sees only its own ranks
    assert adapter.layers[1] == {}  # layer 1: not adapted


def _config(folder, **fields):
    settings = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**settings, **fields}))


def _tensors(folder, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "adapter_model.safetensors"))


KEY = "base_model.model.model.layers.0.self_attn.q_proj"
BAD = [
    (lambda f: shutil.rmtree(f), r"lora_modules: x='.*/x' is not a directory"),
    (lambda f: (f / "adapter_config.json").unlink(), r"has no adapter_config.json \(a PEFT adapter folder"),
    (lambda f: (f / "adapter_config.json").write_text("{"), r"adapter_config.json: not JSON"),
    (lambda f: (f / "adapter_model.safetensors").unlink(), r"has no adapter_model.safetensors"),
    (lambda f: (f / "adapter_model.safetensors").write_bytes(b"torn"), r"cannot be read as safetensors"),
    (lambda f: _config(f, peft_type="PREFIX_TUNING"), r"peft_type 'PREFIX_TUNING' is not LORA"),
    (lambda f: _config(f, use_dora=True), r"use_dora true is not supported"),
    (lambda f: _config(f, bias="all"), r"bias 'all' is not supported"),
    (lambda f: _config(f, modules_to_save=["lm_head"]), r"modules_to_save \['lm_head'\] is not supported"),
    (lambda f: _config(f, lora_alpha="eight"), r"lora_alpha must be a number, got 'eight'"),
    (lambda f: _tensors(f, lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                                               torch.zeros(2, 2)})),
     r"tensor 'base_model.model.model.embed_tokens.lora_embedding_A' is not a LoRA weight of a layer's"),
    (lambda f: _tensors(f, lambda t: t.update({KEY.replace("layers.0", "layers.2") + ".lora_A.weight":
                                               torch.zeros(4, 128)})),
     r"is for layer 2, and the model has 2"),
    (lambda f: _tensors(f, lambda t: t.pop(KEY + ".lora_B.weight")), r"layer 0 q_proj has lora_A without lora_B"),
    (lambda f: _tensors(f, lambda t: t.update({KEY + ".lora_A.weight": torch.zeros(4, 100)})),
     r"layer 0 q_proj: lora_A \(4, 100\) and lora_B \(128, 4\) do not fit a \[128, 128\] projection"),
    (lambda f: _tensors(f, lambda t: t[KEY + ".lora_B.weight"].__setitem__((0, 0), float("nan"))),
     r"layer 0 q_proj: holds a value that is not finite"),
]


@pytest.mark.parametrize("spoil, message", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_an_adapter_kvd_cannot_serve_is_refused_naming_the_file_and_what_is_wrong(base_dir, tmp_path, spoil, message):
    folder = write_adapter(tmp_path / "x", ("q_proj", "v_proj"))
    spoil(folder)
    loaded = load_model(base_dir)
    with pytest.raises(ModelError, match=message):
        load_adapters((("x", str(folder)),), loaded, "demo")


def test_adapter_names_and_lora_modules_settings_are_checked(base_dir, tmp_path):
    folder = write_adapter(tmp_path / "x", ("q_proj",))
    loaded = load_model(base_dir)
    with pytest.raises(ModelError, match=r"adapter name 'demo' is the base model's name"):
        load_adapters((("demo", str(folder)),), loaded, "demo")
    with pytest.raises(ModelError, match=r"adapter name 'a b' must be 1-128 letters"):
        load_adapters((("a b", str(folder)),), loaded, "demo")
    config = resolve({"lora_modules": f"x={folder}, y = {folder}"}, env={})
    assert config.lora_modules == (("x", str(folder)), ("y", str(folder)))
    assert resolve({}, env={"KVD_LORA_MODULES": f"x={folder}"}).lora_modules == (("x", str(folder)),)
    yaml_file = tmp_path / "kvd.yaml"
    yaml_file.write_text(f"lora_modules:\n  sql: {folder}\n")
    assert resolve({}, env={}, config_file=yaml_file).lora_modules == (("sql", str(folder)),)
    for value, message in (("x", "expected NAME=DIR, got 'x'"), ("x=", "expected NAME=DIR, got 'x'=''"),
                           (f"x={folder},x={folder}", "adapter 'x' is given twice")):
        with pytest.raises(ConfigError, match=rf"lora_modules.*{message}"):
            resolve({"lora_modules": value}, env={})


def test_kvd_serves_each_adapter_under_its_name_with_its_own_cached_prefixes(base_dir, adapters, tmp_path):
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, sse_events, start_service

    folders, merged = adapters
    shutil.copytree(base_dir, tmp_path / "models" / base_dir.name)  # the same demo checkpoint, found in place
    service = start_service(tmp_path, lora_modules=f"sql={folders['a']},chat-b={folders['b']}")
    try:
        unix = create_app(service, service.metrics, front="unix")
        listed = call(unix, "GET", "/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            (base_dir.name, None), ("sql", base_dir.name), ("chat-b", base_dir.name)]
        assert call(unix, "GET", "/v1/models/sql").json() == listed[1]
        body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        answers = [call(unix, "POST", "/v1/completions", json={**body, "model": model}).json()
                   for model in ("sql", "sql", base_dir.name, "chat-b")]
        assert [a["model"] for a in answers] == ["sql", "sql", base_dir.name, "chat-b"]
        tokens = [a["choices"][0]["token_ids"] for a in answers]
        assert tokens[0] == tokens[1] == greedy(load_model(merged["a"]), PROMPT)
        assert tokens[2] == greedy(load_model(base_dir), PROMPT)
        assert tokens[3] == greedy(load_model(merged["b"]), PROMPT)
        full = len(PROMPT) // 16 * 16
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, full, 0, 0]
        streamed = sse_events(call(unix, "POST", "/v1/completions", json={**body, "model": "chat-b", "stream": True}))
        assert {e["model"] for e in streamed[:-1]} == {"chat-b"}
        assert [t for e in streamed[:-1] for c in e["choices"] for t in c["token_ids"]] == tokens[3]
        chat = call(unix, "POST", "/v1/chat/completions", json={
            "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["model"] == "sql"
        unknown = call(unix, "POST", "/v1/completions", json={**body, "model": "sq1"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == (f"model: 'sq1' is not served here; GET /v1/models lists "
                                                      f"{base_dir.name!r}, 'sql', 'chat-b'")
        assert call(unix, "POST", "/tokenize", json={"model": "sql", "prompt": "hi"}).status_code == 200
        # kvctl explain --model: the adapter's own blocks, and why the model's do not serve it
        only_base = list(b"Cached for the model alone, and never for an adapter of it. ")
        call(unix, "POST", "/v1/completions", json={**body, "prompt": only_base, "max_tokens": 1})
        explained = call(unix, "POST", "/admin/explain", json={"tokens": only_base, "model": "sql"}).json()
        assert (explained["hit_tokens"], explained["adapter"]) == (0, "sql")
        assert explained["first_miss"]["reason"] == "other_namespace"
        assert explained["first_miss"]["detail"] == (f"cached for the model {base_dir.name!r}; a LoRA adapter's "
                                                     "blocks are its own (its K and V are not the model's)")
        hit = call(unix, "POST", "/admin/explain", json={"tokens": PROMPT, "model": "sql"}).json()
        assert hit["hit_tokens"] == full
        assert call(unix, "POST", "/admin/explain", json={"tokens": PROMPT, "model": "x"}).status_code == 404
        # pins and evictions of a prompt under an adapter: its own blocks, the model's untouched
        system = list(b"A system prompt pinned for the sql adapter only, two blocks long at least. ")
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": system, "model": "sql", "note": "sql bot"}).json()
        blocks = len(system) // 16
        assert pinned["blocks"] == blocks
        sql_keys = service.engine.prefix_keys("default", system, "sql")[2]
        base_keys = service.engine.prefix_keys("default", system)[2]
        with service.lock:
            pool = service.engine.cache.pool
            assert all(pool.block_of(k) is not None and pool.blocks[pool.block_of(k)].pin_count == 1 for k in sql_keys)
            assert all(pool.block_of(k) is None for k in base_keys)  # warmed under the adapter alone
        refused = call(unix, "POST", "/admin/pins", json={"prefix": "abcd", "model": "sql"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        call(unix, "DELETE", f"/admin/pins/{pinned['pin_id']}")
        call(unix, "POST", "/v1/completions", json={**body, "prompt": system, "max_tokens": 1})  # the model's too
        gone = call(unix, "POST", "/admin/evict", json={"tokens": system, "model": "sql"}).json()
        assert gone["evicted_blocks"] == blocks and gone["target"].endswith("(tenant default, LoRA adapter sql)")
        with service.lock:
            assert all(pool.block_of(k) is None for k in sql_keys)
            assert all(pool.block_of(k) is not None for k in base_keys)
        alone = call(unix, "POST", "/admin/evict", json={"tenant": "default", "model": "sql"})
        assert alone.status_code == 400 and alone.json()["error"]["param"] == "model"
        scraped = call(unix, "GET", "/metrics").text
        assert [line for line in scraped.splitlines() if line.startswith("kvd_lora_requests{")] == [
            'kvd_lora_requests{adapter="sql",state="running"} 0.0',
            'kvd_lora_requests{adapter="sql",state="waiting"} 0.0',
            'kvd_lora_requests{adapter="chat-b",state="running"} 0.0',
            'kvd_lora_requests{adapter="chat-b",state="waiting"} 0.0']
        from prometheus_client import generate_latest
        with service.lock:  # a request the engine has queued and not yet admitted: waiting
            queued = service.engine.add_request(PROMPT, GREEDY, adapter="chat-b")
            lines = generate_latest(service.metrics.registry).decode().splitlines()
            service.engine.cancel(queued.request_id)
            service.engine.requests.pop(queued.request_id)
        assert 'kvd_lora_requests{adapter="chat-b",state="waiting"} 1.0' in lines
        # kvctl status: each adapter, what it adapts and its id
        status = call(unix, "GET", "/admin/status").json()
        assert [(a["name"], a["rank"], a["modules"], a["requests"]) for a in status["model"]["adapters"]] == [
            ("sql", 4, list(ALL), 0), ("chat-b", 2, ["q_proj", "v_proj"], 0)]
        from rich.console import Console

        from kvctl.status_view import render_status
        console = Console(record=True, width=160)
        console.print(render_status(status))
        text = console.export_text()
        digest = service.adapters()["sql"].digest[:12]
        rows = [line.split() for line in text.splitlines() if line.startswith("LoRA adapter")]
        held = status["model"]["adapters"][0]["cached_blocks"]  # its device blocks (test_lora_reload counts them)
        weights = [a.nbytes / 2**10 for a in service.adapters().values()]  # KiB: the demo model's adapters are small
        assert rows[0] == ["LoRA", "adapter", "sql", "(rank", "4,", "q,k,v,o,gate,up,down,", f"{weights[0]:.1f}",
                           "KiB;", f"{digest}):", "0", "in", "flight,", str(held), "block" if held == 1 else "blocks",
                           "cached"]
        assert rows[1][:8] == ["LoRA", "adapter", "chat-b", "(rank", "2,", "q,v,", f"{weights[1]:.1f}", "KiB;"]
        assert len(rows) == 2
        # the trace: an adapter's prompt chains apart from the model's, as its blocks do
        lines = call(unix, "GET", "/admin/trace").json()["requests"]
        by_model = [line["hash_ids"] for line in lines[:4]]  # PROMPT for sql, sql, the model, chat-b
        assert by_model[0] == by_model[1] and len({tuple(ids) for ids in by_model}) == 3
        shown = call(unix, "GET", "/admin/config").json()
        assert shown["config"]["lora_modules"] == [["sql", str(folders["a"])], ["chat-b", str(folders["b"])]]
    finally:
        service.shutdown(1)


def test_kvd_does_not_start_with_an_adapter_it_cannot_serve(tmp_path):
    from kvctl.daemon.config import resolve as resolve_config
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    folder = write_adapter(tmp_path / "wide", ("q_proj",), tensors={
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 2)})
    config = resolve_config({"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), "num_blocks": 16,
                             "lora_modules": f"wide={folder}"}, env={})
    service = EngineService(config, Store(tmp_path / "kvd.sqlite3"))
    with pytest.raises(ModelError, match=r"layer 0 q_proj: lora_A \(2, 64\) and lora_B \(128, 2\) do not fit"):
        service.load()


@pytest.mark.parametrize("view", ["ask", "events"])
def test_kvd_router_sends_an_adapters_requests_where_it_is_served_and_weighs_the_adapters_own_blocks(
        base_dir, adapters, tmp_path, view):
    """Two replicas, one serving adapter `sql`: the router sends `sql` only there, and counts what
    that replica caches for `sql`, not for the model (from its feed, computing the adapter's keys
    itself, or by asking)."""
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service
    from .test_router import drive, post, router_app, routed_cached, until_followed

    folders, _ = adapters
    for name in ("r0", "r1"):
        shutil.copytree(base_dir, tmp_path / name / "models" / base_dir.name)
    services = [start_service(tmp_path / "r0", num_blocks=64),
                start_service(tmp_path / "r1", num_blocks=64, lora_modules=f"sql={folders['a']}")]
    try:
        router, app = router_app([create_app(s, s.metrics, front="unix") for s in services], "prefix", view=view)
        system = "Adapters keep their own blocks at every replica, and the router weighs those. " * 2
        demo = base_dir.name

        async def settle(client):
            if view == "events":
                await until_followed(router, (0, 1), settled=True)

        async def what_if(client, model):
            await settle(client)
            return await client.post("/router/route", json={"prompt": system + "Q9?", "model": model,
                                                            "routing": ["prefix"]})

        steps = [lambda c: post(c, system + "Q1?", model="sql"), settle,
                 lambda c: post(c, system + "Q2?", model="sql"),
                 lambda c: what_if(c, "sql"), lambda c: what_if(c, demo),
                 lambda c: post(c, system + "Q3?", model="nope")]
        first, _, second, adapted, plain, unknown = drive(app, steps, service=router if view == "events" else None)
        assert [first.headers["x-kvd-replica"], second.headers["x-kvd-replica"]] == ["replica-1", "replica-1"]
        assert first.json()["model"] == second.json()["model"] == "sql"
        shared = len(services[1].tokenize(system + "Q")) // 16 * 16
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
        assert routed_cached(second) == shared  # the router counted the adapter's blocks, as the replica did
        rows = {r["replica"]: r for r in adapted.json()["replicas"]}
        assert rows["replica-1"]["cached_tokens"] == shared
        assert adapted.json()["routes"]["prefix"]["replica"] == "replica-1"
        plain_rows = {r["replica"]: r for r in plain.json()["replicas"]}
        assert plain_rows["replica-1"]["cached_tokens"] == 0  # the model's own blocks of it: none
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == (
            f"model: 'nope' is not served by any replica; GET /v1/models lists {demo!r}, 'sql'")
    finally:
        for service in services:
            service.shutdown(deadline=5)


@pytest.mark.parametrize("settings", [
    {"r": 4, "lora_alpha": 8, "target_modules": list(ALL)},
    {"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    {"r": 4, "lora_alpha": 8, "target_modules": ["k_proj", "down_proj"], "alpha_pattern": {"down_proj": 2},
     "rank_pattern": {"k_proj": 2}},
], ids=["every-projection", "rslora", "patterns"])
def test_an_adapter_peft_saved_gives_kvd_the_logits_and_greedy_tokens_peft_gives(base_dir, tmp_path, settings):
    """The format as PEFT writes it (save_pretrained), and PEFT's own forward as the reference."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from .model_cases import hf_greedy

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    # init_lora_weights False: B is random too (PEFT's default starts it at zero: no change at all)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **settings)).eval()
    tuned.save_pretrained(tmp_path / "adapter")
    loaded = serving(base_dir, {"x": tmp_path / "adapter"})
    with torch.no_grad():
        expected = tuned(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, PROMPT, lora=[(loaded.adapters["x"], None)]), expected,
                               atol=1e-4, rtol=1e-4)
    engine = Engine(loaded, EngineSettings(num_blocks=64, block_size=16))
    request = engine.add_request(PROMPT, GREEDY, adapter="x")
    engine.run_until_done()
    assert request.sequences[0].output_ids == hf_greedy(tuned, PROMPT, GREEDY.max_tokens)


def test_kvctl_explain_pin_and_evict_send_the_adapter_a_prompt_is_hashed_under():
    from typer.testing import CliRunner

    from kvctl.cli import app as kvctl_app
    from kvctl.errors import KvdUnavailable

    sent: list[tuple[str, dict]] = []
    answers = {"/admin/explain": {"hit_tokens": 0, "prompt_tokens": 5, "hit_blocks": 0, "full_blocks": 0,
                                  "tenant": "default", "adapter": "sql"},
               "/admin/pins": {"pin_id": "pin-1", "tenant": "default", "blocks": 0, "cached_blocks": 0,
                               "warmed": False, "refreshed": False, "owner": "ops", "note": "", "created_at": 0,
                               "expires_at": None},
               "/admin/evict": {"evicted_blocks": 0, "skipped": {}, "result": "ok", "target": "prompt"}}

    class Answering:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def post(self, path, body):
            sent.append((path, body))
            if path == "/admin/route-facts":  # kvctl route: the body is what counts here
                raise KvdUnavailable("kvd is not running")
            return answers[path]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvctl.command_kit.Client", Answering)
        patch.setattr("kvctl.route_cmd.Client", Answering)
        runner = CliRunner()
        explained = runner.invoke(kvctl_app, ["explain", "hello", "--model", "sql"], env={"COLUMNS": "120"})
        assert explained.exit_code == 0 and "0 of 5 tokens would hit (0 of 0 full blocks, tenant default, LoRA " \
                                               "adapter sql)" in explained.output
        runner.invoke(kvctl_app, ["pin", "hello", "--model", "sql", "--json"])
        runner.invoke(kvctl_app, ["evict", "hello", "--model", "sql", "--json"])
        runner.invoke(kvctl_app, ["explain", "hello", "--json"])
        runner.invoke(kvctl_app, ["route", "hello", "--model", "sql", "--replica", "/a.sock", "--replica", "/b.sock"])
        refused = [runner.invoke(kvctl_app, args) for args in (["evict", "--tenant", "acme", "--model", "sql"],
                                                                ["pin", "--prefix", "abcd", "--model", "sql"])]
    assert [(path, body.get("model"), body.get("text")) for path, body in sent] == [
        ("/admin/explain", "sql", "hello"), ("/admin/pins", "sql", "hello"), ("/admin/evict", "sql", "hello"),
        ("/admin/explain", None, "hello"), ("/admin/route-facts", "sql", "hello"),
        ("/admin/route-facts", "sql", "hello")]
    # refused before anything is sent (kvctl's main prints a UserError and exits 2)
    assert [type(r.exception).__name__ for r in refused] == ["UserError", "UserError"]
    assert str(refused[0].exception) == ("--model alone takes every block of a LoRA adapter, and with a prompt that "
                                         "prompt's blocks under it; --adapter-id goes alone")
    assert str(refused[1].exception) == "--model is for a prompt; a prefix id names its LoRA adapter's blocks already"


def test_a_phi3_adapter_of_its_fused_projections_gives_peft_s_logits_and_the_bytes_capacity_plans(tmp_path):
    """Phi-3 stores Q, K and V as one qkv_proj and gate and up as one gate_up_proj; PEFT adapts
    each fused projection with one A and one B, which is already how kvd packs them."""
    peft = pytest.importorskip("peft")
    from dataclasses import replace

    from kvctl.capacity import ModelShape, lora_bytes

    from .model_cases import build_checkpoint, hf_greedy

    hf = build_checkpoint("phi3", tmp_path / "model")
    torch.manual_seed(0)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(
        init_lora_weights=False, lora_dropout=0.0, r=4, lora_alpha=8,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])).eval()
    tuned.save_pretrained(tmp_path / "adapter")
    loaded = serving(tmp_path / "model", {"x": tmp_path / "adapter"})
    adapter = loaded.adapters["x"]
    assert adapter.modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") and adapter.rank == 4
    with torch.no_grad():
        expected = tuned(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(full_forward_logits(loaded, PROMPT, lora=[(adapter, None)]), expected,
                               atol=1e-4, rtol=1e-4)
    engine = Engine(loaded, EngineSettings(num_blocks=64, block_size=16))
    request = engine.add_request(PROMPT, GREEDY, adapter="x")
    engine.run_until_done()
    assert request.sequences[0].output_ids == hf_greedy(tuned, PROMPT, GREEDY.max_tokens)
    shape = ModelShape.from_model_dir(tmp_path / "model")
    assert shape.fused_projections and lora_bytes(replace(shape, dtype="float32"), 4) == adapter.nbytes


def test_an_adapter_of_separate_projections_is_refused_for_a_fused_checkpoint(tmp_path):
    from .model_cases import build_checkpoint

    build_checkpoint("phi3", tmp_path / "model")
    folder = write_adapter(tmp_path / "adapter", ("q_proj",), rank=2, alpha=4, seed=1)
    loaded = load_model(tmp_path / "model")
    with pytest.raises(ModelError) as refused:
        load_adapters((("x", str(folder)),), loaded, "phi")
    assert str(refused.value) == (
        f"{folder / 'adapter_model.safetensors'}: tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A."
        "weight' adapts self_attn.q_proj, which kvd does not in this model (its checkpoint fuses Q, K and V, and "
        "gate and up)")
