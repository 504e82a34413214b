"""Rollouts of cache settings as the service runs them: starting one, reporting it, and
completing it, which makes its settings everyone's (in memory, until a reload or restart with a
config that says otherwise). The rollouts themselves, their cohorts, figures and stop conditions
are rollouts.RolloutManager's. Functions that take the EngineService (service.py)."""

from __future__ import annotations

from dataclasses import replace

from kvctl.daemon.config import speculation_of, speculative_config
from kvctl.policies.reservation import parse_reservation

from .calls import Principal


def complete_rollout(service, rollout_id: int, principal: Principal) -> dict:
    """Finish a rollout: its settings become everyone's now. They live in memory only: the
    answer says which settings to write into the config, and a reload or restart with a
    config that says otherwise reverts them (the reload says so; `rollout_status` shows
    whether they are still in effect)."""
    rollout = service.rollouts.status(rollout_id)
    # before the store records it complete: its settings are applied under the lock
    service.refuse_change_if_stalled(principal, "rollout.complete", f"rollout:{rollout_id}", "-")
    body = service.rollouts.complete(rollout_id, principal.actor)  # (its store write may wait: not under the lock)
    with service.lock:
        applied = {}
        engine = service.engine
        for name, given in rollout["policy"]["settings"].items():
            value = canonical(name, given)
            applied[name] = {"value": value, "was": getattr(service.config, name)}
            if engine is not None and name == "reservation":
                engine.reservation = parse_reservation(value)
                engine.settings = replace(engine.settings, reservation=value)
            if engine is not None and name == "speculative_config":
                engine.settings = replace(engine.settings, speculation=speculation_of(value))
                engine.speculator.configure(engine.settings.speculation)
            service.config = replace(service.config, **{name: value},
                                     sources={**service.config.sources, name: f"rollout {rollout_id}"})
        for name, change in applied.items():
            if change["value"] != change["was"]:
                service.rollout_settings[name] = {"value": change["value"], "rollout": rollout_id}
    body = with_settings_in_effect(service.config, body)
    body["applied"] = applied
    body["keep"] = {name: f"set {name}: {change['value']} in kvd's config (YAML, KVD_{name.upper()} or "
                          f"--{name.replace('_', '-')}); until then a reload or restart reverts it"
                    for name, change in applied.items() if name in service.rollout_settings}
    return body


def start_rollout(service, policy, fraction, stops: list[str], adr_id: int | None, actor: str) -> dict:
    """`RolloutManager.start`; the answer also says when the cohort's settings are everyone's
    already (the two sides cannot differ: nothing to learn from it)."""
    body = service.rollouts.start(policy, fraction, stops, adr_id, actor)
    settings = body["policy"]["settings"]
    if all(settings_in_effect(service.config, settings).values()):
        body["note"] = ("the cohort's settings are everyone's already ("
                        + ", ".join(f"{name} {value}" for name, value in settings.items())
                        + "): cohort and baseline run alike")
    return body


def rollout_status(service, rollout_id: int | None = None, samples: bool = False) -> dict:
    """A rollout as `RolloutManager.status` reports it; a completed one also says whether its
    settings are still in effect (a reload or restart may have reverted them)."""
    return with_settings_in_effect(service.config, service.rollouts.status(rollout_id, samples))


def canonical(name: str, value):
    """A policy's setting as kvd's config holds it: reservation as text, speculative_config as its
    canonical JSON text (None: off)."""
    return speculative_config(value) if name == "speculative_config" else str(value)


def settings_in_effect(config, settings: dict) -> dict[str, bool]:
    """For each of a policy's settings, whether everyone has that value now."""
    return {name: getattr(config, name, None) == canonical(name, value) for name, value in settings.items()}


def with_settings_in_effect(config, body: dict) -> dict:
    if body["state"] == "completed":
        body["settings_in_effect"] = settings_in_effect(config, body["policy"]["settings"])
    return body
