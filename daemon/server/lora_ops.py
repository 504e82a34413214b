"""LoRA adapters loaded and unloaded at runtime by admin callers (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, as vLLM offers them under VLLM_ALLOW_RUNTIME_LORA_UPDATING; here under
the `lora_runtime_updates` setting), beside the adapters lora_modules names.

What a caller changes lasts until kvd stops: `service.runtime_lora` records it over lora_modules
(a name loaded at runtime and its folder, or a lora_modules name unloaded: None), so that a
reload, which reads lora_modules again, keeps it, unless the config's entry for that name has
changed (the edit wins: `standing_changes`); a restart serves lora_modules alone. Requests
in flight finish on the adapter they came for (Request.lora), as after a reload. Functions that
take the EngineService (service.py), as the operator actions do.
"""

from __future__ import annotations

from pathlib import Path

from kvctl.daemon.model.errors import ModelError
from kvctl.daemon.model.lora import NoRoomForAdapter, check_adapter_name, load_adapter, warn_if_kv_changes

from . import pin_ops
from .adapter_room import gpu_room
from .calls import Principal, ServiceError


def standing_changes(service, modules: tuple[tuple[str, str], ...]) -> dict[str, str | None]:
    """The runtime changes that stand over `modules` (lora_modules as a reload reads it): those
    of names whose entry there is as it was. A name whose entry the config added, dropped or
    pointed elsewhere since is the config's again."""
    before, now = dict(service.config.lora_modules), dict(modules)
    return {name: path for name, path in service.runtime_lora.items() if before.get(name) == now.get(name)}


def served_modules(service, modules: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`modules` (lora_modules) with what admin callers changed over it at runtime: the adapters
    kvd serves, as (name, folder) pairs."""
    runtime = standing_changes(service, modules)
    kept = tuple((name, path) for name, path in modules if name not in runtime)
    return kept + tuple((name, path) for name, path in runtime.items() if path is not None)


def load(service, name: str, path: str, principal: Principal, in_place: bool = False) -> dict:
    """Read the PEFT adapter folder `path` and serve it as `name` from the next request. A name
    served already is refused unless `in_place`: its new weights then serve the requests that come
    after (a problem with the folder leaves the one served as it was)."""
    _allowed(service)
    service.require_ready()
    loaded = service.loaded
    folder = Path(path).expanduser()
    if not folder.is_absolute():
        raise ServiceError(400, f"lora_path: give the adapter folder's absolute path, got {path!r}", "lora_path")
    if not folder.is_dir():
        raise ServiceError(400, f"lora_path: {path!r} is not a directory on kvd's machine", "lora_path")
    with service.adapter_updates:  # one change of the served adapters at a time (a reload's too; a sleep's)
        if service.asleep is not None:  # its weights would go where sleep gave the memory back
            raise ServiceError(503, service.asleep.refusal())
        try:
            check_adapter_name(name, service.model_name, "lora_name")
        except ModelError as exc:
            raise ServiceError(400, str(exc), "lora_name") from None
        before = service.adapters().get(name)
        if before is not None and not in_place:
            raise ServiceError(400, f"lora_name: the LoRA adapter {name!r} has already been loaded (load_inplace: "
                                    "true gives it new weights)", "lora_name")
        try:
            adapter = load_adapter(name, folder, loaded.config, loaded.model.device, loaded.model.dtype,
                                   gpu_room(loaded.model.device))
        except ModelError as exc:
            service.store.audit(actor=principal.actor, tenant=principal.tenant, action="lora.load",
                                target=f"lora:{name}", result="refused", detail={"error": str(exc)})
            # no room on the GPU: the adapter is fine, the device is full (409, as a full cache is)
            raise ServiceError(409 if isinstance(exc, NoRoomForAdapter) else 400, str(exc), "lora_path") from None
        with service.change_lock(principal, "lora.load", f"lora:{name}", detail={"path": str(folder)}):
            loaded.adapters = {**loaded.adapters, name: adapter}  # a new dict: readers see one whole
            service.runtime_lora[name] = str(folder)
    warn_if_kv_changes({name: adapter}, service.config.cache_dtype)
    replaced = before is not None and before.digest != adapter.digest
    detail = {"path": str(folder), "digest": adapter.digest, "replaced": replaced}
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="lora.load", target=f"lora:{name}",
                        result="ok", detail=detail)
    stranded = pin_ops.stranded_by(service, {before.digest} if replaced else set(), f"LoRA adapter {name!r} loaded")
    # (no `message`: in kvd's answers that is a warning, and kvd router passes it on as one)
    return {**adapter.describe(), "loaded": True, "replaced": replaced, **stranded}


def unload(service, name: str, principal: Principal) -> dict:
    """Stop serving `name`: new requests for it get a 404; those in flight finish on it."""
    _allowed(service)
    service.require_ready()
    loaded = service.loaded
    with service.adapter_updates:
        adapter = service.adapters().get(name)
        if adapter is None:
            served = ", ".join(repr(n) for n in service.adapters()) or "none"
            raise ServiceError(404, f"lora_name: no LoRA adapter {name!r} is loaded (adapters: {served})", "lora_name")
        with service.change_lock(principal, "lora.unload", f"lora:{name}"):
            loaded.adapters = {n: a for n, a in loaded.adapters.items() if n != name}
            if name in dict(service.config.lora_modules):
                service.runtime_lora[name] = None  # unloaded over lora_modules, until a restart
            else:
                service.runtime_lora.pop(name, None)
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="lora.unload", target=f"lora:{name}",
                        result="ok", detail={"digest": adapter.digest})
    stranded = pin_ops.stranded_by(service, {adapter.digest}, f"LoRA adapter {name!r} unloaded")
    return {"name": name, "digest": adapter.digest, "unloaded": True, **stranded}


def _allowed(service) -> None:
    if not service.config.lora_runtime_updates:
        raise ServiceError(403, "LoRA adapters change at runtime only with lora_runtime_updates on (kvd serve "
                                "--lora-runtime-updates, or in the config and reload); or list them in lora_modules "
                                "and reload")
