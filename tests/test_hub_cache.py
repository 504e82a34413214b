"""`--model ORG/NAME`: a checkpoint found in the local Hugging Face cache; nothing downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvctl.daemon.model.errors import ModelError
from kvctl.daemon.model.hub_cache import hub_cache_dir, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached(cache: Path, hub_id: str, source: Path | None = None, commits=(COMMIT,), ref: str | None = COMMIT) -> Path:
    """A model in the cache's layout: models--ORG--NAME/snapshots/COMMIT/, refs/main."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    for commit in commits:
        snapshot = repo / "snapshots" / commit
        if source is not None:
            shutil.copytree(source, snapshot)
        else:
            snapshot.mkdir(parents=True)
            (snapshot / "config.json").write_text("{}")
    if ref is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(ref + "\n")
    return repo


def test_the_cache_is_where_huggingface_hub_keeps_it(tmp_path):
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache_dir({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}) == Path("/b/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_a_hub_id_resolves_to_the_snapshot_refs_main_names(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path)}
    repo = cached(tmp_path, "Qwen/Qwen3-8B", commits=("f" * 40, COMMIT))
    assert resolve_model("Qwen/Qwen3-8B", env) == (repo / "snapshots" / COMMIT, "Qwen/Qwen3-8B")
    folder = tmp_path / "plain"
    folder.mkdir()
    assert resolve_model(str(folder), env) == (folder, None)  # a folder is a folder, whatever its name
    shutil.rmtree(repo / "refs")
    with pytest.raises(ModelError) as two:
        resolve_model("Qwen/Qwen3-8B", env)
    assert str(two.value) == (f"model: 'Qwen/Qwen3-8B' has no refs/main in the Hugging Face cache and 2 snapshots "
                              f"(0123456789ab, ffffffffffff) in {repo / 'snapshots'}; give the snapshot's folder")
    shutil.rmtree(repo / "snapshots" / ("f" * 40))
    assert resolve_model("Qwen/Qwen3-8B", env)[0] == repo / "snapshots" / COMMIT  # the only one


def test_what_is_not_in_the_cache_is_refused_with_where_kvd_looked(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path)}
    with pytest.raises(ModelError) as missing:
        resolve_model("meta-llama/Llama-3.1-8B-Instruct", env)
    assert str(missing.value) == (f"model: 'meta-llama/Llama-3.1-8B-Instruct' is not a directory, nor in the Hugging "
                                  f"Face cache at {tmp_path} (kvd downloads nothing: fetch it first, e.g. "
                                  "`huggingface-cli download meta-llama/Llama-3.1-8B-Instruct`, or give its folder)")
    with pytest.raises(ModelError, match=r"^model: '/no/such/folder' is not a directory$"):
        resolve_model("/no/such/folder", env)
    repo = cached(tmp_path, "org/partial")
    (repo / "snapshots" / COMMIT / "config.json").unlink()
    with pytest.raises(ModelError, match="has no config.json \\(a download that did not finish\\?\\)"):
        resolve_model("org/partial", env)
    (repo / "refs" / "main").write_text("feedface")
    with pytest.raises(ModelError, match="refs/main names snapshot 'feedface', which is not in"):
        resolve_model("org/partial", env)


def test_kvd_serves_a_cached_model_under_its_hub_id_and_capacity_reads_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    from .daemon_fixtures import apps, call, start_service, token_table
    from .test_cli import cli

    cache = tmp_path / "hub"
    snapshot = cached(cache, "acme/tiny-llama", ensure_demo_checkpoint(tmp_path / "demo")) / "snapshots" / COMMIT
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    service = start_service(tmp_path / "state", model="acme/tiny-llama")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        assert call(unix, "GET", "/v1/models").json()["data"][0]["id"] == "acme/tiny-llama"
        import asyncio

        from .test_responses_api import client_for  # (OpenAI's client sends the slash in its id as it likes)
        assert asyncio.run(client_for(unix).models.retrieve("acme/tiny-llama")).id == "acme/tiny-llama"
        answer = call(unix, "POST", "/v1/completions", json={"model": "acme/tiny-llama", "prompt": "hi",
                                                             "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == "acme/tiny-llama"
        assert service.status()["model"]["path"] == str(snapshot)
    finally:
        service.shutdown(1)
    status, out, _ = cli(capsys, "capacity", "--model", "acme/tiny-llama", "--gpu-memory", "1GiB", "--json")
    shape = json.loads(out)["shape"]
    assert status == 0
    config = json.loads((snapshot / "config.json").read_text())
    assert shape == {"layers": config["num_hidden_layers"], "kv_heads": config["num_key_value_heads"],
                     "head_dim": config["hidden_size"] // config["num_attention_heads"]}
