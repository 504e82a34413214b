"""New weights in place (weights_ops.py): `kvctl update-weights`, POST /admin/weights and SGLang's
/update_weights_from_disk. Another checkpoint of the same model serves from the next request, its
tokens those of a kvd started on it; what the weights before computed is never served under the new
ones; another model or tokenizer is refused; running requests finish on the weights before."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvctl.daemon.model.tokenizer import Tokenizer  # noqa: E402
from kvctl.daemon.model.weights import model_revision  # noqa: E402
from kvctl.daemon.server import weights_ops  # noqa: E402

from .daemon_fixtures import ADMIN_TOKEN, apps, assert_admin_only, call, token_table  # noqa: E402
from .evict_cases import ASK_A, ASK_B, BLOCK, SYSTEM, ask, serving  # noqa: E402
from .test_cache_reset import running  # noqa: E402
from .test_router import drive, router_app  # noqa: E402
from .test_sleep import kvctl_on  # noqa: E402


def tuned_copy(source, target, seed: int = 0):
    """The checkpoint at `source` with other weights (a step of training): same config and tokenizer."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    noise = torch.Generator().manual_seed(seed)
    save_file({name: t + 0.05 * torch.randn(t.shape, generator=noise, dtype=t.dtype) for name, t in weights.items()},
              str(target / "model.safetensors"))
    return target


def text_of(answer: dict) -> str:
    return answer["choices"][0]["text"]


def test_new_weights_serve_the_next_request_and_drop_what_the_old_ones_computed(tmp_path):
    with serving(tmp_path / "kvd", host_cache_bytes="16MiB", tiering="always") as (service, unix):
        before = ask(unix, ASK_A)
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": SYSTEM, "owner": "ops"}).json()
        old_revision = service.loaded.revision
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        answer = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert {k: body[k] for k in ("success", "updated", "model_path", "revision", "previous_revision",
                                     "dropped_blocks", "until_restart")} == {
            "success": True, "updated": True, "model_path": str(tuned), "revision": model_revision(tuned),
            "previous_revision": old_revision, "dropped_blocks": 3, "until_restart": True}  # the pinned 3 stay
        assert [p["pin_id"] for p in body["stranded_pins"]] == [pinned["pin_id"]]
        status = call(unix, "GET", "/admin/status").json()
        assert (status["model"]["revision"], status["model"]["path"]) == (model_revision(tuned), str(tuned))
        after = ask(unix, ASK_A)
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing of the old weights serves
        assert text_of(after) != text_of(before)
        entry = call(unix, "GET", "/admin/audit").json()["entries"][0]
        assert (entry["action"], entry["target"], entry["result"]) == ("weights.update", f"model:{old_revision[:12]}",
                                                                       "ok")
        assert entry["detail"]["revision"] == model_revision(tuned)
        again = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)}).json()
        assert (again["updated"], again["message"]) == (
            False, f"revision {model_revision(tuned)[:12]} is the one served already; nothing changed")
        second = ask(unix, ASK_A)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK and text_of(second) == \
            text_of(after)
    # a kvd started on the new checkpoint gives the same tokens
    with serving(tmp_path / "fresh", model=str(tuned)) as (_, fresh):
        assert text_of(ask(fresh, ASK_A)) == text_of(after)


def test_another_model_or_tokenizer_is_refused_and_nothing_changes(tmp_path):
    with serving(tmp_path / "kvd") as (service, unix):
        ask(unix, ASK_A)
        revision, cached = service.loaded.revision, call(unix, "GET", "/admin/status").json()["blocks"]["device"]
        other = tuned_copy(service.loaded.path, tmp_path / "deeper")
        config = json.loads((other / "config.json").read_text())
        layers = config["num_hidden_layers"]
        config["num_hidden_layers"] = layers + 1
        (other / "config.json").write_text(json.dumps(config))
        refused = call(unix, "POST", "/admin/weights", json={"model_path": str(other)})
        assert refused.status_code == 409
        assert refused.json()["error"]["message"] == (
            f"model_path: {other} holds another model (num_layers: {layers + 1} there, {layers} served); new weights "
            "in place keep the model, so restart kvd with model: set to serve it")
        words = tuned_copy(service.loaded.path, tmp_path / "words")
        tokenizer = json.loads((words / "tokenizer.json").read_text())
        tokenizer["normalizer"] = {"type": "Lowercase"}
        (words / "tokenizer.json").write_text(json.dumps(tokenizer))
        refused = call(unix, "POST", "/admin/weights", json={"model_path": str(words)})
        assert refused.status_code == 409 and refused.json()["error"]["message"] == (
            f"model_path: {words} has another tokenizer (digest {Tokenizer(words).digest[:12]}, "
            f"{service.loaded.tokenizer.digest[:12]} served): prompts would become other tokens; restart kvd with "
            "model: set to serve it")
        relative = call(unix, "POST", "/admin/weights", json={"model_path": "step-1"})
        assert relative.status_code == 400 and relative.json()["error"]["message"] == (
            "model_path: give the checkpoint folder's absolute path, got 'step-1'")
        assert service.loaded.revision == revision
        assert call(unix, "GET", "/admin/status").json()["blocks"]["device"] == cached
        refusals = [e for e in call(unix, "GET", "/admin/audit").json()["entries"] if e["action"] == "weights.update"]
        assert [e["result"] for e in refusals] == ["refused", "refused"]  # (a bad path is refused before)


def test_running_requests_finish_on_the_weights_before_and_a_short_timeout_changes_nothing(tmp_path):
    with serving(tmp_path / "kvd", num_blocks=256) as (service, unix):
        old_text = text_of(ask(unix, ASK_B))
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        revision = service.loaded.revision
        thread = running(unix, ASK_A)
        late = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned), "timeout": 0.2})
        assert late.status_code == 409 and late.json()["error"]["message"] == (
            "model_path: 1 requests still running after 0.2 s; the weights served stay (a longer timeout waits for "
            "them; `kvctl drain` first)")
        assert service.loaded.revision == revision and not service.engine.admission_paused
        assert service.pending_weights is None
        aborted = call(unix, "POST", "/update_weights_from_disk", json={"model_path": str(tuned),
                                                                         "abort_all_requests": True,
                                                                         "load_format": None})
        assert aborted.status_code == 200 and aborted.json()["success"] is True
        thread.join(30)
        assert not thread.is_alive()
        assert call(unix, "GET", "/admin/requests").json()["requests"] == []
        metrics = call(unix, "GET", "/metrics").text  # the long one ended cancelled, as if its client had left
        assert 'kvd_finished_total{api="completions",finish_reason="cancelled"} 1.0' in metrics
        assert service.loaded.revision == model_revision(tuned)
        assert text_of(ask(unix, ASK_B)) != old_text


def test_the_sglang_answer_and_the_admin_role(tmp_path):
    with serving(tmp_path / "kvd") as (service, unix):
        _, tcp = apps(service, token_table(tmp_path))
        assert_admin_only(tcp, "POST", "/admin/weights", json={"model_path": "/x"})
        assert_admin_only(tcp, "POST", "/update_weights_from_disk", json={"model_path": "/x"})
        missing = call(tcp, "POST", "/update_weights_from_disk", json={"model_path": "/nowhere"},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert missing.status_code == 400 and missing.json() == {
            "success": False, "message": "model_path: '/nowhere' is not a directory on kvd's machine"}
        bad = call(unix, "POST", "/admin/weights", json={"model_path": "/x", "timeout": 601})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"


def test_weights_asleep_are_woken_first_and_a_sleeping_cache_takes_new_weights(tmp_path):
    with serving(tmp_path / "kvd", host_cache_bytes="16MiB", tiering="always") as (service, unix):
        ask(unix, ASK_A)
        call(unix, "POST", "/admin/pins", json={"tokens": SYSTEM, "owner": "ops"})
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        call(unix, "POST", "/sleep?level=2")
        refused = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)})
        assert refused.status_code == 409 and refused.json()["error"]["message"] == (
            "model_path: kvd's weights are asleep; `kvctl wake --only weights` (POST /wake_up?tags=weights) first, "
            "then update them")
        call(unix, "POST", "/wake_up?tags=weights")  # the RL trainer's order: weights, update, then the cache
        updated = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)})
        assert updated.status_code == 200 and updated.json()["revision"] == model_revision(tuned)
        assert updated.json()["dropped_host_blocks"] == 6  # what sleep kept of the weights before
        woke = call(unix, "POST", "/wake_up?tags=kv_cache").json()
        assert woke["pins_warming"] == 0  # the pin made under the weights before is stranded: nothing to warm
        assert ask(unix, ASK_A)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_quantised_cache_takes_unit_scales_for_a_revision_it_has_no_calibration_of(tmp_path):
    with serving(tmp_path / "kvd", cache_dtype="int8", allow_uncalibrated=True) as (service, unix):
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        body = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)}).json()
        assert (body["updated"], body["scale_version"]) == (True, "unit")
        assert ask(unix, ASK_A)["usage"]["completion_tokens"] == 20


def test_update_weights_at_the_router_updates_every_replica(tmp_path):
    from kvctl.daemon.server.app import create_app

    with serving(tmp_path / "a") as (first, unix_a), serving(tmp_path / "b") as (second, unix_b):
        ask(unix_a, ASK_A)
        ask(unix_b, ASK_B)
        tuned = tuned_copy(first.loaded.path, tmp_path / "step-1")
        router, app = router_app([create_app(s, s.metrics, front="unix") for s in (first, second)])

        async def update(client):
            return await client.post("/update_weights_from_disk", json={"model_path": str(tuned)})
        [answer] = drive(app, [update])
        body = answer.json()
        assert answer.status_code == 200 and body["result"] == "ok"
        assert (body["revisions"], body["dropped_blocks"]) == ([model_revision(tuned)], 12)
        assert [r["replica"] for r in body["replicas"]] == ["replica-0", "replica-1"]
        assert first.loaded.revision == second.loaded.revision == model_revision(tuned)


def test_kvctl_update_weights_says_what_changed(tmp_path):
    with serving(tmp_path / "kvd") as (service, unix):
        ask(unix, ASK_A)
        previous, original = service.loaded.revision, service.loaded.path
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        code, out = kvctl_on(unix, ["update-weights", str(tuned)])
        lines = out.splitlines()
        assert code == 0, out
        assert lines[0].startswith(f"serving {tuned}: revision {model_revision(tuned)[:12]} (was {previous[:12]}), "
                                   "read in ")
        assert lines[1] == ("cache: 6 blocks of the revision before dropped from the device, 0 from host memory; disk "
                            f"and Redis keep theirs for `kvctl evict --model-revision {previous[:12]}`")
        assert lines[2] == "until kvd restarts: set model in its config to keep it"
        code, out = kvctl_on(unix, ["update-weights", str(tuned)])
        assert out.strip() == f"revision {model_revision(tuned)[:12]} of {tuned} is served already: nothing changed"
        code, out = kvctl_on(unix, ["status"])
        words = " ".join(out.split())  # the table wraps the row
        assert re.search(rf"weights from {re.escape(str(tuned))} \(revision {model_revision(tuned)[:12]}\) since "
                         r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d, by unix-socket: a restart serves the demo checkpoint again "
                         r"\(set model in the config to keep them\)", words)
        # back to the config's own weights: what a restart serves, so the row goes
        code, out = kvctl_on(unix, ["update-weights", str(original)])
        assert code == 0, out
        assert call(unix, "GET", "/admin/status").json()["weights_updated"] is None
        code, out = kvctl_on(unix, ["status"])
        assert "a restart serves" not in " ".join(out.split())


def test_weights_ops_compares_every_field_of_the_model_config_but_the_dtype_and_eos():
    from dataclasses import fields

    from kvctl.daemon.model.config import ModelConfig

    assert set(weights_ops.NOT_COMPARED) < {f.name for f in fields(ModelConfig)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_new_weights_are_read_onto_the_gpu_and_serve(tmp_path):
    with serving(tmp_path / "kvd", device="cuda") as (service, unix):
        before = text_of(ask(unix, ASK_A))
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        body = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)}).json()
        assert body["updated"] and body["revision"] == model_revision(tuned) and body["in_place"] is True
        # the new weights waited in host memory: the GPU never held a second set
        assert torch.cuda.max_memory_allocated() - base < service.loaded.model.weight_bytes() // 2
        assert service.loaded.model.layers[0].qkv.is_cuda
        after = ask(unix, ASK_A)
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and text_of(after) != before


def served_tensors(model) -> list[torch.Tensor]:
    from dataclasses import fields

    return [*model.w.values(), *(t for layer in model.layers for f in fields(layer)
                                 if (t := getattr(layer, f.name)) is not None)]


def test_on_a_gpu_new_weights_are_copied_into_the_served_tensors_in_place(tmp_path, monkeypatch):
    """IN_PLACE_DEVICES (a GPU's path, taken here on the CPU): the new weights wait in host
    memory and the swap copies them into the tensors served, whose memory stays where it was
    (the device never holds two sets); the tokens are a fresh kvd's on the new checkpoint."""
    monkeypatch.setattr(weights_ops, "IN_PLACE_DEVICES", ("cuda", "cpu"))
    with serving(tmp_path / "kvd") as (service, unix):
        model = service.loaded.model
        addresses = [t.data_ptr() for t in served_tensors(model)]
        tuned = tuned_copy(service.loaded.path, tmp_path / "step-1")
        code, out = kvctl_on(unix, ["update-weights", str(tuned), "--json"])
        body = json.loads(out)
        assert (body["updated"], body["in_place"], body["revision"]) == (True, True, model_revision(tuned))
        assert service.loaded.model is model and [t.data_ptr() for t in served_tensors(model)] == addresses
        after = ask(unix, ASK_A)
        from kvctl.weights_cmd import updated_text

        assert updated_text(body).splitlines()[0].endswith(
            " waiting for running requests (copied into the served tensors in place: the GPU held one set)")
    with serving(tmp_path / "fresh", model=str(tuned)) as (_, fresh):
        assert text_of(ask(fresh, ASK_A)) == text_of(after)


def test_staged_weights_of_another_shape_are_refused_before_anything_is_copied(tmp_path):
    from kvctl.daemon.model.errors import ModelError
    from kvctl.daemon.model.llama import stage_weights
    from kvctl.daemon.model.weights import load_weights

    with serving(tmp_path / "kvd") as (service, unix):
        loaded = service.loaded
        model = loaded.model
        before = [t.clone() for t in served_tensors(model)]
        tuned = tuned_copy(loaded.path, tmp_path / "step-1")
        host = load_weights(tuned, loaded.config, model.dtype, torch.device("cpu"))
        host["model.norm.weight"] = host["model.norm.weight"][:-1]  # the last of the staged tensors outside layers
        staged = stage_weights(loaded.config, host, pin=False)
        staged.layers[-1].down = staged.layers[-1].down[:, :-1]
        with pytest.raises(ModelError) as refused:
            model.copy_weights_in(staged)
        hidden = loaded.config.hidden_size
        assert str(refused.value) == (f"weights: model.norm.weight is ({hidden - 1},) in the new weights, ({hidden},) "
                                      "served")
        assert all(torch.equal(a, b) for a, b in zip(before, served_tensors(model)))  # nothing was copied
        body = call(unix, "POST", "/admin/weights", json={"model_path": str(tuned)}).json()
        assert body["in_place"] is False  # on the CPU the new tensors take the old ones' place
